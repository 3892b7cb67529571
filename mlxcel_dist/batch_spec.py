"""Speculative decoding inside batched steps (serve --draft-model /
--prompt-lookup): spec.py's rounds, one per step for every row at once.

A step, with rows at their own positions (row b's last id t_b, not fed yet,
at position n_b - 1):

    drafts:  up to K ids a row: prompt lookup on the host (`PromptLookup`
             on the row's ids), or the draft model's own batch
             (`DraftRows`: a BatchEngine over the draft, rows keyed as the
             target's, stepped K times for all rows at once);
    verify:  the target feeds [t_b, d_b1 .. d_bK] to every row in one
             forward of L = K + 1 positions (`BatchEngine.feed`: per-row
             positions, masks by slot position); a row with fewer drafts
             (none: it opted out, is constrained, wants logprobs, has
             penalties, or its budget is near) still feeds L ids, and only
             its first k + 1 logits count (L = 1 when no row drafts);
    accept:  per row, greedy: the longest prefix equal to the target's
             argmax, then its next id; sampled: spec.speculative_accept;
             a row without drafts samples its one id as a plain step does
             (the same key chain, grammar mask and logprobs);
    rollback: each row's position moves on by what it accepted (a + 1): the
             rejected positions' slots are hidden by the position masks and
             overwritten later (rings hold window + K slots: architecture.md,
             "Speculative decoding"); the draft rows need nothing (each round
             refeeds a row's last two ids from where its context is agreed).

So rows with different accepted lengths stay in one step. Every rank
drafts alike (the draft model whole on every rank, prompt lookup on the
agreed ids) and accepts alike (bit-identical logits, the rows' samplers'
keys), so the step needs nothing on the wire. Steps with drafts are not
pipelined: the next step's inputs are the accepted ids, read on the host.
Models whose caches are not all static KV step without drafts (a log line).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .sampling import SamplingParams, process_logits
from .spec import PromptLookup, check_draft, check_drafting, speculative_accept


def _draftable(params: SamplingParams | None) -> bool:
    """Penalties change within a block (spec.check_target): such rows take no drafts."""
    p = params or SamplingParams()
    return p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty


class DraftRows:
    """The draft model's rows, one per drafting target row (same rid), in a
    BatchEngine of their own with margin K. A round refeeds each row's last
    two agreed ids at their positions (so whatever it drafted past the
    accepted ones is overwritten: no rollback to track), then its K - 1
    drafts one step at a time; each row's position is set from its context."""

    def __init__(self, model, k: int, compiled: bool = True, prefill_step: int | None = None):
        from .batch import BatchEngine

        check_draft(model)
        self.k = k
        self.engine = BatchEngine(model, prefill_step, compiled, pipelined=False, margin=k)

    def add(self, items: list) -> None:
        self.engine.add_many([(rid, ids, None) for rid, ids in items])

    def remove(self, rid) -> None:
        if rid in self.engine:
            self.engine.remove(rid)

    def rids(self) -> list:
        return [r.rid for r in self.engine.rows]

    def draft(self, rows: list) -> tuple[mx.array, list]:
        """The target rows `rows` (in this engine's row order): lazy drafts
        [m, K] and per row its draft logits [K, V] (sampled rows) or None."""
        ctxs = [r.context for r in rows]
        starts = [max(len(c) - 2, 0) for c in ctxs]
        first = [c[-2:] if len(c) > 1 else [c[-1], 0] for c in ctxs]  # a 1-id context: a pad, overwritten next
        logits = self.engine.feed(mx.array(first, mx.int32), starts)
        x = logits[mx.arange(len(rows)), mx.array([len(c) - 1 - s for c, s in zip(ctxs, starts)])]
        drafts, qs = [], [[] for _ in rows]
        for i in range(self.k):
            d = _draw(rows, x, qs)
            drafts.append(d)
            if i < self.k - 1:
                x = self.engine.feed(d.reshape(-1, 1), [len(c) + i for c in ctxs])[:, 0]
        for r, c in zip(self.engine.rows, ctxs):
            r.pos = len(c) - 1
        return mx.stack(drafts, axis=1), [mx.stack(q) if q else None for q in qs]


def _draw(rows: list, x: mx.array, qs: list) -> mx.array:
    """Each row's draft from the draft logits x [m, V], as its sampler would
    draw (greedy: argmax; sampled: categorical with the row's next key, the
    processed logits kept in qs for the accept rule)."""
    if all(r.sampler.params.greedy and r.sampler.params.plain for r in rows):
        return mx.argmax(x.astype(mx.float32), axis=-1).astype(mx.int32)
    out = []
    for b, r in enumerate(rows):
        q = process_logits(x[b], r.context, r.sampler.params)
        if r.sampler.params.greedy:
            out.append(mx.argmax(q, axis=-1).astype(mx.int32))
        else:
            qs[b].append(q)
            out.append(mx.random.categorical(q, key=r.sampler.next_key()).astype(mx.int32))
    return mx.stack(out)


class BatchDrafts:
    """A BatchEngine's drafter and step (`BatchEngine(spec=...)`): `k`
    drafts a row a step from `draft` (DraftRows) or prompt lookup; counts
    of the last step in `last` (drafts: rows that drafted, drafted,
    accepted) and in total."""

    def __init__(self, k: int, draft: DraftRows | None = None, log=None):
        check_drafting(k)
        self.k, self.draft = k, draft
        self.lookup = None if draft is not None else PromptLookup(k)
        self.name = "draft model" if draft is not None else "prompt lookup"
        self.log = log
        self.last = (0, 0, 0)
        self.total = [0, 0, 0]
        self._said = False

    # -- rows (BatchEngine's hooks) ---------------------------------------------
    def added(self, engine, requests) -> None:
        """After `engine.add_many(requests)`: the draft model prefills the drafting rows' prompts."""
        if self.draft is None or not self.active(engine):
            return
        rows = {r.rid: r for r in engine.rows}
        items = [(rid, ids) for rid, ids, *_ in requests if rid in rows and self._drafts(engine, rows[rid])]
        if items:
            self.draft.add(items)

    def removed(self, rid) -> None:
        if self.draft is not None:
            self.draft.remove(rid)

    def active(self, engine) -> bool:
        """Whether `engine`'s steps are ours: every layer a KV row cache, float or --kv-bits
        (rolled back by position alone); else it steps without drafts (said once)."""
        from .batch import QuantizedRowCache, RowCache
        from .cache import SharedKVCache

        ok = bool(engine.static) and all(type(v) in (RowCache, QuantizedRowCache, SharedKVCache)
                                         for v in engine.views)
        if not ok and not self._said:
            self._said = True
            if self.log is not None:
                self.log(f"drafts ({self.name}) are off: this model's caches are not all attention KV "
                         "(its steps run without drafts)")
        return ok

    @staticmethod
    def _drafts(engine, r) -> bool:
        return r.drafts and r.grammar is None and r.rid not in engine.want and _draftable(r.sampler.params)

    # -- the step ---------------------------------------------------------------
    def step(self, engine) -> dict:
        """One verify forward for every row: {rid: [ids]} (read from the device)."""
        rows = engine.rows
        K = self.k
        ks = []
        for r in rows:
            left = K + 1 if r.budget is None else r.budget - len(r.generated)
            ks.append(max(0, min(K, left - 1)) if self._drafts(engine, r) else 0)
        n = len(rows)
        qs = [None] * n
        if self.draft is not None:
            for r in rows:  # a row that stopped drafting (it wants logprobs now) leaves the draft's batch
                if not self._drafts(engine, r):
                    self.draft.remove(r.rid)
            ks = [k if r.rid in self.draft.engine else 0 for k, r in zip(ks, rows)]
            drafted = np.zeros((n, K), np.int32)
            D = mx.array(drafted)
            if self.draft.rids():  # every draft row drafts every step, so each stays two ids behind at most
                at = {r.rid: b for b, r in enumerate(rows)}
                order = [at[rid] for rid in self.draft.rids()]
                d, q = self.draft.draft([rows[b] for b in order])
                idx = np.full(n, len(order), np.int32)  # rows without a draft row take the zero row
                idx[order] = np.arange(len(order))
                D = mx.concatenate([d, mx.zeros((1, K), mx.int32)])[mx.array(idx)]
                for j, b in enumerate(order):
                    qs[b] = q[j]
        else:
            drafted = np.zeros((n, K), np.int32)
            for b, (r, k) in enumerate(zip(rows, ks)):
                got = self.lookup.lookup(r.context)[:k] if k else []
                ks[b] = len(got)
                drafted[b, : len(got)] = got
            D = mx.array(drafted)
        L = K + 1 if any(ks) else 1
        first = mx.array([r.token for r in rows], mx.int32).reshape(n, 1)
        tokens = mx.concatenate([first, D], axis=1) if L > 1 else first
        logits = engine.feed(tokens, [r.pos for r in rows])  # [n, L, V]
        out = self._accept(engine, rows, logits, D, qs, ks)
        engine._sync_pos()
        return out

    def _accept(self, engine, rows, logits, D, qs, ks) -> dict:
        n, K = len(rows), self.k
        greedy = mx.argmax(logits.astype(mx.float32), axis=-1).astype(mx.int32)  # [n, L]: plain greedy rows
        lazy, masks, extras = [], [None] * n, {}
        for b, (r, k) in enumerate(zip(rows, ks)):
            params = r.sampler.params
            if k == 0:  # one id, as a plain step draws it
                x = logits[b, 0]
                if r.grammar is not None:
                    masks[b] = mx.array(r.grammar.mask())
                tok = greedy[b, 0] if params.greedy and params.plain and masks[b] is None else \
                    r.sampler.sample(x, r.context, mask=masks[b])
                extras.update(engine._extras_of([r], [x], [tok], [None], [masks[b]]))
                lazy.append(tok.reshape(1))
            elif params.greedy:
                g = greedy[b, : k + 1] if params.plain else \
                    mx.argmax(process_logits(logits[b, : k + 1], r.context, params), axis=-1).astype(mx.int32)
                lazy.append(g)
            else:
                p = process_logits(logits[b, : k + 1], r.context, params)
                q = None if qs[b] is None else qs[b][:k]
                a, bonus = speculative_accept(p, D[b, :k], q, r.sampler.next_key())
                lazy.append(mx.stack([a, bonus]))
        mx.eval(lazy, D, extras)
        got = [np.array(x).tolist() for x in lazy]
        drafts = np.array(D).tolist()
        out, counts = {}, [0, 0, 0]
        for b, (r, k, g) in enumerate(zip(rows, ks, got)):
            if k == 0:
                ids = g
            elif r.sampler.params.greedy:
                a = 0
                while a < k and drafts[b][a] == g[a]:
                    a += 1
                ids = drafts[b][:a] + [g[a]]
            else:
                a, bonus = g
                ids = drafts[b][:a] + [bonus]
            if k:
                counts[0] += 1
                counts[1] += k
                counts[2] += len(ids) - 1
            r.context.extend(ids)
            r.generated.extend(ids)
            r.token = ids[-1]
            r.pos += len(ids)
            r.launched += 1
            if r.grammar is not None:
                r.grammar.advance(ids[0])
            out[r.rid] = ids
        from .sampling import read_logprobs

        engine.extras = extras
        engine.logprobs = {rid: read_logprobs(lp) for rid, lp in extras.items()}
        self.last = tuple(counts)
        self.total = [t + c for t, c in zip(self.total, counts)]
        return out


def serve_drafts(k: int, draft_model: str | None = None, prompt_lookup: bool = False, dtype=None,
                 prefill_step: int | None = None, log=None) -> BatchDrafts | None:
    """serve's drafter on this rank (None: no drafts): the draft model loaded
    whole (every rank drafts alike), or prompt lookup."""
    if draft_model is None and not prompt_lookup:
        return None
    draft = None
    if draft_model is not None:
        from .loader import load_model

        draft = DraftRows(load_model(draft_model, dtype=dtype).model, k, prefill_step=prefill_step)
    return BatchDrafts(k, draft, log)
