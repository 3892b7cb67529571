"""`mlxcel-dist generate`: text streamed to stdout, speed to stderr; and the
checks of text, chat templates, grammars and drafts that bench and serve
share with it."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

from ..engine.guard import check_context, check_generation_options, rank_resources
from ..engine.generation import generate_text
from ..errors import UserError
from ..checkpoint.loader import open_model
from ..engine.sampling import SamplingParams
from ..checkpoint.tokenizer import StopStrings, Tokenizer
from .common import err, pick_model, pp_note
from .launch import checked, distribute, load_shard


def main(ctx, a) -> None:
    load, launch = a.load, a.launch
    model = pick_model(a.model, a.model_opt)
    prompt, seed = a.prompt, a.seed
    launched = bool(os.environ.get("MLXCEL_DIST_WORLD"))
    if not launched:
        # Decided once, here: every rank gets the same text and seed through its argv.
        if prompt == "-":
            prompt = _read_stdin_text()
        if seed is None:
            import secrets

            from ..engine.sampling import SEED_LIMIT

            seed = secrets.randbelow(SEED_LIMIT)
        ctx.params.update(prompt=prompt, seed=seed, model=model, model_opt=None)
    for name, value in (("--prompt", prompt), ("--system-prompt", a.system), ("--chat-template", a.chat_template),
                        *(("--stop", s) for s in a.stop or ())):
        check_text(name, value)
    sampling = SamplingParams(temp=a.temp, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                              repetition_penalty=a.repetition_penalty,
                              repetition_context_size=a.repetition_context_size, seed=seed).validate()
    check_generation_options(a.max_tokens, a.check_every, a.prefill_step)  # before any rank is launched
    stops = list(a.stop or [])
    StopStrings(stops)
    grammar_text = _grammar_text(a.json_schema, a.json_object)  # before launch: a bad schema is one error line
    extra_eos = a.extra_eos_token or ()
    if not launched:
        # Checkpoint and prompt problems (no config, no tokenizer, a chat
        # template that refuses the conversation, a prompt past the model's
        # context) fail here once, before any rank is launched.
        ck = open_model(model)
        tok = Tokenizer(ck.dir, ck.config, chat_template=template_text(a.chat_template), extra_eos=extra_eos)
        check_context(len(tok.prompt_ids(prompt, chat=a.chat, system=a.system)), a.max_tokens, ck.context_length)
        check_drafting(a.draft_model, a.prompt_lookup, a.num_draft_tokens, model, sampling, launch.pp,
                       grammar_text is not None)
    kv, adapter = checked(model, load)
    group = distribute(ctx, launch, model)
    t0 = time.perf_counter()
    loaded = load_shard(model, load.dtype, group, launch.pp, kv, adapter)
    drafter = make_drafter(a.draft_model, a.prompt_lookup, a.num_draft_tokens, load.dtype,
                           prefill_step=a.prefill_step)
    load_s = time.perf_counter() - t0
    tok = Tokenizer(loaded.model_dir, loaded.config, chat_template=template_text(a.chat_template),
                    extra_eos=extra_eos)
    use_chat = tok.use_chat(a.chat)
    ids = tok.prompt_ids(prompt, chat=a.chat, system=a.system)
    check_context(len(ids), a.max_tokens, open_model(model).context_length)
    if group.is_root and a.verbose:
        how = f"chat template: {tok.chat_template()[1]}" if use_chat else "plain text"
        seeded = "" if "seed" in sampling.describe() else f" (seed {seed}, unused)"
        err(f"prompt {len(ids)} tokens ({how}); sampling: {sampling.describe()}{seeded}; "
            f"EOS ids {tok.eos_ids}; stop strings {stops}; np {group.size()}")
        if kv.describe():
            err(kv.describe())

    def compiling():  # rank 0, on a timer thread: the first step of a new decode graph is slow
        err("compiling kernels for this model's decode step (the first run of this configuration on "
            "this machine; MLX caches them for later runs)...")

    matcher = None
    if grammar_text is not None:
        from ..engine.guard import vocab_size
        from ..engine.grammar import Vocab

        matcher = Vocab(loaded.model_dir / "tokenizer.json", vocab_size(loaded.model), tok.eos_ids).matcher(grammar_text)
    gen = generate_text(loaded.model, tok, ids, a.max_tokens, sampling, stop=stops, prefill_step=a.prefill_step,
                        group=group, check_every=a.check_every, on_compile=compiling if group.is_root else None,
                        grammar=matcher, spec=drafter)
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
    resources = rank_resources(group, load_s) if a.verbose else None
    if group.is_root:
        sys.stdout.write((echo or "") + "\n")
        sys.stdout.flush()
        _report(stats, group, launch.pp, loaded.model, drafter, resources)


def _report(stats, group, pp: int, model, drafter, resources) -> None:
    """Rank 0's stderr lines after the text (with --verbose: why it stopped,
    the drafts, each rank's load time and memory)."""
    prompt_speed = (f"{stats.prefill_tok_s:.1f} tok/s" if stats.prefill_timed_tokens
                    else "speed not measured")
    compiled = (f" (+ {stats.compile_s:.1f} s building the decode graph, cached for later runs)"
                if stats.compile_s >= 1.0 else "")
    err(
        f"prompt {stats.prompt_tokens} tok, {prompt_speed}{compiled} | "
        f"generated {stats.generated} tok, {stats.decode_tok_s:.1f} tok/s | np {group.size()}{pp_note(pp, model)}"
    )
    if resources is None:
        return
    why = {"eos": "EOS", "length": "--max-tokens", "stop": f"stop string {stats.stop!r}"}[stats.finish_reason]
    agreed = (f"ranks agreed at {stats.checks} check(s)" if group.size() > 1
              else "1 rank: the rank-agreement check is a no-op")
    err(f"finished by {why}; {agreed}")
    if drafter is not None:
        err(f"drafts ({drafter.name}, {drafter.k} a round): {stats.drafted} drafted, {stats.accepted} "
            f"accepted ({100 * stats.accepted / max(stats.drafted, 1):.0f}%) in {stats.rounds} verify "
            f"forwards; mean accepted length {stats.mean_accepted:.2f}")
    err(f"{'rank':>4} {'load s':>8} {'MLX peak MiB':>13} {'peak RSS MiB':>13}")
    for r, (ls, peak, rss) in enumerate(resources):
        err(f"{r:>4} {ls:8.2f} {peak:13.1f} {rss:13.1f}")


def check_drafting(draft_model, prompt_lookup: bool, num_draft: int, model, sampling=None, pp: int = 1,
                   grammar: bool = False) -> None:
    """Before launch: the draft options fit together, the target and the draft model."""
    if draft_model is None and not prompt_lookup:
        return
    from ..checkpoint.loader import build_model
    from ..engine.spec import check_drafting, check_pair, check_target

    if draft_model is not None and prompt_lookup:
        raise UserError("--draft-model and --prompt-lookup both draft: give one")
    if grammar:
        raise UserError("drafts (--draft-model, --prompt-lookup) are not available with --json-schema / --json-object")
    check_drafting(num_draft)
    target = build_model(open_model(model).config)
    check_target(target, sampling)
    if draft_model is not None:
        try:
            draft = open_model(draft_model)
        except UserError as e:  # say which of the two models it is
            raise UserError(f"--draft-model: {e}") from None
        check_pair(target, build_model(draft.config))


def make_drafter(draft_model, prompt_lookup: bool, num_draft: int, dtype, compiled: bool = True, prefill_step=None):
    """The drafts of this rank's engine (a batch_spec.BatchDrafts; None: no
    drafts): the draft model loaded whole (every rank drafts alike, no
    message between them), or prompt lookup."""
    from ..engine.batch_spec import BatchDrafts, DraftRows

    if draft_model is None and not prompt_lookup:
        return None
    if prompt_lookup:
        return BatchDrafts(num_draft)
    from ..checkpoint.loader import load_model

    return BatchDrafts(num_draft, DraftRows(load_model(draft_model, dtype=dtype).model, num_draft, compiled, prefill_step))


def _grammar_text(json_schema: Optional[Path], json_object: bool) -> Optional[str]:
    """The grammar of --json-schema FILE / --json-object (grammar.py), or None."""
    if json_schema is None and not json_object:
        return None
    from ..engine import grammar

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


def check_text(name: str, value: Optional[str]) -> None:
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


def template_text(chat_template: Optional[str]) -> Optional[str]:
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
