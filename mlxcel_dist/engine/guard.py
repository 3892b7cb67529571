"""What every generation shares: the options' ranges (checked before launch
too), the prompt checks, the rank-agreement guard and GenStats. The runs
themselves are generation.py's (one request as a row of the batch engine)
and serve's (many rows of it); sampling is sampling.py's, text tokenizer.py's.

The same functions run single-process and on every rank under TP (the model's
sharded layers do the collectives); only rank 0 reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..parallel.collectives import SINGLE, CollectiveError, Group
from ..errors import UserError


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


def check_context(prompt_tokens: int, max_tokens: int, limit: int | None) -> None:
    """Refuse a prompt plus completion longer than the model's context
    (`max_position_embeddings`; None: the config sets none)."""
    if limit is not None and prompt_tokens + max_tokens > limit:
        raise UserError(
            f"the prompt ({prompt_tokens} tokens) plus --max-tokens ({max_tokens}) is {prompt_tokens + max_tokens} "
            f"tokens, more than the model's context of {limit} (max_position_embeddings): shorten the prompt or "
            "lower --max-tokens"
        )


def check_generation_options(max_tokens: int | None = None, check_every: int | None = None,
                             prefill_step: int | None = None) -> None:
    """The generation options' ranges (None: not given). The CLI calls this
    before any rank is launched; the loop's classes call it for library
    callers."""
    if max_tokens is not None and max_tokens < 0:
        raise UserError(f"--max-tokens must be >= 0, got {max_tokens}")
    if check_every is not None and check_every < 0:
        raise UserError(f"--check-every must be >= 0 (0 = only at the end), got {check_every}")
    if prefill_step is not None and prefill_step < 1:
        raise UserError(f"--prefill-step must be >= 1, got {prefill_step}")


def vocab_size(model) -> int:
    return model.args.vocab_size


# Generation ---------------------------------------------------------------------
#
# Every rank runs the whole generation (generation.py): prefill, sample,
# agreement check, EOS, detokenise, stop strings. Only rank 0 prints what it yields. All ranks take
# every decision from the token ids alone, and the ids agree on every rank by
# the sampler's invariant (sampling.py), so they stop at the same token and
# issue the same collectives in the same order.


class RanksDiverged(CollectiveError):
    """Ranks sampled different tokens: the TP job cannot go on. Raised on
    every rank at once (they share the verdict), so only rank 0 reports it."""

    exit_code = 3


class RankAgreement:
    """Run-time guard of the sampler's invariant: all ranks generate the same ids.

    Each rank keeps a checksum of its generated ids (a polynomial hash mod
    2^31-1, so it is exact in int32), their count and the last id. `check()`
    gathers every rank's (count, checksum, last id) with one all_sum of a
    [size, 3] int32 matrix (row r from rank r, zeros elsewhere); every rank
    then holds all rows, reaches the same verdict, and on a mismatch raises
    RanksDiverged naming the ranks.
    At np 1 the same code runs with no collective (a no-op check).

    `every`: check after every N-th generated token, and always before the
    generation ends (`finish`). The default N=1 checks each token before it is
    printed or acted on; that is what keeps the guard sound: a divergent token
    can also make ranks disagree about *stopping* (one rank samples EOS, the
    other does not), and with N>1 such a rank would enter the final check while
    the others enter their next forward pass, a mismatched collective that the
    backend reports (or hangs on) instead of this guard. The cost at N=1 is one
    12-byte-per-rank all_sum per token, next to the model's two per layer.
    N=0 checks only at the end.
    """

    MOD = 2**31 - 1
    MUL = 1_000_003

    def __init__(self, group: Group = SINGLE, every: int = 1):
        check_generation_options(check_every=every)
        self.group = group
        self.every = every
        self.count = 0
        self.checksum = 0
        self.last = -1
        self.checked = 0  # count at the last check
        self.checks = 0
        # pending_rows' running (count, checksum) on the device, lazy int64 [2],
        # the ids it stands for and the count at its last scheduled check (None: not made yet)
        self._dev = None
        self._dev_at = self._due_at = 0
        self._consts = None  # (1, MUL, MOD, this rank's row mask [size, 1], zeros [size, 3]) as arrays

    def _record(self, tok_id: int) -> None:
        self.count += 1
        self.checksum = (self.checksum * self.MUL + int(tok_id) + 1) % self.MOD
        self.last = int(tok_id)

    def add(self, tok_id: int) -> None:
        self._record(tok_id)
        if self.every and self.count - self.checked >= self.every:
            self.check()

    def add_many(self, ids) -> None:
        """Record several ids read together (a speculative round's): one
        check for them when one is due among them."""
        for t in ids:
            self._record(t)
        if self.every and self.count - self.checked >= self.every:
            self.check()

    def check(self) -> None:
        self._verdict(self.group.gather_rows([self.count, self.checksum, self.last], dtype=np.int32))

    def _verdict(self, rows) -> None:
        rows = np.asarray(rows).astype(np.int64)
        self.checked = self.count
        self.checks += 1
        if (rows != rows[0]).any():
            per_rank = "; ".join(f"rank {r}: {c} ids, last id {t}, checksum {h}" for r, (c, h, t) in enumerate(rows))
            raise RanksDiverged(
                f"ranks diverged after {self.count} generated tokens ({per_rank}); every rank must draw the "
                "same token from bit-identical logits with the same seed (mixed host types or a "
                "non-deterministic backend break that)"
            )

    # The pipelined engine (batch.BatchEngine with a `guard`: generate's row)
    # schedules the check of a step's ids before the host has read them:
    # `pending_rows` builds the same gathered [size, 3] matrix on the device
    # from the lazy ids, and `commit` records the ids once read and judges the
    # matrix read with them. The device chain runs ahead of the host record by
    # the one step in flight.

    def pending_rows(self, ids: mx.array) -> mx.array | None:
        """The lazy all_sum of the check that a launched step's ids [n] (lazy
        int32, not read yet; every step's in launch order) make due: row r =
        rank r's (count, checksum, last id) after them. None when no check is
        due, with one rank (no collective: `commit` checks on the host, as
        `add`) or with N = 0.

        The count and checksum are carried on the device from step to step
        (a lazy int64 [2]), so no array is made from host data per token: on
        MLX's CUDA backend such an array cost about 4 ms per token at np 2 on
        two H200s (docs/benchmarks-log.md, "np 2 timeline")."""
        if self.group.single or not self.every:
            return None
        if self._consts is None:  # made once (Python scalars in ops would be arrays from host data too)
            n = self.group.size()
            mine = mx.arange(n) == mx.array(self.group.rank())
            self._consts = (mx.array(1, mx.int64), mx.array(self.MUL, mx.int64), mx.array(self.MOD, mx.int64),
                            mine[:, None], mx.zeros((n, 3), mx.int32))
        one, mul, mod, mine, zeros = self._consts
        if self._dev is None or self._dev_at < self.count:  # ids recorded by `add` since: from the host record
            self._dev = mx.array([self.count, self.checksum], mx.int64)
            self._dev_at = self._due_at = self.count
        ids = ids.reshape(-1).astype(mx.int64)
        for b in range(ids.shape[0]):
            # (checksum * MUL + tok + 1) % MOD: < 2^51 before the modulo, exact in int64
            t = ids[b : b + 1]
            self._dev = mx.concatenate([self._dev[:1] + one, (self._dev[1:] * mul + t + one) % mod])
        self._dev_at += ids.shape[0]
        if self._dev_at - self._due_at < self.every:
            return None
        self._due_at = self._dev_at
        row = mx.concatenate([self._dev, ids[-1:]]).astype(mx.int32)
        return self.group.all_sum(mx.where(mine, row[None], zeros))  # Group.gather_rows_lazy, from the cached parts

    def commit(self, ids, rows=None) -> None:
        """Record ids read from the device; `rows`: the `pending_rows` matrix
        read in the same sync (None: no check was scheduled for them; with one
        rank, as `add`)."""
        if self.group.single:
            return self.add_many(ids)
        for t in ids:
            self._record(t)
        if rows is not None:
            self._verdict(rows)

    def finish(self) -> None:
        if self.checked != self.count or self.checks == 0:
            self.check()


@dataclass
class GenStats:
    prompt_tokens: int = 0
    generated: int = 0
    prefill_s: float = 0.0  # the prompt until its first generated id, less compile_s
    compile_s: float = 0.0  # a first step that built a new decode graph (trace + kernel compile)
    prefill_timed_tokens: int = 0  # prompt tokens prefill_s covers (all, or all but the compiled step's)
    decode_s: float = 0.0
    tokens: list = field(default_factory=list)
    finish_reason: str = ""  # "eos" | "stop" | "length"
    stop: str | None = None  # the stop string that ended generation
    checks: int = 0  # rank-agreement checks run
    # speculative decoding (spec.py): target forwards of a draft block, tokens drafted / accepted in them
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    # with the logprobs option: (logprob, [(id, logprob), ...] best first) per generated id
    logprobs: list = field(default_factory=list)

    @property
    def mean_accepted(self) -> float:
        """Drafted tokens accepted per verify forward (each also yields one target token)."""
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def prefill_tok_s(self):
        return self.prefill_timed_tokens / self.prefill_s if self.prefill_s and self.prefill_timed_tokens else 0.0

    @property
    def ttft_s(self) -> float:
        return self.prefill_s + self.compile_s

    @property
    def decode_tok_s(self):
        return (self.generated - 1) / self.decode_s if self.decode_s and self.generated > 1 else 0.0


COMPILE_NOTICE_S = 1.0  # a first decode step slower than this is announced (on_compile)
DEFAULT_PREFILL_STEP = 2048  # as mlx-lm; on the H200 1.10x its prefill vs 0.94x at 512 (docs/benchmarks-log.md)


def rank_resources(group: Group, load_s: float) -> np.ndarray:
    """[size, 3] on every rank: load seconds, MLX peak memory (MiB), peak RSS
    (MiB) of each rank, gathered with one all_sum."""
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_mib = rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux
    return group.gather_rows([load_s, mx.get_peak_memory() / 2**20, rss_mib])
