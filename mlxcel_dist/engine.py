"""Running a loaded model: logits in every feeding mode, and generation.

The same functions run single-process and on every rank under TP (the model's
sharded layers do the collectives); only rank 0 reports.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from .errors import UserError


def check_tokens(ids, vocab_size: int) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.size == 0:
        raise UserError(f"tokens must be a non-empty 1-D array, got shape {list(ids.shape)}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise UserError(f"tokens must be integers, got {ids.dtype}")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise UserError(f"token id {int(bad[0])} is outside the vocabulary [0, {vocab_size})")
    return ids.astype(np.int32)


def vocab_size(model) -> int:
    return model.args.vocab_size


def sequence_logits(model, ids, decode_from: int | None = None, prefill_step: int | None = None) -> np.ndarray:
    """float32 [T, V] logits for every position of `ids`.

    Tokens [0, decode_from) (all of them by default) are fed as a prompt with a
    fresh cache, in one pass or in chunks of `prefill_step`; the rest go one at
    a time through the decode path.
    """
    ids = check_tokens(ids, vocab_size(model))
    T = len(ids)
    end = T if decode_from is None else decode_from
    if not 1 <= end <= T:
        raise UserError(f"--decode-from must be in [1, {T}] for {T} tokens, got {decode_from}")
    if prefill_step is not None and prefill_step < 1:
        raise UserError(f"--prefill-step must be >= 1, got {prefill_step}")
    step = prefill_step or end
    cache = model.make_cache()
    out = []
    pos = 0
    while pos < T:
        n = min(step, end - pos) if pos < end else 1
        logits = model(mx.array(ids[pos : pos + n])[None], cache)
        out.append(np.array(logits[0].astype(mx.float32)))
        pos += n
    return np.concatenate(out, axis=0)


@dataclass
class GenStats:
    prompt_tokens: int = 0
    generated: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    tokens: list = field(default_factory=list)

    @property
    def prefill_tok_s(self):
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self):
        return (self.generated - 1) / self.decode_s if self.decode_s and self.generated > 1 else 0.0


def sample(logits: mx.array, temp: float) -> mx.array:
    if temp == 0:
        return mx.argmax(logits, axis=-1)
    return mx.random.categorical(logits * (1.0 / temp))


def generate_tokens(model, prompt_ids, max_tokens: int, temp: float = 0.0, seed: int = 0,
                    eos_ids=(), prefill_step: int | None = None):
    """Yield generated token ids one by one; returns GenStats via StopIteration.value.

    Every rank runs this with the same seed, so all ranks sample the same token.
    """
    prompt = check_tokens(prompt_ids, vocab_size(model))
    if max_tokens < 0:
        raise UserError(f"--max-tokens must be >= 0, got {max_tokens}")
    if temp < 0:
        raise UserError(f"--temp must be >= 0, got {temp}")
    mx.random.seed(seed)
    stats = GenStats(prompt_tokens=len(prompt))
    if max_tokens == 0:
        return stats
    cache = model.make_cache()
    t0 = time.perf_counter()
    step = prefill_step or len(prompt)
    for i in range(0, len(prompt), step):
        logits = model(mx.array(prompt[i : i + step])[None], cache)
    tok = sample(logits[0, -1], temp)
    tok_id = int(tok.item())
    t1 = time.perf_counter()
    stats.prefill_s = t1 - t0
    eos = set(eos_ids)
    while True:
        stats.generated += 1
        stats.tokens.append(tok_id)
        yield tok_id
        if tok_id in eos or stats.generated >= max_tokens:
            break
        logits = model(mx.array([[tok_id]]), cache)
        tok_id = int(sample(logits[0, -1], temp).item())
    stats.decode_s = time.perf_counter() - t1
    return stats
