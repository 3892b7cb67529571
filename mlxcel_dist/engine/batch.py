"""Batched decoding: many sequences, each at its own position, one forward
per step (what `serve` runs for concurrent requests; generate's one request
is row 0). `BatchEngine` is the facade over three parts: the prefill queue
(prefill.py: the prompts on their way in), the rows' static buffers
(batch_rows.RowBuffers, `store`: layout, per-row slots, views) and the
device step (batch_step.Steps, `steps`: launch, draw, read, pipelined);
how each row's ids are drawn is choice.py's, for plain steps and draft
rounds alike.

Rows. A request's prompt (all but its last token, less a prompt-cache
prefix) is prefilled, then its keys/values move into a free row (the last
prompt token is that row's first input). Prefilling is prefill.py's: the
prompts admitted by `add_many` become jobs that `step` runs a chunk at a
time beside the decoding rows (or at once without a budget), prompts
admitted together in one forward per chunk where their padding stays
small (`PrefillCache` buffers, per-row offsets and masks), a lone one
through the model's own caches (chunked, exact as `generate`), as are all
of a model that cannot batch (a cache with a state: a padded chunk would
feed its pads into it). A prompt given several times (serve's n > 1) is
prefilled once and its copies forked from its row (`_fork`). Only a cache
with no static form steps row by row on its own caches (`eager_cache`).
A prompt prefilled alone whose requests read one id each (max_tokens 1)
takes no row: its last token is fed through its own caches and the ids
drawn there (`answer`), so the decoding rows never grow to its length.

Drafts (serve --draft-model / --prompt-lookup): with `spec` (a
batch_spec.BatchDrafts) every step is its round for all rows, through
`feed` (L ids a row at host positions; rings of window + margin slots and
masks by slot position, so a row's rejected positions are rolled back by
its position alone); those steps are not pipelined. batch_spec.py uses the
engine's public calls only (`rows`, `feed`, `plain_step`, `collect`,
`launch`, `more`, `in_flight`, `took`, `draftable`).

Exactness: each row is computed by the same operations as a lone sequence
(the matmuls batch rows; a row's values do not depend on the others), so
greedy text is the same alone or batched, prefilled alone or together
(tests/test_batch.py compares ids, not logits: a batched matmul or a masked
key axis longer than a row's need not round bit for bit as the lone one;
tests/test_kv.py the --kv-bits rows).

`row_view` picks one layer's view of the buffers by its kind (the row
caches themselves, `RowCache`, `QuantizedRowCache`, live with their kinds in
cache/); batch_rows.RowBuffers takes it as given.

Under TP every rank runs the same steps on the same rows (the scheduler on
rank 0 decides, serve.protocol shares its decisions): the collectives are per
step, not per sequence.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .batch_rows import Row, RowBuffers
from .batch_step import Steps
from . import decode
from .guard import DEFAULT_PREFILL_STEP, check_tokens, vocab_size
from .prefill import Admission, Alone, Budget, Prefills, Request, Together, pad_groups
from .choice import Choice, draw, grammar_masks, logprobs as choice_logprobs
from ..parallel.pipeline import outstanding_sends
from .sampling import Sampler, SamplingParams, read_logprobs

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


def row_view(store, i: int, views: list, rows=None):
    """Layer i's row cache over `store`'s buffers (a batch_rows.RowBuffers;
    `views`: the layers before it; `rows` (a, e): a micro-batch's rows only),
    made by the layer's kind (cache/: `LayerCache.row_view`)."""
    return store.layout[i].cache.row_view(store.buffers, i, views, rows, store.margin)


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
        rows in up to that many micro-batches (serve --micro-batches, for pipeline
        stages: batch_step's `_launch_micro`; a step may ask for fewer, `step`). `vocab`: a grammar.Vocab, for
        requests that come with a grammar's text. `spec`: a batch_spec.BatchDrafts
        that drafts for the rows and runs every step (`feed` blocks, rollback);
        `margin`: ring slots past each window for drafted tokens (its K).
        `budget`: a prefill.Budget, the prompt tokens a step computes beside
        its decoding rows (serve; prefill.py); None: `add_many` prefills its
        prompts whole at once."""
        self.model = model
        self.spec = spec
        self.vocab = vocab
        self.prompt_cache = prompt_cache
        self.prefill_step = prefill_step or DEFAULT_PREFILL_STEP
        self.rows: list[Row] = []
        self.store = RowBuffers(self.rows, row_view, slot_step, spec.k if spec is not None else margin)
        self.static: bool | None = None  # decided at the first add (the cache kinds)
        self.compiled = compiled  # False: the same steps run eagerly (tests' reference; --no-compile)
        self.micro = micro
        self.parts = micro  # this step's micro-batches (`step`'s `micro`, else `micro`)
        self.micro_steps = 0  # steps launched in micro-batches
        self.pipelined = pipelined
        self.steps = Steps(self)
        self.want: dict = {}  # rid -> k: that row's logprobs with each id (sampling.token_logprobs)
        self.logprobs: dict = {}  # rid -> (logprob, [(id, logprob), ...]) of the step read last
        self.prefilled = 0  # prompt tokens run through prefill forwards (prompt-cache hits and copies excluded)
        self.budget = budget
        self.prefills = Prefills()  # prompts being prefilled (prefill.py)
        self._copies: dict = {}  # rid -> copies of its prompt (n > 1) forked once it is placed
        self.failed: dict = {}  # rid -> message: requests whose prefill failed (taken by the caller)
        self.gave_up: dict = {}  # rid -> llguidance's reason: rows whose grammar gave up at the last step's ids
        self.prompt_logprobs: dict = {}  # rid -> its prompt's logprobs (echo; taken by the caller)
        # One process on a CPU (MLX's CPU ops run on one thread each): a paced step's prefill forwards
        # go on a stream of their own and are evaluated with the step's decode launch, so the chunk and
        # the rows' step compute on two cores at once (never beside collectives: ranks could order them apart)
        self.side = mx.new_stream(mx.cpu) if mx.default_device() == mx.cpu and model.ranks == 1 else None
        self.beside: list = []  # the prefill forwards' arrays waiting for the launch (`evaluate`)
        self.deferring = False  # the prefill queue runs a forward beside the launch (`evaluate` defers it)
        self.answered: dict = {}  # rid -> (id, logprobs) drawn from its prefill (`answer`), out with the next step
        # a step beside a prompt as one forward (flat.py): the job whose chunk the next launch carries,
        # then the one whose chunk it carried (its offsets move on and its finished rows join after it)
        self.flat = None  # flat.FlatStep once some step carries a chunk
        self.flat_job = self.flat_ran = None
        self.flat_steps = 0  # steps that carried a chunk
        self.flat_sizes: set = set()  # the chunk sizes they carried (prefill.Together.stage reuses them)
        # an engine.RankAgreement whose checks ride on the steps' reads (generate: each id is checked
        # in the host sync that reads it); serve checks its steps' ids through the step protocol instead
        self.guard = None
        self.on_new_graph = None  # called when a step traced a new graph, before its ids are awaited

    # what the parts hold, as prefill.py, generation.py and tests read it
    margin = property(lambda self: self.store.margin, lambda self, k: setattr(self.store, "margin", k))
    buffers = property(lambda self: self.store.buffers)
    layout = property(lambda self: self.store.layout)
    shapes = property(lambda self: self.store.shapes)
    dtypes = property(lambda self: self.store.dtypes)
    stateful = property(lambda self: self.store.stateful)
    kinds = property(lambda self: self.store.kinds)
    windows = property(lambda self: self.store.windows)
    entry = property(lambda self: self.store.entry)
    traces = property(lambda self: self.steps.traces)
    split = property(lambda self: self.steps.split, lambda self, v: setattr(self.steps, "split", v))
    splits = property(lambda self: self.steps.splits)

    # -- rows --------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, rid) -> bool:
        """A row, or a request still being prefilled."""
        return (any(r.rid == rid for r in self.rows) or rid in self.prefills
                or any(rid == c[0] for cs in self._copies.values() for c in cs))

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
        for rid, prompt_ids, sampling, budget, grammar, drafts, echo, lps in (Request(*r) for r in requests):
            if isinstance(grammar, str):  # a request's grammar text (serve.wire): this rank's matcher, one a row
                grammar = self.vocab.matcher(grammar)
            if lps is not None:
                self.want[rid] = lps
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
        together = [a for a in todo if a.start < a.last and a.echo is None] \
            if self.static and not self.store.stateful else []
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
            self.static = bool(fresh) and None not in [c.static_form for c in fresh]
            if self.static:
                self.store.learn(self.model, None, probe)

    def evaluate(self, *arrays) -> None:
        """A prefill forward's arrays: evaluated now, or with the step's decode
        launch where they run beside it (`side`; `take_beside`)."""
        if self.deferring:
            self.beside.append(arrays)
        else:
            mx.eval(*arrays)

    def take_beside(self) -> list:
        """The prefill work waiting for this step's launch (each launch takes it)."""
        work, self.beside = self.beside, []
        return work

    @property
    def prefilling(self) -> bool:
        """Prompts still being prefilled (their rows not placed yet)."""
        return bool(self.prefills)

    def _prefill(self, budget: int | None, drain: bool = False) -> None:
        self.prefills.run(self, budget, drain)

    def fail(self, job, message: str) -> None:
        """Prefill `job` failed: its requests (their copies too) end with `message`."""
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
        self.store.reserve(len(self.rows) + 1, a.last + 1)
        self._join(row, [None if a.last == 0 else c.held() for c in cache])
        for c in cache:
            c.release()

    def answerable(self, a: Admission) -> bool:
        """Whether prompt `a` is answered from its own prefilled caches
        (`answer`): it and every copy read one id (max_tokens 1: lm-eval's
        loglikelihood, a classifier)."""
        return a.budget == 1 and all(c[2] == 1 for c in self._copies.get(a.rid, ()))

    def answer(self, a: Admission, cache: list) -> None:
        """A prompt whose requests read one id each: the last prompt token fed
        through its own caches and each one's id drawn from those logits as
        its row's first step would draw it (choice.py: sampler, grammar mask,
        logprobs), so it never takes a row: the rows decoding meanwhile do not
        grow to its length or attend over it. Its ids come with the next
        `step`'s. Every rank alike (the head's collectives run here)."""
        self.answer_with(a, self.model(mx.array(a.prompt[a.last : a.last + 1])[None], cache)[0, -1])
        for c in cache:
            c.release()

    def answer_with(self, a: Admission, logits: mx.array) -> None:
        """`answer` from its last prompt token's logits [V] (prefill.Together's
        last chunk carried that token)."""
        asks = [(a.rid, a.sampling, a.grammar)] + [(c[0], c[1], c[3]) for c in self._copies.pop(a.rid, ())]
        for rid, sampling, grammar in asks:
            if rid in self.prefills.cancelled:
                self.prefills.cancelled.discard(rid)
                continue
            row = Row(rid, Sampler(sampling or SamplingParams(), len(a.prompt)), a.prompt.tolist(), a.last + 1,
                      0, budget=1, grammar=grammar)
            self._answer_now([row], logits)

    def _first_ids(self, rows: list, logits: mx.array) -> tuple[list, dict]:
        """Each of `rows`' first id, drawn lazily from its prompt's last token's
        logits [V] as its row's first step would draw it (choice.py), and the
        logprobs of those that want them."""
        choices = [Choice(r, self.want) for r in rows]
        masks = grammar_masks(choices)
        xs = [logits] * len(rows)
        ids, _ = draw(choices, xs, None, masks)
        return ids, choice_logprobs(choices, xs, ids, None, masks)

    def _answer_now(self, rows: list, logits: mx.array) -> None:
        """`rows`' first ids read now, out with the next `step`'s (`answered`)."""
        ids, lps = self._first_ids(rows, logits)
        mx.eval(ids, lps, outstanding_sends(self.model))
        for r, t in zip(rows, ids):
            tok = int(t.item())
            self.answered[r.rid] = (tok, read_logprobs(lps[r.rid]) if r.rid in lps else None)
            r.took([tok])  # (its grammar advanced, as a row's read would)

    def place_layers(self, a: Admission, layers: list, logits: mx.array | None = None) -> None:
        """Prompt `a`, prefilled together with others, into a new row: `layers`
        as `RowBuffers.write` takes them. `logits` [V]: the prompt's last token
        was prefilled too (a flat job's last chunk, flat.py) and these are its:
        the row and its copies draw their first ids from them, lazily, and
        join at the next position, those ids read with the step in flight
        (`Steps.graft`): one step sooner than a first step of their own."""
        fed = a.last + (logits is not None)  # the tokens its layers hold
        self.store.reserve(len(self.rows) + 1, fed + 1)
        row = self._row(a)
        row.pos = fed
        n = len(self.rows)
        self._join(row, layers)
        if logits is None:
            return
        rows = self.rows[n:]  # it and its copies (`_fork`), less any cancelled meanwhile
        for r in rows:
            r.launched = 1
        self.steps.graft(rows, *self._first_ids(rows, logits))

    def _row(self, a: Admission) -> Row:
        return Row(a.rid, Sampler(a.sampling or SamplingParams(), len(a.prompt)), a.prompt.tolist(), a.last,
                   int(a.prompt[a.last]), budget=a.budget, grammar=a.grammar, drafts=a.drafts)

    def _join(self, row: Row, layers: list | None) -> None:
        """A prefilled row joins the batch (before the next launch; `layers`
        into its buffer row, None: a row on its own caches), then its copies;
        a request cancelled meanwhile leaves again at once."""
        self.rows.append(row)
        self.steps.changed = True
        if layers is not None:
            self.store.write(len(self.rows) - 1, row.pos, layers)
            self.store.sync_pos()
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
        self.store.reserve(len(self.rows) + 1, r.pos + 1)
        self.store.copy(b, len(self.rows))
        self.rows.append(Row(rid, Sampler(sampling or SamplingParams(), len(r.context)), list(r.context), r.pos,
                             r.token, budget=budget, grammar=grammar, drafts=drafts))
        self.steps.changed = True
        self.store.sync_pos()

    def warmup(self, max_rows: int, token: int = 0) -> list:
        """Trace and compile the step for every row capacity a batch of up to
        `max_rows` rows takes (1, 2, 4, ...: `RowBuffers.reserve`'s powers of
        two), at the first buffer size, with throwaway rows fed `token`; the
        engine is left empty, the prompt cache untouched. mx.compile keeps every
        trace, so the first requests that bring a batch to a new size do not pay
        for it (on the H200, 0.2-6 s per capacity for a 12B model once MLX's
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
            self.store.copy(last, b)
        self.rows[b] = self.rows[last]
        self.rows.pop()
        self.steps.changed = True
        if not self.rows:
            self.steps.flights.clear()  # its work runs on, unread
        if self.static:
            self.store.sync_pos()
            if not self.rows:
                self.store.release()
            else:
                self.store.reserve(len(self.rows), max(r.pos for r in self.rows) + self.store.margin, fit=True)

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
        if not self.store.cacheable:  # a state the prompt cache cannot keep (PromptCache.cacheable)
            return
        layers = self.store.held(b, fed)
        self.prompt_cache.store_layers(seen, [self.store.entry(i, x, fed) for i, x in enumerate(layers)],
                                       self.store.windows)

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
                x = self.steps.forward_rows(mx.array([t], mx.int32))[1][0].astype(mx.float32)
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

    # -- steps (batch_step.Steps) ---------------------------------------------
    def step(self, prefill: int | None = None, micro: int = 0) -> dict:
        """One token for every row: {rid: sampled id} (read from the device);
        first the prefill queue's forwards (`prefill` prompt tokens when given
        and rows decode, else the engine's `budget`); the step it launches in
        `micro` micro-batches (at most the engine's `micro`; 0: that).
        Pipelined, the next step is launched before this one is read, so a
        row that the caller removes after this call has already been fed its
        last id once more: that step's work for it is discarded. With drafts
        (`spec`, static caches): {rid: [ids]}, 1 .. K + 1 a row, unpipelined."""
        self.parts = min(micro, self.micro) if micro else self.micro
        if self.prefills:
            self._prefill(prefill if prefill and self.rows and self.budget is not None else self._step_budget())
        answered, self.answered = self.answered, {}
        if not self.rows:
            self.steps.flights.clear()
            out = {}
        elif self.spec is not None and self.spec.active(self):
            out = self.spec.step(self)
        else:
            out = self.steps.plain_step()
        if self.beside:  # no launch took it (no row left, a draft round)
            mx.eval(self.take_beside())
        job, self.flat_job = self.flat_job, None
        if job is not None:  # no launch took it (every row's ids launched): alone
            job.run_staged()
        job, self.flat_ran = self.flat_ran, None
        if job is not None:
            job.advance()
        if answered:
            if not self.rows:
                self.logprobs = {}
            for rid, (tok, lp) in answered.items():
                out[rid] = tok
                if lp is not None:
                    self.logprobs[rid] = lp
        # rows whose grammar llguidance gave up on at these ids (a limit hit; its masks allow only EOS
        # from here): serve ends those requests with an error naming it, not EOS and "stop"
        self.gave_up = {r.rid: r.gave_up for r in self.rows if r.gave_up is not None and r.rid in out}
        return out

    def _step_budget(self) -> int | None:
        """This step's prefill tokens (`budget` of the decoding rows' tokens:
        one a row, K + 1 with drafts); None (a full chunk a prompt) when no row
        decodes."""
        if self.budget is None or not self.rows:
            return None
        per_row = 1 + (self.spec.k if self.spec is not None and self.static else 0)
        return self.budget.prefill(per_row * len(self.rows))

    # the public surface of draft rounds (batch_spec.py)
    def plain_step(self) -> dict:
        """`step`'s pipelined decode step (batch_spec's when no row drafts)."""
        return self.steps.plain_step()

    def launch(self) -> None:
        self.steps.launch()

    def collect(self) -> dict:
        return self.steps.collect()

    def more(self) -> bool:
        return self.steps.more()

    def feed(self, tokens: mx.array, pos: list) -> mx.array:
        return self.steps.feed(tokens, pos)

    def host_clock(self) -> dict:
        """Host seconds by part, summed over the engine's life (serve's step log):
        its steps' (batch_step.Steps.clock) and, with a grammar vocabulary, its
        masks worker's start after submit and its work (grammar.Vocab.ahead_clock)."""
        clock = dict(self.steps.clock)
        if self.vocab is not None:
            clock["start"], clock["compute"] = self.vocab.ahead_clock
        return clock

    @property
    def in_flight(self) -> bool:
        """A launched step not read yet."""
        return bool(self.steps.flights)

    @property
    def draftable(self) -> bool:
        """Draft rounds can step these rows: every layer's rows roll back by
        position alone (attention KV, float or --kv-bits, or a shared layer's)."""
        return bool(self.static) and all(k in ("kv", "quantized", "shared") for k in self.store.kinds)

    def took(self, ids: dict, logprobs: dict) -> None:
        """A draft round's read: each row's accepted ids ({rid: ids}) fed
        (its position moves on by them) and the rows' logprobs."""
        for r in self.rows:
            got = ids[r.rid]
            r.took(got)
            r.pos += len(got)
            r.launched += len(got)
        self.store.sync_pos()
        self.logprobs = logprobs
