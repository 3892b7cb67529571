"""Prompts on their way into the batch engine's rows, prefilled a chunk at a
time so that the steps of the rows already decoding never wait for a whole
prompt (the engine's prefill scheduling; batch.py owns the rows).

An admitted request becomes a job in `Prefills`' queue: `Alone` (one prompt
through the model's own caches, chunk by chunk, exact as `generate`) or
`Together` (several prompts in one forward per chunk over [B, chunk] in
`cache.PrefillCache` buffers, each row at its own offset; a shorter prompt's chunk
padded after its end, its pad keys masked from its real queries). Each
engine step gives the queue its prompt tokens (`Budget`, from what the
decoding rows take): the oldest job runs first, a job's forward takes at most what is left, and a job whose
prompts are done moves them into rows before the step's decode forward, so
their first ids come from that step. With no rows decoding, nothing waits on
a prefill: each job runs one forward of its full chunk (`prefill_step` a
prompt) per step. Every rank makes the same queue decisions (they depend on
rows and prompt lengths only).

How many prompt tokens a step takes beside its rows: the number a step
brings (serve's pacing, serve/pacing.py, from the steps' times), else the
engine's `Budget`: a fixed token budget per step (vLLM's
`--max-num-batched-tokens`: the rows' tokens first, prompts take the rest, at
least a quarter), or, until pacing has measured anything, `default_budget()`
(docs/benchmarks.md, "Streams beside a long prompt").

A job's forward is evaluated before the step goes on (its time is the step's,
which serve's pacing reads), after the decode step in flight, which it
follows on the device; in one process on a CPU a paced step's forwards run
on a stream of their own and are evaluated with the step's decode launch
(`BatchEngine.evaluate`), so the two compute on two cores at once.

Chunks of any size give the same keys as one pass (the sliding-window
invariant, docs/architecture.md): a budgeted chunk changes when a prompt's
keys are written, not which.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from ..cache import ring_slots
from ..parallel.collectives import ends_the_job
from ..parallel.pipeline import outstanding_sends
from .flat import chunk_size, fusable
from .sampling import SamplingParams


@dataclass(eq=False)
class Admission:
    """A request on its way into a row: its prompt, the prompt-cache prefix,
    and what the row carries (the one admission record, serve's wire included)."""

    rid: object
    prompt: np.ndarray
    last: int  # its last prompt token's position (the row's first input)
    sampling: SamplingParams | None
    start: int  # prompt tokens the prompt cache supplies
    cache: list | None  # their caches (None: a miss)
    budget: int | None = None
    grammar: object = None  # grammar.Matcher: the row's constrained decoding
    drafts: bool = True  # drafts may be verified for it (batch_spec.py)
    echo: int | None = None  # its prompt's logprobs, with the k most likely each (OpenAI's echo)


class Request(NamedTuple):
    """What `BatchEngine.add_many` takes for one request (a plain tuple in
    this order does too)."""

    rid: object
    prompt_ids: object
    sampling: SamplingParams | None = None
    budget: int | None = None  # ids the caller reads at most (max_tokens); 0: the prompt's logprobs only
    grammar: object = None  # a grammar.Matcher, or a grammar's text for the engine's vocab
    drafts: bool = True  # False: opted out of drafts
    echo: int | None = None  # the prompt's logprobs (k most likely each)
    logprobs: int | None = None  # each id's logprob with the k most likely (the engine's `want`)


def prompt_logprobs(logits: mx.array, following: np.ndarray, k: int) -> tuple:
    """Lazy (logprob of each following id [m], top-k ids [m, k], their
    logprobs [m, k]) from one forward's logits [m, V]: the model's own
    distribution (log-softmax, as vLLM's prompt_logprobs)."""
    x = logits.astype(mx.float32)
    lse = mx.logsumexp(x, axis=-1, keepdims=True)
    lp = mx.take_along_axis(x, mx.array(following, mx.int32)[:, None], axis=-1)[:, 0] - lse[:, 0]
    if not k:
        return lp, None, None
    top = mx.argsort(-x, axis=-1)[:, :k]
    return lp, top, mx.take_along_axis(x, top, axis=-1) - lse


def read_prompt_logprobs(prompt, parts: list) -> list:
    """Per prompt token: None (the first), else (logprob, [(id, logprob), ...])."""
    out = [None]
    for lp, top, top_lp in parts:
        lp = np.array(lp).tolist()
        tops = np.array(top).tolist() if top is not None else [[] for _ in lp]
        tlps = np.array(top_lp).tolist() if top_lp is not None else [[] for _ in lp]
        out += [(v, list(zip(t, tl))) for v, t, tl in zip(lp, tops, tlps)]
    return out[: len(prompt)]


PREFILL_PER_DECODE = 2  # the CPU default: prompt tokens a step per decoding token
MIN_PREFILL = 8  # ... and at least this many


@dataclass(frozen=True)
class Budget:
    """The prompt tokens one step computes beside `decoding` row tokens:
    `tokens` a step in all (less the rows', at least a quarter of it), or
    without it PREFILL_PER_DECODE x the rows' (at least MIN_PREFILL)."""

    tokens: int | None = None

    def prefill(self, decoding: int) -> int:
        if self.tokens is None:
            return max(PREFILL_PER_DECODE * decoding, MIN_PREFILL)
        return max(self.tokens - decoding, self.tokens // 4, 1)


# Before pacing has measured a step: on a CPU a step is compute-bound, a prompt token
# costing about a decoding row's token (the 24M bf16 llama of benchmarks/serve_stall.py:
# 18-23 ms against 25 ms), so prompts get twice the rows' tokens; a GPU step of few
# rows is bound by reading the weights, which a chunk shares: a fixed budget there.
GPU_TOKEN_BUDGET = 512


def default_budget() -> Budget:
    return Budget() if mx.default_device() == mx.cpu else Budget(GPU_TOKEN_BUDGET)


PAD_SLACK = 1.25  # prompts prefill together while the padded tokens stay within 25% of the real ones


def _chunks(admits: list, L: int):
    """The chunk schedule of prompts sorted by tokens left (most first):
    per forward (each active row's offset, its tokens in the chunk, the
    largest end); a row leaves after its last chunk, so the active rows are
    always the first ones."""
    offs = [a.start for a in admits]
    while offs:
        lens = [min(L, a.last - o) for a, o in zip(admits, offs)]
        n = max(lens)
        yield offs, lens, max(o + n for o in offs)
        offs = [o + m for a, o, m in zip(admits, offs, lens) if o + m < a.last]


def pad_groups(admits: list, step: int) -> list:
    """Prompts (sorted by tokens left) in groups prefilled together: a prompt
    joins the group before it while the group's forwards, padded to their
    longest chunk, cost at most PAD_SLACK x its real tokens (on a CPU the
    padding is pure cost; a GPU gains by fewer, larger forwards)."""
    admits = sorted(admits, key=lambda a: a.start - a.last)
    groups = []
    for a in admits:
        g = groups[-1] + [a] if groups else None
        if g is not None:
            L = min(step, g[0].last - g[0].start)
            padded = sum(len(offs) * max(lens) for offs, lens, _ in _chunks(g, L))
            if padded <= PAD_SLACK * sum(x.last - x.start for x in g):
                groups[-1] = g
                continue
        groups.append([a])
    return groups


# The fewest slots an unwrapped prefill buffer holds (then powers of two): each size is a trace of the
# flat step (flat.py), and a GPU's attention over slots not written yet costs little
GROW_CPU, GROW_GPU = 64, 1024
# A job whose chunks may ride in the rows' step takes at most this many tokens a row a chunk: its
# rings (window + chunk) and buffers (a power of two) then have sizes shared by every prompt, so a
# server traces each flat graph once, not once per prompt length (a chunk's array-masked attention
# made a 768-token flat step slower than the chunk alone on the H200: docs/benchmarks.md)
FLAT_CHUNK = 512


def _grown(need: int, cap: int) -> int:
    """Slots for `need`: a power of two, at least GROW_CPU / GROW_GPU, at most `cap`."""
    least = GROW_CPU if mx.default_device() == mx.cpu else GROW_GPU
    return min(cap, max(least, 1 << (need - 1).bit_length()))


def _read_row(buf: mx.array, b: int, slots) -> mx.array:
    """buf[b, :, slots, :] as [1, H, n, D] (a view when `slots` is a slice)."""
    return buf[b : b + 1][:, :, slots, :]


def _write_row(buf: mx.array, b: int, slots, x: mx.array) -> None:
    """buf[b, :, slots, :] = x[0] in place of the Python object `buf`."""
    if isinstance(slots, slice):
        buf[b : b + 1, :, slots, :] = x
        return
    row_buf = buf[b : b + 1]
    row_buf[..., slots, :] = x
    buf[b : b + 1] = row_buf


class Alone:
    """One prompt through the model's own caches, a chunk per `run` (exact as
    `generate`); done, its caches move into a row (or stay its eager cache)."""

    def __init__(self, engine, a: Admission):
        self.engine, self.a = engine, a
        self.cache = a.cache if a.cache is not None else engine.model.make_cache()
        self.at = a.start
        self.admits = [a]
        self.echoed = []  # (logprobs, top ids, top logprobs) per forward: the prompt's, when a.echo is set

    def left(self) -> int:
        return self.a.last - self.at

    def width(self) -> int:
        return 1

    def run(self, n: int) -> int:
        """One forward of up to `n` prompt tokens; the tokens it ran."""
        m = min(n, self.left())
        if m > 0:
            model = self.engine.model
            logits = model(mx.array(self.a.prompt[self.at : self.at + m])[None], self.cache)
            if self.a.echo is not None:  # every rank: the head's collectives run alike
                self.echoed.append(prompt_logprobs(logits[0], self.a.prompt[self.at + 1 : self.at + m + 1],
                                                   self.a.echo))
            self.engine.evaluate([c.state for c in self.cache] if self.cache else [], outstanding_sends(model),
                                 [x for x in (self.echoed[-1] if self.a.echo is not None else ()) if x is not None])
            self.at += m
        return m

    def finish(self) -> None:
        e, a = self.engine, self.a
        if e.prompt_cache is not None and a.start < a.last:
            e.prompt_cache.store(a.prompt[: a.last], self.cache)
        if a.echo is not None:
            e.echoed(a, read_prompt_logprobs(a.prompt, self.echoed))
        if e.answerable(a):
            e.answer(a, self.cache)
            return
        e.place_prefilled(a, self.cache)

    def answers(self) -> bool:
        """Its one request is answered from these caches, no row taken
        (`BatchEngine.answer`): finished in the step of its last chunk."""
        return self.engine.answerable(self.a)


class Together:
    """Several prompts (sorted by tokens left, most first) prefilled in one
    forward per chunk over the active ones ([B, chunk], PrefillCache buffers,
    per-row offsets and masks). A chunk moves every active row on alike, so
    the prompts finished after it are the last rows: they move into batch
    rows and the prefill buffers keep the first rows. A shorter prompt's
    chunk is padded with id 0 at the positions after its end; its pad keys
    are masked from its real queries, land where its later tokens (or nothing
    it keeps) go, and are finite (no query row is all masked)."""

    def __init__(self, engine, admits: list, L: int):
        self.engine = engine
        self.admits = sorted(admits, key=lambda a: a.start - a.last)  # stable: ties keep their order
        flat = fusable(engine)
        if flat:  # (a power of two: a prompt's length is no ring size of its own; within --prefill-step)
            L = min(FLAT_CHUNK, engine.prefill_step, 1 << (L - 1).bit_length())
        self.L = L  # the longest chunk a row takes (rings are sized for it)
        self.offs = [a.start for a in self.admits]
        # where each prompt's prefill ends: before its last token (its row's first input), or after it
        # for a prompt answered from its prefill (BatchEngine.answerable) and, in flat steps, for every
        # prompt: that token's logits come with the forward of its last chunk and its row's first id is
        # drawn from them (BatchEngine.place_layers), a step sooner than its row's own first step
        first = flat and engine.pipelined and engine.guard is None
        self.ends = {id(a): a.last + (first or engine.answerable(a)) for a in self.admits}
        T = max(self.ends.values()) + L  # slots written, pads included, at most
        if flat:
            T = 1 << (T - 1).bit_length()  # (a power of two: few buffer shapes, few flat graphs)
        layout = engine.layout  # batch_rows.LayerRows per layer (only KV kinds prefill together)
        self.rings = [None if not lay.kv else (T if lay.window is None else min(lay.window + L, T))
                      for lay in layout]  # (None: a layer that reads another's)
        B = len(self.admits)
        self.bufs = bufs = {"offsets": None, "end": None, "upto": 0}
        self.kv = [name for lay, R in zip(layout, self.rings) if R is not None for name in lay.kv]
        self.T = T
        for lay, R in zip(layout, self.rings):
            for name in lay.kv if R is not None else ():
                shape = engine.shapes[name]
                n = R if R < T else _grown(max(a.start for a in self.admits) + 1, T)  # (unwrapped: grown as written)
                bufs[name] = mx.zeros((B, shape[1], n, shape[3]), engine.dtypes[name])
        for b, a in enumerate(self.admits):  # a prompt-cache prefix: its keys/values at their slots
            for lay, R, c in zip(layout, self.rings, a.cache or ()):
                if R is None:
                    continue
                held, _ = c.held()
                slots = ring_slots(a.start - held[0].shape[2], held[0].shape[2], R)
                for name, x in zip(lay.kv, held):
                    _write_row(bufs[name], b, slots, x)
                c.release()
        # the forward `stage` planned: (tokens [B, m], each row's real tokens, the rows answered after it)
        self.staged = None
        self.logits = None  # those rows' last tokens' logits [len(pick), V], once the forward ran
        self.views = []  # each layer's kind makes its view (cache.PrefillCache, ...)
        for i, (lay, R) in enumerate(zip(layout, self.rings)):
            self.views.append(lay.cache.prefill_view(bufs, i, R, R is not None and R < T, self.views))

    def left(self) -> int:
        return sum(self.ends[id(a)] - o for a, o in zip(self.admits, self.offs))

    def width(self) -> int:
        return len(self.offs)

    def run(self, n: int) -> int:
        """One forward of up to `n` tokens over the active rows (at least one
        each); the tokens it ran. Finished rows move into the batch."""
        ran = self.stage(n, flat=False)
        self.run_staged()
        return ran

    def stage(self, n: int, flat: bool = True) -> int:
        """Plan this job's next forward of up to `n` tokens (at least one a
        row); the real tokens it takes. `flat`: it rides in the rows' step
        (flat.FlatStep), its chunk one of few sizes (`_flat_size`) so that
        few graphs are traced; `run_staged` runs it alone instead."""
        offs, B = self.offs, len(self.offs)
        c = max(1, min(self.L, n // B))
        if flat:
            c = self._flat_size(c)
        lens = [min(c, self.ends[id(a)] - o) for a, o in zip(self.admits, offs)]
        m = c if flat else max(lens)  # (a flat chunk keeps its size: its pads after a prompt's end)
        tokens = np.zeros((B, m), np.int32)
        for b, (a, o, k) in enumerate(zip(self.admits, offs, lens)):
            tokens[b, :k] = a.prompt[o : o + k]
        # the prompts answered after this chunk: their last token's logits, at [b, lens[b] - 1]
        pick = [b for b, (a, o, k) in enumerate(zip(self.admits, offs, lens))
                if self.ends[id(a)] > a.last and o + k == self.ends[id(a)]]
        self.staged = (tokens, lens, pick)
        self.logits = None
        self._fit(max(o + m for o in offs))
        bufs = self.bufs
        bufs["offsets"] = mx.array(offs, mx.int32)
        bufs["end"], bufs["upto"] = bufs["offsets"] + m, max(o + m for o in offs)
        return sum(lens)

    def _flat_size(self, c: int) -> int:
        """A flat chunk's size for an offer of `c` tokens a row. Each new size
        is a new graph (a trace, 100-170 ms of host time on the H200, and where
        the machine's kernel cache lacks it MLX's kernel compiles, seconds)
        where twice the tokens cost a few ms: so a size run before
        (`BatchEngine.flat_sizes`) within [c / 2, 2 c], the largest up to c
        first; else `chunk_size`. A chunk that would leave a tail of at most a
        quarter of itself takes the tail too, in a size run before up to 1.5 x
        its own (the tail's step would cost the streams a whole gap and the
        prompt a step); a last chunk whose pads alone would grow the buffers (a new
        shape for a few tokens) takes a size that fits."""
        sizes = [m for m in self.engine.flat_sizes if m <= self.L]
        m = max([m for m in sizes if c // 2 <= m <= c], default=None) \
            or min([m for m in sizes if c < m <= 2 * c], default=None) or chunk_size(c, self.L)
        left = max(self.ends[id(a)] - o for a, o in zip(self.admits, self.offs))
        if 0 < left - m <= m // 4:  # a short last chunk would be a step of its own: this one takes it too,
            # in a size run before (a new one would be a trace, dearer than the step it saves)
            m = min([k for k in sizes if left <= k <= m * 3 // 2], default=m)
        held = self._held()
        top, real = max(self.offs), max(min(m, self.ends[id(a)] - o) for a, o in zip(self.admits, self.offs))
        if held is not None and top + m > held >= top + real:
            fit = [k for k in sizes if real <= k <= held - top] or [chunk_size(held - top, self.L)]
            m = max(fit) if max(fit) >= real else m
        self.engine.flat_sizes.add(m)
        return m

    def _held(self) -> int | None:
        """The slots the unwrapped layers' buffers hold now (None: every layer a ring)."""
        for lay, R in zip(self.engine.layout, self.rings):
            for name in lay.kv if R == self.T else ():
                return self.bufs[name].shape[2]
        return None

    def _fit(self, need: int) -> None:
        """The unwrapped layers' buffers (slot = position) hold `need` slots:
        they grow to a power of two as the prompts are written (at most T),
        so a chunk's attention in a flat step covers about what is written,
        in few shapes (each a trace)."""
        for lay, R in zip(self.engine.layout, self.rings):
            for name in lay.kv if R == self.T else ():
                x = self.bufs[name]
                if x.shape[2] < need:
                    pad = mx.zeros((*x.shape[:2], _grown(need, self.T) - x.shape[2], x.shape[3]), x.dtype)
                    self.bufs[name] = mx.concatenate([x, pad], axis=2)

    def staged_tokens(self) -> np.ndarray:
        return self.staged[0]

    def flat_inputs(self) -> dict:
        """The buffers a flat step takes (its `state`): keys/values, offsets,
        ends, and where each row's last token in the chunk is among its B x m
        ("pick": read for the prompts answered after this chunk; every row's,
        so that their last chunk is no graph of its own)."""
        state = {name: self.bufs[name] for name in (*self.kv, "offsets", "end")}
        tokens, lens, _ = self.staged
        state["pick"] = mx.array([b * tokens.shape[1] + k - 1 for b, k in enumerate(lens)], mx.int32)
        return state

    def flat_done(self, state: dict, logits: mx.array) -> None:
        """The flat step has written this chunk's keys/values (`state`: its
        outputs); `logits` [B, V]: each row's last token's in the chunk, kept
        for the prompts answered after it."""
        for name in self.kv:
            self.bufs[name] = state[name]
        pick = self.staged[2]
        self.logits = logits[mx.array(pick)] if pick else None

    def run_staged(self) -> None:
        """The staged forward alone (eager), then `advance`."""
        model = self.engine.model
        tokens, lens, pick = self.staged
        logits = model(mx.array(tokens), self.views)
        if pick:
            self.logits = logits[mx.array(pick), mx.array([lens[b] - 1 for b in pick])]
        self.engine.evaluate([self.bufs[name] for name in self.kv], outstanding_sends(model),
                             [self.logits] if pick else [])
        self.advance()

    def advance(self) -> None:
        """After the staged forward ran: the offsets move on; the rows it
        finished move into the batch."""
        (_, lens, pick), self.staged = self.staged, None
        offs, B = self.offs, len(self.offs)
        keep = sum(o + k < self.ends[id(a)] for a, o, k in zip(self.admits, offs, lens))  # the finished: last rows
        for b in range(keep, B):
            self._finish_row(self.admits[b], b, self.logits[pick.index(b)] if b in pick else None)
        self.logits = None
        for name in self.kv:
            self.bufs[name] = self.bufs[name][:keep]
        self.offs = [o + k for o, k in zip(offs[:keep], lens[:keep])]
        self.admits = self.admits[:keep]

    def _finish_row(self, a: Admission, b: int, logits: mx.array | None = None) -> None:
        """Row b of the prefill buffers holds prompt `a` up to a.last: keep it
        in the prompt cache and move it into a batch row, or, answered from its
        prefill, draw its ids from its last token's `logits` [V]."""
        e = self.engine
        held = self._row_kv(b, a.last)  # (lazy slices of the buffers)
        if e.prompt_cache is not None:
            e.prompt_cache.store_layers(a.prompt[: a.last], [e.entry(i, x) for i, x in enumerate(held)], e.windows)
        if logits is None:
            e.place_layers(a, held)
        elif e.answerable(a):  # its one id, no row (BatchEngine.answer)
            e.answer_with(a, logits)
        else:  # its last token prefilled too: the row's first id drawn from its logits
            e.place_layers(a, self._row_kv(b, a.last + 1), logits)

    def _row_kv(self, b: int, n: int) -> list:
        """Row b's keys/values of its first n tokens per layer, oldest first (a
        sliding layer's last window of them), as RowBuffers.write takes them."""
        kv = []
        for lay, R in zip(self.engine.layout, self.rings):
            if R is None:
                kv.append(None)
                continue
            k = n if lay.window is None else min(n, lay.window)  # a ring of w + chunk slots holds the last w
            slots = ring_slots(n - k, k, R)
            kv.append(([_read_row(self.bufs[name], b, slots) for name in lay.kv], []))
        return kv

    def finish(self) -> None:
        """Every row has moved in (`run` moves them as they finish)."""

    def answers(self) -> bool:
        return False


class Prefills:
    """The queue of prefill jobs, oldest first (see the module docstring)."""

    def __init__(self):
        self.jobs: list = []
        self.cancelled: set = set()

    def __bool__(self) -> bool:
        return bool(self.jobs)

    def __contains__(self, rid) -> bool:
        return any(a.rid == rid for j in self.jobs for a in j.admits)

    def cancel(self, rid) -> None:
        """A queued request's row leaves as soon as it is placed (its prefill
        work runs on: a group's other rows need the same forwards)."""
        self.cancelled.add(rid)

    def run(self, e, budget: int | None, drain: bool = False) -> None:
        """Run the queue for engine `e`, oldest job first: with a `budget` (tokens)
        until it is spent, a job's forward taking at most what is left; without
        one, one forward of `prefill_step` tokens a prompt per job, or every
        job to its end (`drain`). A job that fails ends its own requests
        (`failed`), no other."""
        while self.jobs:
            for job in list(self.jobs):
                if budget is not None and budget <= 0:
                    return
                try:
                    if job.left() == 0:  # prefilled by an earlier step, or nothing to prefill: placed now
                        self.jobs.remove(job)
                        if budget is not None and job.answers():
                            budget -= 1  # its answer: one more token's forward
                        job.finish()
                        continue
                    if budget is not None and e.rows and isinstance(job, Alone) and fusable(e) \
                            and job.a.echo is None:
                        job = self._into_buffers(e, job)  # so that its chunks can ride in the rows' forward
                    if budget is not None and e.rows and isinstance(job, Together) and fusable(e):
                        # this step's chunk rides in the rows' forward (flat.py): one job a step
                        ran = job.stage(budget)
                        e.flat_job = job
                        e.prefilled += ran
                        return
                    # a paced step beside rows (one process, a CPU): the forward built on the side stream
                    beside = e.deferring = budget is not None and bool(e.rows) and e.side is not None
                    try:
                        with mx.stream(e.side) if beside else contextlib.nullcontext():
                            ran = job.run(e.prefill_step * job.width() if budget is None else budget)
                    finally:
                        e.deferring = False  # (a failing job too: later evaluations run at once)
                    # beside decoding rows a prompt's last chunk and its placement (the buffers grown
                    # for it, its rows' first step) take two steps: one step would stall the rows for
                    # both; an answer (one token's forward, no row) follows in the same step if the
                    # budget has room for it and the chunk is not waiting to run beside the launch
                    # (the answer would read it first: chunk, answer and decode one after another)
                    answer_now = job.answers() and budget is not None and budget > ran and not beside
                    if job.left() == 0 and (budget is None or not e.rows or answer_now):
                        self.jobs.remove(job)
                        job.finish()
                except Exception as err:  # noqa: BLE001 - that job's requests alone
                    if ends_the_job(err):
                        raise
                    e.fail(job, f"{type(err).__name__}: {err}")
                    continue
                e.prefilled += ran
                if budget is not None:
                    budget -= ran
            if not drain:
                return

    def _into_buffers(self, e, job: Alone) -> Together:
        """A prompt prefilling alone through its own caches (fast where no row
        decodes: a GPU's fused attention) moves into prefill buffers once rows
        decode, its keys so far copied in (as a prompt-cache prefix), so that
        its chunks can ride in the rows' steps (flat.py)."""
        a = job.a
        moved = replace(a, start=job.at, cache=job.cache if job.at > 0 else None)
        together = Together(e, [moved], min(e.prefill_step, a.last + 1 - job.at))
        self.jobs[self.jobs.index(job)] = together
        return together
