"""How each row's next ids are chosen: decided here once a step per row
(`Choice`), for the batch engine's plain steps (batch_step.py) and its
draft rounds (batch_spec.py) alike.

A row's Choice reads its sampler's parameters, its grammar and whether the
caller wants its logprobs (the engine's `want`):

- `greedy`: temperature 0 and nothing changes the logits before the argmax
  (no penalty, no logit_bias). Its id is the argmax of its float32 logits
  (after its grammar mask): what its Sampler draws, so such rows are drawn
  together by one argmax (`draw`; `fast`: greedy with no grammar);
- a grammar: its mask (sampling.apply_mask) first, from the row's last id
  read (a pipelined step defers such a draw until that id is read:
  batch_step.py);
- `logprobs` (k, or None): sampling.token_logprobs of the drawn id with the
  step (`logprobs`);
- `drafts`: whether a draft round verifies drafts for it: the request lets
  it, and no grammar (a mask a position), no logprobs (one id a step) and no
  penalty (they change within a block: spec.check_target).

Every other row is drawn by its Sampler (penalties, logit_bias, temperature,
top-k / top-p / min-p, its key chain). A draft round (`verify`, `accepted`)
takes a drafting row's target argmax at each position (greedy) or
spec.speculative_accept's (sampled); a row without drafts draws its one id
as a plain step does (`draw`: the same key chain, mask and logprobs).
Every rank makes the same choices from the same ids and parameters.
"""

from __future__ import annotations

import mlx.core as mx

from .sampling import masked_argmax, process_logits, token_logprobs
from .spec import speculative_accept


class Choice:
    """How row `row`'s next ids are drawn (see the module docstring)."""

    __slots__ = ("row", "greedy", "fast", "logprobs", "drafts")

    def __init__(self, row, want: dict):
        p = row.sampler.params
        self.row = row
        self.greedy = p.greedy and p.plain
        self.fast = self.greedy and row.grammar is None
        self.logprobs = want.get(row.rid)
        self.drafts = (row.drafts and row.grammar is None and self.logprobs is None
                       and p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty)


def choose(rows, want: dict) -> list[Choice]:
    return [Choice(r, want) for r in rows]


def argmax_ids(x: mx.array) -> mx.array:
    """int32 argmax over the last axis of float32 logits (a greedy row's id)."""
    return mx.argmax(x.astype(mx.float32), axis=-1).astype(mx.int32)


def draw(choices: list, xs: list, pending: list | None = None, masks=None, batch: mx.array | None = None) -> tuple:
    """(each row's lazy int32 id, those ids as one [n] array or None) from its
    logits xs[b] [V]; pending[b]: its last id not read yet (the context
    lacks it), masks[b]: its grammar's bitmask (None: none; `masks` a list or
    one [n, words] array). Greedy rows are drawn together by one argmax:
    every row unconstrained (over `batch`, the step's logits [>= n, V] as
    they are), or the constrained greedy ones (masked); the others by their
    Samplers."""
    n = len(choices)
    if masks is None and batch is not None and all(c.fast for c in choices):
        # every row greedy, no penalty: one argmax over the batch (the same ids as each
        # row's Sampler: argmax of the same float32 values), not ~5 small ops per row
        top = argmax_ids(batch[:n])
        return [top[b] for b in range(n)], top
    ids = [None] * n
    stacked = isinstance(masks, mx.array)  # one [n, words] array: every row has a mask (not sliced to ask)
    held = [b for b, c in enumerate(choices) if c.greedy and masks is not None and (stacked or masks[b] is not None)]
    if len(held) > 1:
        # constrained greedy rows: one masked argmax over them (every row one: the step's logits and
        # masks as they are)
        whole = len(held) == n and batch is not None and stacked
        x = batch[:n] if whole else mx.stack([xs[b] for b in held])
        bits = masks if stacked and len(held) == n else mx.stack([masks[b] for b in held])
        top = masked_argmax(x, bits)
        if whole:
            return [top[b] for b in range(n)], top
        for i, b in enumerate(held):
            ids[b] = top[i]
    for b, c in enumerate(choices):
        if ids[b] is None:
            r = c.row
            ids[b] = r.sampler.sample(xs[b], r.context, pending=None if pending is None else pending[b],
                                      mask=None if masks is None else masks[b])
    return ids, None


def logprobs(choices: list, xs: list, ids: list, pending: list | None = None, masks=None) -> dict:
    """Lazy {rid: sampling.token_logprobs} of the rows that want them, from each
    row's logits, its lazy id, its unread last id and its grammar mask (the
    constrained distribution); a row whose id is not drawn yet (None) has none."""
    n = len(choices)
    return {c.row.rid: token_logprobs(x, c.row.context, c.row.sampler.params,
                                      None if pending is None else pending[b], tok, c.logprobs,
                                      c.row.sampler.prompt_len, None if masks is None else masks[b])
            for b, (c, x, tok) in enumerate(zip(choices, xs[:n], ids)) if c.logprobs is not None and tok is not None}


def grammar_masks(choices: list) -> list | None:
    """The constrained rows' masks now, in line (each row's `Matcher.mask()`;
    None a row without a grammar; None: no row has one). A pipelined step's
    are computed ahead instead (batch_step: `Vocab.masks_ahead`)."""
    if all(c.row.grammar is None for c in choices):
        return None
    return [None if c.row.grammar is None else mx.array(c.row.grammar.mask()) for c in choices]


def verify(choices: list, logits: mx.array, drafts: mx.array, qs: list, ks: list) -> tuple[list, dict]:
    """A draft round's draws, lazily: per row [k + 1] (a greedy row's target
    argmax after each of its k drafts), [a, bonus] (a sampled row's
    spec.speculative_accept) or its one id [1] (k = 0, drawn as `draw`
    draws), and the logprobs of rows that want them. logits [n, L, V]: the
    target's over the block; drafts [n, m]; qs[b]: the draft logits a sampled
    row's drafts were drawn from (None: deterministic drafts)."""
    top = argmax_ids(logits)  # [n, L]: the plain greedy rows'
    one = [b for b, k in enumerate(ks) if k == 0]
    sub = [choices[b] for b in one]
    masks = grammar_masks(sub)  # (constrained rows take no drafts)
    xs = [logits[b, 0] for b in one]
    ids, _ = draw(sub, xs, masks=masks)
    extras = logprobs(sub, xs, ids, masks=masks)
    lazy = {b: t.reshape(1) for b, t in zip(one, ids)}
    for b, (c, k) in enumerate(zip(choices, ks)):
        if k == 0:
            continue
        r = c.row
        params = r.sampler.params
        if c.greedy:
            lazy[b] = top[b, : k + 1]
        elif params.greedy:
            lazy[b] = argmax_ids(process_logits(logits[b, : k + 1], r.context, params))
        else:
            p = process_logits(logits[b, : k + 1], r.context, params)
            a, bonus = speculative_accept(p, drafts[b, :k], None if qs[b] is None else qs[b][:k], r.sampler.next_key())
            lazy[b] = mx.stack([a, bonus])
    return [lazy[b] for b in range(len(choices))], extras


def accepted(choice: Choice, k: int, got: list, drafts: list) -> list:
    """A row's ids from `verify`'s draws as read (`got`) and its k drafts:
    greedy, the drafts up to the first that differs from the target's argmax
    and that argmax; sampled, the a accepted and the bonus."""
    if k == 0:
        return got
    if choice.row.sampler.params.greedy:
        a = 0
        while a < k and drafts[a] == got[a]:
            a += 1
        return drafts[:a] + [got[a]]
    a, bonus = got
    return drafts[:a] + [bonus]


def draft_ids(choices: list, x: mx.array, qs: list) -> mx.array:
    """Each drafting row's next draft from the draft model's logits x [m, V],
    as its sampler would draw (greedy: argmax; sampled: categorical with the
    row's next key, the processed logits kept in qs[b] for the accept rule)."""
    if all(c.greedy for c in choices):
        return argmax_ids(x)
    out = []
    for b, c in enumerate(choices):
        r = c.row
        q = process_logits(x[b], r.context, r.sampler.params)
        if r.sampler.params.greedy:
            out.append(mx.argmax(q, axis=-1).astype(mx.int32))
        else:
            qs[b].append(q)
            out.append(mx.random.categorical(q, key=r.sampler.next_key()).astype(mx.int32))
    return mx.stack(out)
