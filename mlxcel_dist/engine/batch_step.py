"""The batch engine's device step (the engine's `steps`): one forward for
every row on the row buffers (batch_rows.py), each row's id drawn as its
`choice.Choice` says, the host read.

Pipelined (as the old TokenGenerator was): `BatchEngine.step` launches step n+1
(`mx.async_eval`) with step n's lazy ids [n] as its input tokens before the
host reads them, so one step is in flight between calls. A row removed
between calls has already been fed its last read id by that step: the K/V
it writes (exact: the id is real) goes into the prompt cache with the row;
the id it samples for the row is never read. Rows added or removed only
change where the next launch takes each row's input (the unread id,
gathered into the new row order, or a host token) and `pos`. Each row's
sampler counts its unread id as context (`Sampler.sample(..., pending=)`),
so the ids are those of unpipelined steps. No step is launched once every
row has had its `budget` (the caller's max_tokens) launched: a lone
request's last id leaves nothing running behind it. Each step is one
`mx.compile`d graph per (C, S), reused as rows come and go.

Constrained rows (a `grammar.Matcher` per row: response_format, forced tool
calls) need their last id on the host before their next draw: the mask
depends on it. `launch` still builds and starts the forward for every row
from the lazy ids; a constrained row whose last id is unread keeps only its
logits (`_Flight.deferred`); right after `collect` has read that id and
advanced the row's matcher, `finish` starts the masks on the vocabulary's
worker thread (grammar.Vocab.masks_ahead), and `_draw` draws those rows
when their ids are next needed (the next `launch` or `collect`). In
`plain_step` that read comes inside the launch, between building the step
and starting it (`launch(read=True)`): the step before's draw was started
first, so the read waits little, and the masks are computed while the
start runs (on MLX CUDA the longest host part of a step, the GIL released),
not in the caller's shorter host work between steps. Only the small draw
of those rows waits for them. Every rank computes the same masks from the
same ids (no collective).
Micro-batched steps (serve --micro-batches, for pipeline stages:
`_launch_micro`) are skipped while a constrained row is in the batch.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .choice import argmax_ids, choose, draw, grammar_masks, logprobs
from .decode import SplitSegments, splittable
from .flat import FlatStep
from .sampling import device_masks, packed_masks, read_logprobs


# Steps.clock's keys: "eval" MLX's start (async_eval) inside "launch", "masks" the draw's wait for them, "upload"
# their hand-over to MLX, "deferred" rows (a count)
CLOCK = ("launch", "eval", "masks", "upload", "draw", "read", "deferred")


@dataclass(eq=False)
class _Flight:
    """A launched step: the rows it fed (buffer order at launch) and their lazy ids [n]
    (micro-batched: also each micro-batch's ids, `parts`, its rows' and pads')."""

    rows: list
    ids: mx.array | None  # None until `_draw` has drawn the deferred rows' ids
    extras: object
    parts: list | None = None
    deferred: list | None = None  # (b, logits [V]) of constrained rows drawn once their last id is read
    logits: mx.array | None = None  # with deferred rows: the step's logits [C, V] (static batch), else None
    drawn: list | None = None  # the other rows' lazy ids (the deferred rows' slots None)
    read: mx.array | None = None  # what `collect` reads: ids [n], then the guard's check rows when one is due
    masks: object = None  # the deferred rows' masks being computed (a Future: grammar.Vocab.masks_ahead)


class Steps:
    """A BatchEngine's steps: `launch` (build and start one), `collect` (read
    the oldest in flight: the one host sync), `plain_step` (both, pipelined),
    `feed` (blocks of L ids a row, for draft rounds) and the forwards they
    run; `traces` counts the graphs traced (compiled) or steps run (eager)."""

    def __init__(self, engine):
        self.e = engine
        self.flights: list = []  # launched steps not read yet (at most one between `step` calls)
        self.changed = False  # rows added/removed since the last launch
        self.traces = 0
        # host seconds by part, summed over the engine's life (serve's MLXCEL_DIST_STEP_LOG reads them):
        # building and starting steps (of it MLX's start: "eval"), waiting for grammar masks, the deferred
        # rows' draws, the host read
        self.clock = dict.fromkeys(CLOCK, 0.0)
        self._early_s = 0.0  # a launch's read of the step before (`launch(read=True)`), kept out of its time
        self.split = None  # whether the model's one-row steps run split (`splits`), decided with the layout
        self._segments = None
        b = engine.store.buffers  # (one dict for the engine's life: the compiled steps' state)
        self._compiled = mx.compile(self._forward, inputs=b, outputs=b)
        self._compiled_block = mx.compile(self._forward_block, inputs=b, outputs=b)
        # Pipeline stages (--pp): the rows can go through in micro-batches, one behind the other,
        # so that each stage works on a different one at once (`_launch_micro`)
        self._compiled_part = mx.compile(self._forward_part, inputs=b, outputs=b)

    # -- forwards ----------------------------------------------------------
    def splits(self, C: int) -> bool:
        """The one-row case (generate's row; a lone request): a model that opts in steps split
        (decode.SplitSegments: compiled segments between the layers' attention, which then runs
        unmasked on the written prefix, so GPU backends take their fused decode kernels). With a
        margin (drafts) only where no layer is a ring: a full layer's prefix 0 .. pos holds just this
        row's positions (rejected drafts lie past it), a ring of window + margin slots does not."""
        e = self.e
        if self.split is None:
            self.split = splittable(e.model) and all(lay.kind == "kv" for lay in e.store.layout)
        return C == 1 and self.split and e.compiled and (not e.store.margin or
                                                         all(lay.window is None for lay in e.store.layout))

    def _split_row(self, x: mx.array, p: int | None = None) -> mx.array:
        """The one row's split step at host position p (default: the row's)."""
        e = self.e
        if self._segments is None:
            self._segments = SplitSegments(e.model)
        logits = self._segments(x, e.store.buffers, e.store.views, e.rows[0].pos if p is None else p)
        self.traces += self._segments.traced
        return logits

    def _forward(self, tokens: mx.array) -> mx.array:
        self.traces += self.e.compiled  # (the Python body runs per trace compiled, per step eager)
        store = self.e.store
        logits = self.e.model(tokens, store.views)[:, -1]
        store.buffers["pos"] = store.buffers["pos"] + 1
        return logits

    def _forward_block(self, tokens: mx.array) -> mx.array:
        self.traces += self.e.compiled  # (the Python body runs per trace compiled, per step eager)
        return self.e.model(tokens, self.e.store.views)

    def _forward_part(self, tokens: mx.array, a: int, e: int) -> mx.array:
        """Rows [a, e) (a micro-batch) one step on; `pos` moves on with the last part."""
        self.traces += self.e.compiled  # (the Python body runs per trace compiled, per step eager)
        store = self.e.store
        views = []
        for i in range(len(store.layout)):
            views.append(store.view(i, views, (a, e)))
        logits = self.e.model(tokens, views)[:, -1]
        if e == store.capacity():
            store.buffers["pos"] = store.buffers["pos"] + 1
        return logits

    def forward_rows(self, tokens: mx.array) -> tuple:
        """One step's forward: row b fed tokens[b] (lazy int32 [n]) at its
        position; (the static batch's logits [C, V], None for rows on their own
        caches; each row's logits [V])."""
        e = self.e
        n = len(e.rows)
        if not e.static:
            return None, [e.model(tokens[b].reshape(1, 1), r.eager_cache)[0, -1] for b, r in enumerate(e.rows)]
        e.store.reserve(n, max(r.pos for r in e.rows))
        C = e.store.capacity()
        x = (tokens if C == n else mx.concatenate([tokens, mx.zeros((C - n,), mx.int32)])).reshape(C, 1)
        if e.flat_job is not None:  # a prefill chunk rides in this step (flat.py)
            if e.flat is None:
                e.flat = FlatStep(e)
            job, e.flat_job = e.flat_job, None
            logits = e.flat(x.reshape(C), job)
            e.flat_ran = job
            e.flat_steps += 1
            return logits, [logits[b] for b in range(n)]
        logits = self._split_row(x) if self.splits(C) else self._compiled(x) if e.compiled else self._forward(x)
        return logits, [logits[b] for b in range(n)]

    def feed(self, tokens: mx.array, pos: list) -> mx.array:
        """Feed row b the ids tokens[b] [n, L] at positions pos[b] .. pos[b] + L - 1
        (engine built with a margin >= L - 1: each row's later positions may then
        be rolled back by feeding it from an earlier `pos`); lazy logits [n, L, V].
        The rows' `pos` is left to the caller."""
        e, store = self.e, self.e.store
        n, L = tokens.shape
        assert store.margin >= L - 1, (L, store.margin)
        store.reserve(n, max(pos) + L - 1)
        C = store.capacity()
        store.sync_pos(pos)
        # one row, one id (a draft model's step): split as a plain step. Not a block: MLX CUDA's
        # SDPA for several queries builds a cuDNN graph per key length (40-57 ms each new one, one H200)
        if L == 1 and self.splits(C):
            return self._split_row(tokens, pos[0])[:, None]
        x = tokens if C == n else mx.concatenate([tokens, mx.zeros((C - n, L), mx.int32)])
        logits = self._compiled_block(x) if e.compiled else self._forward_block(x)
        return logits[:n]

    # -- launch ------------------------------------------------------------
    def _inputs(self) -> tuple[mx.array, list]:
        """Every row's next input as one lazy int32 [n] (the unread id of the
        step in flight, else the row's host token) and, per row, that unread
        id (the sampler counts it as context) or None."""
        rows = self.e.rows
        f = self.flights[-1] if self.flights else None
        if f is not None and not self.changed:
            return f.ids, [f.ids[b] for b in range(len(rows))]
        at = {} if f is None else {id(r): b for b, r in enumerate(f.rows)}
        host = [r.token for r in rows if id(r) not in at]
        if not at:
            return mx.array(host, mx.int32), [None] * len(rows)
        idx, h = [], len(f.rows)
        for r in rows:
            idx.append(at[id(r)] if id(r) in at else h)
            h += id(r) not in at
        src = mx.concatenate([f.ids, mx.array(host, mx.int32)]) if host else f.ids
        tokens = src[mx.array(idx, mx.int32)]
        return tokens, [tokens[b] if id(r) in at else None for b, r in enumerate(rows)]

    def _launched(self, f: _Flight) -> None:
        for r in self.e.rows:
            r.pos += 1
            r.launched += 1
        self.flights.append(f)
        self.changed = False

    def launch(self, read: bool = False) -> dict | None:
        """Build one step for every row and start it: each row feeds its next
        token at its position `pos`. No host read, unless `read` (plain_step's)
        and the step defers constrained rows: then the step before it is read
        (`collect`) between building this one and starting it, and its
        constrained rows' masks start (`finish`), so they are computed while
        this step's start runs (MLX releases the GIL there); that read's
        {rid: id}, else None."""
        assert len(self.flights) <= 1, "a row's context may lack one unread id, not two"
        e = self.e
        if not e.rows:
            return None
        self._draw()
        t0, self._early_s = time.perf_counter(), 0.0
        try:
            return self._launch(read)
        finally:  # (a read inside it is no part of the launch's time, as a read after it is not)
            self.clock["launch"] += time.perf_counter() - t0 - self._early_s

    def _launch(self, read: bool) -> dict | None:
        e = self.e
        n = len(e.rows)
        choices = choose(e.rows, e.want)
        if e.static and e.parts > 1 and all(c.row.grammar is None for c in choices):
            e.store.reserve(n, max(r.pos for r in e.rows))
            if e.store.capacity() > 1:
                return self._launch_micro(choices, e.store.capacity())
        tokens, pending = self._inputs()
        logits, rows = self.forward_rows(tokens)
        # a constrained row whose last id is unread waits for it (`finish`): its mask needs it
        later = [b for b, (c, p) in enumerate(zip(choices, pending)) if c.row.grammar is not None and p is not None]
        if not later:
            masks = grammar_masks(choices)
            ids, stacked = draw(choices, rows, pending, masks, logits if e.static else None)
            f = _Flight(list(e.rows), stacked if stacked is not None else mx.stack(ids),
                        logprobs(choices, rows, ids, pending, masks))
            with self._timed("eval"):
                self._checked(f)
            return self._launched(f)
        now = [b for b in range(n) if b not in later]
        sub, xs, ps = [choices[b] for b in now], [rows[b] for b in now], [pending[b] for b in now]
        masks = grammar_masks(sub)
        got, _ = draw(sub, xs, ps, masks)
        ids = [None] * n
        for b, t in zip(now, got):
            ids[b] = t
        extras = logprobs(sub, xs, got, ps, masks)
        f = _Flight(list(e.rows), None, extras, deferred=[(b, rows[b]) for b in later], drawn=ids,
                    logits=logits if e.static else None)
        self._launched(f)
        out = None
        if read and len(self.flights) > 1:
            # the step before: read now (its draw was started by `_draw` above, so the wait is short),
            # and the masks of this step's constrained rows start before the long start below
            t0 = time.perf_counter()
            out = self.collect()
            self.finish()
            self._early_s = time.perf_counter() - t0
        # the static batch's logits as one array, not a slice a deferred row: each evaluated output costs
        # MLX CUDA host time
        held = [logits] if e.static else [x for _, x in f.deferred]
        with self._timed("eval"):
            mx.async_eval(held, got, extras, self.e.take_beside())
        return out

    @contextmanager
    def _timed(self, part: str):
        """`clock[part]` += the seconds of the with-block."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.clock[part] += time.perf_counter() - t0

    def _parts(self, C: int) -> list:
        """The micro-batches' row ranges of a C-row step (as even as possible)."""
        m = min(self.e.parts, C)
        cuts = [C * j // m for j in range(m + 1)]
        return [(cuts[j], cuts[j + 1]) for j in range(m)]

    def _launch_micro(self, choices: list, C: int) -> None:
        """A step as micro-batches: each part's forward is scheduled on its own
        (async_eval), in order, and its ids are left unevaluated, so a stage
        (one stream of work per rank) runs part j while the next stage runs
        part j - 1, and the next step's part j needs only this step's part j
        (its ids are evaluated with it)."""
        e = self.e
        n = len(choices)
        f = self.flights[-1] if self.flights else None
        parts = self._parts(C)
        if f is not None and not self.changed and f.parts is not None and len(f.parts) == len(parts) \
                and sum(x.shape[0] for x in f.parts) == C:
            xs = list(f.parts)
            pending = [f.parts[j][b - a] for j, (a, e_) in enumerate(parts) for b in range(a, min(e_, n))]
        else:
            tokens, pending = self._inputs()
            x = tokens if C == n else mx.concatenate([tokens, mx.zeros((C - n,), mx.int32)])
            xs = [x[a:e_] for a, e_ in parts]
        step = self._compiled_part if e.compiled else self._forward_part
        logits = []
        for (a, e_), x in zip(parts, xs):
            out = step(x.reshape(-1, 1), a, e_)
            with self._timed("eval"):
                mx.async_eval(out)
            logits.append(out)
        rows = [logits[j][b - a] for j, (a, e_) in enumerate(parts) for b in range(a, min(e_, n))]
        if all(c.fast for c in choices):  # every part's rows (its pads' too) by one argmax
            ids_parts = [argmax_ids(x) for x in logits]
            ids = [ids_parts[j][b - a] for j, (a, e_) in enumerate(parts) for b in range(a, min(e_, n))]
        else:
            ids, _ = draw(choices, rows, pending)
            pad = mx.array(0, mx.int32)  # the padding rows' next input
            ids_parts = [mx.stack(ids[a:min(e_, n)] + [pad] * (e_ - max(a, n))) for a, e_ in parts]
        stacked = mx.concatenate(ids_parts)[:n]
        f = _Flight(list(e.rows), stacked, logprobs(choices, rows, ids, pending), ids_parts)
        e.micro_steps += 1
        with self._timed("eval"):
            self._checked(f)
        self._launched(f)

    def _checked(self, f: _Flight) -> _Flight:
        """Schedule flight `f` once its ids are complete: with a `guard`, its
        check rows packed behind the ids, so one host read takes both."""
        guard = self.e.guard
        rows = None if guard is None else guard.pending_rows(f.ids)
        f.read = f.ids if rows is None else mx.concatenate([f.ids, rows.reshape(-1)])
        mx.async_eval(f.read, f.extras, self.e.take_beside())  # (a prefill chunk beside it: BatchEngine.evaluate)
        return f

    def graft(self, rows: list, ids: list, extras: dict) -> None:
        """Rows just joined whose first ids were drawn lazily from their
        prompts' last chunk (`BatchEngine.place_layers`): read with the step
        in flight, as if it had fed them (so those ids are the next launch's
        inputs), or as a flight of their own where none is."""
        if not self.flights:
            self.flights.append(self._checked(_Flight(list(rows), mx.stack(ids), extras)))
            return
        f = self.flights[-1]
        f.rows.extend(rows)
        f.extras = {**(f.extras or {}), **extras}
        if f.ids is None:  # its constrained rows not drawn yet: `_draw_flight` stacks these with theirs
            f.drawn.extend(ids)
            return
        f.ids = mx.concatenate([f.ids, mx.stack(ids)])
        self._checked(f)

    # -- deferred draws and the read ----------------------------------------
    def finish(self) -> None:
        """Start the masks of the step in flight's deferred rows: their last
        ids are read now (`collect` advanced their grammars). They are computed
        on the vocabulary's worker thread while the device runs the forward and
        the caller does its host work between steps; `_draw` draws the rows
        when their ids are next needed (the next `launch` or `collect`)."""
        f = self.flights[-1] if self.flights else None
        if f is not None and f.deferred is not None and f.masks is None:
            f.masks = self.e.vocab.masks_ahead([f.rows[b].grammar for b, _ in f.deferred], packed_masks)

    def _draw(self) -> None:
        """Draw the deferred rows of every step in flight whose masks `finish`
        started. Its ids [n] are complete after."""
        for f in self.flights:
            if f.deferred is not None and f.masks is not None:
                self._draw_flight(f)

    def _draw_flight(self, f: _Flight) -> None:
        ids = list(f.drawn)
        t0 = time.perf_counter()
        packed = f.masks.result()  # the deferred rows' masks from one llguidance call, trimmed and distinct
        t1 = time.perf_counter()
        masks = device_masks(packed)  # [k, words] (here: MLX calls stay on the stepping thread)
        t2 = time.perf_counter()
        choices = choose([f.rows[b] for b, _ in f.deferred], self.e.want)
        xs = [x for _, x in f.deferred]
        k = len(f.deferred)
        first = all(b == i for i, (b, _) in enumerate(f.deferred))  # the step's first k rows (the rest drawn or grafted)
        batch = None if f.logits is None or not first else f.logits[:k]
        got, top = draw(choices, xs, None, masks, batch)
        for (b, _), t in zip(f.deferred, got):
            ids[b] = t
        f.extras = {**f.extras, **logprobs(choices, xs, got, None, masks)}
        if top is None:
            f.ids = mx.stack(ids)
        else:  # the deferred rows' ids as one array, the rows after them (grafted: ids drawn) behind it
            f.ids = top if k == len(ids) else mx.concatenate([top, mx.stack(ids[k:])])
        self.clock["deferred"] += k
        f.deferred, f.drawn = None, None
        self._checked(f)
        self.clock["masks"] += t1 - t0
        self.clock["upload"] += t2 - t1
        self.clock["draw"] += time.perf_counter() - t2

    def collect(self) -> dict:
        """Read the oldest step in flight (the one host sync): {rid: id} of
        its rows still present; a removed row's id is dropped unseen."""
        if not self.flights:
            return {}
        e = self.e
        self._draw()
        f = self.flights.pop(0)
        t0 = time.perf_counter()
        read = np.array(f.read)  # the one host sync
        self.clock["read"] += time.perf_counter() - t0
        n = len(f.rows)
        got = read[:n].tolist()
        if e.guard is not None:
            e.guard.commit(got, read[n:].reshape(-1, 3) if len(read) > n else None)
        present = {id(r) for r in e.rows}
        out = {}
        for r, tok in zip(f.rows, got):
            if id(r) in present:
                r.took([tok])
                out[r.rid] = tok
        e.logprobs = {rid: read_logprobs(lp) for rid, lp in (f.extras or {}).items() if rid in out}
        return out

    def more(self) -> bool:
        """Whether some row may still take an id launched now (its budget not all launched)."""
        return any(r.budget is None or r.launched < r.budget for r in self.e.rows)

    def plain_step(self) -> dict:
        """The pipelined decode step (also batch_spec's when no row drafts)."""
        e = self.e
        traces = self.traces
        if not self.flights:
            self.launch()
        # no step past every row's budget: its work would only be discarded (a lone request's last id)
        read = None
        if e.pipelined and self.more():
            read = self.launch(read=True)
        if self.traces > traces and e.on_new_graph is not None:  # before the wait: its kernels compile
            e.on_new_graph()
        out = self.collect() if read is None else read
        self.finish()
        return out
