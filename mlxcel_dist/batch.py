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
prompt token is that row's first input). Prefilling is prefill.py's: the
prompts admitted by `add_many` become jobs that `step` runs a chunk at a
time beside the decoding rows (or at once without a budget), prompts
admitted together in one forward per chunk where their padding stays
small (`PrefillCache` buffers, per-row offsets and masks), a lone one
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
logits (`_Flight.deferred`); right after `collect` has read that id and
advanced the row's matcher, `_finish` starts the masks on the vocabulary's
worker thread (grammar.Vocab.masks_ahead), and `_draw` draws those rows
when their ids are next needed (the next `launch` or `collect`). So the
masks are computed while the device runs the forward and the caller does
its own host work, and only the small draw of those rows waits for them. Every rank computes the same
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

from .cache import QuantizedKV, QuantizedRowCache, RowCache, SharedKVCache
from .collectives import CollectiveError
from . import decode
from .decode import (QuantizedStaticCache, SplitSegments, StaticCache, StaticConvKV, StaticState, _round_up,
                     held_arrays, ring_slots, splittable, static_kind)
from .engine import DEFAULT_PREFILL_STEP, check_tokens, vocab_size
from .prefill import Admission, Alone, Budget, Prefills, Request, Together, _read_row, _write_row, pad_groups
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
    """Slots a buffer grows by: decode.STEP, at most CPU_STEP on the CPU."""
    return min(CPU_STEP, decode.STEP) if mx.default_device() == mx.cpu else decode.STEP


@dataclass(frozen=True)
class LayerRows:
    """How one layer's rows live in the batch buffers (learned from a
    prefilled cache, `BatchEngine._learn_layout`)."""

    kind: str  # decode.static_kind: "kv", "quantized", "state", "conv_kv" or "shared"
    window: int | None = None  # a sliding layer's window (a chunked one's: its chunk)
    chunk: int | None = None  # chunked attention (llama4): the chunk mask
    reads: int | None = None  # a shared layer: the layer whose keys/values it reads
    quant: tuple | None = None  # --kv-bits: (bits, group_size)
    kv: tuple = ()  # its keys/values buffers' names ([C, H, S, D] each: the slot axis 2)
    state: tuple = ()  # its state arrays' buffers' names ([C, ...] each)


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
    read: mx.array | None = None  # what `collect` reads: ids [n], then the guard's check rows when one is due
    masks: object = None  # the deferred rows' masks being computed (a Future: grammar.Vocab.masks_ahead)


def _plain_greedy(params) -> bool:
    return params.greedy and params.plain


class BatchEngine:
    """Rows that decode together. `add` prefills a request and gives it a
    row; `step` feeds every row's next token in one forward and returns
    {rid: sampled id}; `remove` frees a row. Every rank of a TP job makes the
    same calls in the same order."""

    def __init__(self, model, prefill_step: int | None = None, compiled: bool = True, prompt_cache=None,
                 pipelined: bool = True, micro: int = 1, vocab=None, spec=None, margin: int = 0,
                 budget: Budget | None = None):
        """`prompt_cache`: a prompt_cache.PromptCache that requests' prompts
        (and finished rows' whole sequences) are kept in and reused from.
        `pipelined=False`: each step is read before the next is built (the
        reference the pipelined steps are tested against). `micro`: each step's
        rows in that many micro-batches (serve --micro-batches, for pipeline
        stages: `_launch_micro`). `vocab`: a grammar.Vocab, for requests that
        come with a grammar's text. `spec`: a batch_spec.BatchDrafts that
        drafts for the rows and runs every step (`feed` blocks, rollback);
        `margin`: ring slots past each window for drafted tokens (its K).
        `budget`: a prefill.Budget, the prompt tokens a step computes beside
        its decoding rows (serve; prefill.py); None: `add_many` prefills its
        prompts whole at once."""
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
        self.layout: list[LayerRows] = []  # per layer, learned at the first row
        self.shapes: dict = {}  # buffer name -> a row's shape (slots: the prefilled cache's)
        self.dtypes: dict = {}
        self.stateful = False  # some layer holds a state (prefilled alone: pads would enter it)
        self._cap = 0
        self.compiled = compiled  # False: the same steps run eagerly (tests' reference; --no-compile)
        self._compiled = mx.compile(self._forward, inputs=self.buffers, outputs=self.buffers)
        self._compiled_block = mx.compile(self._forward_block, inputs=self.buffers, outputs=self.buffers)
        # Pipeline stages (--pp): the rows can go through in micro-batches, one behind the other,
        # so that each stage works on a different one at once (`_launch_micro`)
        self.micro = micro
        self._compiled_part = mx.compile(self._forward_part, inputs=self.buffers, outputs=self.buffers)
        self.traces = 0
        self.split = None  # whether the model's one-row steps run split (`splits`), decided with the layout
        self._segments = None
        self._size = 0
        self.pipelined = pipelined
        self._flights: list = []  # launched steps not read yet (at most one between `step` calls)
        self._changed = False  # rows added/removed since the last launch
        self.extras = []  # step_extras of the step read last
        self.want: dict = {}  # rid -> k: that row's logprobs with each id (sampling.token_logprobs)
        self.logprobs: dict = {}  # rid -> (logprob, [(id, logprob), ...]) of the step read last
        self.prefilled = 0  # prompt tokens run through prefill forwards (prompt-cache hits and copies excluded)
        self.budget = budget
        self.prefills = Prefills()  # prompts being prefilled (prefill.py)
        self._copies: dict = {}  # rid -> copies of its prompt (n > 1) forked once it is placed
        self.failed: dict = {}  # rid -> message: requests whose prefill failed (taken by the caller)
        self.prompt_logprobs: dict = {}  # rid -> its prompt's logprobs (echo; taken by the caller)
        # an engine.RankAgreement whose checks ride on the steps' reads (generate: each id is checked
        # in the host sync that reads it); serve checks its steps' ids through the step protocol instead
        self.guard = None
        self.on_new_graph = None  # called when a step traced a new graph, before its ids are awaited

    # -- rows --------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, rid) -> bool:
        """A row, or a request still being prefilled."""
        return (any(r.rid == rid for r in self.rows) or rid in self.prefills
                or any(rid == c[0] for cs in self._copies.values() for c in cs))

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
        """`add` for several (rid, prompt_ids, sampling[, budget[, grammar[, drafts]]])
        at once (budget: the most ids the caller reads for it, e.g. max_tokens;
        grammar: a grammar.Matcher constraining its ids, or a grammar's text for
        `vocab`'s matcher; drafts False: the request opted out of drafts). The
        prompts become prefill jobs (prefill.py): two or more with tokens to
        prefill go together (one forward per chunk over all of them) when the
        model's caches are all static KV; else each alone through the model's
        own caches (chunked, exact as `generate`). A prompt given more than once
        (serve's n > 1) is prefilled once: its copies get the first's
        keys/values (`_fork`) when it is placed. Without a `budget` the
        jobs run to the end here; with one, `step` runs them a budget at a time
        beside the decode rows. Every rank makes the same calls."""
        todo, first = [], {}
        for rid, prompt_ids, sampling, budget, grammar, drafts, echo in (Request(*r) for r in requests):
            if isinstance(grammar, str):  # a request's grammar text (serve.wire): this rank's matcher, one a row
                grammar = self.vocab.matcher(grammar)
            prompt = check_tokens(prompt_ids, vocab_size(self.model))
            key = prompt.tobytes() if budget != 0 else rid  # (a request of no ids takes no row to copy)
            if key in first:  # a copy (serve's n > 1): forked once its source is placed
                self._copies.setdefault(first[key], []).append((rid, sampling, budget, grammar, drafts))
                continue
            first[key] = rid
            start, cache = 0, None
            if self.prompt_cache is not None and echo is None:  # (an echo runs the whole prompt: its logprobs)
                start, cache = self.prompt_cache.lookup(prompt, self.model.make_cache)
            todo.append(Admission(rid, prompt, len(prompt) - 1, sampling, start, cache, budget, grammar, drafts,
                                  echo))
        if todo:
            self._decide(todo[0].prompt[:1])
        together = [a for a in todo if a.start < a.last and a.echo is None] if self.static and not self.stateful else []
        groups = [g for g in pad_groups(together, self.prefill_step) if len(g) > 1]
        grouped = {id(a) for g in groups for a in g}
        jobs = [Alone(self, a) for a in todo if id(a) not in grouped]
        jobs += [Together(self, g, min(self.prefill_step, max(a.last - a.start for a in g))) for g in groups]
        self.prefills.jobs += jobs
        if self.budget is None:
            self._prefill(None, drain=True)

    def _decide(self, probe) -> None:
        """At the first row: whether the model's caches all have a static form
        (rows in the batch buffers), and then their layout (`probe`: one id)."""
        if self.static is None:
            fresh = self.model.make_cache()
            self.static = bool(fresh) and None not in [static_kind(c) for c in fresh]
            if self.static:
                self._learn_layout(None, probe)

    @property
    def prefilling(self) -> bool:
        """Prompts still being prefilled (their rows not placed yet)."""
        return bool(self.prefills)

    def _prefill(self, budget: int | None, drain: bool = False) -> None:
        """Run the prefill queue, oldest job first: with a `budget` (tokens)
        until it is spent, a job's forward taking at most what is left; without
        one, one forward of `prefill_step` tokens a prompt per job, or every
        job to its end (`drain`). A job that fails ends its own requests
        (`failed`), no other."""
        while self.prefills:
            for job in list(self.prefills.jobs):
                if budget is not None and budget <= 0:
                    return
                try:
                    ran = job.run(self.prefill_step * job.width() if budget is None else budget)
                    if job.left() == 0:
                        self.prefills.jobs.remove(job)
                        job.finish()
                except CollectiveError:
                    raise
                except Exception as e:  # noqa: BLE001 - that job's requests alone
                    self._fail(job, f"{type(e).__name__}: {e}")
                    continue
                self.prefilled += ran
                if budget is not None:
                    budget -= ran
            if not drain:
                return

    def _fail(self, job, message: str) -> None:
        if job in self.prefills.jobs:
            self.prefills.jobs.remove(job)
        for a in job.admits:
            for rid in [a.rid, *(c[0] for c in self._copies.pop(a.rid, ()))]:
                self.failed[rid] = message
                self.prefills.cancelled.discard(rid)

    def echoed(self, a: Admission, logprobs: list) -> None:
        """Prompt `a`'s logprobs (its copies' too), for the caller (`prompt_logprobs`)."""
        for rid in [a.rid, *(c[0] for c in self._copies.get(a.rid, ()))]:
            self.prompt_logprobs[rid] = logprobs

    def place_prefilled(self, a: Admission, cache: list) -> None:
        """Prompt `a`, prefilled in its own caches `cache`, into a new row
        (none for a request that reads no ids: its prompt's logprobs only)."""
        if a.budget == 0:
            self._copies.pop(a.rid, None)
            for c in cache:
                c.release()
            return
        row = self._row(a)
        if not self.static:
            row.eager_cache = cache
            self._join(row, None)
            return
        self._reserve(len(self.rows) + 1, a.last + 1)
        self._join(row, [None if kind == "shared" or a.last == 0 else held_arrays(c, kind)
                         for c, kind in zip(cache, self.kinds)])
        for c in cache:
            c.release()

    def place_layers(self, a: Admission, layers: list) -> None:
        """Prompt `a`, prefilled together with others, into a new row: `layers`
        as `_place` takes them."""
        self._reserve(len(self.rows) + 1, a.last + 1)
        self._join(self._row(a), layers)

    def _row(self, a: Admission) -> Row:
        return Row(a.rid, Sampler(a.sampling or SamplingParams(), len(a.prompt)), a.prompt.tolist(), a.last,
                   int(a.prompt[a.last]), budget=a.budget, grammar=a.grammar, drafts=a.drafts)

    def _join(self, row: Row, layers: list | None) -> None:
        """A prefilled row joins the batch (before the next launch), then its
        copies; a request cancelled meanwhile leaves again at once."""
        if layers is None:
            self.rows.append(row)
            self._changed = True
        else:
            self._place(row, layers)
        copies = self._copies.pop(row.rid, ())
        for copy in copies:
            self._fork(row.rid, *copy)
        rids = [row.rid, *(c[0] for c in copies)]
        if self.spec is not None:
            self.spec.added(self, [(rid, row.context) for rid in rids])
        for rid in rids:
            if rid in self.prefills.cancelled and rid in self:
                self.prefills.cancelled.discard(rid)
                self.remove(rid)

    def _place(self, row: "Row", layers: list) -> None:
        """Append `row`, per layer (its keys/values in `names` order, [1, H, n, .]
        of positions up to row.pos, oldest first; its state arrays [1, ...])
        moved into its batch row (buffers already reserved); None: nothing
        held (a state starts at zeros)."""
        b, last = len(self.rows), row.pos
        self.rows.append(row)
        self._changed = True
        for lay, x in zip(self.layout, layers):
            held, states = x or ([], [None] * len(lay.state))
            if held:
                S = self.buffers[lay.kv[0]].shape[2]  # this layer's (a sliding one stops at its window)
                n = min(held[0].shape[2], S)
                slots = ring_slots(last - n, n, S)
                for name, a in zip(lay.kv, held):
                    _write_row(self.buffers[name], b, slots, a[..., a.shape[2] - n :, :])
            for name, a in zip(lay.state, states):
                buf = self.buffers[name]
                buf[b : b + 1] = mx.zeros_like(buf[:1]) if a is None else a
        self._sync_pos()

    def _fork(self, src, rid, sampling, budget, grammar=None, drafts=True) -> None:
        """A new row `rid` holding row `src`'s prompt (its keys/values copied,
        no forward), with its own sampler. Rows stepping eagerly have caches
        of their own, so their copies are prefilled each."""
        b = next(i for i, r in enumerate(self.rows) if r.rid == src)
        r = self.rows[b]
        if not self.static:
            prompt = np.asarray(r.context, np.int32)
            self.prefills.jobs.append(Alone(self, Admission(rid, prompt, len(prompt) - 1, sampling, 0, None, budget,
                                                            grammar, drafts)))
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

    def remove(self, rid) -> None:
        """Free `rid`'s row (kept in the prompt cache when there is one): the
        last row moves into it (rows stay [0, n))."""
        b = next((i for i, r in enumerate(self.rows) if r.rid == rid), None)
        if b is None:  # still being prefilled: it leaves when placed; a copy leaves its list
            for cs in self._copies.values():
                cs[:] = [c for c in cs if c[0] != rid]
            if rid in self.prefills:
                self.prefills.cancel(rid)
            self.want.pop(rid, None)
            return
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
        for lay in self.layout:
            held = []
            if lay.kv:
                S = self.buffers[lay.kv[0]].shape[2]
                n = min(fed, S)
                slots = ring_slots(fed - n, n, S)
                held = [_read_row(self.buffers[name], b, slots) for name in lay.kv]
            layers.append(None if lay.kind == "shared" else (held, [self.buffers[x][b : b + 1] for x in lay.state]))
        self.prompt_cache.store_layers(seen, [self.entry(i, x, fed) for i, x in enumerate(layers)], self.windows)

    def entry(self, i: int, x, offset: int | None = None):
        """Layer i's prompt-cache entry from (keys/values, states) of `offset`
        tokens: (keys, values) (QuantizedKVs under --kv-bits), a state's
        Snapshot (its arrays, then the offset: DeltaNetCache.snapshot), or None."""
        if x is None:
            return None
        held, states = x
        lay = self.layout[i]
        if lay.kind == "state":
            return Snapshot((*states, offset))
        return QuantizedKV.pair(held, *lay.quant) if lay.kind == "quantized" else tuple(held)

    @property
    def kinds(self) -> list:
        return [lay.kind for lay in self.layout]

    @property
    def windows(self) -> list:
        return [lay.window for lay in self.layout]

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
        for lay in self.layout:
            s = min(want_s, lay.window + self.margin) if lay.window else want_s  # a margin: rolled-back drafts
            for name in lay.kv:
                old = self.buffers.get(name)
                shape = self.shapes[name] if old is None else old.shape
                buf = mx.zeros((want_c, shape[1], s, shape[3]), self.dtypes[name])
                if old is not None:
                    # A sliding buffer already at the window keeps its ring; a
                    # growing one is in temporal order: copy the slots held.
                    keep = min(old.shape[2], s)
                    buf[: old.shape[0], :, :keep, :] = old[:, :, :keep, :]
                new[name] = buf
            for name in lay.state:  # a state: rows only
                old = self.buffers.get(name)
                buf = mx.zeros((want_c, *self.shapes[name][1:]), self.dtypes[name])
                if old is not None:
                    buf[: old.shape[0]] = old
                new[name] = buf
        self.buffers.clear()
        self.buffers.update(new)
        self._cap = want_c
        self.views = []
        for i in range(len(self.layout)):
            self.views.append(self._view(i, self.views))
        self._sync_pos()

    def _view(self, i: int, views: list, rows=None):
        """Layer i's cache over the batch buffers (`views`: the layers before
        it; `rows`: a micro-batch's rows only)."""
        lay = self.layout[i]
        if lay.kind == "shared":
            return SharedKVCache(views[lay.reads], lay.reads)
        if lay.kind == "state":
            return StaticState(self.buffers, i, len(lay.state), rows)
        if lay.kind == "quantized":
            return QuantizedRowCache(self.buffers, i, *lay.quant, rows, self.margin)
        view = RowCache(self.buffers, i, lay.window, rows, lay.chunk, self.margin)
        return view if lay.kind == "kv" else StaticConvKV(view, StaticState(self.buffers, i, 2, rows))

    def _learn_layout(self, cache, probe) -> None:
        """Per-layer window, cache kind, buffer names and per-row shapes and
        dtypes, from a prefilled cache (or a one-token probe forward when the
        prompt had nothing to prefill)."""
        if cache is None:
            cache = self.model.make_cache()
            self.model(mx.array(probe)[None], cache)
        kinds = [static_kind(c) for c in cache]
        held = [([], []) if k == "shared" else held_arrays(c, k) for c, k in zip(cache, kinds)]
        self.layout = []
        for i, (c, k, (kv, st)) in enumerate(zip(cache, kinds, held)):
            quant = (c.bits, c.group_size) if k == "quantized" else None
            # the static forms' buffer names ("k{i}", "v{i}"; quantized: words, scales, biases of each)
            names = (() if k in ("shared", "state") else QuantizedStaticCache(None, i, *quant).names if quant
                     else StaticCache(None, i, None).names)
            self.layout.append(LayerRows(k, c.window, c.chunk, c.reads_layer, quant, tuple(names),
                                         tuple(StaticState(None, i, len(st)).names)))
            for name, x in zip([*names, *self.layout[-1].state], [*kv, *st]):
                self.shapes[name], self.dtypes[name] = x.shape, x.dtype
        self.stateful = any(k in ("state", "conv_kv") for k in kinds)
        self._cacheable = PromptCache.cacheable(cache)

    # -- steps -------------------------------------------------------------
    # Pipelined as engine.TokenGenerator: `step` launches step n+1 (async_eval)
    # from step n's lazy ids before it reads them, so building a step overlaps
    # the device's work on the last. After `step` one step is in flight; rows
    # added or removed meanwhile only change which inputs the next launch takes.

    def splits(self, C: int) -> bool:
        """The one-row case (generate's row; a lone request): a model that opts in steps split
        (decode.SplitSegments: compiled segments between the layers' attention, which then runs
        unmasked on the written prefix, so GPU backends take their fused decode kernels)."""
        if self.split is None:
            self.split = splittable(self.model) and all(lay.kind == "kv" for lay in self.layout)
        return C == 1 and self.split and self.compiled and not self.margin

    def _split_row(self, x: mx.array) -> mx.array:
        if self._segments is None:
            self._segments = SplitSegments(self.model)
        logits = self._segments(x, self.buffers, self.views, self.rows[0].pos)
        self.traces += self._segments.traced
        return logits

    def _forward(self, tokens: mx.array) -> mx.array:
        self.traces += self.compiled  # (the Python body runs per trace compiled, per step eager)
        logits = self.model(tokens, self.views)[:, -1]
        self.buffers["pos"] = self.buffers["pos"] + 1
        return logits

    def _forward_block(self, tokens: mx.array) -> mx.array:
        self.traces += self.compiled  # (the Python body runs per trace compiled, per step eager)
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
        logits = self._compiled_block(x) if self.compiled else self._forward_block(x)
        return logits[:n]

    def _forward_part(self, tokens: mx.array, a: int, e: int) -> mx.array:
        """Rows [a, e) (a micro-batch) one step on; `pos` moves on with the last part."""
        self.traces += self.compiled  # (the Python body runs per trace compiled, per step eager)
        views = []
        for i in range(len(self.layout)):
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
        step = self._compiled_part if self.compiled else self._forward_part
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
        self._flights.append(self._checked(_Flight(list(self.rows), stacked, extras, ids_parts)))
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
        self._draw()
        n = len(self.rows)
        if self.static and self.micro > 1 and not any(r.grammar is not None for r in self.rows):
            self._reserve(n, max(r.pos for r in self.rows))
            if self._capacity() > 1:
                return self._launch_micro(n, self._capacity())
        tokens, pending = self._inputs()
        logits, rows = self._forward_rows(tokens)
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
        f = _Flight(list(self.rows), stacked, extras, deferred=deferred or None, drawn=ids if deferred else None,
                    logits=logits if deferred and self.static else None)
        if deferred:
            mx.async_eval([x for _, x in deferred], [i for i in ids if i is not None], extras)
        else:
            self._checked(f)
        for r in self.rows:
            r.pos += 1
            r.launched += 1
        self._flights.append(f)
        self._changed = False

    def _forward_rows(self, tokens: mx.array) -> tuple:
        """One step's forward: row b fed tokens[b] (lazy int32 [n]) at its
        position; (the static batch's logits [C, V], None for rows on their own
        caches; each row's logits [V])."""
        n = len(self.rows)
        if not self.static:
            return None, [self.model(tokens[b].reshape(1, 1), r.eager_cache)[0, -1] for b, r in enumerate(self.rows)]
        self._reserve(n, max(r.pos for r in self.rows))
        C = self._capacity()
        x = (tokens if C == n else mx.concatenate([tokens, mx.zeros((C - n,), mx.int32)])).reshape(C, 1)
        logits = self._split_row(x) if self.splits(C) else self._compiled(x) if self.compiled else self._forward(x)
        return logits, [logits[b] for b in range(n)]

    def scores(self, cache: list, ids, read: bool = True) -> np.ndarray | None:
        """float32 [len(ids), V]: the logits of feeding `ids` one at a time
        after an eager `cache` that holds the tokens before them, as a row of
        this (idle) engine: the one-row step generation runs, its inputs
        known (sequence_logits' decode part: logit-match's decode mode). Step
        j + 1 is launched before step j's logits are read, so the host copy
        overlaps the device. `read=False`: only evaluated (a timing), None."""
        if self.rows or self.prefills:
            raise RuntimeError("scores needs an idle engine")
        ids = [int(t) for t in ids]
        pos = next(c.offset for c in cache if c.reads_layer is None)
        prompt = np.zeros(pos + 1, np.int32)
        prompt[pos] = ids[0]
        a = Admission("scores", prompt, pos, None, 0, None, len(ids), None, False, None)
        self._decide(prompt[:1])
        self.place_prefilled(a, cache)
        row, out, pending = self.rows[0], [], None
        try:
            for t in ids:
                x = self._forward_rows(mx.array([t], mx.int32))[1][0].astype(mx.float32)
                row.pos += 1
                mx.async_eval(x)
                if pending is not None and read:
                    out.append(np.array(pending))
                pending = x
            if not read:
                mx.eval(pending)
                return None
            out.append(np.array(pending))
        finally:
            self.remove("scores")
        return np.stack(out)

    def _checked(self, f: _Flight) -> _Flight:
        """Schedule flight `f` once its ids are complete: with a `guard`, its
        check rows packed behind the ids, so one host read takes both."""
        rows = None if self.guard is None else self.guard.pending_rows(f.ids)
        f.read = f.ids if rows is None else mx.concatenate([f.ids, rows.reshape(-1)])
        mx.async_eval(f.read, f.extras)
        return f

    def _finish(self) -> None:
        """Start the masks of the step in flight's deferred rows: their last
        ids are read now (`collect` advanced their grammars). They are computed
        on the vocabulary's worker thread while the device runs the forward and
        the caller does its host work between steps; `_draw` draws the rows
        when their ids are next needed (the next `launch` or `collect`)."""
        f = self._flights[-1] if self._flights else None
        if f is not None and f.deferred is not None and f.masks is None:
            f.masks = self.vocab.masks_ahead([f.rows[b].grammar for b, _ in f.deferred])

    def _draw(self) -> None:
        """Draw the deferred rows of every step in flight whose masks `_finish`
        started. Its ids [n] are complete after."""
        for f in self._flights:
            if f.deferred is not None and f.masks is not None:
                self._draw_flight(f)

    def _draw_flight(self, f: _Flight) -> None:
        ids, extras = list(f.drawn), dict(f.extras)
        # [k, words]: every deferred row's mask from one llguidance call, one copy in
        masks = mx.array(f.masks.result())
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
                self._checked(f)
                return
            for i, j in enumerate(greedy):
                ids[f.deferred[j][0]] = top[i]
        for j, (b, x) in enumerate(f.deferred):
            r = f.rows[b]
            if ids[b] is None:
                ids[b] = r.sampler.sample(x, r.context, mask=masks[j])
            extras.update(self._extras_of([r], [x], [ids[b]], [None], [masks[j]]))
        f.ids, f.extras, f.deferred, f.drawn = mx.stack(ids), extras, None, None
        self._checked(f)

    def collect(self) -> dict:
        """Read the oldest step in flight (the one host sync): {rid: id} of
        its rows still present; a removed row's id is dropped unseen."""
        if not self._flights:
            return {}
        self._draw()
        f = self._flights.pop(0)
        read = np.array(f.read)  # the one host sync
        n = len(f.rows)
        got = read[:n].tolist()
        if self.guard is not None:
            self.guard.commit(got, read[n:].reshape(-1, 3) if len(read) > n else None)
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

    def step(self, prefill: int | None = None) -> dict:
        """One token for every row: {rid: sampled id} (read from the device);
        first the prefill queue's forwards (`prefill` prompt tokens when given
        and rows decode, else the engine's `budget`).
        Pipelined, the next step is launched before this one is read, so a
        row that the caller removes after this call has already been fed its
        last id once more: that step's work for it is discarded. With drafts
        (`spec`, static caches): {rid: [ids]}, 1 .. K + 1 a row, unpipelined."""
        if self.prefills:
            self._prefill(prefill if prefill and self.rows and self.budget is not None else self._step_budget())
        if not self.rows:
            self._flights.clear()
            return {}
        if self.spec is not None and self.spec.active(self):
            return self.spec.step(self)
        return self.plain_step()

    def plain_step(self) -> dict:
        """`step`'s pipelined decode step (also batch_spec's when no row drafts)."""
        traces = self.traces
        if not self._flights:
            self.launch()
        # no step past every row's budget: its work would only be discarded (a lone request's last id)
        if self.pipelined and self.more():
            self.launch()
        if self.traces > traces and self.on_new_graph is not None:  # before the wait: its kernels compile
            self.on_new_graph()
        out = self.collect()
        self._finish()
        return out

    def more(self) -> bool:
        """Whether some row may still take an id launched now (its budget not all launched)."""
        return any(r.budget is None or r.launched < r.budget for r in self.rows)

    def _step_budget(self) -> int | None:
        """This step's prefill tokens (`budget` of the decoding rows' tokens:
        one a row, K + 1 with drafts); None (a full chunk a prompt) when no row
        decodes."""
        if self.budget is None or not self.rows:
            return None
        per_row = 1 + (self.spec.k if self.spec is not None and self.static else 0)
        return self.budget.prefill(per_row * len(self.rows))

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
