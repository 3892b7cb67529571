"""Scripted drafts for the speculative-decoding tests (test_spec.py and the
launched helpers/spec_cases.py): drafts copied from a known greedy
continuation, with one draft per round made wrong at a rotating index, so
that rounds accept 0, 1, .., K drafts in turn and the accepted count is known
in advance."""

from __future__ import annotations

import numpy as np


class ScriptedDrafts:
    """Prompt lookup's seam of batch_spec.BatchDrafts (`lookup(context)`)
    proposing `want` (the plain greedy ids after the prompt, at least K + 1
    more than are generated), round r with draft r % (K + 1) off by one
    (none when that is K); `expected` sums the drafts a correct verifier
    accepts. A round is a point of the generation (ids generated so far):
    asked again there (BatchDrafts looks ahead for a hit before its round),
    it proposes the same drafts."""

    def __init__(self, want, prompt_len: int, k: int, vocab: int):
        self.want, self.prompt_len, self.k, self.vocab = list(want), prompt_len, k, vocab
        self.bad: dict = {}  # ids generated -> the index made wrong in that round

    @property
    def rounds(self) -> int:
        return len(self.bad)

    @property
    def expected(self) -> int:
        return sum(self.bad.values())

    def lookup(self, context) -> list:
        g = len(context) - self.prompt_len  # ids generated so far
        drafts = self.want[g : g + self.k]
        assert len(drafts) == self.k, "want must reach K past the generation"
        bad = self.bad.setdefault(g, len(self.bad) % (self.k + 1))
        if bad < self.k:
            drafts[bad] = (drafts[bad] + 1) % self.vocab
        return drafts


def misled(draft_model, k: int, compiled: bool = True):
    """BatchDrafts over a draft model whose round r draft r % (K + 1) is
    turned wrong after it was drawn (its rows hold the right one): with the
    target's twin as the draft, every other draft is right exactly when the
    rollback is; `.rounds` / `.expected` as ScriptedDrafts'."""
    import mlx.core as mx

    from mlxcel_dist.engine.batch_spec import BatchDrafts, DraftRows

    class Misled(DraftRows):
        rounds = expected = 0

        def draft(self, rows, k):
            d, q = super().draft(rows, k)
            bad = self.rounds % (k + 1)
            self.rounds += 1
            self.expected += bad
            return mx.where(mx.arange(k) == bad, (d + 1) % draft_model.args.vocab_size, d), q

    return BatchDrafts(k, Misled(draft_model, k, compiled), adaptive=False)


def plain_ids(model, prompt, n: int, group=None, compiled: bool = True) -> list:
    from mlxcel_dist.parallel.collectives import SINGLE
    from mlxcel_dist.engine.generation import Generation

    gen = Generation(model, np.asarray(prompt), n, group=group or SINGLE, compiled=compiled)
    out = list(gen)
    gen.finish()
    return out


def spec_ids(model, prompt, n: int, drafts, group=None, compiled: bool = True, sampling=None):
    """(ids, GenStats) of a generation with drafts: a batch_spec.BatchDrafts,
    or a lookup seam (ScriptedDrafts) in one. It may run K + 1 past n (so no
    round is cut short by the end) and is read up to n ids."""
    from mlxcel_dist.engine.batch_spec import BatchDrafts
    from mlxcel_dist.parallel.collectives import SINGLE
    from mlxcel_dist.engine.generation import Generation

    # scripted drafts count on K a round: fixed K (not adaptive)
    spec = drafts if isinstance(drafts, BatchDrafts) else BatchDrafts(drafts.k, adaptive=False, lookup=drafts)
    gen = Generation(model, np.asarray(prompt), n + spec.k + 1, sampling, (), None, group or SINGLE, 1, compiled,
                     spec=spec)
    out = []
    for t in gen:
        out.append(t)
        if len(out) == n:
            break
    return out, gen.finish()
