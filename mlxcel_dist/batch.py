"""Batched decoding: many sequences, each at its own position, one forward
per step (what `serve` runs for concurrent requests).

Layout. Every layer's keys/values live in static buffers [C, kv_heads, S, D]
shared by the batch: row b holds one sequence, `pos[b]` (int32 [C]) is the
position of the token row b feeds in this step. As in decode.py (whose
single-sequence steps this generalises), a full layer writes slot `pos[b]`
and a sliding layer slot `pos[b] % S` of a buffer that grows to exactly the
window and is then a ring; the mask of row b is `arange(S) <= pos[b]`
([C, 1, 1, S]), RoPE takes the per-row offsets `pos`. Rows are written with
one scatter per layer (`mx.put_along_axis`), so rows never see each other.

Rows. A request's prompt (all but its last token, less a prompt-cache
prefix) is prefilled, then its keys/values move into a free row (the last
prompt token is that row's first input). Requests admitted together
(`add_many`) are prefilled together in groups of two or more whose padding
stays within PAD_SLACK of their tokens (`_pad_groups`): one forward per chunk of `prefill_step` tokens per prompt over [B, chunk]
(shorter chunks padded with id 0 after their end), each row at its own
offset (RoPE) in `PrefillCache` buffers [B, kv_heads, R, D] where position
p sits in slot p % R (full layers: R covers the longest prompt, slot =
position; sliding: R = window + chunk, a ring), masks [B, 1, chunk, R] from
each slot's position (`masks.create_rows_mask`: windowed per row, pad keys
hidden from real queries, no all-masked row). A lone request is prefilled
through the model's own caches (chunked, exact as `generate`), as are all
of a model that cannot batch. `C` (the buffer's row count) is a
power of two that covers the active rows: a step over 3 sequences computes 4
rows, and a finished row is filled by moving the last one into it, so the
active rows are always [0, n). Each step is one `mx.compile`d graph per
(C, S), reused as rows come and go.

Steps are pipelined as engine.TokenGenerator's: `step` launches step n+1
(`mx.async_eval`) with step n's lazy ids [n] as its input tokens before the
host reads them, so one step is in flight between calls. A row removed
between calls has already been fed its last read id by that step: the K/V
it writes (exact: the id is real) goes into the prompt cache with the row;
the id it samples for the row is never read. Rows added or removed only
change where the next launch takes each row's input
(the unread id, gathered into the new row order, or a host token) and `pos`.
Each row's sampler counts its unread id as context (`Sampler.sample(...,
pending=)`), so the ids are those of unpipelined steps. No step is launched
once every row has had its `budget` (the caller's max_tokens) launched: a
lone request's last id leaves nothing running behind it.

Constrained rows (a `grammar.Matcher` per row: response_format, forced tool
calls) need their last id on the host before their next draw: the mask
depends on it. `launch` still builds and starts the forward for every row
from the lazy ids; a constrained row whose last id is unread keeps only its
logits (`_Flight.deferred`), and `step` draws it in `_finish`, right after
`collect` has read that id and advanced the row's matcher, while the device
runs the forward. So the pipelining of the forward is kept, and only the
small draw of those rows waits for the host. Every rank computes the same
masks from the same ids (no collective). Micro-batched steps are skipped
while a constrained row is in the batch.

Drafts (serve --draft-model / --prompt-lookup): with `spec` (a
batch_spec.BatchDrafts) every step is its round for all rows, through
`feed` (L ids a row at host positions; rings of window + margin slots and
masks by slot position, so a row's rejected positions are rolled back by
its position alone); those steps are not pipelined.

Exactness: each row is computed by the same operations as a lone sequence
(the matmuls batch rows; a row's values do not depend on the others), so
greedy text is the same alone or batched, prefilled alone or together
(tests/test_batch.py compares ids, not logits: a batched matmul or a masked
key axis longer than a row's need not round bit for bit as the lone one;
tests/test_kv.py the --kv-bits rows).

Every cache kind has its rows in the buffers (decode.static_kind): a
--kv-bits layer holds decode.QuantizedStaticCache's six buffers [C, H, S, .]
(`QuantizedRowCache`: each row's token quantized into its slot, attention
through mx.quantized_matmul under the per-row mask; `QuantizedPrefillCache`
for prompts prefilled together), a state layer (RG-LRU, conv, DeltaNet) its
state arrays as [C, ...] buffers "s{i}.{j}" (decode.StaticState: the step
replaces every row's in the graph; Baichuan-M1's conv state beside its KV,
decode.StaticConvKV). A row's state is its slice: admission writes the
prefilled state into the row (zeros when nothing was prefilled), `remove`
moves the last row's into it, `_fork` copies it, `_keep` hands the prompt
cache its Snapshot (DeltaNet; RG-LRU and conv state are not kept). Models
with a state prefill each prompt alone through their own caches (a padded
chunk would feed its pads into the state). Only a cache with no static form
steps row by row on its own caches (`eager_cache`).

Under TP every rank runs the same steps on the same rows (the scheduler on
rank 0 decides, serve.protocol shares its decisions): the collectives are per
step, not per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from .cache import LayerCache, QuantizedKV, SharedKVCache
from .decode import STEP as GPU_STEP
from .decode import (QuantizedStaticCache, StaticCache, StaticConvKV, StaticState, _round_up, held_arrays,
                     quantize_kv, ring_slots, static_kind)
from .engine import DEFAULT_PREFILL_STEP, check_tokens, vocab_size
from .masks import create_rows_mask
from .pipeline import outstanding_sends
from .prompt_cache import PromptCache, Snapshot
from .sampling import NEG_INF, Sampler, SamplingParams, allowed_from_bits, read_logprobs, token_logprobs

# Buffer granularity of the batch's static KV, per device. A batch step
# attends every row over the whole buffer (masked), so slack slots cost
# attention work: on the 2-core CPU 64 measured 78 -> 88-94 tok/s for 16 rows
# of short sequences against 256. On a GPU that work is cheap and each new
# buffer shape is a retrace whose fused kernels are compiled anew
# (0.2-6 s per shape for a 12B model on the H200): decode.STEP (256) there.
# Growth stays geometric either way.
CPU_STEP = 64


def slot_step() -> int:
    return CPU_STEP if mx.default_device() == mx.cpu else GPU_STEP


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


class RowCache(StaticCache):
    """One layer's view of the batch buffers: decode.StaticCache with `pos`
    (`offset`) the per-row positions [C], so its mask and writes are per row.
    `rows` (a, b): the view of a micro-batch, rows [a, b) only."""

    def __init__(self, state, index: int, window: int | None, rows=None, chunk: int | None = None,
                 margin: int = 0):
        super().__init__(state, index, window, chunk, margin)
        self.rows = rows

    @property
    def offset(self) -> mx.array:
        pos = self.buffers["pos"]
        return pos if self.rows is None else pos[self.rows[0] : self.rows[1]]

    def mask(self, L: int) -> mx.array:
        """[rows, 1, 1, S]: row b sees the slots it has written (chunked: its chunk's).
        With a margin (drafts, batch_spec.py): [rows, 1, L, S] by each slot's position
        (`StaticCache.position_mask`'s rule per row), for blocks of L tokens a row."""
        if self.margin:
            pos, S = self.offset, self.size
            last = (pos + (L - 1)).reshape(-1, 1)
            kp = last - mx.remainder(last - mx.arange(S)[None], S)  # [rows, S]: the position slot j holds
            return create_rows_mask(L, pos, kp, None if self.chunk else self.window, self.chunk)
        assert L == 1, "batch rows take one token per step"
        last = self.last_slot(self.offset)
        return (mx.arange(self.size)[None, :] <= last[:, None])[:, None, None, :]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        k, v = self._write([keys, values])
        self.last = (k, v, self.offset)
        return k, v

    def _write(self, xs: list) -> list:
        """Each row's new token (xs: one array per buffer of `names`) into its
        slot; the buffers (this view's rows)."""
        b = self.buffers
        pos = b["pos"]
        C, L = pos.shape[0], xs[0].shape[2]
        slot = self.slot(pos.reshape(C, 1) + mx.arange(L)) if L > 1 else self.slot(pos)  # a block: L slots a row
        out = []
        for name, x in zip(self.names, xs):
            idx = mx.broadcast_to(slot.reshape(C, 1, L, 1), (C, x.shape[1], L, x.shape[3]))
            if self.rows is not None:
                # a micro-batch writes its rows; the others' slots get their own values back
                # (one gathered slot per row), so the write stays one in-place scatter
                a, e = self.rows
                old = mx.take_along_axis(b[name], idx, axis=2)
                x = mx.concatenate([old[:a], x, old[e:]])
            b[name] = mx.put_along_axis(b[name], idx, x, axis=2)
            out.append(b[name] if self.rows is None else b[name][self.rows[0] : self.rows[1]])
        return out


class QuantizedRowCache(RowCache):
    """A --kv-bits layer's rows (decode.QuantizedStaticCache's buffers, `pos`
    per row): each row's new token quantized into its slot; attention gets
    `QuantizedKV`s of the whole buffers under RowCache's per-row mask."""

    names = QuantizedStaticCache.names

    def __init__(self, state, index: int, bits: int, group_size: int, rows=None):
        super().__init__(state, index, None, rows)
        self.bits, self.group_size = bits, group_size

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        k, v = QuantizedKV.pair(self._write(quantize_kv(keys, values, self.bits, self.group_size)),
                                self.bits, self.group_size)
        self.last = (k, v, self.offset)
        return k, v


class PrefillCache(LayerCache):
    """One layer's keys/values of B prompts prefilled together: [B, H, R, D],
    row b's position p in slot p % R (R: the window plus a chunk on a sliding
    layer, so a chunk never overwrites a key its queries see; the longest
    prompt plus a chunk on a full layer, so slot = position). `offset` is the
    chunk's first position per row ([B], for RoPE); the mask comes from each
    slot's position after this chunk's writes (masks.create_rows_mask)."""

    static_kv = True

    def __init__(self, buffers: dict, index: int, window: int | None, ring: int, wraps: bool, chunk=None):
        self.buffers, self.index, self.window, self.ring, self.wraps = buffers, index, window, ring, wraps
        self.chunk = chunk  # a chunked layer: its window is the chunk, the mask the chunk rule

    @property
    def offset(self) -> mx.array:
        return self.buffers["offsets"]

    def mask(self, L: int) -> mx.array:
        if not self.wraps:  # slot = position: the slots up to this chunk's last end
            pos = mx.arange(self.buffers["upto"])
        else:  # slot k: the latest position = k (mod R) before the row's chunk end (pads included); < 0: empty
            end = self.buffers["end"].reshape(-1, 1)
            pos = end - 1 - (end - 1 - mx.arange(self.ring)[None]) % self.ring
        if self.chunk:
            return create_rows_mask(L, self.buffers["offsets"], pos, chunk=self.chunk)
        return create_rows_mask(L, self.buffers["offsets"], pos, self.window)

    names = StaticCache.names

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        k, v = self._write([keys, values])
        self.last = (k, v, self.buffers["offsets"])
        return k, v

    def _write(self, xs: list) -> list:
        """The chunk's tokens (one array per buffer of `names`) into their
        slots; the buffers (without a ring: the slots written so far)."""
        b = self.buffers
        B, H, L = xs[0].shape[:3]
        slots = ((b["offsets"].reshape(B, 1) + mx.arange(L)) % self.ring).reshape(B, 1, L, 1)
        for name, x in zip(self.names, xs):
            b[name] = mx.put_along_axis(b[name], mx.broadcast_to(slots, (B, H, L, x.shape[3])), x, axis=2)
        # no ring: attention over the keys written so far, not the whole buffer
        return [b[n] if self.wraps else b[n][:, :, : b["upto"]] for n in self.names]


class QuantizedPrefillCache(PrefillCache):
    """PrefillCache for a --kv-bits layer: the chunk's keys/values quantized
    into the six buffers of decode.QuantizedStaticCache's layout."""

    names = QuantizedStaticCache.names

    def __init__(self, buffers: dict, index: int, ring: int, wraps: bool, bits: int, group_size: int):
        super().__init__(buffers, index, None, ring, wraps)
        self.bits, self.group_size = bits, group_size

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        k, v = QuantizedKV.pair(self._write(quantize_kv(keys, values, self.bits, self.group_size)),
                                self.bits, self.group_size)
        self.last = (k, v, self.buffers["offsets"])
        return k, v


@dataclass(eq=False)
class _Admit:
    """A request on its way into a row: its prompt, the prompt-cache prefix."""

    rid: object
    prompt: np.ndarray
    last: int  # its last prompt token's position (the row's first input)
    sampling: SamplingParams | None
    start: int  # prompt tokens the prompt cache supplies
    cache: list | None  # their caches (None: a miss)
    budget: int | None = None
    grammar: object = None  # grammar.Matcher: the row's constrained decoding
    drafts: bool = True  # drafts may be verified for it (batch_spec.py)


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


def _pad_groups(admits: list, step: int) -> list:
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


@dataclass(eq=False)
class Row:
    """One sequence in the batch."""

    rid: object
    sampler: Sampler
    context: list  # prompt + generated ids (the repetition penalty's context)
    pos: int  # position of the token this row feeds next (counting steps launched, read or not)
    token: int  # the token it feeds next when no step in flight holds it (read ids, the prompt's last)
    eager_cache: list | None = None  # models that cannot batch: their own cache
    generated: list = field(default_factory=list)
    budget: int | None = None  # ids the caller will read at most (max_tokens): no step launched past it
    launched: int = 0  # steps launched for it
    grammar: object = None  # grammar.Matcher (None: unconstrained), advanced with each id read
    drafts: bool = True  # the request lets drafts be verified for it (batch_spec.py; serve's "speculative")


@dataclass(eq=False)
class _Flight:
    """A launched step: the rows it fed (buffer order at launch) and their lazy ids [n]
    (micro-batched: also each micro-batch's ids, `parts`, its rows' and pads')."""

    rows: list
    ids: mx.array | None  # None until `_finish` has drawn the deferred rows' ids
    extras: object
    parts: list | None = None
    deferred: list | None = None  # (b, logits [V]) of constrained rows drawn once their last id is read
    logits: mx.array | None = None  # with deferred rows: the step's logits [C, V] (static batch), else None
    drawn: list | None = None  # the other rows' lazy ids (the deferred rows' slots None)


def _plain_greedy(params) -> bool:
    return params.greedy and params.plain


class BatchEngine:
    """Rows that decode together. `add` prefills a request and gives it a
    row; `step` feeds every row's next token in one forward and returns
    {rid: sampled id}; `remove` frees a row. Every rank of a TP job makes the
    same calls in the same order."""

    def __init__(self, model, prefill_step: int | None = None, compiled: bool = True, prompt_cache=None,
                 pipelined: bool = True, micro: int = 1, vocab=None, spec=None, margin: int = 0):
        """`prompt_cache`: a prompt_cache.PromptCache that requests' prompts
        (and finished rows' whole sequences) are kept in and reused from.
        `pipelined=False`: each step is read before the next is built (the
        reference the pipelined steps are tested against). `micro`: each step's
        rows in that many micro-batches (serve --micro-batches, for pipeline
        stages: `_launch_micro`). `vocab`: a grammar.Vocab, for requests that
        come with a grammar's text. `spec`: a batch_spec.BatchDrafts that
        drafts for the rows and runs every step (`feed` blocks, rollback);
        `margin`: ring slots past each window for drafted tokens (its K)."""
        self.model = model
        self.spec = spec
        self.margin = spec.k if spec is not None else margin
        self.vocab = vocab
        self.prompt_cache = prompt_cache
        self.prefill_step = prefill_step or DEFAULT_PREFILL_STEP
        self.rows: list[Row] = []
        self.buffers: dict = {}
        self.views: list = []
        self.static: bool | None = None  # decided at the first add (the cache kinds)
        self.windows: list = []
        self.chunks: list = []
        self.reads: list = []
        self.kinds: list = []  # per layer: decode.static_kind
        self.stateful = False  # some layer holds a state (prefilled alone: pads would enter it)
        self._cap = 0
        self._compiled = mx.compile(self._forward, inputs=self.buffers, outputs=self.buffers) if compiled else None
        self._compiled_block = (mx.compile(self._forward_block, inputs=self.buffers, outputs=self.buffers)
                                if compiled else None)
        # Pipeline stages (--pp): the rows can go through in micro-batches, one behind the other,
        # so that each stage works on a different one at once (`_launch_micro`)
        self.micro = micro
        self._compiled_part = (mx.compile(self._forward_part, inputs=self.buffers, outputs=self.buffers)
                               if compiled else None)
        self.traces = 0
        self._size = 0
        self.pipelined = pipelined
        self._flights: list = []  # launched steps not read yet (at most one between `step` calls)
        self._changed = False  # rows added/removed since the last launch
        self.extras = []  # step_extras of the step read last
        self.want: dict = {}  # rid -> k: that row's logprobs with each id (sampling.token_logprobs)
        self.logprobs: dict = {}  # rid -> (logprob, [(id, logprob), ...]) of the step read last
        self.prefilled = 0  # prompt tokens run through prefill forwards (prompt-cache hits and copies excluded)

    # -- rows --------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, rid) -> bool:
        return any(r.rid == rid for r in self.rows)

    def _capacity(self) -> int:
        return self._cap if self.buffers else 0

    def _slots(self) -> int:
        """The nominal buffer length (full layers'; sliding ones stop at their window)."""
        return self._size if self.buffers else 0

    def add(self, rid, prompt_ids, sampling: SamplingParams | None = None) -> None:
        """Prefill `prompt_ids` (all but the last token), then move its
        keys/values into a new row whose next input is the last prompt token."""
        self.add_many([(rid, prompt_ids, sampling)])

    def add_many(self, requests) -> None:
        """`add` for several (rid, prompt_ids, sampling[, budget[, grammar]]) at once
        (budget: the most ids the caller reads for it, e.g. max_tokens; grammar: a
        grammar.Matcher constraining its ids, or a grammar's text for `vocab`'s
        matcher); the prompts
        with tokens to prefill are prefilled together (`_prefill_together`,
        one forward per chunk over all of them) when there are two or more and
        the model's caches are all static KV; else each alone through the
        model's own caches (chunked, exact as `generate`). A prompt given
        more than once (serve's n > 1) is prefilled once: its copies get the
        first's keys/values (`_fork`). Rows join in a fixed order (every rank
        makes the same calls)."""
        todo, copies, first = [], [], {}
        for rid, prompt_ids, sampling, *extra in requests:
            budget = extra[0] if extra else None
            grammar = extra[1] if len(extra) > 1 else None
            drafts = extra[2] if len(extra) > 2 else True  # False: a request that opted out of drafts
            if isinstance(grammar, str):  # a request's grammar text (serve.wire): this rank's matcher, one a row
                grammar = self.vocab.matcher(grammar)
            prompt = check_tokens(prompt_ids, vocab_size(self.model))
            key = prompt.tobytes()
            if key in first:  # a copy (serve's n > 1): forked after the prefill
                copies.append((first[key], rid, sampling, budget, grammar, drafts))
                continue
            first[key] = rid
            start, cache = 0, None
            if self.prompt_cache is not None:
                start, cache = self.prompt_cache.lookup(prompt, self.model.make_cache)
            todo.append(_Admit(rid, prompt, len(prompt) - 1, sampling, start, cache, budget, grammar, drafts))
        if self.static is None:
            fresh = self.model.make_cache()
            self.static = bool(fresh) and None not in [static_kind(c) for c in fresh]
            if self.static:
                self._learn_layout(None, todo[0].prompt[:1])
        together = [a for a in todo if a.start < a.last] if self.static and not self.stateful else []
        groups = _pad_groups(together, self.prefill_step)
        together = [g for g in groups if len(g) > 1]
        for a in todo:
            if not any(a is t for g in together for t in g):
                self._add_alone(a)
        for g in together:
            self._prefill_together(g)
        for src, rid, sampling, budget, grammar, drafts in copies:
            self._fork(src, rid, sampling, budget, grammar, drafts)
        if self.spec is not None:
            self.spec.added(self, requests)

    def _fork(self, src, rid, sampling, budget, grammar=None, drafts=True) -> None:
        """A new row `rid` holding row `src`'s prompt (its keys/values copied,
        no forward), with its own sampler. Rows stepping eagerly have caches
        of their own, so their copies are prefilled each."""
        b = next(i for i, r in enumerate(self.rows) if r.rid == src)
        r = self.rows[b]
        if not self.static:
            prompt = np.asarray(r.context, np.int32)
            self._add_alone(_Admit(rid, prompt, len(prompt) - 1, sampling, 0, None, budget, grammar, drafts))
            return
        self._reserve(len(self.rows) + 1, r.pos + 1)
        new = len(self.rows)
        for name in list(self.buffers):
            if name == "pos":
                continue
            buf = self.buffers[name]
            buf[new : new + 1] = buf[b : b + 1]
            self.buffers[name] = buf
        self.rows.append(Row(rid, Sampler(sampling or SamplingParams(), len(r.context)), list(r.context), r.pos,
                             r.token, budget=budget, grammar=grammar, drafts=drafts))
        self._changed = True
        self._sync_pos()

    def warmup(self, max_rows: int, token: int = 0) -> list:
        """Trace and compile the step for every row capacity a batch of up to
        `max_rows` rows takes (1, 2, 4, ...: `_reserve`'s powers of two), at
        the first buffer size, with throwaway rows fed `token`; the engine is
        left empty, the prompt cache untouched. mx.compile keeps every trace,
        so the first requests that bring a batch to a new size do not pay for
        it (on the H200, 0.2-6 s per capacity for a 12B model once MLX's
        kernels are cached on disk). serve's --warmup, off by default: on MLX
        0.32 CUDA steady decode after it was slower in 13 of 15 runs on two
        H200 hosts (docs/benchmarks.md; cause not found). Models whose rows
        step eagerly (a cache with no static form) compile nothing: only the
        first capacity runs.
        Returns [(capacity, seconds)]. Every rank makes the same call."""
        import time

        if self.rows:
            raise RuntimeError("warmup needs an empty engine")
        saved, self.prompt_cache = self.prompt_cache, None
        done, c = [], 1
        try:
            while True:
                t = time.perf_counter()
                rids = [("warmup", i) for i in range(c)]
                self.add_many([(rid, [token, token], SamplingParams(temp=0.0), 2) for rid in rids])
                self.step()
                self.step()
                for rid in rids:
                    self.remove(rid)
                mx.synchronize()
                done.append((c, time.perf_counter() - t))
                if c >= max_rows or not self.static:
                    return done
                c *= 2
        finally:
            self.prompt_cache = saved

    def _add_alone(self, a: "_Admit") -> None:
        prompt, last, cache = a.prompt, a.last, a.cache
        if cache is None:
            cache = self.model.make_cache()
        self.prefilled += max(last - a.start, 0)
        for i in range(a.start, last, self.prefill_step):
            self.model(mx.array(prompt[i : min(i + self.prefill_step, last)])[None], cache)
            mx.eval([c.state for c in cache] if cache else [], outstanding_sends(self.model))
        if self.prompt_cache is not None and a.start < last:
            self.prompt_cache.store(prompt[:last], cache)
        row = Row(a.rid, Sampler(a.sampling or SamplingParams(), len(prompt)), prompt.tolist(), last, int(prompt[last]),
                  budget=a.budget, grammar=a.grammar, drafts=a.drafts)
        if not self.static:
            row.eager_cache = cache
            self.rows.append(row)
            self._changed = True
            return
        self._reserve(len(self.rows) + 1, last + 1)
        self._place(row, [None if kind == "shared" or last == 0 else held_arrays(c, kind)
                          for c, kind in zip(cache, self.kinds)])
        for c in cache:
            c.release()

    def _place(self, row: "Row", layers: list) -> None:
        """Append `row`, per layer (its keys/values in `names` order, [1, H, n, .]
        of positions up to row.pos, oldest first; its state arrays [1, ...])
        moved into its batch row (buffers already reserved); None: nothing
        held (a state starts at zeros)."""
        b, last = len(self.rows), row.pos
        self.rows.append(row)
        self._changed = True
        for i, x in enumerate(layers):
            held, states = x or ([], [None] * len(self.snames[i]))
            if held:
                S = self.buffers[self.names[i][0]].shape[2]  # this layer's (a sliding one stops at its window)
                n = min(held[0].shape[2], S)
                slots = ring_slots(last - n, n, S)
                for name, a in zip(self.names[i], held):
                    _write_row(self.buffers[name], b, slots, a[..., a.shape[2] - n :, :])
            for name, a in zip(self.snames[i], states):
                buf = self.buffers[name]
                buf[b : b + 1] = mx.zeros_like(buf[:1]) if a is None else a
        self._sync_pos()

    def _prefill_together(self, admits: list) -> None:
        """Prefill several prompts in one forward per chunk of at most
        `prefill_step` tokens per prompt (PrefillCache: per-row offsets and
        masks), then move each into a row as `_add_alone` does.

        Rows are sorted by tokens left (most first), so the prompts finished
        after a chunk are the last rows: they move into the batch and the
        prefill buffers keep the first rows. A shorter prompt's chunk is padded
        with id 0 at the positions after its end; its pad keys are masked
        from its real queries, land where its later tokens (or nothing it
        keeps) go, and are finite (no query row is all masked)."""
        admits = sorted(admits, key=lambda a: a.start - a.last)  # stable: ties keep their order
        self.prefilled += sum(a.last - a.start for a in admits)
        L = min(self.prefill_step, admits[0].last - admits[0].start)
        T = max(end for _, _, end in _chunks(admits, L))  # slots written, pads included
        rings = [None if k == "shared" else (T if w is None else min(w + L, T))
                 for w, k in zip(self.windows, self.kinds)]
        B = len(admits)
        bufs = {"offsets": None, "end": None, "upto": 0}
        for i, R in enumerate(rings):
            for name in self.names[i] if R is not None else ():
                shape = self._shapes[name]
                bufs[name] = mx.zeros((B, shape[1], R, shape[3]), self._dtypes[name])
        for b, a in enumerate(admits):  # a prompt-cache prefix: its keys/values at their slots
            if a.cache is None:
                continue
            for i, c in enumerate(a.cache):
                if rings[i] is None:
                    continue
                held, _ = held_arrays(c, self.kinds[i])
                slots = ring_slots(a.start - held[0].shape[2], held[0].shape[2], rings[i])
                for name, x in zip(self.names[i], held):
                    _write_row(bufs[name], b, slots, x)
                c.release()
        views = []
        for i, R in enumerate(rings):
            if R is None:
                views.append(SharedKVCache(views[self.reads[i]], self.reads[i]))
            elif self.kinds[i] == "quantized":
                views.append(QuantizedPrefillCache(bufs, i, R, R < T, *self._quant[i]))
            else:
                views.append(PrefillCache(bufs, i, self.windows[i], R, wraps=R < T, chunk=self.chunks[i]))
        self._reserve(len(self.rows) + B, max(a.last for a in admits) + 1)
        for offs, lens, upto in _chunks(admits, L):
            n = max(lens)
            tokens = np.zeros((len(offs), n), np.int32)
            for b, (a, o, m) in enumerate(zip(admits, offs, lens)):
                tokens[b, :m] = a.prompt[o : o + m]
            bufs["offsets"] = mx.array(offs, mx.int32)
            bufs["end"], bufs["upto"] = bufs["offsets"] + n, upto
            self.model(mx.array(tokens), views)
            mx.eval([x for name, x in bufs.items() if name[0] in "kv"], outstanding_sends(self.model))
            keep = sum(o + m < a.last for a, o, m in zip(admits, offs, lens))  # the finished are the last rows
            for b in range(keep, len(offs)):
                self._finish_prefill(admits[b], b, bufs, rings)
            for name in list(bufs):
                if name[0] in "kv":
                    bufs[name] = bufs[name][:keep]

    def _finish_prefill(self, a: "_Admit", b: int, bufs: dict, rings: list) -> None:
        """Row b of the prefill buffers holds prompt `a` up to a.last: keep it
        in the prompt cache and move it into a batch row."""
        kv = []
        for i, R in enumerate(rings):
            if R is None:
                kv.append(None)
                continue
            w = self.windows[i]
            n = a.last if w is None else min(a.last, w)  # a ring of w + chunk slots holds the last w
            slots = ring_slots(a.last - n, n, R)
            kv.append(([_read_row(bufs[name], b, slots) for name in self.names[i]], []))
        if self.prompt_cache is not None:
            self.prompt_cache.store_layers(a.prompt[: a.last], [self._entry(i, x) for i, x in enumerate(kv)],
                                           self.windows)
        self._place(Row(a.rid, Sampler(a.sampling or SamplingParams(), len(a.prompt)), a.prompt.tolist(), a.last,
                        int(a.prompt[a.last]), budget=a.budget, grammar=a.grammar, drafts=a.drafts), kv)

    def remove(self, rid) -> None:
        """Free `rid`'s row (kept in the prompt cache when there is one): the
        last row moves into it (rows stay [0, n))."""
        b = next(i for i, r in enumerate(self.rows) if r.rid == rid)
        self.want.pop(rid, None)
        if self.spec is not None:
            self.spec.removed(rid)
        if self.prompt_cache is not None:
            self._keep(b)
        last = len(self.rows) - 1
        if self.static and b != last:
            for name in list(self.buffers):
                if name == "pos":
                    continue
                buf = self.buffers[name]
                buf[b : b + 1] = buf[last : last + 1]
                self.buffers[name] = buf
        self.rows[b] = self.rows[last]
        self.rows.pop()
        self._changed = True
        if not self.rows:
            self._flights.clear()  # its work runs on, unread
        if self.static:
            self._sync_pos()
            if not self.rows:
                self.release()

    def _keep(self, b: int) -> None:
        """Store row b's keys/values of the tokens it has fed, oldest first.
        A step in flight feeds the row's last read id (its K/V is exact once
        the step runs): that id is kept too; the id it samples is unread, so
        it is never fed and never kept."""
        r = self.rows[b]
        fed = r.pos
        # One unread step at most: a ring slot it writes held a position
        # older than the window of the `fed` tokens kept (so all are exact).
        assert fed <= len(r.context), "a kept row may have one step in flight, not two"
        seen = r.context[:fed]
        if not self.static:
            self.prompt_cache.store(seen, r.eager_cache)
            return
        if not self._cacheable:  # a state the prompt cache cannot keep (PromptCache.cacheable)
            return
        layers = []
        for i, kind in enumerate(self.kinds):
            held = []
            if self.names[i]:
                S = self.buffers[self.names[i][0]].shape[2]
                n = min(fed, S)
                slots = ring_slots(fed - n, n, S)
                held = [_read_row(self.buffers[name], b, slots) for name in self.names[i]]
            layers.append(None if kind == "shared" else (held, [self.buffers[x][b : b + 1] for x in self.snames[i]]))
        self.prompt_cache.store_layers(seen, [self._entry(i, x, fed) for i, x in enumerate(layers)], self.windows)

    def _entry(self, i: int, x, offset: int | None = None):
        """Layer i's prompt-cache entry from (keys/values, states) of `offset`
        tokens: (keys, values) (QuantizedKVs under --kv-bits), a state's
        Snapshot (its arrays, then the offset: DeltaNetCache.snapshot), or None."""
        if x is None:
            return None
        held, states = x
        if self.kinds[i] == "state":
            return Snapshot((*states, offset))
        return QuantizedKV.pair(held, *self._quant[i]) if self.kinds[i] == "quantized" else tuple(held)

    def release(self) -> None:
        """Drop the buffers (no rows left)."""
        self.buffers.clear()
        self.views = []

    def _sync_pos(self) -> None:
        C = self._capacity()
        pos = [r.pos for r in self.rows] + [0] * (C - len(self.rows))
        self.buffers["pos"] = mx.array(pos, mx.int32)

    def _reserve(self, n_rows: int, max_pos: int) -> None:
        """Buffers with at least `n_rows` rows (a power of two) and slot
        `max_pos` for every layer (full layers: pos < S; sliding: up to the
        window, then a ring)."""
        C, S = self._capacity(), self._slots()
        want_c = max(C, 1 << (n_rows - 1).bit_length())
        need = max_pos + 1
        want_s = S if S >= need else _round_up(need + need // 4, slot_step())
        if self.buffers and want_c == C and want_s == S:
            return
        self._size = want_s
        new = {}
        for i, window in enumerate(self.windows):
            s = min(want_s, window + self.margin) if window else want_s  # a margin: room for rolled-back drafts
            for name in self.names[i]:
                old = self.buffers.get(name)
                shape = self._shapes[name] if old is None else old.shape
                buf = mx.zeros((want_c, shape[1], s, shape[3]), self._dtypes[name])
                if old is not None:
                    # A sliding buffer already at the window keeps its ring; a
                    # growing one is in temporal order: copy the slots held.
                    keep = min(old.shape[2], s)
                    buf[: old.shape[0], :, :keep, :] = old[:, :, :keep, :]
                new[name] = buf
            for name in self.snames[i]:  # a state: rows only
                old = self.buffers.get(name)
                buf = mx.zeros((want_c, *self._shapes[name][1:]), self._dtypes[name])
                if old is not None:
                    buf[: old.shape[0]] = old
                new[name] = buf
        self.buffers.clear()
        self.buffers.update(new)
        self._cap = want_c
        self.views = []
        for i in range(len(self.kinds)):
            self.views.append(self._view(i, self.views))
        self._sync_pos()

    def _view(self, i: int, views: list, rows=None):
        """Layer i's cache over the batch buffers (`views`: the layers before
        it; `rows`: a micro-batch's rows only)."""
        kind = self.kinds[i]
        if kind == "shared":
            return SharedKVCache(views[self.reads[i]], self.reads[i])
        if kind == "state":
            return StaticState(self.buffers, i, len(self.snames[i]), rows)
        if kind == "quantized":
            return QuantizedRowCache(self.buffers, i, *self._quant[i], rows)
        view = RowCache(self.buffers, i, self.windows[i], rows, self.chunks[i], self.margin)
        return view if kind == "kv" else StaticConvKV(view, StaticState(self.buffers, i, 2, rows))

    def _learn_layout(self, cache, probe) -> None:
        """Per-layer window, cache kind, buffer names and per-row shapes and
        dtypes, from a prefilled cache (or a one-token probe forward when the
        prompt had nothing to prefill)."""
        if cache is None:
            cache = self.model.make_cache()
            self.model(mx.array(probe)[None], cache)
        self.kinds = [static_kind(c) for c in cache]
        self.windows = [c.window for c in cache]
        self.chunks = [c.chunk for c in cache]  # chunked layers (window = chunk, the chunk mask)
        self.reads = [c.reads_layer for c in cache]
        self.stateful = any(k in ("state", "conv_kv") for k in self.kinds)
        self._cacheable = PromptCache.cacheable(cache)
        self._quant = [(c.bits, c.group_size) if k == "quantized" else None for c, k in zip(cache, self.kinds)]
        held = [([], []) if k == "shared" else held_arrays(c, k) for c, k in zip(cache, self.kinds)]
        self.snames = [[f"s{i}.{j}" for j in range(len(st))] for i, (_, st) in enumerate(held)]  # StaticState's
        views = []
        for i in range(len(cache)):
            views.append(self._view(i, views))
        self.names = [[] if k in ("shared", "state") else v.names for v, k in zip(views, self.kinds)]
        self._shapes, self._dtypes = {}, {}
        for i, (kv, st) in enumerate(held):
            for name, x in zip(self.names[i] + self.snames[i], kv + st):
                self._shapes[name], self._dtypes[name] = x.shape, x.dtype

    # -- steps -------------------------------------------------------------
    # Pipelined as engine.TokenGenerator: `step` launches step n+1 (async_eval)
    # from step n's lazy ids before it reads them, so building a step overlaps
    # the device's work on the last. After `step` one step is in flight; rows
    # added or removed meanwhile only change which inputs the next launch takes.

    def _forward(self, tokens: mx.array) -> mx.array:
        self.traces += 1
        logits = self.model(tokens, self.views)[:, -1]
        self.buffers["pos"] = self.buffers["pos"] + 1
        return logits

    def _forward_block(self, tokens: mx.array) -> mx.array:
        self.traces += 1
        return self.model(tokens, self.views)

    def feed(self, tokens: mx.array, pos: list) -> mx.array:
        """Feed row b the ids tokens[b] [n, L] at positions pos[b] .. pos[b] + L - 1
        (engine built with a margin >= L - 1: each row's later positions may then
        be rolled back by feeding it from an earlier `pos`); lazy logits [n, L, V].
        The rows' `pos` is left to the caller."""
        n, L = tokens.shape
        assert self.margin >= L - 1, (L, self.margin)
        self._reserve(n, max(pos) + L - 1)
        C = self._capacity()
        self.buffers["pos"] = mx.array(list(pos) + [0] * (C - n), mx.int32)
        x = tokens if C == n else mx.concatenate([tokens, mx.zeros((C - n, L), mx.int32)])
        logits = self._compiled_block(x) if self._compiled_block is not None else self._forward_block(x)
        return logits[:n]

    def _forward_part(self, tokens: mx.array, a: int, e: int) -> mx.array:
        """Rows [a, e) (a micro-batch) one step on; `pos` moves on with the last part."""
        self.traces += 1
        views = []
        for i in range(len(self.kinds)):
            views.append(self._view(i, views, (a, e)))
        logits = self.model(tokens, views)[:, -1]
        if e == self._capacity():
            self.buffers["pos"] = self.buffers["pos"] + 1
        return logits

    def _parts(self, C: int) -> list:
        """The micro-batches' row ranges of a C-row step (as even as possible)."""
        m = min(self.micro, C)
        cuts = [C * j // m for j in range(m + 1)]
        return [(cuts[j], cuts[j + 1]) for j in range(m)]

    def _launch_micro(self, n: int, C: int) -> None:
        """A step as micro-batches: each part's forward is scheduled on its own
        (async_eval), in order, and its ids are left unevaluated, so a stage
        (one stream of work per rank) runs part j while the next stage runs
        part j - 1, and the next step's part j needs only this step's part j
        (its ids are evaluated with it)."""
        f = self._flights[-1] if self._flights else None
        parts = self._parts(C)
        if f is not None and not self._changed and f.parts is not None and len(f.parts) == len(parts) \
                and sum(x.shape[0] for x in f.parts) == C:
            xs = list(f.parts)
            pending = [f.parts[j][b - a] for j, (a, e) in enumerate(parts) for b in range(a, min(e, n))]
        else:
            tokens, pending = self._inputs()
            x = tokens if C == n else mx.concatenate([tokens, mx.zeros((C - n,), mx.int32)])
            xs = [x[a:e] for a, e in parts]
        step = self._compiled_part if self._compiled_part is not None else self._forward_part
        logits = []
        for (a, e), x in zip(parts, xs):
            out = step(x.reshape(-1, 1), a, e)
            mx.async_eval(out)
            logits.append(out)
        rows = [logits[j][b - a] for j, (a, e) in enumerate(parts) for b in range(a, min(e, n))]
        if all(_plain_greedy(r.sampler.params) for r in self.rows):
            ids_parts = [mx.argmax(x.astype(mx.float32), axis=-1).astype(mx.int32) for x in logits]
            ids = [ids_parts[j][b - a] for j, (a, e) in enumerate(parts) for b in range(a, min(e, n))]
        else:
            ids = [r.sampler.sample(x, r.context, pending=p) for r, x, p in zip(self.rows, rows, pending)]
            pad = mx.array(0, mx.int32)  # the padding rows' next input
            ids_parts = [mx.stack(ids[a:min(e, n)] + [pad] * (e - max(a, n))) for a, e in parts]
        stacked = mx.concatenate(ids_parts)[:n]
        extras = self.step_extras(rows, ids, pending)
        for r in self.rows:
            r.pos += 1
            r.launched += 1
        self._flights.append(_Flight(list(self.rows), stacked, extras, ids_parts))
        self._changed = False

    def _inputs(self) -> tuple[mx.array, list]:
        """Every row's next input as one lazy int32 [n] (the unread id of the
        step in flight, else the row's host token) and, per row, that unread
        id (the sampler counts it as context) or None."""
        f = self._flights[-1] if self._flights else None
        if f is not None and not self._changed:
            return f.ids, [f.ids[b] for b in range(len(self.rows))]
        at = {} if f is None else {id(r): b for b, r in enumerate(f.rows)}
        host = [r.token for r in self.rows if id(r) not in at]
        if not at:
            return mx.array(host, mx.int32), [None] * len(self.rows)
        idx, h = [], len(f.rows)
        for r in self.rows:
            idx.append(at[id(r)] if id(r) in at else h)
            h += id(r) not in at
        src = mx.concatenate([f.ids, mx.array(host, mx.int32)]) if host else f.ids
        tokens = src[mx.array(idx, mx.int32)]
        return tokens, [tokens[b] if id(r) in at else None for b, r in enumerate(self.rows)]

    def launch(self) -> None:
        """Build one step for every row and start it (no host read): each row
        feeds its next token at its position `pos`."""
        assert len(self._flights) <= 1, "a row's context may lack one unread id, not two"
        if not self.rows:
            return
        n = len(self.rows)
        if self.static and self.micro > 1 and not any(r.grammar is not None for r in self.rows):
            self._reserve(n, max(r.pos for r in self.rows))
            if self._capacity() > 1:
                return self._launch_micro(n, self._capacity())
        tokens, pending = self._inputs()
        if not self.static:
            rows = [self.model(tokens[b].reshape(1, 1), r.eager_cache)[0, -1] for b, r in enumerate(self.rows)]
        else:
            self._reserve(n, max(r.pos for r in self.rows))
            C = self._capacity()
            x = (tokens if C == n else mx.concatenate([tokens, mx.zeros((C - n,), mx.int32)])).reshape(C, 1)
            logits = self._compiled(x) if self._compiled is not None else self._forward(x)
            rows = [logits[b] for b in range(n)]
        masks = [None] * n
        deferred = []
        if self.static and all(_plain_greedy(r.sampler.params) and r.grammar is None for r in self.rows):
            # every row greedy, no penalty: one argmax over the batch (the same ids as each
            # row's Sampler: argmax of the same float32 values), not ~5 small ops per row
            stacked = mx.argmax(logits[:n].astype(mx.float32), axis=-1).astype(mx.int32)
            ids = [stacked[b] for b in range(n)]
        else:
            # every row's sampler on its own logits, the unread id counted as context; a
            # constrained row whose last id is unread waits for it (`_finish`): its mask needs it
            ids = []
            for b, (r, x, p) in enumerate(zip(self.rows, rows, pending)):
                if r.grammar is not None and p is not None:
                    deferred.append((b, x))
                    ids.append(None)
                    continue
                if r.grammar is not None:
                    masks[b] = mx.array(r.grammar.mask())
                ids.append(r.sampler.sample(x, r.context, pending=p, mask=masks[b]))
            stacked = None if deferred else mx.stack(ids)
        constrained = any(m is not None for m in masks)
        extras = self.step_extras(rows, ids, pending, masks) if constrained else self.step_extras(rows, ids, pending)
        if deferred:
            mx.async_eval([x for _, x in deferred], [i for i in ids if i is not None], extras)
        else:
            mx.async_eval(stacked, extras)
        for r in self.rows:
            r.pos += 1
            r.launched += 1
        self._flights.append(_Flight(list(self.rows), stacked, extras, deferred=deferred or None,
                                     drawn=ids if deferred else None, logits=logits if deferred and self.static
                                     else None))
        self._changed = False

    def _finish(self) -> None:
        """Draw the deferred rows' ids of the step in flight: their last ids
        are read now (`collect` advanced their grammars), so their masks are
        known; the forward ran meanwhile. Its ids [n] are complete after."""
        f = self._flights[-1] if self._flights else None
        if f is None or f.deferred is None:
            return
        ids, extras = list(f.drawn), dict(f.extras)
        # [k, words]: every deferred row's mask from one llguidance call, one copy in
        masks = mx.array(self.vocab.masks([f.rows[b].grammar for b, _ in f.deferred]))
        greedy = [j for j, (b, _) in enumerate(f.deferred) if _plain_greedy(f.rows[b].sampler.params)]
        if len(greedy) > 1:
            # greedy rows without penalties: one masked argmax over them (the ids their Samplers
            # would draw: argmax of the same masked float32 values)
            whole = len(greedy) == len(ids) and f.logits is not None  # every row: the logits, masks as they are
            x = (f.logits[:len(ids)] if whole else mx.stack([f.deferred[j][1] for j in greedy])).astype(mx.float32)
            allowed = allowed_from_bits(masks if whole else masks[mx.array(greedy)], x.shape[-1])
            top = mx.argmax(mx.where(allowed, x, NEG_INF), axis=-1).astype(mx.int32)
            if whole and not self.want:
                f.ids, f.deferred, f.drawn = top, None, None
                mx.async_eval(f.ids, f.extras)
                return
            for i, j in enumerate(greedy):
                ids[f.deferred[j][0]] = top[i]
        for j, (b, x) in enumerate(f.deferred):
            r = f.rows[b]
            if ids[b] is None:
                ids[b] = r.sampler.sample(x, r.context, mask=masks[j])
            extras.update(self._extras_of([r], [x], [ids[b]], [None], [masks[j]]))
        f.ids, f.extras, f.deferred, f.drawn = mx.stack(ids), extras, None, None
        mx.async_eval(f.ids, f.extras)

    def collect(self) -> dict:
        """Read the oldest step in flight (the one host sync): {rid: id} of
        its rows still present; a removed row's id is dropped unseen."""
        if not self._flights:
            return {}
        f = self._flights.pop(0)
        got = np.array(f.ids).tolist()
        self.extras = f.extras
        present = {id(r) for r in self.rows}
        out = {}
        for r, tok in zip(f.rows, got):
            if id(r) in present:
                r.context.append(tok)
                r.generated.append(tok)
                r.token = tok
                out[r.rid] = tok
                if r.grammar is not None:
                    r.grammar.advance(tok)
        self.logprobs = {rid: read_logprobs(lp) for rid, lp in (f.extras or {}).items() if rid in out}
        return out

    def step(self) -> dict:
        """One token for every row: {rid: sampled id} (read from the device).
        Pipelined, the next step is launched before this one is read, so a
        row that the caller removes after this call has already been fed its
        last id once more: that step's work for it is discarded. With drafts
        (`spec`, static caches): {rid: [ids]}, 1 .. K + 1 a row, unpipelined."""
        if not self.rows:
            self._flights.clear()
            return {}
        if self.spec is not None and self.spec.active(self):
            return self.spec.step(self)
        if not self._flights:
            self.launch()
        # no step past every row's budget: its work would only be discarded (a lone request's last id)
        if self.pipelined and any(r.budget is None or r.launched < r.budget for r in self.rows):
            self.launch()
        out = self.collect()
        self._finish()
        return out

    def step_extras(self, logits: list, ids: list, pending: list, masks: list | None = None) -> dict:
        """Lazy arrays evaluated with a step: {rid: token_logprobs} of the
        rows in `want`, from each row's logits, its lazy id, the id still
        unread when the step was launched (pipelined: its context lacks it)
        and its grammar mask (the constrained distribution); a deferred row's
        (id None) come with its id (`_finish`)."""
        return self._extras_of(self.rows, logits, ids, pending, masks or [None] * len(ids))

    def _extras_of(self, rows, logits, ids, pending, masks) -> dict:
        return {r.rid: token_logprobs(x, r.context, r.sampler.params, prev, tok, self.want[r.rid],
                                      r.sampler.prompt_len, mask)
                for r, x, tok, prev, mask in zip(rows, logits, ids, pending, masks)
                if r.rid in self.want and tok is not None}
