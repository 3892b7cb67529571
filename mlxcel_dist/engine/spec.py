"""Speculative decoding's shared pieces: the checks of the draft options
(`check_drafting`, `check_pair`, `check_draft`, `check_target`), prompt
lookup's n-gram drafter (`PromptLookup`) and the sampled acceptance rule
(`speculative_accept`). The rounds themselves are the batch engine's
(batch_spec.py): generate, bench and serve draft through the same step.

A round, with t the last generated id (not fed to the target yet) at
position n - 1:

    drafter:  d1 .. dK           (a small model's steps, or an n-gram match
                                  in the prompt + output: `PromptLookup`)
    target:   block [t, d1 .. dK] at positions n - 1 .. n - 1 + K
              -> logits rows 0 .. K (row i: the distribution after d_i)
    accept:   greedy: the longest prefix with d_i == argmax(row i - 1), then
              the argmax of the first row not matched (the bonus token);
              sampled: `speculative_accept` (Leviathan et al. / Chen et al.:
              accept d_i with probability min(1, p_i(d_i) / q_i(d_i)), on the
              first rejection draw from norm(max(p - q, 0)), all accepted:
              draw from the last row), which keeps the target's distribution
    rollback: the row's position moves on by what it accepted; its rings
              hold window + K slots and masks go by slot positions, so
              nothing a later query sees was overwritten (a target whose
              layers hold a recurrent or conv state takes no drafts:
              `check_target`).

So every round yields a + 1 tokens (1 .. K + 1) for one target forward, and
under tensor parallelism pays the target's collectives once for all of them.
Every rank drafts alike (the draft model is loaded whole, unsharded, on every
rank; prompt lookup is host arithmetic on the agreed ids), so the ranks need
no message to agree on the drafts; the target's logits are bit-identical on
every rank, so every rank accepts the same tokens (the rank-agreement guard
checks the ids once per round).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..errors import UserError


MAX_DRAFT_TOKENS = 64  # each sliding ring holds window + K slots a row: an unbounded K is a memory error


def check_drafting(num_draft_tokens: int) -> None:
    if not 1 <= num_draft_tokens <= MAX_DRAFT_TOKENS:
        raise UserError(f"--num-draft-tokens must be in [1, {MAX_DRAFT_TOKENS}], got {num_draft_tokens}")


def check_pair(target, draft) -> None:
    """A draft model must share the target's vocabulary and keep only KV
    caches (its rollback is a rewind of static buffers)."""
    tv, dv = target.args.vocab_size, draft.args.vocab_size
    if tv != dv:
        raise UserError(f"the draft model's vocabulary ({dv} ids) differs from the target's ({tv}): "
                        "a draft model must use the target's tokenizer")
    check_draft(draft)


def check_draft(draft) -> None:
    if draft.own_loop or not all(c.static_kv for c in draft.make_cache()):
        raise UserError(f"a {draft.args.model_type} model cannot be a draft model (its recurrent or conv state "
                        "cannot be rolled back cheaply); pick a draft whose layers are all attention")


def check_target(model, sampling) -> None:
    """What speculative decoding refuses in the target or the sampling settings."""
    if model.own_loop:
        raise UserError(f"{model.args.model_type} runs its own generation loop: it takes no drafts")
    kinds = {c.static_form if c is not None else None for c in model.make_cache() or [None]}
    if not kinds <= {"kv", "shared"}:
        raise UserError(f"drafts (--draft-model, --prompt-lookup) need a target whose layers all hold attention "
                        f"keys/values (rolled back by position): {model.args.model_type}'s recurrent or conv state "
                        "would need a replay per rejected draft")
    if sampling is not None and not (sampling.repetition_penalty == 1.0 and not sampling.presence_penalty
                                     and not sampling.frequency_penalty):
        raise UserError("drafts (--draft-model, --prompt-lookup) do not take --repetition-penalty or presence / "
                        "frequency penalties (the penalised distribution changes within a draft block)")


# Drafters ---------------------------------------------------------------------
#
# `start(prompt)` once per generation; `propose(context, sampler)` returns
# (drafts, q): drafts a lazy int32 [k] (k <= K, 0 allowed), q the processed
# draft logits [k, V] they were drawn from, or None for a deterministic
# draft (q one-hot); `accepted(valid)` after the round: the first `valid`
# ids of the context are final.


class PromptLookup:
    """Drafts copied from the prompt and output: the longest suffix n-gram
    (max_ngram .. min_ngram ids) that occurred before, its latest
    occurrence, and the (up to) K ids that followed it (transformers' prompt
    lookup decoding, vLLM's ngram proposer). Host work on the agreed ids."""

    name = "prompt lookup"

    def __init__(self, k: int, max_ngram: int = 3, min_ngram: int = 1):
        check_drafting(k)
        self.k, self.max_ngram, self.min_ngram = k, max_ngram, min_ngram

    def lookup(self, context) -> list:
        ctx = np.asarray(context, np.int64)
        T = len(ctx)
        for n in range(min(self.max_ngram, T - 1), self.min_ngram - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(ctx[: T - 1], n)  # starts 0 .. T - 1 - n
            hits = np.flatnonzero((windows == ctx[T - n :]).all(axis=1))
            if hits.size:
                i = int(hits[-1]) + n
                return ctx[i : i + self.k].tolist()
        return []


def speculative_accept(p_logits: mx.array, drafts: mx.array, q_logits: mx.array | None, key: mx.array):
    """Speculative sampling's rule, lazily: (a, bonus) int32 scalars, a the
    drafts accepted (0 .. k), bonus the token drawn after them.

    p_logits [k + 1, V]: the target's processed logits (row i: after draft
    i); drafts [k]; q_logits [k, V] the draft's processed logits they were
    drawn from (None: deterministic drafts, q one-hot). Draft i is accepted
    with probability min(1, p_i(d) / q_i(d)); at the first rejection the
    bonus is drawn from max(p - q, 0) renormalised, after k acceptances from
    p_k. The emitted tokens then follow the target's distribution exactly."""
    k = drafts.shape[0]
    V = p_logits.shape[-1]
    p = mx.softmax(p_logits.astype(mx.float32), axis=-1)  # [k + 1, V]
    if q_logits is None:
        q = (mx.arange(V)[None] == drafts[:, None]).astype(mx.float32)  # [k, V] one-hot
    else:
        q = mx.softmax(q_logits.astype(mx.float32), axis=-1)
    k_u, k_b = mx.random.split(key)
    if k:
        pd = mx.take_along_axis(p[:k], drafts[:, None], axis=-1)[:, 0]
        qd = mx.take_along_axis(q, drafts[:, None], axis=-1)[:, 0]
        ok = (mx.random.uniform(shape=(k,), key=k_u) * qd < pd).astype(mx.int32)
        a = mx.sum(mx.cumprod(ok))
    else:
        a = mx.array(0, mx.int32)
    q_full = mx.concatenate([q, mx.zeros((1, V), mx.float32)])  # row k: nothing drafted there
    pa, qa = mx.take(p, a, axis=0), mx.take(q_full, a, axis=0)
    res = mx.maximum(pa - qa, 0)
    res = mx.where(mx.sum(res) > 0, res, pa)  # p == q at that row: p itself
    bonus = mx.random.categorical(mx.log(res), key=k_b)
    return a.astype(mx.int32), bonus.astype(mx.int32)


# The generator ------------------------------------------------------------------
