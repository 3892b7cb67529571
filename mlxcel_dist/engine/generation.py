"""One request through the one engine: what `generate`, `bench` and the
harness's decode mode run (serve runs many through the same engine, from
serve.protocol's step); `sequence_logits`, every position's logits in the
feeding modes logit-match compares.

`Generation` gives a prompt a row of the model's `BatchEngine` (kept in the
model's `engine` slot, so its compiled steps are traced once per buffer
shape and reused by later generations) and reads its ids step by step:
the prompt is prefilled in chunks of `prefill_step`, its last token is the
row's first input, and every step after is pipelined (the next one
launched before this one's id is read, one host sync per token). The
rank-agreement check of an id rides on the same read (`BatchEngine.guard`).
Drafts (`spec`: a batch_spec.BatchDrafts), a grammar (`grammar.Matcher`),
logprobs and penalties are the row's, decided by the engine as for serve's
rows; a model with its own generation loop (`generate_ids`) runs through
`OneRowEngine`, the same calls over that loop.

EOS, stop strings and max_tokens end a generation here and in serve's
scheduler by the same rule (`tokenizer.RowText`).
"""

from __future__ import annotations

import threading
import time

import mlx.core as mx
import numpy as np

from ..cluster import faults
from .batch import BatchEngine
from ..parallel.collectives import SINGLE, Group
from .guard import (COMPILE_NOTICE_S, DEFAULT_PREFILL_STEP, GenStats, RankAgreement, check_generation_options,
                     check_tokens, vocab_size)
from ..errors import UserError
from .prefill import Request
from .sampling import SamplingParams

ROW = 0  # the one request's row id


class OneRowEngine:
    """BatchEngine's calls over a model with its own generation loop
    (`generate_ids`, e.g. diffusion_gemma's block diffusion): one row at a
    time, each `step` the loop's next id; the loop's own end is reported as
    `eos` (its first EOS id) so the caller finishes the row as at EOS."""

    capacity = 1
    prefilling = False  # its loop prefills inside the first step
    prefilled = 0
    spec = None
    static = False
    traces = 0
    flat_steps = 0
    micro_steps = 0

    def splits(self, C: int) -> bool:
        return False

    def __init__(self, model, group: Group, eos_ids):
        self.model, self.group = model, group
        self.eos_ids = tuple(int(e) for e in eos_ids)
        self.eos = self.eos_ids[0] if self.eos_ids else -1
        self.rid = None
        self.gen = None
        self.want: dict = {}  # logprobs are refused before a request gets here for these models
        self.logprobs: dict = {}
        self.failed: dict = {}
        self.prompt_logprobs: dict = {}  # echo is refused at parse time for these models

    def __len__(self) -> int:
        return int(self.rid is not None)

    def __contains__(self, rid) -> bool:
        return rid is not None and rid == self.rid

    def add_many(self, items) -> None:
        for rid, prompt_ids, sampling, max_tokens, *_ in (Request(*r) for r in items):
            if self.rid is not None:
                raise RuntimeError("one row at a time: this model has its own generation loop")
            prompt = check_tokens(prompt_ids, vocab_size(self.model))
            ids = self.model.generate_ids(prompt, max_tokens, sampling or SamplingParams(), self.eos_ids, self.group)
            self.rid, self.gen = rid, iter(ids)

    def remove(self, rid) -> None:
        if rid == self.rid:
            self.gen.close()  # every rank leaves the loop at the same id
            self.rid = self.gen = None

    def step(self, prefill: int | None = None, micro: int = 0) -> dict:
        if self.rid is None:
            return {}
        try:
            return {self.rid: int(next(self.gen))}
        except StopIteration:
            return {self.rid: self.eos}


def batch_engine(model) -> BatchEngine:
    """The model's BatchEngine, kept in its `engine` slot (its traces reused
    by later generations and scores)."""
    if model.engine is None:
        model.engine = BatchEngine(model)
    return model.engine


def engine_for(model, eos_ids=(), group: Group = SINGLE):
    """The model's generation engine: its BatchEngine, or a OneRowEngine over its own loop."""
    return OneRowEngine(model, group, eos_ids) if model.own_loop else batch_engine(model)


def sequence_logits(model, ids, decode_from: int | None = None, prefill_step: int | None = None,
                    compiled: bool = True) -> np.ndarray:
    """float32 [T, V] logits for every position of `ids`.

    Tokens [0, decode_from) (all of them by default) are fed as a prompt with a
    fresh cache, in one pass or in chunks of `prefill_step`; the rest go one at
    a time through the step generation uses: a row of the model's engine
    (`BatchEngine.scores`; compiled unless `compiled` is False).
    """
    ids = check_tokens(ids, vocab_size(model))
    T = len(ids)
    end = T if decode_from is None else decode_from
    if not 1 <= end <= T:
        raise UserError(f"--decode-from must be in [1, {T}] for {T} tokens, got {decode_from}")
    check_generation_options(prefill_step=prefill_step)
    step = prefill_step or end
    cache = model.make_cache()
    out = []
    pos = 0
    while pos < end:
        n = min(step, end - pos)
        logits = model(mx.array(ids[pos : pos + n])[None], cache)
        out.append(np.array(logits[0].astype(mx.float32)))
        pos += n
    if pos < T:
        engine = batch_engine(model)
        engine.compiled, engine.margin, engine.spec = compiled, 0, None
        out.append(engine.scores(cache, ids[pos:]))
    return np.concatenate(out, axis=0)




class Generation:
    """Iterating yields generated ids (each already agreed on, per the
    guard's schedule) until EOS or `max_tokens`; a caller may also stop
    early (stop strings). Call `finish()` afterwards, on every rank: it
    frees the row, runs the final agreement check and returns GenStats.

    `spec`: a batch_spec.BatchDrafts (drafts: 1 .. K + 1 ids a step);
    `grammar`: a grammar.Matcher the ids follow; `logprobs` (None: off, k:
    each id's logprob and the k most likely); `on_compile()` runs on a timer
    thread when the first decode step takes over COMPILE_NOTICE_S (a new
    graph's kernels compiling), whose time is then reported as compile_s;
    `engine`: another engine than the model's (tests: a model with its own
    loop stepped token by token)."""

    def __init__(self, model, prompt_ids, max_tokens: int, sampling: SamplingParams | None = None, eos_ids=(),
                 prefill_step: int | None = None, group: Group = SINGLE, check_every: int = 1,
                 compiled: bool = True, on_compile=None, logprobs: int | None = None, grammar=None, spec=None,
                 engine=None):
        self.prompt = check_tokens(prompt_ids, vocab_size(model))
        check_generation_options(max_tokens, check_every, prefill_step)
        if logprobs is not None and (isinstance(logprobs, bool) or logprobs < 0):
            raise UserError(f"logprobs must be None or an integer >= 0, got {logprobs}")
        self.eos = set(int(e) for e in eos_ids)
        self.engine = engine if engine is not None else engine_for(model, tuple(self.eos), group)
        if isinstance(self.engine, OneRowEngine):
            for asked, what in ((logprobs is not None, "logprobs are"), (grammar is not None, "constrained decoding is"),
                                (spec is not None, "drafts are")):
                if asked:
                    raise UserError(f"{what} not available for {model.args.model_type} (its own generation loop)")
        else:
            e = self.engine
            if ROW in e:  # a generation left unfinished (its caller stopped reading): this one takes the engine
                e.remove(ROW)
            e.prefill_step, e.compiled, e.spec = prefill_step or DEFAULT_PREFILL_STEP, compiled, spec
            e.margin = spec.k if spec is not None else 0
            e.vocab = grammar.vocab if grammar is not None else None
            e.budget = None  # a lone prompt goes in whole before its first step
        self.model = model
        self.max_tokens = max_tokens
        self.sampling = faults.sampling(sampling or SamplingParams(), group)
        self.grammar, self.logprobs, self.spec = grammar, logprobs, spec
        self.guard = RankAgreement(group, check_every)
        self.rank = group.rank()
        self.prefill_step = prefill_step or DEFAULT_PREFILL_STEP
        self.on_compile = on_compile
        self.stats = GenStats(prompt_tokens=len(self.prompt))
        self._t_decode = None
        self._added = False

    def _start(self) -> list:
        """Prefill the prompt and read the first step: its ids."""
        e, stats = self.engine, self.stats
        t0 = time.perf_counter()
        faults.at("prefill", self.rank)
        if not isinstance(e, OneRowEngine):
            e.guard = self.guard
        e.add_many([Request(ROW, self.prompt, self.sampling, self.max_tokens, self.grammar, logprobs=self.logprobs)])
        self._added = True
        if ROW in e.failed:  # (every rank alike: the same data)
            raise RuntimeError(f"the prompt's prefill failed: {e.failed.pop(ROW)}")
        t_chunks, traces = time.perf_counter(), e.traces
        notice = []

        def new_graph():  # the first step built a graph: announce it if its kernels take a while
            if self.on_compile is not None:
                notice.append(threading.Timer(COMPILE_NOTICE_S, self.on_compile))
                notice[0].daemon = True
                notice[0].start()

        if not isinstance(e, OneRowEngine):
            e.on_new_graph = new_graph
        try:
            first = self._step()
        finally:
            for n in notice:
                n.cancel()
            if not isinstance(e, OneRowEngine):
                e.on_new_graph = None
        self._t_decode = time.perf_counter()
        if e.traces > traces and e.compiled:  # a new graph: its trace and kernels timed apart
            stats.compile_s = self._t_decode - t_chunks
            stats.prefill_s, stats.prefill_timed_tokens = t_chunks - t0, len(self.prompt) - 1
        else:
            stats.prefill_s, stats.prefill_timed_tokens = self._t_decode - t0, len(self.prompt)
        return first

    def _step(self) -> list:
        """One engine step: this row's ids (a list: drafts give several)."""
        e = self.engine
        before = self.guard.count
        got = e.step().get(ROW)
        if got is None:
            raise RuntimeError("the engine gave no id for the generation's row")
        ids = got if isinstance(got, list) else [got]
        # the ids the engine's read recorded (its guard: a pipelined step's, also one read ahead of a draft
        # round) come first; the rest (a round's, a model's own loop's) are recorded and checked here
        rest = ids[self.guard.count - before:]
        if rest:
            self.guard.add_many(rest)
        if isinstance(got, list):
            drafted = e.spec.last
            self.stats.rounds += drafted[0] > 0
            self.stats.drafted += drafted[1]
            self.stats.accepted += drafted[2]
        if self.logprobs is not None:
            self.stats.logprobs.append(e.logprobs.get(ROW))
        return ids

    def __iter__(self):
        if self.max_tokens == 0:
            self.stats.finish_reason = "length"
            return
        try:
            yield from self._ids()
        finally:
            self._free()

    def _ids(self):
        stats = self.stats
        ids = self._start()
        while True:
            for tok in ids:
                if stats.generated == 1:
                    faults.at("decode", self.rank)
                stats.generated += 1  # (EOS counts as generated, not yielded)
                stats.tokens.append(tok)
                if tok in self.eos:
                    stats.finish_reason = "eos"
                    return
                yield tok
                if stats.generated >= self.max_tokens:
                    stats.finish_reason = "length"
                    return
            ids = self._step()

    def _free(self) -> None:
        """The row leaves the engine (its buffers go with the last row); every rank alike."""
        e = self.engine
        if self._added and ROW in e:
            e.remove(ROW)
        if not isinstance(e, OneRowEngine):
            e.guard = None
            e.want.pop(ROW, None)

    def finish(self) -> GenStats:
        self._free()
        self.guard.finish()
        if self._t_decode is not None:
            self.stats.decode_s = time.perf_counter() - self._t_decode
        self.stats.checks = self.guard.checks
        return self.stats


def generate_text(model, tokenizer, prompt_ids, max_tokens: int, sampling: SamplingParams | None = None,
                  stop=(), eos_ids=None, prefill_step: int | None = None, group: Group = SINGLE, check_every: int = 1,
                  context_tokens: int = 4, on_compile=None,
                  logprobs: int | None = None, on_token=None, grammar=None, spec=None, compiled: bool = True):
    """Yield text chunks as they become final; returns GenStats via
    StopIteration.value. `grammar`: a grammar.Matcher the ids must follow.

    Stops at EOS (not printed), after `max_tokens`, or at the first occurrence
    of a stop string (neither it nor any part of it is yielded). Text is
    yielded only when it is whole UTF-8 and cannot be the start of a stop
    string. The prompt's last `context_tokens` ids are the detokenizer's left
    context (never yielded). Every rank must run this, not only the one that
    prints: stop strings decide when generation ends.

    `logprobs` (None = off): Generation's option; `on_token(id, entry)`
    is called for each generated id (EOS excepted) before the text it
    completes is yielded, `entry` being its (logprob, top) or None.
    `spec` (batch_spec.BatchDrafts): drafts, the same ids at temperature 0."""
    from ..checkpoint.tokenizer import RowText

    eos = tokenizer.eos_ids if eos_ids is None else eos_ids
    # the ids end at EOS or max_tokens in Generation; RowText ends the text by the same rule as serve's rows
    gen = Generation(model, prompt_ids, max_tokens, sampling, eos, prefill_step, group, check_every, compiled,
                     on_compile, logprobs, grammar, spec)
    row = RowText(tokenizer, stop, (), max_tokens, list(prompt_ids)[-context_tokens:] if context_tokens else ())
    for tok in gen:
        if on_token is not None:
            on_token(tok, gen.stats.logprobs[-1] if logprobs is not None else None)
        text = row.add(tok)
        if text:
            yield text
        if row.reason is not None:
            break
    if row.reason is None:  # EOS (Generation's): the held-back tail
        tail = row.close()
        if tail:
            yield tail
    stats = gen.finish()
    if row.reason == "stop":
        stats.finish_reason, stats.stop = "stop", row.stopped
    elif row.reason == "length":  # (read to max_tokens: the loop left before Generation said so)
        stats.finish_reason = "length"
    return stats
