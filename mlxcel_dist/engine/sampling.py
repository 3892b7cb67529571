"""Choosing the next token: repetition penalty, temperature, top-k, top-p,
min-p, seeded categorical sampling; greedy at temperature 0.

Order (transformers' `generate` order, and why)::

    grammar mask -> logit bias -> repetition penalty -> presence / frequency penalties -> (temp == 0: argmax)
        -> temperature -> top-k -> top-p -> min-p -> sample

Each step has exactly the semantics of the transformers LogitsProcessor of the
same name (`RepetitionPenaltyLogitsProcessor`, `TemperatureLogitsWarper`,
`TopKLogitsWarper`, `TopPLogitsWarper`, `MinPLogitsWarper`, with
`min_tokens_to_keep=1`), on float32 logits, removed tokens set to -inf:

- grammar mask (constrained decoding, mlxcel_dist.engine.grammar): the tokens the
  row's grammar does not allow next get -inf before anything else, as vLLM
  applies its structured-output bitmask to the logits before its sampler;
- repetition penalty: every distinct token id in the context (prompt +
  generated so far; with `repetition_context_size` N only the last N ids, as
  mlx-lm's `repetition_context_size`) gets `l * p` if `l < 0` else `l / p`;
- logit bias (OpenAI's `logit_bias`): `l + bias[id]` for the ids it names;
- presence / frequency penalties (OpenAI's, as vLLM applies them, over the
  generated ids only, not the prompt): `l - frequency x count(id) -
  presence x (count(id) > 0)`;
- temperature: `l / temp`;
- top-k: drop tokens whose logit is below the k-th largest (ties kept);
- top-p: sort ascending, drop tokens whose cumulative probability (of the
  distribution left by the steps before) is <= 1 - top_p; the top token stays;
- min-p: drop tokens whose probability is below min_p x the top probability.

Why this order: it is the order of the reference the project is tested
against, and the one `generation_config.json` sampling values are tuned for;
applying min-p after temperature is also llama.cpp's choice. mlx-lm agrees on
greedy decoding, on the repetition-penalty formula, on top-k alone, and on
top-p or min-p alone at temperature 1; it differs elsewhere (it filters the
untempered distribution in the order top-p -> min-p -> top-k and applies
temperature last), so where the two disagree we follow transformers. With
sampling off (temp 0) only the repetition penalty applies, then argmax, as
transformers' greedy search (the filters never remove the argmax anyway).

Randomness comes from an explicit key chain, never MLX's global random state:
`key = mx.random.key(seed)`, and each sampled token splits it once. So the
sequence of draws depends only on the seed and on how many tokens were drawn.

Rank agreement (the invariant tensor parallelism relies on): every rank runs
this same deterministic sampler, with the same parameters and seed, on the
same logits — after a TP forward's final all_sum every rank holds the same
hidden state, computes the replicated norm and its vocabulary slice of the
head on it, and one all_gather gives every rank the same slices, so the
logits are bit-identical on every rank of one machine type. Hence every rank
draws the same token, feeds the same token to its next forward, and makes the
same stop decision (EOS, stop strings, length), without any communication.
Nothing here may depend on the rank. `engine.RankAgreement` checks the
invariant at run time (see there).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..errors import UserError

SEED_LIMIT = 2**64


@dataclass(frozen=True)
class SamplingParams:
    temp: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    repetition_context_size: int = 0  # 0 = the whole context (prompt + generated)
    seed: int = 0
    presence_penalty: float = 0.0  # OpenAI's, over the generated ids; 0 = off
    frequency_penalty: float = 0.0  # OpenAI's, over the generated ids; 0 = off
    logit_bias: tuple = ()  # ((token id, bias), ...) sorted by id, OpenAI's logit_bias

    def validate(self) -> "SamplingParams":
        """Raise UserError (named after the CLI option) on a value no reference accepts."""
        def bad(opt, want, got):
            raise UserError(f"{opt} must be {want}, got {got}")

        if not math.isfinite(self.temp) or self.temp < 0:
            bad("--temp", ">= 0 (0 = greedy)", self.temp)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            bad("--top-k", "an integer >= 0 (0 = off)", self.top_k)
        if not (0.0 < self.top_p <= 1.0):
            bad("--top-p", "in (0, 1] (1 = off)", self.top_p)
        if not (0.0 <= self.min_p <= 1.0):
            bad("--min-p", "in [0, 1] (0 = off)", self.min_p)
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("--repetition-penalty", "> 0 (1 = off)", self.repetition_penalty)
        if self.repetition_context_size < 0:
            bad("--repetition-context-size", ">= 0 (0 = the whole context)", self.repetition_context_size)
        if not 0 <= self.seed < SEED_LIMIT:
            bad("--seed", "in [0, 2^64)", self.seed)
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -2.0 <= v <= 2.0):
                bad(name, "in [-2, 2] (0 = off)", v)
        for tid, bias in self.logit_bias:
            if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
                bad("logit_bias", "keyed by token ids >= 0", tid)
            if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                bad("logit_bias", "values in [-100, 100]", bias)
        return self

    @property
    def plain(self) -> bool:
        """Nothing changes the model's logits before the draw."""
        return self.repetition_penalty == 1.0 and not (self.presence_penalty or self.frequency_penalty
                                                        or self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    def describe(self) -> str:
        if self.greedy:
            parts = ["greedy"]
        else:
            parts = [f"temp {self.temp:g}"]
            if self.top_k:
                parts.append(f"top-k {self.top_k}")
            if self.top_p < 1:
                parts.append(f"top-p {self.top_p:g}")
            if self.min_p > 0:
                parts.append(f"min-p {self.min_p:g}")
            parts.append(f"seed {self.seed}")
        if self.repetition_penalty != 1:
            ctx = self.repetition_context_size or "all"
            parts.append(f"repetition penalty {self.repetition_penalty:g} (context {ctx})")
        if self.presence_penalty:
            parts.append(f"presence penalty {self.presence_penalty:g}")
        if self.frequency_penalty:
            parts.append(f"frequency penalty {self.frequency_penalty:g}")
        if self.logit_bias:
            parts.append(f"logit bias on {len(self.logit_bias)} token(s)")
        return ", ".join(parts)


NEG_INF = float("-inf")


def apply_repetition_penalty(logits: mx.array, context, penalty: float, context_size: int = 0,
                             pending: mx.array | None = None) -> mx.array:
    """transformers' RepetitionPenaltyLogitsProcessor over the distinct ids of
    `context` (its last `context_size` ids when > 0).

    `pending`: one more id at the end of the context that the host has not
    read yet (a lazy scalar; the decode loop samples step n+1 before it reads
    token n). It joins the penalised set on the device, so the result is the
    same as with that id appended to `context`."""
    if penalty == 1.0 or (len(context) == 0 and pending is None):
        return logits
    ids = np.asarray(context, dtype=np.int64)
    if context_size > 0:
        keep = context_size - (pending is not None)  # the pending id takes one slot of the window
        ids = ids[max(0, len(ids) - keep):] if keep > 0 else ids[:0]
    mask = np.zeros(logits.shape[-1], dtype=bool)
    mask[ids] = True
    seen = mx.array(mask)
    if pending is not None:
        seen = mx.logical_or(seen, mx.arange(logits.shape[-1]) == pending.astype(mx.int32))
    penalized = mx.where(logits < 0, logits * penalty, logits / penalty)
    return mx.where(seen, penalized, logits)


@functools.lru_cache(maxsize=64)
def _bias_vector(logit_bias: tuple, V: int) -> mx.array:
    b = np.zeros(V, np.float32)
    for tid, bias in logit_bias:
        if tid < V:  # ids past the vocabulary are refused where requests are parsed
            b[tid] += np.float32(bias)
    return mx.array(b)


def apply_logit_bias(logits: mx.array, logit_bias: tuple) -> mx.array:
    """OpenAI's logit_bias: `bias` added to the logit of each id it names."""
    return logits + _bias_vector(logit_bias, logits.shape[-1]) if logit_bias else logits


def apply_presence_frequency(logits: mx.array, generated, presence: float, frequency: float,
                             pending: mx.array | None = None) -> mx.array:
    """OpenAI's penalties over the generated ids (vLLM's definitions):
    `l - frequency x count - presence x (count > 0)`. `pending`: one more
    generated id not read yet (see apply_repetition_penalty)."""
    if not (presence or frequency) or (len(generated) == 0 and pending is None):
        return logits
    V = logits.shape[-1]
    counts = mx.array(np.bincount(np.asarray(generated, np.int64), minlength=V)[:V].astype(np.float32))
    if pending is not None:
        counts = counts + (mx.arange(V) == pending.astype(mx.int32)).astype(mx.float32)
    return logits - frequency * counts - presence * (counts > 0).astype(mx.float32)


def live_words(bits: np.ndarray) -> np.ndarray:
    """Grammars' bitmasks [k, words] up to the last word any row allows a token
    in, their count rounded up to a power of two (few shapes): the same mask to
    `allowed_from_bits`, which reads missing words as disallowed. Handing masks
    to MLX costs host time by their bytes (MLX CUDA's managed memory: about
    1 ms a step for 31 rows of 262k tokens on an H200's host)."""
    live = np.flatnonzero(bits.any(axis=0))
    need = int(live[-1]) + 1 if live.size else 1
    words = min(bits.shape[-1], 1 << (need - 1).bit_length())
    return np.ascontiguousarray(bits[:, :words]) if words < bits.shape[-1] else bits


def packed_masks(bits: np.ndarray) -> tuple:
    """A batch's grammar masks [k, words] for the upload: (the distinct rows of
    `live_words(bits)` [u, w], each row's index among them [k] int32, or None
    when all k differ). Rows in the same grammar state share a mask (5 distinct
    among 32 json_schema rows, median), and the upload is paid by its bytes;
    `device_masks` rebuilds the batch's [k, w] on the device."""
    bits = live_words(bits)
    first, index = {}, []
    for row in bits:
        index.append(first.setdefault(row.tobytes(), len(first)))
    if len(first) == len(bits):
        return bits, None
    keep = np.unique(np.asarray(index), return_index=True)[1]  # each distinct mask's first row
    return np.ascontiguousarray(bits[keep]), np.asarray(index, np.int32)


def device_masks(packed: tuple) -> mx.array:
    """`packed_masks`' rows handed to MLX and gathered back to one row a mask: [k, w]."""
    rows, index = packed
    return mx.array(rows) if index is None else mx.take(mx.array(rows), mx.array(index), axis=0)


@functools.lru_cache(maxsize=16)  # (live_words' widths: powers of two, and the whole)
def _bit_index(V: int, words: int) -> tuple:
    ids = np.arange(V)
    return mx.array(np.minimum(ids // 32, words - 1).astype(np.int32)), mx.array((ids % 32).astype(np.uint32)), \
        mx.array(ids < 32 * words)


def allowed_from_bits(bits: mx.array, V: int) -> mx.array:
    """bool [..., V] from grammars' int32 bitmasks [..., words] (bit t % 32 of word
    t // 32 = token t allowed; tokens past the words are not), unpacked on the device."""
    return _unpacked(bits, *_bit_index(V, bits.shape[-1]))


def _unpacked(bits: mx.array, word: mx.array, shift: mx.array, inside: mx.array) -> mx.array:
    on = (mx.take(bits.view(mx.uint32), word, axis=-1) >> shift) & 1  # [..., V]
    return mx.logical_and(on.astype(mx.bool_), inside)


@mx.compile  # (traced once per shape of rows and words: a server's are few)
def _masked_argmax(x: mx.array, bits: mx.array, word: mx.array, shift: mx.array, inside: mx.array) -> mx.array:
    allowed = _unpacked(bits, word, shift, inside)
    return mx.argmax(mx.where(allowed, x.astype(mx.float32), NEG_INF), axis=-1).astype(mx.int32)


def masked_argmax(x: mx.array, bits: mx.array) -> mx.array:
    """Each row's argmax over the ids its grammar allows: int32 [n] from logits [n, V]
    and bitmasks [n, words] (read as `allowed_from_bits` reads them). Compiled: its
    elementwise part one kernel, as MLX CUDA's host time goes by the op (issue 42)."""
    return _masked_argmax(x, bits, *_bit_index(x.shape[-1], bits.shape[-1]))


def apply_mask(logits: mx.array, mask: mx.array | None) -> mx.array:
    """-inf where `mask` (bool [V], or a grammar's int32 bitmask) disallows."""
    if mask is None:
        return logits
    if mask.dtype != mx.bool_:
        mask = allowed_from_bits(mask, logits.shape[-1])
    return mx.where(mask, logits, NEG_INF)


def penalized(logits: mx.array, context, params: "SamplingParams", pending: mx.array | None = None,
              prompt_len: int = 0, mask: mx.array | None = None) -> mx.array:
    """float32 logits after the grammar mask, the logit bias and the
    penalties: what greedy takes the argmax of, temperature scales and
    logprobs report. `context`: prompt + generated ids, its first
    `prompt_len` the prompt."""
    x = apply_mask(logits.astype(mx.float32), mask)
    x = apply_logit_bias(x, params.logit_bias)
    x = apply_repetition_penalty(x, context, params.repetition_penalty, params.repetition_context_size, pending)
    return apply_presence_frequency(x, context[prompt_len:], params.presence_penalty, params.frequency_penalty,
                                    pending)


def apply_top_k(logits: mx.array, k: int) -> mx.array:
    """transformers' TopKLogitsWarper: keep logits >= the k-th largest."""
    V = logits.shape[-1]
    if k <= 0 or k >= V:
        return logits
    kth = mx.min(mx.topk(logits, k, axis=-1), axis=-1, keepdims=True)
    return mx.where(logits < kth, NEG_INF, logits)


def apply_top_p(logits: mx.array, top_p: float) -> mx.array:
    """transformers' TopPLogitsWarper: ascending sort, drop cumulative
    probability <= 1 - top_p, always keep the top token."""
    if top_p >= 1.0:
        return logits
    order = mx.argsort(logits, axis=-1)
    sorted_logits = mx.take_along_axis(logits, order, axis=-1)
    cum = mx.cumsum(mx.softmax(sorted_logits, axis=-1), axis=-1)
    remove_sorted = cum <= (1 - top_p)
    last = mx.arange(logits.shape[-1]) == logits.shape[-1] - 1
    remove_sorted = mx.logical_and(remove_sorted, mx.logical_not(last))
    remove = mx.put_along_axis(mx.zeros(logits.shape, dtype=mx.bool_), order, remove_sorted, axis=-1)
    return mx.where(remove, NEG_INF, logits)


def apply_min_p(logits: mx.array, min_p: float) -> mx.array:
    """transformers' MinPLogitsWarper: drop probabilities < min_p x the top one."""
    if min_p <= 0.0:
        return logits
    probs = mx.softmax(logits, axis=-1)
    top = mx.max(probs, axis=-1, keepdims=True)
    return mx.where(probs < min_p * top, NEG_INF, logits)


def process_logits(logits: mx.array, context, params: SamplingParams, pending: mx.array | None = None,
                   prompt_len: int = 0, mask: mx.array | None = None) -> mx.array:
    """float32 logits of the distribution a token is drawn from (the warped
    scores of transformers' sampling), in the documented order. At temp 0 only
    the bias and penalties apply (greedy takes the argmax of this).
    `pending`: a not-yet-read last context id (see apply_repetition_penalty);
    `mask`: the grammar's (apply_mask)."""
    x = penalized(logits, context, params, pending, prompt_len, mask)
    if params.greedy:
        return x
    if params.temp != 1.0:
        x = x / params.temp
    x = apply_top_k(x, params.top_k)
    x = apply_top_p(x, params.top_p)
    x = apply_min_p(x, params.min_p)
    return x


class Sampler:
    """The deterministic sampler every rank runs (see the module docstring):
    `sampler(logits [V], context ids) -> token id`; `sample` is the same draw
    as a lazy int32 scalar (no host sync), for a decode loop that schedules
    the next step before it reads this one."""

    def __init__(self, params: SamplingParams, prompt_len: int = 0):
        self.params = params.validate()
        self.prompt_len = prompt_len  # the context's first ids: not generated (presence / frequency)
        self._key = mx.random.key(params.seed)
        self.draws = 0

    def next_key(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        self.draws += 1
        return sub

    def sample(self, logits: mx.array, context, pending: mx.array | None = None,
               mask: mx.array | None = None) -> mx.array:
        x = process_logits(logits, context, self.params, pending, self.prompt_len, mask)
        if self.params.greedy:
            tok = mx.argmax(x, axis=-1)
        else:
            tok = mx.random.categorical(x, axis=-1, key=self.next_key())
        return tok.astype(mx.int32)

    def __call__(self, logits: mx.array, context) -> int:
        return int(self.sample(logits, context).item())


def token_logprobs(logits: mx.array, context, params: SamplingParams, pending, tok: mx.array, k: int,
                   prompt_len: int = 0, mask: mx.array | None = None) -> tuple:
    """Lazy (logprob of the drawn id `tok` [1], top-k ids, their logprobs); k = 0: the first only.

    Which distribution: the log-softmax of the model's logits after the
    grammar mask, the logit bias and the penalties and before temperature,
    top-k, top-p and min-p, as mlx-lm's generate_step; with none it is the
    model's own, what OpenAI's API and vLLM (raw_logprobs) return. Under a
    grammar it is the constrained one (disallowed tokens -inf, the rest
    renormalised), as vLLM's, whose bitmask is applied to the logits its
    sampler computes logprobs from. Every rank computes the same values from
    bit-identical logits (no collective)."""
    x = penalized(logits.reshape(-1), context, params, pending, prompt_len, mask)
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    chosen = mx.take(lp, tok.reshape(1).astype(mx.int32))
    k = min(k, lp.shape[-1])
    if k == 0:
        return (chosen,)
    ids = mx.argpartition(-lp, kth=k - 1)[:k]
    return (chosen, ids, mx.take(lp, ids))


def read_logprobs(lp) -> tuple:
    """token_logprobs' arrays, read: (logprob, [(id, logprob), ...] most likely first;
    tokens a grammar disallows (-inf) are left out, so the list may be shorter than k)."""
    chosen = float(np.array(lp[0])[0])
    if len(lp) == 1:
        return chosen, []
    ids, vals = np.array(lp[1]), np.array(lp[2])
    order = np.argsort(-vals, kind="stable")
    return chosen, [(int(ids[i]), float(vals[i])) for i in order if vals[i] > NEG_INF]
