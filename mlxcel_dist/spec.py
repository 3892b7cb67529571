"""Speculative decoding: K tokens drafted cheaply, verified by the target in
one forward of K + 1 positions.

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
    rollback: the target's static buffers forget the K - a rejected
              positions (`decode.DecodeStep.rewind`; its rings hold window + K
              slots and masks go by slot positions, so nothing a later query
              sees was overwritten); a cache that is not static (recurrent
              state, a conv over K/V) is snapshotted before the block and,
              on a rejection, restored and fed the accepted tokens again.

So every round yields a + 1 tokens (1 .. K + 1) for one target forward, and
under tensor parallelism pays the target's collectives once for all of them.
Every rank drafts alike (the draft model is loaded whole, unsharded, on every
rank; prompt lookup is host arithmetic on the agreed ids), so the ranks need
no message to agree on the drafts; the target's logits are bit-identical on
every rank, so every rank accepts the same tokens (the rank-agreement guard
checks the ids once per round).
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from .cache import LayerCache
from .decode import DecodeStep
from .engine import DEFAULT_PREFILL_STEP, TokenGenerator, _cache_state
from .errors import UserError
from .sampling import process_logits


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
    if callable(getattr(draft, "generate_ids", None)) or not all(c.static_kv for c in draft.make_cache()):
        raise UserError(f"a {draft.args.model_type} model cannot be a draft model (its recurrent or conv state "
                        "cannot be rolled back cheaply); pick a draft whose layers are all attention")


def check_target(model, sampling) -> None:
    """What speculative decoding refuses in the target or the sampling settings."""
    if callable(getattr(model, "generate_ids", None)):
        raise UserError(f"{model.args.model_type} runs its own generation loop: it takes no drafts")
    if getattr(getattr(model, "model", None), "stage", None) is not None:
        raise UserError("drafts (--draft-model, --prompt-lookup) are not available with --pp")
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

    def start(self, prompt) -> None:
        pass

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

    def propose(self, context, sampler):
        return self.lookup(context), None

    def accepted(self, valid: int) -> None:
        pass


class DraftModel:
    """A small model with the target's tokenizer drafting K tokens a round
    through its own compiled steps (a `DecodeStep` with margin K, so a
    rejected draft is a rewind). Kept between generations (its traces).

    `root_of`: a group whose rank 0 alone drafts and shares the drafts (and
    their logits, sampled) with one all_sum a round; the others then need no
    draft model (`model` None there). The alternative to every rank drafting
    alike (the default, no message), kept to measure the two
    (benchmarks/spec_tp_draft.py)."""

    name = "draft model"

    def __init__(self, model, k: int, compiled: bool = True, prefill_step: int | None = None, root_of=None,
                 vocab: int | None = None):
        check_drafting(k)
        self.group = root_of if root_of is not None and not root_of.single else None
        self.idle = self.group is not None and not self.group.is_root  # this rank only receives drafts
        if self.idle:
            self.k, self.vocab = k, vocab  # (the target's: the drafted logits' width)
            return
        check_draft(model)
        self.model, self.k, self.compiled = model, k, compiled
        self.prefill_step = prefill_step or DEFAULT_PREFILL_STEP
        self.step = DecodeStep(model)
        self.fed = 0  # context ids in the draft's cache

    def start(self, prompt) -> None:
        """Feed all prompt ids but the last (the first round feeds it with the target's first id)."""
        if self.idle:
            return
        cache = self.model.make_cache()
        end = max(len(prompt) - 1, 1)  # the static buffers need one token held
        for i in range(0, end, self.prefill_step):
            self.model(mx.array(prompt[i : min(i + self.prefill_step, end)])[None], cache)
            mx.eval(_cache_state(cache))
        self.step.start(cache, end, self.compiled, margin=self.k)
        self.fed = end

    def propose(self, context, sampler):
        if self.group is not None:
            return self._shared(context, sampler)
        return self._draft(context, sampler)

    def _shared(self, context, sampler):
        """Rank 0's drafts (and logits) on every rank: an all_sum of them with the others' zeros (exact)."""
        if self.idle:
            drafts, q = mx.zeros((self.k,), mx.int32), None
            if not sampler.params.greedy:  # the key chain advances alike on every rank
                q = mx.zeros((self.k, self.vocab), mx.float32)
                for _ in range(self.k):
                    sampler.next_key()
        else:
            drafts, q = self._draft(context, sampler)
        drafts = self.group.all_sum(drafts)
        return drafts, None if q is None else self.group.all_sum(q.astype(mx.float32))

    def _draft(self, context, sampler):
        feed = context[self.fed :]  # 1 id (t), or 2 after a round that accepted every draft
        y = mx.array(feed, mx.int32)[None]
        logits = self.step(y) if len(feed) == 1 else self.step.block(y)[-1]
        drafts, qs = [], []
        for i in range(self.k):
            q = process_logits(logits, context, sampler.params)
            d = (mx.argmax(q, axis=-1) if sampler.params.greedy
                 else mx.random.categorical(q, axis=-1, key=sampler.next_key())).astype(mx.int32)
            drafts.append(d)
            qs.append(q)
            if i < self.k - 1:
                logits = self.step(d.reshape(1, 1))
        self.fed = len(context) + self.k - 1
        return mx.stack(drafts), (None if sampler.params.greedy else mx.stack(qs))

    def accepted(self, valid: int) -> None:
        if not self.idle and self.fed > valid:
            self.step.rewind(self.fed - valid)
            self.fed = valid

    def release(self) -> None:
        if not self.idle:
            self.step.release()


# The accept rule ----------------------------------------------------------------


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


class _Snapshot:
    """An eager cache list's state, by reference: their arrays are replaced
    on a multi-token update (or written in place past the offset that a
    restore sets back), so the references stay what they were."""

    def __init__(self, cache):
        self.cache = cache
        self.saved = [self._take(c) for c in cache]

    @classmethod
    def _take(cls, c) -> dict:
        return {k: cls._take(v) if isinstance(v, LayerCache) else v for k, v in vars(c).items()}

    @classmethod
    def _put(cls, c, saved: dict) -> None:
        for k, v in saved.items():
            if isinstance(getattr(c, k, None), LayerCache):
                cls._put(getattr(c, k), v)
            else:
                setattr(c, k, v)

    def restore(self) -> None:
        for c, saved in zip(self.cache, self.saved):
            self._put(c, saved)


class SpecGenerator(TokenGenerator):
    """TokenGenerator's interface (iterate ids, then `finish()`), decoding
    in speculative rounds (the module docstring). `drafter`: a DraftModel or
    a PromptLookup; `stats` adds rounds, drafted and accepted."""

    def __init__(self, model, prompt_ids, max_tokens: int, drafter, sampling=None, eos_ids=(),
                 prefill_step: int | None = None, group=None, check_every: int = 1, compiled: bool = True):
        from .collectives import SINGLE

        check_target(model, sampling)
        super().__init__(model, prompt_ids, max_tokens, sampling, eos_ids, prefill_step, group or SINGLE,
                         check_every, compiled)
        self.drafter = drafter
        self.margin = drafter.k

    def _verify(self, context, drafts, q, static: bool):
        """One round's target forward and acceptance: (drafts list, a, bonus) read from the device."""
        t = context[-1]
        k = int(drafts.shape[0]) if isinstance(drafts, mx.array) else len(drafts)
        d = drafts if isinstance(drafts, mx.array) else mx.array(drafts, mx.int32)
        block = mx.concatenate([mx.array([t], mx.int32), d.reshape(-1)])[None] if k else mx.array([[t]], mx.int32)
        snap = None if static or not k else _Snapshot(self.decode.views)
        logits = self.decode.block(block)  # [k + 1, V]
        p = process_logits(logits, context, self.sampler.params)
        if self.sampler.params.greedy:
            g = mx.argmax(p, axis=-1).astype(mx.int32)
            got = np.array(mx.concatenate([d.reshape(-1), g]) if k else g)
            ds, g = got[:k].tolist(), got[k:].tolist()
            a = 0
            while a < k and ds[a] == g[a]:
                a += 1
            bonus = g[a]
        else:
            a, bonus = speculative_accept(p, d.reshape(-1), q, self.sampler.next_key())
            got = np.array(mx.concatenate([d.reshape(-1), a.reshape(1), bonus.reshape(1)]))
            ds, a, bonus = got[:k].tolist(), int(got[k]), int(got[k + 1])
        if a < k:  # forget the rejected positions
            if static:
                self.decode.rewind(k - a)
            else:
                snap.restore()
                self.decode.pos -= k + 1
                self.model(mx.array([t, *ds[:a]], mx.int32)[None], self.decode.views)
                self.decode.pos += a + 1
                mx.eval(_cache_state(self.decode.views))
        return ds, a, bonus

    def __iter__(self):
        stats = self.stats
        if self.max_tokens == 0:
            stats.finish_reason = "length"
            return
        context = self.prompt.tolist()
        cache = self.model.make_cache()
        t0 = time.perf_counter()
        logits = self._prefill(cache)
        if self._notice is not None:
            self._notice.cancel()
        if getattr(self.decode, "quantized", False):  # its buffers take one token a step
            raise UserError("drafts (--draft-model, --prompt-lookup) are not available with --kv-bits")
        tok = int(self.sampler.sample(logits, context).item())
        self._t_decode = time.perf_counter()
        stats.prefill_s = self._t_decode - t0
        stats.prefill_timed_tokens = len(self.prompt)
        self.drafter.start(self.prompt)
        static = self.decode.static
        out = [tok]
        while True:
            self.guard.add_many(out)
            for tok in out:
                stats.generated += 1
                stats.tokens.append(tok)
                context.append(tok)
                if tok in self.eos:
                    stats.finish_reason = "eos"
                    return
                yield tok
                if stats.generated >= self.max_tokens:
                    stats.finish_reason = "length"
                    return
            drafts, q = self.drafter.propose(context, self.sampler)
            ds, a, bonus = self._verify(context, drafts, q, static)
            self.drafter.accepted(len(context) + a)
            stats.rounds += 1
            stats.drafted += len(ds)
            stats.accepted += a
            out = ds[:a] + [bonus]

    def finish(self):
        release = getattr(self.drafter, "release", None)
        if release is not None:
            release()
        return super().finish()
