"""Scripted drafts for the speculative-decoding tests (test_spec.py and the
launched helpers/spec_cases.py): drafts copied from a known greedy
continuation, with one draft per round made wrong at a rotating index, so
that rounds accept 0, 1, .., K drafts in turn and the accepted count is known
in advance."""

from __future__ import annotations

import numpy as np


class ScriptedDrafts:
    """A drafter (spec.py's protocol) proposing `want` (the plain greedy
    ids after the prompt, at least K + 1 more than are generated), round r
    with draft r % (K + 1) off by one (none when that is K); `expected` sums
    the drafts a correct verifier accepts."""

    name = "scripted"

    def __init__(self, want, prompt_len: int, k: int, vocab: int):
        self.want, self.prompt_len, self.k, self.vocab = list(want), prompt_len, k, vocab
        self.rounds = self.expected = 0

    def start(self, prompt) -> None:
        self.rounds = self.expected = 0

    def propose(self, context, sampler):
        g = len(context) - self.prompt_len  # ids generated so far
        drafts = self.want[g : g + self.k]
        assert len(drafts) == self.k, "want must reach K past the generation"
        bad = self.rounds % (self.k + 1)
        if bad < self.k:
            drafts[bad] = (drafts[bad] + 1) % self.vocab
        self.rounds += 1
        self.expected += bad
        return drafts, None

    def accepted(self, valid: int) -> None:
        pass


def plain_ids(model, prompt, n: int, group=None, compiled: bool = True) -> list:
    from mlxcel_dist.collectives import SINGLE
    from mlxcel_dist.engine import TokenGenerator

    gen = TokenGenerator(model, np.asarray(prompt), n, group=group or SINGLE, compiled=compiled)
    out = list(gen)
    gen.finish()
    return out


def spec_ids(model, prompt, n: int, drafter, group=None, compiled: bool = True, sampling=None):
    """(ids, GenStats) of a speculative generation."""
    from mlxcel_dist.collectives import SINGLE
    from mlxcel_dist.spec import SpecGenerator

    gen = SpecGenerator(model, np.asarray(prompt), n, drafter, sampling, (), None, group or SINGLE, 1, compiled)
    out = list(gen)
    return out, gen.finish()
