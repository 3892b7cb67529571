"""`mlxcel-dist` command line: thin typer commands over the library.

Results go to stdout, progress and stats to stderr, and under tensor
parallelism only rank 0 prints or writes files. Every model command takes
--np/--backend/--hostfile: with more than one rank the command re-runs itself
on every rank through the launcher (`launcher.launch`), and each rank joins the
group (`distributed.init_from_env`) before loading its shard.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from . import backends
from .collectives import CollectiveError
from .errors import UserError
from .watchdog import DEFAULT_STALL_TIMEOUT_S

app = typer.Typer(
    add_completion=False,
    rich_markup_mode=None,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Tensor-parallel LLM inference across MLX ranks.",
)


def _version(value: bool):
    if value:
        from . import __version__

        print(f"mlxcel-dist {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True,
                                                    help="Print the version and exit.")] = None,
):
    """Tensor-parallel LLM inference across MLX ranks."""

# Shared options -------------------------------------------------------------
ModelArg = Annotated[
    Optional[str],
    typer.Argument(help="Checkpoint directory or Hugging Face repo id (default: the embedded tiny gemma3).",
                   metavar="MODEL", show_default=False),
]
RequiredModelArg = Annotated[str, typer.Argument(help="Checkpoint directory or Hugging Face repo id.", metavar="MODEL")]
# mlx-lm's spelling, --model MODEL, beside the positional MODEL (one of them, or both alike)
ModelOpt = Annotated[Optional[str], typer.Option("--model", help="The same as MODEL (mlx-lm's spelling).",
                                                 show_default=False)]
NpOpt = Annotated[int, typer.Option("--np", help="Number of ranks (tensor-parallel degree).")]
PpOpt = Annotated[int, typer.Option("--pp", help="Pipeline stages: the layers split into P stages, one rank each (no --np or --np P), or T tensor-parallel ranks each (--np P x T).")]
BackendOpt = Annotated[str, typer.Option("--backend", help=f"Distributed backend: auto, {', '.join(backends.names())}.")]
HostfileOpt = Annotated[
    Optional[Path], typer.Option("--hostfile", help="OpenMPI or MLX JSON hostfile for multi-host runs.")
]
RankWeightsOpt = Annotated[
    Optional[str],
    typer.Option("--rank-weights", help="Comma-separated positive weights, one per rank (e.g. 3,1,1): each rank's share "
                 "of heads, MLP columns and vocabulary proportional to its weight, and with --pp each stage's share of "
                 "the layers to its ranks' weights (default: the hostfile's per-host weight=W or memory=, else as "
                 "even as possible).",
                 show_default=False),
]
MoeSplitOpt = Annotated[
    str,
    typer.Option("--moe-split", help="Routed experts' placement across tensor-parallel ranks: intermediate (each rank a "
                 "slice of every expert) or experts (each rank whole experts; the stacked-expert families: qwen3_moe, "
                 "glm4_moe, deepseek_v3, minimax_m2, llama4, step3p5, gemma4, qwen3_next, qwen3_5_moe).",
                 metavar="intermediate|experts"),
]
DtypeOpt = Annotated[
    Optional[str], typer.Option("--dtype", help="Compute dtype (float32, bfloat16, float16); default: the checkpoint's.")
]
StallOpt = Annotated[
    float,
    typer.Option("--stall-timeout", help="Stop the job when a rank sends no heartbeat for this many seconds (a stopped or cut-off rank); 0 = never."),
]
# 2048: engine.DEFAULT_PREFILL_STEP (not imported here: it would load mlx for --help)
PrefillStepOpt = Annotated[
    Optional[int],
    typer.Option("--prefill-step", "--prefill-step-size",
                 help="Feed the prompt through the cache in chunks of this many tokens "
                 "(default: 2048 when generating; logits: one pass)."),
]
MaxKvSizeOpt = Annotated[
    Optional[int],
    typer.Option("--max-kv-size", metavar="N",
                 help="Full-attention layers keep the last N positions (a rotating cache: attention sees the last N "
                 "tokens, as mlx-lm's); sliding layers keep at most N.", show_default=False),
]
KvBitsOpt = Annotated[
    Optional[int],
    typer.Option("--kv-bits", metavar="BITS",
                 help="Full-attention layers' keys/values held MLX-quantized with this many bits (4 or 8; also 2, 3, "
                 "5, 6), attention on the quantized cache (default: the compute dtype).", show_default=False),
]
KvGroupSizeOpt = Annotated[
    int, typer.Option("--kv-group-size", metavar="G", help="Values per scale and bias with --kv-bits: 32, 64 or 128.")
]
AdapterOpt = Annotated[
    Optional[Path],
    typer.Option("--adapter-path", metavar="DIR",
                 help="A LoRA or DoRA adapter as mlx_lm.lora writes it (adapter_config.json, adapters.safetensors), "
                 "applied to the model's layers.", show_default=False),
]
ExtraEosOpt = Annotated[
    Optional[list[str]],
    typer.Option("--extra-eos-token", metavar="TOKEN",
                 help="Also stop at this token (its text, e.g. \"<end_of_turn>\", or its id; repeatable).",
                 show_default=False),
]
DraftModelOpt = Annotated[
    Optional[str],
    typer.Option("--draft-model", help="A small model with the same tokenizer that drafts tokens for the target to "
                 "verify in one forward (speculative decoding; loaded whole on every rank)."),
]
NumDraftOpt = Annotated[int, typer.Option("--num-draft-tokens", help="Tokens drafted per verify forward (with --draft-model or --prompt-lookup).")]
PromptLookupOpt = Annotated[
    bool,
    typer.Option("--prompt-lookup/--no-prompt-lookup", help="Draft the tokens that followed the latest earlier "
                 "occurrence of the last n-gram of the prompt + output (no second model)."),
]


def _check_drafting(draft_model, prompt_lookup: bool, num_draft: int, model, sampling=None, pp: int = 1,
                    kv_bits=None, grammar: bool = False) -> None:
    """Before launch: the draft options fit together, the target and the draft model."""
    if draft_model is None and not prompt_lookup:
        return
    from .loader import build_model, open_model
    from .spec import check_drafting, check_pair, check_target

    if draft_model is not None and prompt_lookup:
        raise UserError("--draft-model and --prompt-lookup both draft: give one")
    for given, what in ((pp != 1, "--pp"), (kv_bits is not None, "--kv-bits"),
                        (grammar, "--json-schema / --json-object")):
        if given:
            raise UserError(f"drafts (--draft-model, --prompt-lookup) are not available with {what}")
    check_drafting(num_draft)
    target = build_model(open_model(model).config)
    check_target(target, sampling)
    if draft_model is not None:
        try:
            draft = open_model(draft_model)
        except UserError as e:  # say which of the two models it is
            raise UserError(f"--draft-model: {e}") from None
        check_pair(target, build_model(draft.config))


def _drafter(draft_model, prompt_lookup: bool, num_draft: int, dtype, compiled: bool = True, prefill_step=None):
    """The drafter of this rank (None: no drafts): the draft model loaded
    whole (every rank drafts alike, no message between them), or prompt lookup."""
    from .spec import DraftModel, PromptLookup

    if prompt_lookup:
        return PromptLookup(num_draft)
    if draft_model is None:
        return None
    from .loader import load_model

    return DraftModel(load_model(draft_model, dtype=dtype).model, num_draft, compiled, prefill_step)


COLLECTIVE_ERROR_GRACE_S = 2.0  # other ranks wait this long before exiting on a CollectiveError


def _handle_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            if isinstance(e, CollectiveError) and _is_other_rank():
                # Every rank raised it; rank 0 reports. Leave it the time to:
                # mpirun stops the whole job at the first rank that exits.
                import time

                time.sleep(COLLECTIVE_ERROR_GRACE_S)
            else:
                _err(f"error: {e}")
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            _err("interrupted")
            raise typer.Exit(130) from None

    return wrapper


def _is_other_rank() -> bool:
    """A launched rank other than 0 (errors every rank raises alike are
    reported by rank 0 alone)."""
    if not os.environ.get("MLXCEL_DIST_WORLD"):
        return False
    from . import distributed

    return not distributed.world().is_root


def _err(msg: str) -> None:
    """A line for stderr. Rank 0 under a launcher whose command relays
    stdout and stderr separately (mpirun, which can reorder them) sends it
    along its stdout, marked, and the launcher puts it on stderr in order
    (distributed.REPORT_MARKER)."""
    if os.environ.get("MLXCEL_DIST_REPORTS_ON_STDOUT") == "1":
        from . import distributed

        if distributed.world().is_root:
            sys.stdout.write(f"{distributed.REPORT_MARKER}{msg}\n")
            sys.stdout.flush()
            return
    print(msg, file=sys.stderr, flush=True)


def _argv_from_ctx(ctx: typer.Context) -> list[str]:
    """The command line that re-creates this command on each rank."""
    argv = [ctx.info_name]
    for p in ctx.command.params:
        v = ctx.params.get(p.name)
        if p.param_type_name == "argument":
            if v is not None:
                argv.append(str(v))
        elif getattr(p, "is_flag", False):
            if v and p.opts:
                argv.append(p.opts[0])
            elif v is False and p.secondary_opts:  # None: not given (an auto default)
                argv.append(p.secondary_opts[0])
        elif isinstance(v, (list, tuple)):  # repeatable option
            for item in v:
                argv.append(_opt_value(p.opts[0], item))
        elif v is not None:
            argv.append(_opt_value(p.opts[0], v))
    return argv


def _opt_value(opt: str, v) -> str:
    # --opt=VALUE: a value that starts with "-" (say --stop "-") stays a value.
    return f"{opt}={v}" if opt.startswith("--") else f"{opt}{v}"


def _distribute(ctx: typer.Context, np_: int, backend: str, hostfile: Optional[Path], model=None, pp: int = 1):
    """Launch ranks (and exit with the job's code) or join the group: the
    `collectives.Group` of this process (`SINGLE` when it runs alone).

    Before launching, the model is sharded on paper for every rank, so a rank
    count its heads cannot take fails here, once (with --pp: the family must
    run in stages and have a layer per stage, pipeline.check_stageable)."""
    weights = parse_rank_weights(ctx.params.get("rank_weights"))
    split = check_moe_split(ctx.params.get("moe_split"))
    if os.environ.get("MLXCEL_DIST_WORLD"):  # we are a launched rank
        from . import distributed

        group = distributed.init_from_env()
        if weights is not None and not group.single:  # every rank re-runs the same argv: the same weights
            group.set_weights(weights)
        group.moe_split = split  # the same argv on every rank: the same placement
        distributed.check_cluster(group, model)
        return group
    if np_ < 1:
        raise UserError(f"--np must be >= 1, got {np_}")
    if pp != 1:
        from . import pipeline

        np_ = pipeline.check_pp_ranks(np_, pp)
    if weights is not None and len(weights) != np_:
        raise UserError(f"--rank-weights gives {len(weights)} weights for {np_} ranks")
    if weights is None and hostfile is not None:
        weights = _hostfile_weights(ctx, hostfile, np_)
    backends.check_choice(backend)
    if np_ == 1 and hostfile is None:
        from .collectives import SINGLE

        return SINGLE
    from .launcher import launch

    _check_placement(model, np_, pp, weights, split)
    code = launch(_argv_from_ctx(ctx), np_, backend, str(hostfile) if hostfile else None,
                  stall_timeout=ctx.params.get("stall_timeout", DEFAULT_STALL_TIMEOUT_S))
    raise typer.Exit(code)


def _hostfile_weights(ctx: typer.Context, hostfile: Path, np_: int):
    """The ranks' weights from the hostfile's per-host ``weight`` (None when it
    sets none); put in the ranks' argv as --rank-weights (the ranks never read
    the hostfile)."""
    from .hostfile import rank_weights, read_hostfile

    weights = rank_weights(read_hostfile(hostfile).hosts, np_)
    if weights is not None:
        ctx.params["rank_weights"] = ",".join(map(str, weights))
    return weights


def check_moe_split(value: Optional[str]) -> str:
    """--moe-split's value (default intermediate)."""
    from .shard import MOE_SPLITS

    value = value or "intermediate"
    if value not in MOE_SPLITS:
        raise UserError(f"--moe-split must be one of {', '.join(MOE_SPLITS)}, got {value!r}")
    return value


def parse_rank_weights(text: Optional[str]):
    """--rank-weights "3,1,1" -> (Fraction(3), Fraction(1), Fraction(1)) (exact,
    so every rank splits alike); None when not given."""
    if text is None or text == "":
        return None
    from fractions import Fraction

    try:
        weights = tuple(Fraction(w.strip()) for w in text.split(","))
    except (ValueError, ZeroDivisionError):
        raise UserError(f"--rank-weights must be comma-separated positive numbers, got {text!r}") from None
    if any(w <= 0 for w in weights):
        raise UserError(f"--rank-weights must be positive, got {text!r}")
    return weights


def _kv_options(model, max_kv_size, kv_bits, kv_group_size):
    """--max-kv-size / --kv-bits / --kv-group-size checked against the model's
    head_dim (before any rank is launched) as a cache.KVOptions."""
    from .cache import KVOptions

    kv = KVOptions(max_kv_size, kv_bits, kv_group_size)
    if kv_bits is None:
        return kv.check()
    from .loader import open_model
    from .models import get_model_module

    ck = open_model(model)
    a = ck.args
    refused = getattr(get_model_module(a.model_type).Model, "kv_bits_refused", None)
    if refused:
        raise UserError(f"--kv-bits: {a.model_type} cannot take a quantized cache ({refused})")
    return kv.check(getattr(a, "head_dim", None) or a.hidden_size // a.num_attention_heads)


def _adapter(model, adapter_path):
    """--adapter-path read and checked against the model (before any rank is
    launched; each rank reads it again)."""
    if adapter_path is None:
        return None
    from .loader import build_model, open_model
    from .lora import Adapter

    adapter = Adapter(adapter_path)
    adapter.check(build_model(open_model(model).config))
    return adapter


def _load(model, dtype, group, pp: int = 1, kv=None, adapter=None):
    """Load this rank's shard (or pipeline stage); rank 0 shows a progress bar on stderr."""
    from .loader import load_model

    if not group.is_root:
        return load_model(model, dtype=dtype, group=group, pp=pp, kv=kv, adapter=adapter)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    console = Console(stderr=True)
    with Progress(TextColumn("loading"), BarColumn(), MofNCompleteColumn(), console=console,
                  transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("load", total=None)
        loaded = load_model(model, dtype=dtype, group=group, pp=pp, kv=kv, adapter=adapter,
                            progress=lambda i, n: bar.update(task, completed=i, total=n))
    return loaded


# Commands --------------------------------------------------------------------
@app.command()
@_handle_errors
def logits(
    ctx: typer.Context,
    model: RequiredModelArg,
    tokens_file: Annotated[Path, typer.Option("--tokens-file", help="1-D integer .npy of token ids.")],
    out: Annotated[Path, typer.Option("--out", help="Where to write float32 [T, V] logits (.npy).")],
    decode_from: Annotated[
        Optional[int], typer.Option("--decode-from", help="Tokens [0, K) are the prompt; the rest are decoded one by one.")
    ] = None,
    prefill_step: PrefillStepOpt = None,
    max_kv_size: MaxKvSizeOpt = None,
    kv_bits: KvBitsOpt = None,
    kv_group_size: KvGroupSizeOpt = 64,
    adapter_path: AdapterOpt = None,
    dtype: DtypeOpt = None,
    np_: NpOpt = 1,
    pp: PpOpt = 1,
    backend: BackendOpt = "auto",
    hostfile: HostfileOpt = None,
    rank_weights: RankWeightsOpt = None,
    moe_split: MoeSplitOpt = "intermediate",
    stall_timeout: StallOpt = DEFAULT_STALL_TIMEOUT_S,
):
    """Write the logits of every position of a token sequence."""
    import numpy as np

    from .engine import check_tokens, sequence_logits
    from .loader import open_model

    ids = _read_tokens(tokens_file)
    _check_out(out)
    ck = open_model(model)
    try:  # before any rank is launched, naming the file
        check_tokens(ids, ck.args.vocab_size)
        limit = ck.context_length
        if limit is not None and len(ids) > limit:
            raise UserError(f"{len(ids)} tokens, more than the model's context of {limit} (max_position_embeddings)")
    except UserError as e:
        raise UserError(f"{tokens_file}: {e}") from None
    kv = _kv_options(model, max_kv_size, kv_bits, kv_group_size)
    adapter = _adapter(model, adapter_path)
    group = _distribute(ctx, np_, backend, hostfile, model, pp)
    loaded = _load(model, dtype, group, pp, kv, adapter)
    result = sequence_logits(loaded.model, ids, decode_from=decode_from, prefill_step=prefill_step)
    if group.is_root:
        try:
            np.save(out, result)
        except OSError as e:
            raise UserError(f"cannot write {out}: {e.strerror}") from None
        _err(f"wrote {out} {list(result.shape)} float32 (np {group.size()}{_pp_note(pp, loaded.model)})")


def _check_out(out: Path) -> None:
    """An output file's folder must exist and be writable before any work."""
    parent = out.expanduser().resolve().parent
    if not parent.is_dir():
        raise UserError(f"cannot write {out}: no such directory {parent}")
    if not os.access(parent, os.W_OK):
        raise UserError(f"cannot write {out}: {parent} is not writable")


def _read_tokens(path: Path):
    import numpy as np

    if not path.exists():
        raise UserError(f"{path}: no such tokens file")
    try:
        ids = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as e:
        raise UserError(f"{path}: not a .npy array ({e})") from None
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise UserError(f"{path}: expected a 1-D integer array, got {ids.dtype} {list(ids.shape)}")
    return ids


@app.command()
@_handle_errors
def generate(
    ctx: typer.Context,
    model: ModelArg = None,
    model_opt: ModelOpt = None,
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="Prompt text ('-' reads it from stdin); with a chat template: the user message.")] = "The sea",
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-m", "-n", help="Most tokens to generate.")] = 64,
    temp: Annotated[float, typer.Option("--temp", help="Sampling temperature (0 = greedy).")] = 0.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Sample from the k most likely tokens (0 = off).")] = 0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling: smallest set with this much probability, in (0, 1] (1 = off).")] = 1.0,
    min_p: Annotated[float, typer.Option("--min-p", help="Drop tokens below min-p x the top probability, in [0, 1] (0 = off).")] = 0.0,
    repetition_penalty: Annotated[float, typer.Option("--repetition-penalty", help="Divide positive / multiply negative logits of tokens already in the context (1 = off).")] = 1.0,
    repetition_context_size: Annotated[int, typer.Option("--repetition-context-size", help="Penalise only the last N ids of the context (0 = all of it).")] = 0,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Random seed, the same on every rank (default: a random one; --verbose prints it).", show_default=False)] = None,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", metavar="<str>", help="Stop at the first occurrence of this text, not printed (repeatable).")] = None,
    chat: Annotated[Optional[bool], typer.Option("--chat/--ignore-chat-template", help="Render the prompt as a user turn through the chat template (default: when the checkpoint has one), or use it as plain text.", show_default=False)] = None,
    chat_template: Annotated[Optional[str], typer.Option("--chat-template", help="A chat template instead of the checkpoint's: jinja text (holding '{', '}' or a newline) or a file of it.")] = None,
    system: Annotated[Optional[str], typer.Option("--system-prompt", "--system", help="System prompt (a chat-template turn).")] = None,
    json_schema: Annotated[Optional[Path], typer.Option("--json-schema", metavar="FILE", help="Constrain the answer to JSON valid under the JSON schema in FILE (constrained decoding; needs llguidance: pip install 'mlxcel-dist\\[grammar]').", show_default=False)] = None,
    json_object: Annotated[bool, typer.Option("--json-object", help="Constrain the answer to a JSON object (OpenAI's json_object mode; needs llguidance).")] = False,
    check_every: Annotated[int, typer.Option("--check-every", help="Ranks compare a checksum of the generated ids every N tokens and at the end (0 = only at the end).")] = 1,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Per-rank load time and peak memory, sampling settings and seed, EOS ids, drafts accepted (stderr).")] = False,
    extra_eos_token: ExtraEosOpt = None,
    draft_model: DraftModelOpt = None,
    num_draft_tokens: NumDraftOpt = 3,
    prompt_lookup: PromptLookupOpt = False,
    prefill_step: PrefillStepOpt = None,
    max_kv_size: MaxKvSizeOpt = None,
    kv_bits: KvBitsOpt = None,
    kv_group_size: KvGroupSizeOpt = 64,
    adapter_path: AdapterOpt = None,
    dtype: DtypeOpt = None,
    np_: NpOpt = 1,
    pp: PpOpt = 1,
    backend: BackendOpt = "auto",
    hostfile: HostfileOpt = None,
    rank_weights: RankWeightsOpt = None,
    moe_split: MoeSplitOpt = "intermediate",
    stall_timeout: StallOpt = DEFAULT_STALL_TIMEOUT_S,
):
    """Generate text, streamed to stdout; speed to stderr."""
    import time

    from .engine import check_context, check_generation_options, generate_text, rank_resources
    from .loader import open_model
    from .sampling import SamplingParams
    from .tokenizer import StopStrings, Tokenizer

    model = _pick_model(model, model_opt)
    launched = bool(os.environ.get("MLXCEL_DIST_WORLD"))
    if not launched:
        # Decided once, here: every rank gets the same text and seed through its argv.
        if prompt == "-":
            prompt = _read_stdin_text()
        if seed is None:
            import secrets

            from .sampling import SEED_LIMIT

            seed = secrets.randbelow(SEED_LIMIT)
        ctx.params.update(prompt=prompt, seed=seed, model=model, model_opt=None)
    for name, value in (("--prompt", prompt), ("--system-prompt", system), ("--chat-template", chat_template),
                        *(("--stop", s) for s in stop or ())):
        _check_text(name, value)
    sampling = SamplingParams(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
                              repetition_context_size=repetition_context_size, seed=seed).validate()
    check_generation_options(max_tokens, check_every, prefill_step)  # before any rank is launched
    stops = list(stop or [])
    StopStrings(stops)
    grammar_text = _grammar_text(json_schema, json_object)  # before launch: a bad schema is one error line
    if not launched:
        # Checkpoint and prompt problems (no config, no tokenizer, a chat
        # template that refuses the conversation, a prompt past the model's
        # context) fail here once, before any rank is launched.
        ck = open_model(model)
        tok = Tokenizer(ck.dir, ck.config, chat_template=_template_text(chat_template), extra_eos=extra_eos_token or ())
        check_context(len(tok.prompt_ids(prompt, chat=chat, system=system)), max_tokens, ck.context_length)
        _check_drafting(draft_model, prompt_lookup, num_draft_tokens, model, sampling, pp, kv_bits,
                        grammar_text is not None)
    kv = _kv_options(model, max_kv_size, kv_bits, kv_group_size)
    adapter = _adapter(model, adapter_path)
    group = _distribute(ctx, np_, backend, hostfile, model, pp)
    t0 = time.perf_counter()
    loaded = _load(model, dtype, group, pp, kv, adapter)
    drafter = _drafter(draft_model, prompt_lookup, num_draft_tokens, dtype, prefill_step=prefill_step)
    load_s = time.perf_counter() - t0
    tok = Tokenizer(loaded.model_dir, loaded.config, chat_template=_template_text(chat_template),
                    extra_eos=extra_eos_token or ())
    use_chat = tok.use_chat(chat)
    ids = tok.prompt_ids(prompt, chat=chat, system=system)
    check_context(len(ids), max_tokens, open_model(model).context_length)
    if group.is_root and verbose:
        how = f"chat template: {tok.chat_template()[1]}" if use_chat else "plain text"
        seeded = "" if "seed" in sampling.describe() else f" (seed {seed}, unused)"
        _err(f"prompt {len(ids)} tokens ({how}); sampling: {sampling.describe()}{seeded}; "
             f"EOS ids {tok.eos_ids}; stop strings {stops}; np {group.size()}")

    def compiling():  # rank 0, on a timer thread: the first step of a new decode graph is slow
        _err("compiling kernels for this model's decode step (the first run of this configuration on "
             "this machine; MLX caches them for later runs)...")

    matcher = None
    if grammar_text is not None:
        from .engine import vocab_size
        from .grammar import Vocab

        matcher = Vocab(loaded.model_dir / "tokenizer.json", vocab_size(loaded.model), tok.eos_ids).matcher(grammar_text)
    gen = generate_text(loaded.model, tok, ids, max_tokens, sampling, stop=stops, prefill_step=prefill_step,
                        group=group, check_every=check_every, on_compile=compiling if group.is_root else None,
                        grammar=matcher, drafter=drafter)
    # The echoed prompt goes out with the first text: until then stdout holds
    # no partial line that a progress line on stderr could land inside.
    echo = prompt if group.is_root and not use_chat else ""
    while True:
        try:
            text = next(gen)
        except StopIteration as done:
            stats = done.value
            break
        except UserError:
            if group.is_root and echo is None:  # end the partial line before the error line
                sys.stdout.write("\n")
                sys.stdout.flush()
            raise
        if group.is_root:
            sys.stdout.write((echo or "") + text)
            sys.stdout.flush()
            echo = None
    resources = rank_resources(group, load_s) if verbose else None
    if group.is_root:
        sys.stdout.write((echo or "") + "\n")
        sys.stdout.flush()
        prompt_speed = (f"{stats.prefill_tok_s:.1f} tok/s" if stats.prefill_timed_tokens
                        else "speed not measured")
        compiled = (f" (+ {stats.compile_s:.1f} s building the decode graph, cached for later runs)"
                    if stats.compile_s >= 1.0 else "")
        _err(
            f"prompt {stats.prompt_tokens} tok, {prompt_speed}{compiled} | "
            f"generated {stats.generated} tok, {stats.decode_tok_s:.1f} tok/s | np {group.size()}{_pp_note(pp, loaded.model)}"
        )
        if verbose:
            why = {"eos": "EOS", "length": "--max-tokens", "stop": f"stop string {stats.stop!r}"}[stats.finish_reason]
            agreed = (f"ranks agreed at {stats.checks} check(s)" if group.size() > 1
                      else "1 rank: the rank-agreement check is a no-op")
            _err(f"finished by {why}; {agreed}")
            if drafter is not None:
                _err(f"drafts ({drafter.name}, {drafter.k} a round): {stats.drafted} drafted, {stats.accepted} "
                     f"accepted ({100 * stats.accepted / max(stats.drafted, 1):.0f}%) in {stats.rounds} verify "
                     f"forwards; mean accepted length {stats.mean_accepted:.2f}")
            _err(f"{'rank':>4} {'load s':>8} {'MLX peak MiB':>13} {'peak RSS MiB':>13}")
            for r, (ls, peak, rss) in enumerate(resources):
                _err(f"{r:>4} {ls:8.2f} {peak:13.1f} {rss:13.1f}")


def _grammar_text(json_schema: Optional[Path], json_object: bool) -> Optional[str]:
    """The grammar of --json-schema FILE / --json-object (grammar.py), or None."""
    if json_schema is None and not json_object:
        return None
    from . import grammar

    if json_schema is not None and json_object:
        raise UserError("give --json-schema or --json-object, not both")
    if json_object:
        return grammar.json_object()
    try:
        schema = json.loads(json_schema.read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"--json-schema: cannot read {json_schema}: {e.strerror or e}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"--json-schema: {json_schema} is not JSON: {e}") from None
    try:
        return grammar.json_schema(schema)
    except UserError as e:
        raise UserError(f"--json-schema {json_schema}: {e}") from None


def _read_stdin_text() -> str:
    """`--prompt -`: the prompt from stdin, strict UTF-8."""
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"the prompt on stdin is not valid UTF-8 (byte {data[e.start]:#04x} at offset {e.start})") from None


def _check_text(name: str, value: Optional[str]) -> None:
    """Text from the command line must be valid UTF-8 (Python hands invalid
    bytes over as lone surrogates, which no tokenizer takes)."""
    if value is None:
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raw = value[e.start].encode("utf-8", "surrogateescape")
        raise UserError(f"{name} is not valid UTF-8 (byte {raw[0]:#04x} at character {e.start})") from None


TEMPLATE_CHARS = "{}\n"  # vLLM's rule: text with one of these is a template, anything else a file


def _template_text(chat_template: Optional[str]) -> Optional[str]:
    """--chat-template: jinja text (it holds '{', '}' or a newline) or the
    path of a file that holds it, which must exist (a template without
    them would be constant text, whatever the conversation)."""
    if chat_template is None or any(c in chat_template for c in TEMPLATE_CHARS):
        return chat_template
    p = Path(chat_template).expanduser()
    if not p.is_file():
        why = "a directory" if p.is_dir() else "no such file"
        raise UserError(f"--chat-template {chat_template}: {why} (a value without '{{', '}}' or a newline "
                        "names a file of jinja text)")
    try:
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--chat-template {p}: cannot read it ({e})") from None


@app.command(hidden=True)
@_handle_errors
def modes(
    ctx: typer.Context,
    model: RequiredModelArg,
    tokens: Annotated[str, typer.Option("--tokens", help="Comma-separated token ids.")],
    out: Annotated[Path, typer.Option("--out", help="npz with one [T, V] array per mode (rank 0 writes).")],
    max_kv_size: MaxKvSizeOpt = None,
    kv_bits: KvBitsOpt = None,
    kv_group_size: KvGroupSizeOpt = 64,
    adapter_path: AdapterOpt = None,
    dtype: DtypeOpt = None,
    np_: NpOpt = 1,
    pp: PpOpt = 1,
    backend: BackendOpt = "auto",
    hostfile: HostfileOpt = None,
    rank_weights: RankWeightsOpt = None,
    moe_split: MoeSplitOpt = "intermediate",
    stall_timeout: StallOpt = DEFAULT_STALL_TIMEOUT_S,
):
    """Logits of one sequence in every feeding mode (the harness's rank job)."""
    import numpy as np

    from .harness import all_mode_logits

    try:
        ids = np.array([int(t) for t in tokens.split(",")], np.int64)
    except ValueError:
        raise UserError("--tokens must be comma-separated integers") from None
    kv = _kv_options(model, max_kv_size, kv_bits, kv_group_size)
    adapter = _adapter(model, adapter_path)
    group = _distribute(ctx, np_, backend, hostfile, model, pp)
    loaded = _load(model, dtype, group, pp, kv, adapter)
    result = all_mode_logits(loaded.model, ids)
    if group.is_root:
        np.savez(out, **result)


@app.command("logit-match", short_help="N-rank logits against one process and a reference.")
@_handle_errors
def logit_match(
    ctx: typer.Context,
    model: ModelArg = None,
    model_opt: ModelOpt = None,
    reference: Annotated[
        Optional[Path], typer.Option("--reference", help="npz with ids and logits (e.g. from transformers).")
    ] = None,
    tokens_file: Annotated[Optional[Path], typer.Option("--tokens-file", help="1-D integer .npy of token ids.")] = None,
    max_kv_size: MaxKvSizeOpt = None,
    kv_bits: KvBitsOpt = None,
    kv_group_size: KvGroupSizeOpt = 64,
    adapter_path: AdapterOpt = None,
    dtype: DtypeOpt = None,
    np_: NpOpt = 2,
    pp: Annotated[int, typer.Option("--pp", help="Compare a run in P pipeline stages (one rank each, or --np P x T: T tensor-parallel ranks each) instead of --np ranks of tensor parallelism.")] = 1,
    backend: BackendOpt = "auto",
    hostfile: HostfileOpt = None,
    rank_weights: RankWeightsOpt = None,
    moe_split: MoeSplitOpt = "intermediate",
    stall_timeout: StallOpt = DEFAULT_STALL_TIMEOUT_S,
):
    """Compare N-rank logits with single-process logits (and a reference) in every mode."""
    import tempfile

    import numpy as np

    from .harness import all_mode_logits, compare, default_tokens, model_window, rel_tol_for
    from .loader import load_model, open_model

    model = _pick_model(model, model_opt)
    if np_ < 1:
        raise UserError(f"--np must be >= 1, got {np_}")
    if pp != 1:  # --np's default (2) is tensor parallelism's: with --pp alone, one rank per stage
        from . import pipeline

        given = ctx.get_parameter_source("np_").name not in ("DEFAULT", "DEFAULT_MAP")
        np_ = pipeline.check_pp_ranks(np_ if given else 1, pp)
    model_dir = open_model(model).dir
    kv = _kv_options(model_dir, max_kv_size, kv_bits, kv_group_size)
    adapter = _adapter(model_dir, adapter_path)
    single = load_model(model_dir, dtype=dtype, kv=kv, adapter=adapter)
    m = single.model
    ref = None
    if reference is not None:
        ref = _read_reference(reference)
    if tokens_file is not None:
        ids = _read_tokens(tokens_file)
    elif ref is not None:
        ids = ref["ids"]
    else:
        ids = default_tokens(m.args.vocab_size, model_window(m))
    if ref is not None and (len(ref["ids"]) != len(ids) or (ref["ids"] != ids).any()):
        raise UserError("--tokens-file ids differ from the reference's ids")
    from .engine import check_tokens

    ids = check_tokens(ids, m.args.vocab_size)
    dtype_name = str(np.dtype("float32")) if single.dtype is None else str(single.dtype).split(".")[-1]
    tol = rel_tol_for(dtype_name)
    _err(f"logit-match: {model_dir.name}, {len(ids)} tokens, window {model_window(m)}, {dtype_name}, np {np_}{_pp_note(pp)}")
    ours = all_mode_logits(m, ids)
    tp = None
    if np_ > 1 or hostfile is not None:
        from .launcher import launch

        with tempfile.TemporaryDirectory(prefix="mlxcel-match-") as tmp:
            out = Path(tmp).resolve() / "tp.npz"
            argv = ["modes", str(model_dir.resolve()), "--tokens", ",".join(map(str, ids.tolist())), "--out", str(out)]
            if dtype:
                argv += ["--dtype", dtype]
            if max_kv_size is not None:
                argv += ["--max-kv-size", str(max_kv_size)]
            if kv_bits is not None:
                argv += ["--kv-bits", str(kv_bits), "--kv-group-size", str(kv_group_size)]
            if adapter_path is not None:
                argv += ["--adapter-path", str(Path(adapter_path).resolve())]
            split = check_moe_split(moe_split)
            argv += ["--moe-split", split]
            if pp > 1:
                argv += ["--pp", str(pp)]
            weights = parse_rank_weights(rank_weights)
            if weights is None and hostfile is not None:
                weights = _hostfile_weights(ctx, hostfile, np_)
            if weights is not None:
                if len(weights) != np_:
                    raise UserError(f"--rank-weights gives {len(weights)} weights for {np_} ranks")
                argv += ["--rank-weights", ",".join(map(str, weights))]
            _check_placement(model_dir, np_, pp, weights, split)
            code = launch(argv, np_, backend, str(hostfile) if hostfile else None,
                          stall_timeout=stall_timeout)
            if code != 0:
                raise UserError(f"the {np_}-rank run failed (exit code {code})")
            with np.load(out) as z:
                tp = {k: z[k] for k in z.files}
    rows = []
    run = f"pp{pp}" if pp > 1 else f"np{np_}"
    for mode, logits in ours.items():
        if tp is not None:
            rows.append((mode, f"{run} vs np1", compare(tp[mode], logits, tol)))
        if ref is not None:
            rows.append((mode, "np1 vs reference", compare(logits, ref["logits"], tol)))
            if tp is not None:
                rows.append((mode, f"{run} vs reference", compare(tp[mode], ref["logits"], tol)))
    if not rows:
        raise UserError("nothing to compare: use --np >= 2 (or --pp >= 2) and/or --reference")
    print(f"{'mode':24} {'comparison':20} {'max|diff|':>10} {'mean|diff|':>10} {'rel':>9} {'top1':>6} {'KL':>9}  ok")
    for mode, what, r in rows:
        print(f"{mode:24} {what:20} {r['max']:10.3e} {r['mean']:10.3e} {r['rel']:9.2e} {r['top1']:6.3f} "
              f"{r['kl']:9.2e}  {'yes' if r['ok'] else 'NO'}")
    bad = [r for r in rows if not r[2]["ok"]]
    print(f"tolerance: max|diff| <= {tol:.2e} x logit scale; {len(rows) - len(bad)}/{len(rows)} comparisons match")
    if bad:
        raise typer.Exit(1)


def _read_reference(path: Path) -> dict:
    import numpy as np

    if not path.exists():
        raise UserError(f"{path}: no such reference file")
    try:
        with np.load(path, allow_pickle=False) as z:
            if "ids" not in z.files or "logits" not in z.files:
                raise UserError(f"{path}: a reference npz needs 'ids' and 'logits'")
            return {"ids": z["ids"], "logits": z["logits"]}
    except (ValueError, OSError) as e:
        raise UserError(f"{path}: not an npz file ({e})") from None


@app.command(short_help="Each rank's share and memory, a predicted decode time.")
@_handle_errors
def plan(
    model: ModelArg = None,
    model_opt: ModelOpt = None,
    np_: NpOpt = 1,
    pp: Annotated[int, typer.Option("--pp", help="Pipeline stages (one rank each, or --np P x T: T tensor-parallel ranks each): each stage's layers and bytes, and its ranks' heads with T > 1.")] = 1,
    hostfile: HostfileOpt = None,
    rank_weights: RankWeightsOpt = None,
    moe_split: MoeSplitOpt = "intermediate",
    link: Annotated[str, typer.Option("--link", help="The link between ranks for the predicted time: loopback (one machine), tb5 (Thunderbolt 5 RDMA), 10gbe.")] = "loopback",
    bandwidth: Annotated[Optional[float], typer.Option("--bandwidth", help="Memory bandwidth of a rank in GB/s for the predicted time (default: measured here).", show_default=False)] = None,
):
    """Per rank: heads, MLP columns, vocabulary rows and weight memory; per token: collectives and a predicted decode time (from the checkpoint's headers only)."""
    from .loader import open_model
    from .plan import format_plan, make_plan

    ck = open_model(_pick_model(model, model_opt))
    weights = parse_rank_weights(rank_weights)
    memory = None
    if hostfile is not None:
        from .hostfile import rank_memory, rank_weights as host_weights, read_hostfile

        hosts = read_hostfile(hostfile).hosts
        np_ = np_ if np_ > 1 else sum(h.slots for h in hosts)
        weights = weights or host_weights(hosts, np_)
        memory = rank_memory(hosts, np_)
        if all(m is None for m in memory):
            memory = None
        if link == "loopback":
            link = "10gbe"
    if np_ < 1:
        raise UserError(f"--np must be >= 1, got {np_}")
    if weights is not None and len(weights) != np_:
        raise UserError(f"--rank-weights gives {len(weights)} weights for {np_} ranks")
    if pp > 1:
        from .pipeline import check_pp_ranks

        np_ = check_pp_ranks(np_, pp)
    split = check_moe_split(moe_split)
    _check_placement(ck, np_, pp, weights, split)
    p = make_plan(ck, np_, weights, link, None if bandwidth is None else bandwidth * 1e9, memory, pp, split)
    print(f"{ck.dir}: {np_} rank(s)")
    for line in format_plan(p):
        print(line)


@app.command()
@_handle_errors
def info(model: ModelArg = None, model_opt: ModelOpt = None, np_: NpOpt = 1):
    """Config summary, context length, per-layer attention kind, parameters and bytes per rank."""
    import numpy as np

    from .loader import build_model, open_model

    from mlx.utils import tree_flatten

    ck = open_model(_pick_model(model, model_opt))
    if np_ < 1:
        raise UserError(f"--np must be >= 1, got {np_}")
    from .loader import check_shardable
    from .plan import rank_plans

    check_shardable(ck, np_)
    ranks = rank_plans(ck, np_)  # on paper, as the ranks shard it
    model_dir, config = ck.dir, ck.config
    m = build_model(config)
    a = m.args
    refs = m.sanitize(dict(ck.refs))
    # The model as built (unquantized, lazy: nothing is read) has the logical
    # shapes; stored packed 4-bit words or scales would miscount them.
    n_params = sum(int(np.prod(p.shape)) for _, p in tree_flatten(m.parameters()))
    dtypes = sorted({r.dtype for r in refs.values()})
    print(f"model       {model_dir}")
    print(f"model_type  {config.get('model_type')} -> {a.model_type}")
    print(f"parameters  {n_params:,} ({', '.join(dtypes)})")
    print(f"hidden      {a.hidden_size}, intermediate {a.intermediate_size}, vocab {a.vocab_size}")
    print(f"heads       {a.num_attention_heads} q, {a.num_key_value_heads} kv, head_dim {a.head_dim}")
    print(f"layers      {a.num_hidden_layers}")
    print(f"context     {ck.context_length or 'not set'} tokens (max_position_embeddings)")
    from .models.base import describe_layers

    for line in getattr(m, "describe_layers", lambda: describe_layers(m))():
        print(f"  {line}")
    shared = " (tensor parallel: replicated tensors counted on every rank)" if np_ > 1 else ""
    print(f"per rank    np {np_}{shared}")
    for rp in ranks:
        print(f"  rank {rp.rank:<3} {rp.params:,} parameters, {rp.bytes:,} bytes ({rp.bytes / 2**20:.2f} MiB)")


@app.command(short_help="Write an MLX checkpoint (optionally quantized).")
@_handle_errors
def convert(
    model: RequiredModelArg,
    out: Annotated[Path, typer.Argument(help="Output directory (created; must be empty).", metavar="OUT", show_default=False)],
    quantize: Annotated[
        bool, typer.Option("--quantize", "-q", help="Quantize Linear and Embedding weights (MLX affine, as mlx-lm).")
    ] = False,
    bits: Annotated[
        Optional[int], typer.Option("--bits", help="Bits per weight with --quantize: 2, 3, 4, 5, 6 or 8 (default 4).")
    ] = None,
    group_size: Annotated[
        Optional[int],
        typer.Option("--group-size", help="Weights per scale and bias with --quantize: 32, 64 or 128 (default 64)."),
    ] = None,
    dtype: Annotated[
        Optional[str],
        typer.Option("--dtype", help="Dtype of the stored float tensors (float32, bfloat16, float16); default: the checkpoint's."),
    ] = None,
    adapter_path: Annotated[
        Optional[Path],
        typer.Option("--adapter-path", metavar="DIR", help="Fuse this LoRA or DoRA adapter (mlx_lm.lora's files) "
                     "into the weights first.", show_default=False),
    ] = None,
):
    """Write an mlx-community-style checkpoint (optionally MLX-quantized) that mlxcel-dist and mlx-lm load."""
    from .convert import convert_checkpoint
    from .loader import check_shardable

    s = convert_checkpoint(model, out, quantize=quantize, bits=bits, group_size=group_size, dtype=dtype,
                           adapter_path=adapter_path)
    q = s["quantization"]
    what = (
        f"{q.describe()}, {len(s['quantized_modules'])} layers quantized, {s['bits_per_weight']:.2f} bits per weight"
        if q
        else "not quantized"
    )
    _err(f"wrote {out}: {', '.join(s['files'])} ({s['tensors']} tensors, {s['bytes'] / 2**20:.1f} MiB), {what}")
    if s["copied"]:
        _err(f"copied {', '.join(s['copied'])}")
    splits = []
    for n in (2, 3, 4, 8):
        try:
            check_shardable(out, n)
            splits.append(str(n))
        except UserError:
            pass
    _err(f"tensor-parallel rank counts that split it (of 2, 3, 4, 8): {', '.join(splits) or 'none'}")


@app.command(short_help="OpenAI-compatible HTTP server; rank 0 listens.")
@_handle_errors
def serve(
    ctx: typer.Context,
    model: ModelArg = None,
    model_opt: ModelOpt = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on (rank 0).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port to listen on (0 = any free port).")] = 8080,
    max_tokens_cap: Annotated[int, typer.Option("--max-tokens-cap", help="Largest max_tokens a request may ask for.")] = 4096,
    max_request_bytes: Annotated[int, typer.Option("--max-request-bytes", help="Largest request body accepted (bytes).")] = 1_000_000,
    max_tokens: Annotated[Optional[int], typer.Option("--max-tokens", "-n", help="Default max_tokens of a request that gives none (default: 512 for chat, as mlx-lm; 16 for completions, as OpenAI).", show_default=False)] = None,
    temp: Annotated[float, typer.Option("--temp", help="Default temperature of a request that gives none (OpenAI's 1; mlx-lm's server: 0).")] = 1.0,
    top_p: Annotated[float, typer.Option("--top-p", help="Default top_p, in (0, 1] (1 = off).")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Default top_k (0 = off).")] = 0,
    min_p: Annotated[float, typer.Option("--min-p", help="Default min_p, in [0, 1] (0 = off).")] = 0.0,
    decode_concurrency: Annotated[int, typer.Option("--decode-concurrency", help="Requests decoded together, one forward per step (as mlx-lm's server).")] = 32,
    warmup: Annotated[bool, typer.Option("--warmup/--no-warmup", help="Before serving, compile the batch step for every batch size up to --decode-concurrency, so a batch reaching a new size does not stall while it compiles (seconds on a GPU). Off by default: on MLX 0.32 CUDA, steady decode after it was slower than without it in 13 of 15 runs on two H200 hosts (docs/benchmarks.md).")] = False,
    prompt_concurrency: Annotated[int, typer.Option("--prompt-concurrency", help="Prompts prefilled between two decode steps, at most (as mlx-lm's server).")] = 8,
    prompt_cache_size: Annotated[int, typer.Option("--prompt-cache-size", help="Prompt cache entries (KV of earlier prompts and replies, reused by a request that starts with one; 0 = off), as mlx-lm's server.")] = 10,
    prompt_cache_bytes: Annotated[Optional[str], typer.Option("--prompt-cache-bytes", help="Prompt cache limit in bytes per rank (e.g. 2GB, 500M; default: no limit), as mlx-lm's server.", show_default=False)] = None,
    extra_eos_token: ExtraEosOpt = None,
    prefill_step: PrefillStepOpt = None,
    max_kv_size: MaxKvSizeOpt = None,
    kv_bits: KvBitsOpt = None,
    kv_group_size: KvGroupSizeOpt = 64,
    adapter_path: AdapterOpt = None,
    dtype: DtypeOpt = None,
    np_: NpOpt = 1,
    backend: BackendOpt = "auto",
    hostfile: HostfileOpt = None,
    rank_weights: RankWeightsOpt = None,
    moe_split: MoeSplitOpt = "intermediate",
    pp: PpOpt = 1,
    micro_batches: Annotated[int, typer.Option("--micro-batches", help="With --pp: each decode step's rows in N micro-batches that follow each other through the stages, so that the stages can work on different ones at once (default 1: see docs/benchmarks.md for what it measured).")] = 1,
    stall_timeout: StallOpt = DEFAULT_STALL_TIMEOUT_S,
    served_model_name: Annotated[Optional[list[str]], typer.Option("--served-model-name", metavar="NAME", help="A name requests may give as 'model' (vLLM's flag, repeatable; the first is the id the server shows; default: MODEL as given).", show_default=False)] = None,
    header_timeout: Annotated[float, typer.Option("--header-timeout", metavar="SECONDS", help="Close a connection that has not sent a whole request head within this many seconds (at its start or after a response).")] = 10.0,
    tool_call_parser: Annotated[Optional[str], typer.Option("--tool-call-parser", metavar="FORMAT", help="How the model writes tool calls: hermes, llama3_json, mistral, harmony (gpt-oss), deepseek_v3, glm45, kimi_k2 or minimax_m2 (default: from markers in the chat template; none found: requests with tools get a 400); hermes, llama3_json and mistral also take tool_choice required / named (forced calls).", show_default=False)] = None,
    reasoning_parser: Annotated[Optional[str], typer.Option("--reasoning-parser", metavar="FORMAT", help="How the model's answer carries its thinking, which chat answers give apart as reasoning_content: qwen3 or deepseek_r1 (<think> blocks), gpt_oss (harmony's analysis channel), or none (default: from the chat template).", show_default=False)] = None,
    draft_model: DraftModelOpt = None,
    num_draft_tokens: NumDraftOpt = 3,
    prompt_lookup: PromptLookupOpt = False,
):
    """OpenAI-compatible HTTP server (/v1/models, /v1/completions, /v1/chat/completions, /health, /metrics, /docs); rank 0 listens.

    Structured output (response_format json_object / json_schema) and forced tool calls (tool_choice
    required / a named function) run by constrained decoding: install the grammar extra
    (pip install 'mlxcel-dist\\[grammar]', llguidance); without it such requests get a 400."""
    from .serve.lifecycle import listen, long_lived_env

    # first: MLX reads these at its first GPU evaluation (set after one, they
    # are ignored; measured); the ranks started below inherit them
    long_lived_env()
    from .engine import check_generation_options
    from .sampling import SamplingParams
    from .serve.lifecycle import Options, run
    from .units import parse_size
    from .serve.openai_api import Defaults
    from .tokenizer import Tokenizer

    model = _pick_model(model, model_opt)
    ctx.params.update(model=model, model_opt=None)

    if not 0 <= port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {port}")
    if not 1 <= max_tokens_cap < 2**31:
        raise UserError(f"--max-tokens-cap must be in [1, 2^31), got {max_tokens_cap}")
    if max_request_bytes < 1:
        raise UserError(f"--max-request-bytes must be >= 1, got {max_request_bytes}")
    check_generation_options(max_tokens=max_tokens, prefill_step=prefill_step)
    if max_tokens is not None and max_tokens > max_tokens_cap:
        raise UserError(f"--max-tokens ({max_tokens}) must be <= --max-tokens-cap ({max_tokens_cap})")
    SamplingParams(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p).validate()
    if decode_concurrency < 1:
        raise UserError(f"--decode-concurrency must be >= 1, got {decode_concurrency}")
    if prompt_concurrency < 1:
        raise UserError(f"--prompt-concurrency must be >= 1, got {prompt_concurrency}")
    if not 1 <= micro_batches <= 64:
        raise UserError(f"--micro-batches must be in [1, 64], got {micro_batches}")
    if micro_batches > 1 and pp <= 1:
        raise UserError("--micro-batches splits steps between pipeline stages: it needs --pp P (P >= 2)")
    if prompt_cache_size < 0:
        raise UserError(f"--prompt-cache-size must be >= 0, got {prompt_cache_size}")
    if not (math.isfinite(header_timeout) and 0 < header_timeout <= 86400):
        raise UserError(f"--header-timeout must be in (0, 86400] seconds, got {header_timeout}")
    from .serve.tools import FORMATS

    if tool_call_parser is not None and tool_call_parser not in FORMATS:
        raise UserError(f"--tool-call-parser must be one of {', '.join(FORMATS)}, got {tool_call_parser!r}")
    from .serve import reasoning

    if reasoning_parser is not None and reasoning_parser not in (*reasoning.FORMATS, "none"):
        raise UserError(f"--reasoning-parser must be one of {', '.join(reasoning.FORMATS)} or none, "
                        f"got {reasoning_parser!r}")
    names = [n for n in (served_model_name or []) if n.strip()]
    if served_model_name and len(names) != len(served_model_name):
        raise UserError("--served-model-name must not be empty")
    cache_bytes = None if prompt_cache_bytes is None else parse_size(prompt_cache_bytes, "--prompt-cache-bytes")
    if not os.environ.get("MLXCEL_DIST_WORLD"):  # before launch
        _check_drafting(draft_model, prompt_lookup, num_draft_tokens, model, pp=pp, kv_bits=kv_bits)
    defaults = Defaults(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, max_tokens=max_tokens)
    kv = _kv_options(model, max_kv_size, kv_bits, kv_group_size)
    adapter = _adapter(model, adapter_path)
    if extra_eos_token and not os.environ.get("MLXCEL_DIST_WORLD"):  # an unknown token fails before launch
        from .loader import open_model

        ck = open_model(model)
        Tokenizer(ck.dir, ck.config, extra_eos=extra_eos_token)
    group = _distribute(ctx, np_, backend, hostfile, model, pp)
    sock = listen(host, port) if group.is_root else None  # before the load: a port in use fails at once
    loaded = _load(model, dtype, group, pp, kv, adapter)
    tok = Tokenizer(loaded.model_dir, loaded.config, extra_eos=extra_eos_token or ())
    names = names or [str(model if model is not None else loaded.model_dir.name)]
    opts = Options(max_tokens_cap=max_tokens_cap, max_request_bytes=max_request_bytes, defaults=defaults,
                   decode_concurrency=decode_concurrency, prompt_concurrency=prompt_concurrency,
                   prompt_cache_size=prompt_cache_size, prompt_cache_bytes=cache_bytes, prefill_step=prefill_step,
                   warmup=warmup, micro_batches=micro_batches, served_names=list(dict.fromkeys(names)),
                   header_timeout_s=header_timeout, tool_call_parser=tool_call_parser,
                   reasoning_parser=reasoning_parser, draft_model=draft_model, prompt_lookup=prompt_lookup,
                   num_draft_tokens=num_draft_tokens, dtype=dtype)
    run(loaded.model, tok, group, opts, sock, loaded.config)


@app.command(short_help="Prefill/decode speed, first-token time, peak memory.")
@_handle_errors
def bench(
    ctx: typer.Context,
    model: ModelArg = None,
    model_opt: ModelOpt = None,
    prompt_tokens: Annotated[int, typer.Option("--prompt-tokens", help="Prompt length (random token ids, seeded).")] = 128,
    gen_tokens: Annotated[int, typer.Option("--gen-tokens", help="Tokens to generate (greedy, EOS ignored).")] = 48,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON line (rank 0) instead of a table.")] = False,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random prompt ids.")] = 0,
    check_every: Annotated[int, typer.Option("--check-every", help="Rank-agreement check every N tokens, as generate (0 = only at the end).")] = 1,
    warmup: Annotated[bool, typer.Option("--warmup/--no-warmup", help="One short untimed generation first.")] = True,
    compiled: Annotated[bool, typer.Option("--compile/--no-compile", help="Compiled decode steps (the default, as generate), or eager ones for comparison.")] = True,
    draft_model: DraftModelOpt = None,
    num_draft_tokens: NumDraftOpt = 3,
    prompt_lookup: PromptLookupOpt = False,
    prompt_file: Annotated[Optional[Path], typer.Option("--prompt-file", help="Prompt text (UTF-8, plain, no chat template) instead of random ids: drafts need real text.")] = None,
    prefill_step: PrefillStepOpt = None,
    max_kv_size: MaxKvSizeOpt = None,
    kv_bits: KvBitsOpt = None,
    kv_group_size: KvGroupSizeOpt = 64,
    adapter_path: AdapterOpt = None,
    dtype: DtypeOpt = None,
    np_: NpOpt = 1,
    pp: PpOpt = 1,
    backend: BackendOpt = "auto",
    hostfile: HostfileOpt = None,
    rank_weights: RankWeightsOpt = None,
    moe_split: MoeSplitOpt = "intermediate",
    stall_timeout: StallOpt = DEFAULT_STALL_TIMEOUT_S,
):
    """Prefill/decode speed, time to first token, peak memory per rank, all_sums per token."""
    import json
    import time

    from .bench import check_lengths, format_table, run_bench
    from .engine import check_generation_options

    model = _pick_model(model, model_opt)
    ctx.params.update(model=model, model_opt=None)
    check_lengths(prompt_tokens, gen_tokens)
    check_generation_options(check_every=check_every, prefill_step=prefill_step)
    if prompt_file is not None and not prompt_file.is_file():
        raise UserError(f"{prompt_file}: no such prompt file")
    if not os.environ.get("MLXCEL_DIST_WORLD"):
        _check_drafting(draft_model, prompt_lookup, num_draft_tokens, model, pp=pp, kv_bits=kv_bits)
    kv = _kv_options(model, max_kv_size, kv_bits, kv_group_size)
    adapter = _adapter(model, adapter_path)
    group = _distribute(ctx, np_, backend, hostfile, model, pp)
    t0 = time.perf_counter()
    loaded = _load(model, dtype, group, pp, kv, adapter)
    load_s = time.perf_counter() - t0
    drafter = _drafter(draft_model, prompt_lookup, num_draft_tokens, dtype, compiled, prefill_step)
    ids = None
    if prompt_file is not None:
        from .tokenizer import Tokenizer

        text = prompt_file.read_text(encoding="utf-8")
        ids = Tokenizer(loaded.model_dir, loaded.config).prompt_ids(text, chat=False)[:prompt_tokens]
    result = run_bench(loaded.model, prompt_tokens, gen_tokens, group=group, prefill_step=prefill_step,
                       seed=seed, check_every=check_every, warmup=warmup, compiled=compiled, drafter=drafter,
                       ids=ids)
    if group.is_root:
        result = {"model": str(loaded.model_dir), "backend": os.environ.get("MLXCEL_DIST_BACKEND", "none"),
                  "load_s": load_s, "pp": pp, **result}
        if as_json:
            print(json.dumps(result), flush=True)
        else:
            print(f"model  {result['model']} (backend {result['backend']})")
            print(format_table(result), flush=True)


def _check_placement(model, np_: int, pp: int, weights, moe_split: str | None = None) -> None:
    """Before launch, on paper: the model splits over np_ ranks (with --pp:
    into pp stages, each split np_ / pp ways)."""
    from .loader import check_shardable

    if pp > 1:
        from .pipeline import check_stageable, member_weights

        check_stageable(model, pp, weights)
        T = np_ // pp
        for s in range(pp):  # each stage splits over its own ranks, by their weights
            check_shardable(model, T, member_weights(weights, s * T, pp), moe_split)
    else:
        check_shardable(model, np_, weights, moe_split)


def _pp_note(pp: int, model=None) -> str:
    """", pp P" and, given the loaded model, each stage's layers."""
    if pp <= 1:
        return ""
    stage = getattr(getattr(model, "model", None), "stage", None)
    spans = " ".join(f"[{a}, {b})" for a, b in stage.ranges) if stage is not None else ""
    return f", pp {pp}" + (f": layers {spans}" if spans else "")


def _pick_model(model: Optional[str], model_opt: Optional[str]) -> Optional[str]:
    """MODEL or --model (mlx-lm's spelling); both only when they agree."""
    if model is not None and model_opt is not None and model != model_opt:
        raise UserError(f"MODEL {model!r} and --model {model_opt!r} differ: give one")
    return model if model is not None else model_opt


BOOL_WORDS = {"true", "false", "yes", "no", "on", "off", "1", "0", "y", "n", "t", "f"}


def _check_flag_values(args: list[str]) -> None:
    """`--verbose False`: an on/off flag takes no value, and click would read
    the word as the next argument (MODEL): say so instead. A word that
    names an existing path is left to be that argument."""
    cmd = typer.main.get_command(app)
    name = next((a for a in args if not a.startswith("-")), None)
    sub = getattr(cmd, "commands", {}).get(name)
    if sub is None:
        return
    flags = {o: p for p in sub.params if getattr(p, "is_flag", False) for o in (*p.opts, *p.secondary_opts)}
    rest = args[args.index(name) + 1 :]
    for opt, nxt in zip(rest, rest[1:]):
        if opt in flags and nxt.lower() in BOOL_WORDS and not Path(nxt).exists():
            p = flags[opt]
            give = f"{p.opts[0]} or {p.secondary_opts[0]}" if p.secondary_opts else "it"
            raise UserError(f"{opt} is an on/off flag: give {give} alone, with no value (got {nxt!r} after it)")


def main():
    """The console entry point: usage errors are one `error:` line, exit 2
    (click's own form is a multi-line box)."""
    try:
        from typer._click import exceptions as click_exceptions  # newer typer vendors click
    except ImportError:  # pragma: no cover - typer on the click package
        from click import exceptions as click_exceptions

    try:
        _check_flag_values(sys.argv[1:])
        rv = app(standalone_mode=False)
    except UserError as e:
        _err(f"error: {e}")
        sys.exit(e.exit_code)
    except click_exceptions.NoArgsIsHelpError as e:  # no arguments at all: the help is the answer
        print(e.format_message())
        sys.exit(e.exit_code)
    except click_exceptions.ClickException as e:
        _err(f"error: {e.format_message()}")
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt, EOFError):
        _err("interrupted")
        sys.exit(130)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
