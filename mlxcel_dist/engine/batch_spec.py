"""Speculative decoding inside batched steps (serve --draft-model /
--prompt-lookup): spec.py's rounds, one per step for every row at once.

A step, with rows at their own positions (row b's last id t_b, not fed yet,
at position n_b - 1):

    drafts:  up to k_b <= K ids a row: prompt lookup on the host
             (`PromptLookup` on the row's ids), or the draft model's own
             batch (`DraftRows`: a BatchEngine over the draft, rows keyed
             as the target's, stepped max k_b times for all rows at once);
    verify:  the target feeds [t_b, d_b1 .. d_bm] to every row in one
             forward of L = m + 1 positions, m the most drafts any row has
             (`BatchEngine.feed`: per-row positions, masks by slot
             position); a row with fewer drafts (none: it opted out, is
             constrained, wants logprobs, has penalties, its budget is
             near, its lookup missed) still feeds L ids, and only its first
             k + 1 logits count;
    accept:  per row, greedy: the longest prefix equal to the target's
             argmax, then its next id; sampled: spec.speculative_accept;
             a row without drafts samples its one id as a plain step does
             (the same key chain, grammar mask and logprobs);
    rollback: each row's position moves on by what it accepted (a + 1): the
             rejected positions' slots are hidden by the position masks and
             overwritten later (rings hold window + K slots: architecture.md,
             "Speculative decoding"); the draft rows need nothing (each round
             feeds the agreed ids a row's draft cache lacks, then drafts).

So rows with different accepted lengths stay in one step. Every rank
drafts alike (the draft model whole on every rank, prompt lookup on the
agreed ids) and accepts alike (bit-identical logits, the rows' samplers'
keys), so the step needs nothing on the wire. Steps with drafts are not
pipelined: the next step's inputs are the accepted ids, read on the host.

A step in which no row has a draft (every lookup missed, no draft-model
row) is the engine's plain pipelined step (`BatchEngine.plain_step`), so
a miss costs no verify round. While plain steps run, one step is in flight
and each row's context lacks its id; after each, the rows' lookups run on
the contexts as read (while the next step runs), and a hit makes the next
step read the one in flight first, then draft from the whole contexts
(its ids lead the round's; with a logprobs row, whose steps give one id,
the round waits for the next call).

K per row (`BatchDrafts._adapt`). A draft-model row drafts the k whose
expected ids a round, from its acceptance seen at each draft position,
per the round's cost is highest (`_worth`): the verify's fixed part (two
plain steps on a GPU, where the plain step runs the fused decode kernels and
the verify a masked graph; one on a CPU) and per draft a draft step and one
more verify position (little on a GPU, about a third of a step on a CPU);
where its k yields under REST_BELOW ids per target step (a plain step: one),
the row rests as a failing lookup row does (while every row rests, plain pipelined steps;
the draft's rows then catch up on the ids they lack in blocks of K + 1).
A prompt-lookup row (SGLang-style adaptive drafting): one that takes all
its drafts drafts one more next round (up to K), one that accepts a of them
at most a + 1 and at least one fewer (down to 1); one whose one draft fails
rests 1, 2, 4 .. 16 steps. The engine's margin stays K, so every k_b <= K
rolls back as before; greedy ids are the plain ones whatever the k.

Models whose caches are not all static KV step without drafts (a log line).
"""

from __future__ import annotations

import weakref

import mlx.core as mx
import numpy as np

from .choice import Choice, accepted, choose, draft_ids, verify
from .sampling import read_logprobs
from .spec import PromptLookup, check_draft, check_drafting


MAX_REST = 16  # the longest rest of a prompt-lookup row whose drafts keep failing (steps)
# A verify position's cost in target steps: a block's width cost little on one H200 (draft_floor.py's chains:
# 4 ids 1.1-1.3x one), a third of a step on the 2-core CPU (spec_7b.py --tiny --parts: 4 ids 1.9-2.2x one)
POSITION_COST = {"gpu": 0.05, "cpu": 0.35}
# A verify's fixed part where a lone row's plain steps run split on a GPU (fused decode kernels) and its verify
# is the masked block: 9.8-12.5 ms against a 4.8-5.3 ms plain step (one H200, the 7.2B pair); elsewhere the
# plain step is the same kind of graph as the verify (1: assumed for batches on a GPU, not measured)
SPLIT_VERIFY = 2.0
PRIOR, RATE = 0.7, 0.2  # a draft position's acceptance before any is seen; the weight of each seen
# A draft-model row rests where its round's expected ids per target step fall under this share of a plain
# step's one: the costs above come from the device kind and layer counts, not timings (the H200 pair's
# rounds ran 2.0-2.9 steps where they say 2.7), so only a clear loss rests
REST_BELOW = 0.8


class DraftRows:
    """The draft model's rows, one per drafting target row (same rid), in a
    BatchEngine of their own with margin K. A round feeds each row's agreed
    ids its cache lacks at their positions (so whatever it drafted past the
    accepted ones is overwritten: no rollback to track): the last one after
    a round that accepted fewer than all its drafts, the last two after one
    that accepted all (its last draft was never fed), two for a new row,
    those of the plain steps since its last round (every row rested: blocks
    of K + 1, each row's last block ending at its context's end);
    then its K - 1 drafts one step at a time; each row's position is set
    from its context. A round in which every row lacks one id feeds one id a
    row (a lone row: the split one-row step, not the masked block)."""

    def __init__(self, model, k: int, compiled: bool = True, prefill_step: int | None = None):
        from .batch import BatchEngine

        check_draft(model)
        self.k = k
        self.engine = BatchEngine(model, prefill_step, compiled, pipelined=False, margin=k)
        self.fed: dict = {}  # rid -> (its context's length at its last round, its row in that round's drafts)
        self._drafts = None  # the last round's drafts [m, k] (lazy until its verify read them)

    def add(self, items: list) -> None:
        self.engine.add_many([(rid, ids, None) for rid, ids in items])

    def remove(self, rid) -> None:
        self.fed.pop(rid, None)
        if rid in self.engine:
            self.engine.remove(rid)

    def _lacks(self, rid, ctx: list, last: list | None) -> int:
        """The agreed ids at the end of `ctx` whose keys row rid's cache lacks
        (at least 1); `last`: the last round's drafts as read."""
        if rid not in self.fed or last is None:
            return 2
        n, b = self.fed[rid]
        held = n  # its last round fed the context, then its drafts but the last from position n
        for d in last[b][:-1]:  # (its last draft was never fed)
            if held >= len(ctx) - 1 or ctx[held] != d:
                break
            held += 1
        return max(1, len(ctx) - held)

    def rids(self) -> list:
        return [r.rid for r in self.engine.rows]

    def draft(self, rows: list, k: int) -> tuple[mx.array, list]:
        """The target rows `rows` (in this engine's row order): lazy drafts
        [m, k] (k <= K) and per row its draft logits [k, V] (sampled rows) or None."""
        ctxs = [r.context for r in rows]
        last = None if self._drafts is None else np.array(self._drafts).tolist()  # (read by the last verify)
        L, W = max(self._lacks(r.rid, c, last) for r, c in zip(rows, ctxs)), self.k + 1
        for j in range(-(-L // W) - 1, 0, -1):  # plain steps ran (every row rested): blocks of W before the last
            self._feed(ctxs, W, j * W)
        logits, starts = self._feed(ctxs, min(L, W), 0)
        x = logits[mx.arange(len(rows)), mx.array([len(c) - 1 - s for c, s in zip(ctxs, starts)])]
        drafts, qs = [], [[] for _ in rows]
        choices = choose(rows, {})
        for i in range(k):
            d = draft_ids(choices, x, qs)
            drafts.append(d)
            if i < k - 1:
                x = self.engine.feed(d.reshape(-1, 1), [len(c) + i for c in ctxs])[:, 0]
        for r, c in zip(self.engine.rows, ctxs):
            r.pos = len(c) - 1
        self._drafts = mx.stack(drafts, axis=1)  # [m, k]
        self.fed = {r.rid: (len(c), b) for b, (r, c) in enumerate(zip(rows, ctxs))}
        return self._drafts, [mx.stack(q) if q else None for q in qs]

    def _feed(self, ctxs: list, L: int, back: int) -> tuple[mx.array, list]:
        """Each row's L context ids ending `back` ids before its context's end (a row whose context is
        too short for it: its last L again, same keys; shorter than L: padded, the pads past its end
        overwritten by its drafts): lazy logits [m, L, V] and each row's first position."""
        starts = [len(c) - back - L if len(c) - back - L >= 0 else max(len(c) - L, 0) for c in ctxs]
        ids = [(c[s:s + L] + [0] * L)[:L] for c, s in zip(ctxs, starts)]
        return self.engine.feed(mx.array(ids, mx.int32), starts), starts


class _Ngrams:
    """spec.PromptLookup's answer for a growing context from an index of its
    n-grams (min_ngram .. max_ngram ids) by the position each last ended at,
    extended by the ids added since the last lookup: the same drafts, without
    rescanning the whole context each step (0.3-0.6 ms a row for ~60 ids on
    the 2-core CPU host, growing with the context)."""

    def __init__(self, lookup: PromptLookup):
        self.k, self.ns = lookup.k, range(lookup.max_ngram, lookup.min_ngram - 1, -1)
        self.last = {n: {} for n in self.ns}  # n -> {n-gram: the index its latest occurrence ends at}
        self.upto = 0  # n-grams ending before this index are in `last`
        self.plain = lookup

    def lookup(self, context) -> list:
        T = len(context)
        if T - 1 < self.upto:  # (a context that shrank: not this engine's rows)
            return self.plain.lookup(context)
        for e in range(self.upto, T - 1):  # n-grams that end at e <= T - 2 (PromptLookup's windows)
            for n in self.ns:
                if e + 1 >= n:
                    self.last[n][tuple(context[e + 1 - n : e + 1])] = e
        self.upto = max(self.upto, T - 1)
        for n in self.ns:
            if n <= T - 1:
                e = self.last[n].get(tuple(context[T - n :]))
                if e is not None:
                    return list(context[e + 1 : e + 1 + self.k])
        return []


class BatchDrafts:
    """A BatchEngine's drafter and step (`BatchEngine(spec=...)`): up to `k`
    drafts a row a step from `draft` (DraftRows) or prompt lookup, each row's
    own k moved by what it accepts (`adaptive`, `row_k`; a lookup row whose
    single drafts keep failing rests a few steps, `rest`). A step in which no
    row drafts is the engine's plain pipelined step (`plain_step`). Counts of
    the last step in `last` (rows that drafted, drafted, accepted), in
    `total`, and the steps taken in `steps` (plain, verify; reread: a step in
    flight read early for drafts that then were not there)."""

    def __init__(self, k: int, draft: DraftRows | None = None, log=None, adaptive: bool = True,
                 lookup: PromptLookup | None = None, cost: tuple | None = None):
        check_drafting(k)
        self.k, self.draft, self.adaptive = k, draft, adaptive
        self.lookup = None if draft is not None else lookup or PromptLookup(k)
        self.name = "draft model" if draft is not None else "prompt lookup"
        self.log = log
        self.last = (0, 0, 0)
        self.total = [0, 0, 0]
        self.steps = {"plain": 0, "verify": 0, "reread": 0}
        self.row_k: dict = {}  # rid -> its drafts in the next round (adaptive; absent: k)
        self.rates: dict = {}  # rid -> per draft position, its acceptance seen (a draft-model row; EMAs)
        self.given = cost  # a round's (V, c) for every round (tests), else `_cost`'s each round
        self.cost = cost  # this round's (V, c) (`_worth`)
        self._index = weakref.WeakKeyDictionary()  # Row -> its _Ngrams (prompt lookup)
        self.rest: dict = {}  # rid -> (the step it drafts again, its last rest) (prompt lookup, adaptive)
        self._t = 0  # steps taken
        self._probe = False  # after a plain step: some row may draft now (read the step in flight first)
        self._said = False

    # -- rows (BatchEngine's hooks) ---------------------------------------------
    def added(self, engine, requests) -> None:
        """After `engine.add_many(requests)`: the draft model prefills the drafting rows' prompts."""
        if not self.active(engine):
            return
        if self.draft is None:  # a new row whose prompt has a hit: the next step reads the one in flight
            rows = {r.rid: r for r in engine.rows}
            self._probe |= any(rid in rows and self._room(engine, rows[rid]) and self._lookup(rows[rid])
                               for rid, *_ in requests)
            return
        rows = {r.rid: r for r in engine.rows}
        items = [(rid, ids) for rid, ids, *_ in requests if rid in rows and self._drafts(engine, rows[rid])]
        if items:
            self.draft.add(items)
            self._probe = True

    def removed(self, rid) -> None:
        self.row_k.pop(rid, None)
        self.rates.pop(rid, None)
        self.rest.pop(rid, None)
        if self.draft is not None:
            self.draft.remove(rid)

    def active(self, engine) -> bool:
        """Whether `engine`'s steps are ours (`engine.draftable`: every layer's rows roll back
        by position alone); else it steps without drafts (said once)."""
        ok = engine.draftable
        if not ok and not self._said:
            self._said = True
            if self.log is not None:
                self.log(f"drafts ({self.name}) are off: this model's caches are not all attention KV "
                         "(its steps run without drafts)")
        return ok

    @staticmethod
    def _drafts(engine, r) -> bool:
        return Choice(r, engine.want).drafts

    def _room(self, engine, r) -> int:
        """Row r's drafts this round: its own k, less what its budget leaves (0: it takes no drafts)."""
        if not self._drafts(engine, r) or self.rest.get(r.rid, (0,))[0] > self._t:
            return 0
        left = self.k + 1 if r.budget is None else r.budget - len(r.generated)
        return max(0, min(self.row_k.get(r.rid, self.k), left - 1))

    # -- the step ---------------------------------------------------------------
    def step(self, engine) -> dict:
        """One step for every row: {rid: [ids]} (read from the device). No row
        drafting: the plain pipelined step. Else one verify forward; a plain
        step still in flight is read first and its ids lead the round's."""
        self._t += 1
        head = {}
        if engine.in_flight:
            if not self._probe:
                return self._plain(engine)
            head = engine.collect()  # every context whole again: the round drafts from it
            if any(rid in engine.want for rid in head):  # a logprobs row takes one id a step: the round next call
                self._probe = True
                self.last = (0, 0, 0)
                return {rid: [t] for rid, t in head.items()}
        ks, D, qs = self._propose(engine)
        if not any(ks):
            if not head:
                return self._plain(engine)
            self.steps["reread"] += 1  # read early for nothing: the pipeline again from here
            if engine.pipelined and engine.more():
                engine.launch()
            self._probe = self._may_draft(engine)
            self.last = (0, 0, 0)
            return {rid: [t] for rid, t in head.items()}
        self.steps["verify"] += 1
        rows = engine.rows
        first = mx.array([r.token for r in rows], mx.int32).reshape(-1, 1)
        logits = engine.feed(mx.concatenate([first, D], axis=1), [r.pos for r in rows])  # [n, L, V]
        out, extras = self._accept(engine, rows, logits, D, qs, ks)
        engine.took(out, {rid: read_logprobs(lp) for rid, lp in extras.items()})
        return {rid: [head[rid], *ids] if rid in head else ids for rid, ids in out.items()}

    def _plain(self, engine) -> dict:
        """The engine's pipelined step; then, while the next runs, whether a row may draft next time."""
        out = engine.plain_step()
        self.steps["plain"] += 1
        self.last = (0, 0, 0)
        self._probe = self._may_draft(engine)
        return {rid: [t] for rid, t in out.items()}

    def _may_draft(self, engine) -> bool:
        """Some row would draft from its context as read (a lookup hit; a draft-model row)."""
        if self.draft is not None:
            return any(r.rid in self.draft.engine and self._room(engine, r) for r in engine.rows)
        return any(self._room(engine, r) and self._lookup(r) for r in engine.rows)

    def _propose(self, engine) -> tuple[list, mx.array, list]:
        """Per row its number of drafts, the drafts [n, m] (m the most any row has; a row's
        unused ones 0) and per row its draft logits (sampled draft-model rows) or None."""
        rows = engine.rows
        n, ks, qs = len(rows), [self._room(engine, r) for r in rows], [None] * len(rows)
        if self.draft is None:
            drafted = np.zeros((n, self.k), np.int32)
            for b, (r, k) in enumerate(zip(rows, ks)):
                got = self._lookup(r)[:k] if k else []
                ks[b] = len(got)
                drafted[b, : len(got)] = got
            return ks, mx.array(drafted[:, : max(ks)]), qs
        for r in rows:  # a row that stopped drafting (it wants logprobs now) leaves the draft's batch
            if not self._drafts(engine, r):
                self.draft.remove(r.rid)
        ks = [k if r.rid in self.draft.engine else 0 for k, r in zip(ks, rows)]
        m = max(ks)
        if not m:  # (its draft rows are at their budgets' last id: they are never drafted for again)
            return ks, mx.zeros((n, 0), mx.int32), qs
        # every draft row drafts every round, so each stays two ids behind at most
        at = {r.rid: b for b, r in enumerate(rows)}
        order = [at[rid] for rid in self.draft.rids()]
        d, q = self.draft.draft([rows[b] for b in order], m)
        idx = np.full(n, len(order), np.int32)  # rows without a draft row take the zero row
        idx[order] = np.arange(len(order))
        for j, b in enumerate(order):
            qs[b] = q[j]
        return ks, mx.concatenate([d, mx.zeros((1, m), mx.int32)])[mx.array(idx)], qs

    def _lookup(self, r) -> list:
        """`self.lookup.lookup(r.context)`, from the row's n-gram index (host time per step
        independent of the context's length)."""
        if not isinstance(self.lookup, PromptLookup):  # another drafter behind the same seam (tests' scripts)
            return self.lookup.lookup(r.context)
        index = self._index.get(r)
        if index is None:
            index = self._index[r] = _Ngrams(self.lookup)
        return index.lookup(r.context)

    def _adapt(self, rid, k: int, a: int) -> None:
        """Row rid's next k after it accepted a of k drafts. A draft-model row: `_worth`, and
        a rest where its k pays less than plain steps (`_pays`). A lookup row: one more when
        it took them all, else at most a + 1 and at least one less (SGLang's adaptive
        drafting, per row); one whose one draft fails rests. A rest: 1, 2, 4 .. MAX_REST steps
        (plain steps when every row rests or misses), reset by a round that pays."""
        if not self.adaptive:
            return
        if self.draft is not None:
            self.row_k[rid] = self._worth(rid, k, a)
            self._rest(rid, not self._pays(rid))
            return
        cur = self.row_k.get(rid, self.k)
        self.row_k[rid] = min(self.k, cur + 1) if a == k else max(1, min(cur - 1, a + 1))
        if a or cur == 1:
            self._rest(rid, not a)

    def _rest(self, rid, rests: bool) -> None:
        if not rests:
            self.rest.pop(rid, None)
            return
        last = self.rest.get(rid, (0, 0))[1]
        n = min(MAX_REST, 2 * last or 1)
        self.rest[rid] = (self._t + n + 1, n)

    def _pays(self, rid) -> bool:
        """Whether row rid's next round yields at least REST_BELOW ids per target step (a plain
        step yields one): E(k) / (V + k c), its k and acceptance as `_worth` has them."""
        (V, c), k, E, run = self.cost, self.row_k[rid], 1.0, 1.0
        for p in self.rates[rid][:k]:
            run *= p
            E += run
        return E >= REST_BELOW * (V + k * c)

    def _worth(self, rid, k: int, a: int) -> int:
        """A draft-model row's next k, after it accepted a of k drafts: with p_i its acceptance
        seen at draft position i (given the ones before it were taken; EMAs from PRIOR), a round
        of k drafts yields E(k) = 1 + p_1 + p_1 p_2 + ... + p_1 .. p_k ids for V + k c target
        steps (`cost` = (V, c)); the k with the most ids per step (the larger on a tie), and one more than
        k after a round that took all k (positions past k are never seen otherwise)."""
        p = self.rates.setdefault(rid, [PRIOR] * self.k)
        for i in range(min(a + 1, k)):  # positions seen: those taken and the first refused
            p[i] += RATE * ((i < a) - p[i])
        (V, c), best, most, E, run = self.cost, 1, 0.0, 1.0, 1.0
        for j in range(self.k):
            run *= p[j]
            E += run
            if E / (V + (j + 1) * c) >= most:
                best, most = j + 1, E / (V + (j + 1) * c)
        return max(best, min(self.k, k + 1)) if a == k else best

    def _cost(self, engine) -> tuple:
        """This round's cost in target steps, (V, c): the verify's fixed part V (SPLIT_VERIFY for
        a lone row stepping split on a GPU, else 1) and per draft c, a draft step (the draft's
        share of the target's layers, +1: embedding and head) and one more verify position
        (POSITION_COST). From the device, the models and the rows, not timings: every rank
        picks the same k."""
        gpu = mx.default_device().type == mx.DeviceType.gpu
        d, t = len(self.draft.engine.model.model.layers), len(engine.model.model.layers)  # (every stage's)
        fixed = SPLIT_VERIFY if gpu and engine.steps.splits(engine.store.capacity()) else 1.0  # (as the plain step asks)
        return fixed, POSITION_COST["gpu" if gpu else "cpu"] + (d + 1) / (t + 1)

    def _accept(self, engine, rows, logits, D, qs, ks) -> tuple[dict, dict]:
        """Each row's accepted ids ({rid: ids}, the rows not moved yet) and the
        logprobs of the rows that want them, read."""
        choices = choose(rows, engine.want)
        if self.draft is not None and self.given is None:
            self.cost = self._cost(engine)
        lazy, extras = verify(choices, logits, D, qs, ks)
        mx.eval(lazy, D, extras)
        drafts = np.array(D).tolist()
        out, counts = {}, [0, 0, 0]
        for b, (c, k, x) in enumerate(zip(choices, ks, lazy)):
            ids = accepted(c, k, np.array(x).tolist(), drafts[b])
            if k:
                counts[0] += 1
                counts[1] += k
                counts[2] += len(ids) - 1
                self._adapt(c.row.rid, k, len(ids) - 1)
            out[c.row.rid] = ids
        self.last = tuple(counts)
        self.total = [t + c for t, c in zip(self.total, counts)]
        return out, extras


def serve_drafts(k: int, draft_model: str | None = None, prompt_lookup: bool = False, dtype=None,
                 prefill_step: int | None = None, log=None) -> BatchDrafts | None:
    """serve's drafter on this rank (None: no drafts): the draft model loaded
    whole (every rank drafts alike), or prompt lookup."""
    if draft_model is None and not prompt_lookup:
        return None
    draft = None
    if draft_model is not None:
        from ..checkpoint.loader import load_model

        draft = DraftRows(load_model(draft_model, dtype=dtype).model, k, prefill_step=prefill_step)
    return BatchDrafts(k, draft, log)
