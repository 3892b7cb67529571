"""`mlxcel-dist` command line: the typer declarations of the commands and
their options; each command's body is mlxcel_dist/commands/<name>.py, called
as `main(ctx, args)` (imported only when the command runs: --help loads no MLX).

Results go to stdout, progress and stats to stderr, and under tensor
parallelism only rank 0 prints or writes files. Every model command takes the
launch options (LaunchOptions: --np, --pp, --backend, --hostfile, ...): with
more than one rank the command re-runs itself on every rank through the
launcher (commands/launch.py), and each rank joins the group before loading
its shard.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import typing
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Optional

import typer

from .cluster import backends
from .commands.common import err as _err, handle_errors as _handle_errors
from .commands.launch import parse_rank_weights  # noqa: F401 (re-exported: tests/helpers use it)
from .errors import UserError
from .cluster.watchdog import DEFAULT_STALL_TIMEOUT_S

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
PpHandoffOpt = Annotated[
    str,
    typer.Option("--pp-handoff", help="How pipeline stages hand on hidden states: send (MLX's send/recv), "
                 "collective (no point-to-point op: an all_gather over the two stages' ranks where the backend "
                 "splits groups (mpi), else over every rank), auto (send where the backend has it; nccl: "
                 "collective).", metavar="auto|send|collective"),
]
DtypeOpt = Annotated[
    Optional[str], typer.Option("--dtype", help="Compute dtype (float32, bfloat16, float16); default: the checkpoint's.")
]
StallOpt = Annotated[
    float,
    typer.Option("--stall-timeout", help="Stop the job when a rank sends no heartbeat for this many seconds (a stopped or cut-off rank); 0 = never."),
]
FetchOpt = Annotated[
    bool,
    typer.Option("--fetch/--no-fetch", help="With --hostfile: send each host without MODEL (or with another revision "
                 "of it) just its ranks' shards from this one, kept in its shard cache (--no-fetch: every host must "
                 "hold MODEL)."),
]
ShardCacheOpt = Annotated[
    Optional[str],
    typer.Option("--shard-cache", metavar="DIR", help="Each host's shard cache (default: $MLXCEL_DIST_CACHE on "
                 "that host, else ~/.cache/mlxcel-dist).", show_default=False),
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
    Optional[int], typer.Option("--kv-group-size", metavar="G", show_default=False,
                                help="Values per scale and bias with --kv-bits: 32, 64 or 128 (default: the largest that divides head_dim).")
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
NumDraftOpt = Annotated[int, typer.Option("--num-draft-tokens", help="The most tokens drafted per verify forward (with --draft-model or --prompt-lookup; a row drafts fewer while its drafts miss).")]
PromptLookupOpt = Annotated[
    bool,
    typer.Option("--prompt-lookup/--no-prompt-lookup", help="Draft the tokens that followed the latest earlier "
                 "occurrence of the last n-gram of the prompt + output (no second model)."),
]


# Option groups: declared once, each field an option of every command that
# takes the group; the body gets them as args.load / args.launch.
@dataclass
class LoadOptions:
    max_kv_size: MaxKvSizeOpt = None
    kv_bits: KvBitsOpt = None
    kv_group_size: KvGroupSizeOpt = None
    adapter_path: AdapterOpt = None
    dtype: DtypeOpt = None


@dataclass
class LaunchOptions:
    np_: NpOpt = 1
    pp: PpOpt = 1
    backend: BackendOpt = "auto"
    hostfile: HostfileOpt = None
    rank_weights: RankWeightsOpt = None
    moe_split: MoeSplitOpt = "intermediate"
    pp_handoff: PpHandoffOpt = "auto"
    stall_timeout: StallOpt = DEFAULT_STALL_TIMEOUT_S
    fetch: FetchOpt = True
    shard_cache: ShardCacheOpt = None


@dataclass
class MatchLaunchOptions(LaunchOptions):
    """logit-match's: two ranks by default, its own --pp help."""
    np_: NpOpt = 2
    pp: Annotated[int, typer.Option("--pp", help="Compare a run in P pipeline stages (one rank each, or --np P x T: T tensor-parallel ranks each) instead of --np ranks of tensor parallelism.")] = 1


def _option_groups(fn):
    """A parameter typed as an option group (a dataclass above) stands, in the
    signature typer reads, for the group's fields in their order (so each
    command's --help lists them); the function gets the group built from them."""
    hints = typing.get_type_hints(fn, include_extras=True)
    params, groups = [], {}
    for p in inspect.signature(fn).parameters.values():
        cls = hints.get(p.name)
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            params.append(p.replace(annotation=hints.get(p.name, p.annotation)))
            continue
        fields = dataclasses.fields(cls)
        groups[p.name] = (cls, [f.name for f in fields])
        field_hints = typing.get_type_hints(cls, include_extras=True)
        params += [inspect.Parameter(f.name, p.kind, default=f.default, annotation=field_hints[f.name])
                   for f in fields]

    @functools.wraps(fn)
    def wrapper(**kwargs):
        for name, (cls, names) in groups.items():
            kwargs[name] = cls(**{n: kwargs.pop(n) for n in names})
        return fn(**kwargs)

    wrapper.__signature__ = inspect.Signature(params)
    return wrapper


def _command(*names, **kw):
    """``app.command`` over ``_handle_errors`` (bad input: one error line) over
    ``_option_groups``: how every command is declared."""
    return lambda fn: app.command(*names, **kw)(_handle_errors(_option_groups(fn)))


def _run(module: str, args: dict, fn: str = "main"):
    """Call the command's body, commands/<module>.py's `fn`, with its
    arguments (the declaration's locals()) as one namespace."""
    ctx = args.pop("ctx", None)
    return getattr(import_module(f".commands.{module}", __package__), fn)(ctx, SimpleNamespace(**args))


# Commands --------------------------------------------------------------------
@_command()
def logits(
    ctx: typer.Context,
    model: RequiredModelArg,
    tokens_file: Annotated[Path, typer.Option("--tokens-file", help="1-D integer .npy of token ids.")],
    out: Annotated[Path, typer.Option("--out", help="Where to write float32 [T, V] logits (.npy).")],
    decode_from: Annotated[
        Optional[int], typer.Option("--decode-from", help="Tokens [0, K) are the prompt; the rest are decoded one by one.")
    ] = None,
    prefill_step: PrefillStepOpt = None,
    *,
    load: LoadOptions,
    launch: LaunchOptions,
):
    """Write the logits of every position of a token sequence."""
    return _run("logits", locals())


@_command()
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
    *,
    load: LoadOptions,
    launch: LaunchOptions,
):
    """Generate text, streamed to stdout; speed to stderr."""
    return _run("generate", locals())


@_command(hidden=True)
def modes(
    ctx: typer.Context,
    model: RequiredModelArg,
    tokens: Annotated[str, typer.Option("--tokens", help="Comma-separated token ids.")],
    out: Annotated[Path, typer.Option("--out", help="npz with one [T, V] array per mode (rank 0 writes).")],
    *,
    load: LoadOptions,
    launch: LaunchOptions,
):
    """Logits of one sequence in every feeding mode (the harness's rank job)."""
    return _run("logit_match", locals(), "modes")


@_command("logit-match", short_help="N-rank logits against one process and a reference.")
def logit_match(
    ctx: typer.Context,
    model: ModelArg = None,
    model_opt: ModelOpt = None,
    reference: Annotated[
        Optional[Path], typer.Option("--reference", help="npz with ids and logits (e.g. from transformers).")
    ] = None,
    tokens_file: Annotated[Optional[Path], typer.Option("--tokens-file", help="1-D integer .npy of token ids.")] = None,
    *,
    load: LoadOptions,
    launch: MatchLaunchOptions,
):
    """Compare N-rank logits with single-process logits (and a reference) in every mode."""
    return _run("logit_match", locals())


@_command(short_help="Each rank's share and memory, a predicted decode time.")
def plan(
    model: ModelArg = None,
    model_opt: ModelOpt = None,
    np_: NpOpt = 1,
    pp: Annotated[int, typer.Option("--pp", help="Pipeline stages (one rank each, or --np P x T: T tensor-parallel ranks each): each stage's layers and bytes, and its ranks' heads with T > 1.")] = 1,
    hostfile: HostfileOpt = None,
    rank_weights: RankWeightsOpt = None,
    moe_split: MoeSplitOpt = "intermediate",
    backend: BackendOpt = "auto",
    pp_handoff: PpHandoffOpt = "auto",
    link: Annotated[str, typer.Option("--link", help="The link between ranks for the predicted time: loopback (one machine), tb5 (Thunderbolt 5 RDMA), 10gbe.")] = "loopback",
    bandwidth: Annotated[Optional[float], typer.Option("--bandwidth", help="Memory bandwidth of a rank in GB/s for the predicted time (default: measured here).", show_default=False)] = None,
    ask_hosts: Annotated[bool, typer.Option("--ask-hosts", help="With --hostfile: ask each other host (over ssh) how many bytes of its shards a launch would send it (default: the most it could).")] = False,
    shard_cache: ShardCacheOpt = None,
    context: Annotated[int, typer.Option("--context", help="Tokens already in the KV cache: a decoded token's attention reads their keys and values (latent attention: its latent cache).")] = 0,
    host_us_per_layer: Annotated[Optional[float], typer.Option("--host-us-per-layer", help="Host time a decoded token spends per layer, in microseconds, on every rank (default: a hostfile's per-host host_us_per_layer=, else measured here).", show_default=False)] = None,
    host_ms_per_token: Annotated[Optional[float], typer.Option("--host-ms-per-token", help="Host time a decoded token spends outside the layers (sampling, the host read), in milliseconds (default: measured here).", show_default=False)] = None,
):
    """Per rank: heads, MLP columns, vocabulary rows and weight memory; per token: collectives and a predicted decode time (from the checkpoint's headers only)."""
    return _run("plan", locals())


@_command()
def info(model: ModelArg = None, model_opt: ModelOpt = None, np_: NpOpt = 1):
    """Config summary, context length, per-layer attention kind, parameters and bytes per rank."""
    return _run("info", locals())


@_command(short_help="Write an MLX checkpoint (optionally quantized).")
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
    return _run("convert", locals())


@_command(short_help="OpenAI-compatible HTTP server; rank 0 listens.")
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
    prompt_concurrency: Annotated[int, typer.Option("--prompt-concurrency", help="Prompts admitted at one step, at most (as mlx-lm's server); their prefill then runs beside the decoding rows, --max-num-batched-tokens a step.")] = 8,
    max_num_batched_tokens: Annotated[Optional[int], typer.Option("--max-num-batched-tokens", metavar="N", help="Tokens one step computes while prompts are prefilled beside decoding rows (vLLM's flag): each running stream's token, then chunks of the waiting prompts (at least a quarter of N); a prompt with no stream running prefills a --prefill-step chunk a step. Default: paced from the steps' own times, so that a running stream's gap stays within --max-stall x its usual gap (docs/serving.md).", show_default=False)] = None,
    max_stall: Annotated[float, typer.Option("--max-stall", metavar="X", help="Paced prefill: a running stream's gap while prompts prefill beside it stays within X x its usual gap; a larger X gives the prompts larger chunks (their first token sooner: at worst 1 + 1/(X-1) x their time alone). Not with --max-num-batched-tokens.")] = 3.0,
    prompt_cache_size: Annotated[int, typer.Option("--prompt-cache-size", help="Prompt cache entries (KV of earlier prompts and replies, reused by a request that starts with one; 0 = off), as mlx-lm's server.")] = 10,
    prompt_cache_bytes: Annotated[Optional[str], typer.Option("--prompt-cache-bytes", help="Prompt cache limit in bytes per rank (e.g. 2GB, 500M; default: no limit), as mlx-lm's server.", show_default=False)] = None,
    extra_eos_token: ExtraEosOpt = None,
    prefill_step: PrefillStepOpt = None,
    *,
    load: LoadOptions,
    launch: LaunchOptions,
    micro_batches: Annotated[int, typer.Option("--micro-batches", help="With --pp: each decode step's rows in up to N micro-batches that follow each other through the stages, so that the stages can work on different ones at once; the server times steps in parts against whole ones and keeps whichever is faster (default 1).")] = 1,
    served_model_name: Annotated[Optional[list[str]], typer.Option("--served-model-name", metavar="NAME", help="A name requests may give as 'model' (vLLM's flag, repeatable; the first is the id the server shows; default: MODEL as given).", show_default=False)] = None,
    header_timeout: Annotated[float, typer.Option("--header-timeout", metavar="SECONDS", help="Close a connection that has not sent a whole request head within this many seconds (at its start or after a response).")] = 10.0,
    tool_call_parser: Annotated[Optional[str], typer.Option("--tool-call-parser", metavar="FORMAT", help="How the model writes tool calls: hermes, llama3_json, mistral, harmony (gpt-oss), deepseek_v3, deepseek_v31, glm45, kimi_k2 or minimax_m2 (default: from markers in the chat template; none found: requests with tools get a 400); tool_choice required / named force a call in that format.", show_default=False)] = None,
    reasoning_parser: Annotated[Optional[str], typer.Option("--reasoning-parser", metavar="FORMAT", help="How the model's answer carries its thinking, which chat answers give apart as reasoning_content: qwen3 or deepseek_r1 (<think> blocks), gpt_oss (harmony's analysis channel), or none (default: from the chat template); a constrained answer's grammar starts after the thinking.", show_default=False)] = None,
    draft_model: DraftModelOpt = None,
    num_draft_tokens: NumDraftOpt = 3,
    prompt_lookup: PromptLookupOpt = False,
):
    """OpenAI-compatible HTTP server (/v1/models, /v1/completions, /v1/chat/completions, /health, /metrics, /docs); rank 0 listens.

    Structured output (response_format json_object / json_schema) and forced tool calls (tool_choice
    required / a named function) run by constrained decoding: install the grammar extra
    (pip install 'mlxcel-dist\\[grammar]', llguidance); without it such requests get a 400."""
    return _run("serve", locals())


@_command(short_help="Prefill/decode speed, first-token time, peak memory.")
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
    *,
    load: LoadOptions,
    launch: LaunchOptions,
):
    """Prefill/decode speed, time to first token, peak memory per rank, all_sums per token."""
    return _run("bench", locals())


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


def _stack_dumps() -> None:
    """`kill -USR1 PID` makes this process (launcher or rank) print every
    thread's Python stack to its stderr: a hung job's first clue. Printed by a
    Python handler, under the GIL: faulthandler's C dump of every thread
    crashed a serving rank (SIGSEGV) while another thread was starting. For a
    process stuck in C with the GIL held (no Python handler runs), `kill -USR2`
    is faulthandler's dump (unsafe while threads start or stop)."""
    import faulthandler
    import signal

    def dump(signum, frame):
        import threading
        import traceback

        names = {t.ident: t.name for t in threading.enumerate()}
        out = []
        for ident, f in sys._current_frames().items():
            out.append(f"Thread {ident:#x} ({names.get(ident, '?')}, most recent call first):\n")
            out.extend(reversed(traceback.format_stack(f)))
        try:
            sys.stderr.write("".join(out) + "\n")
            sys.stderr.flush()
        except (OSError, ValueError):  # (a closed stderr)
            pass

    try:
        signal.signal(signal.SIGUSR1, dump)
        faulthandler.register(signal.SIGUSR2, all_threads=True)
    except (AttributeError, ValueError, OSError, RuntimeError):  # no SIGUSR1 (Windows), not the main thread,
        pass  # or a stderr without a file


def main():
    """The console entry point: usage errors are one `error:` line, exit 2
    (click's own form is a multi-line box)."""
    _stack_dumps()
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
