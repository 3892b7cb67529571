"""Running a loaded model: logits in every feeding mode, and generation
(sampling in sampling.py; text in/out in tokenizer.py).

The same functions run single-process and on every rank under TP (the model's
sharded layers do the collectives); only rank 0 reports.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from . import faults
from .collectives import SINGLE, CollectiveError, Group
from .decode import decode_step_for
from .errors import UserError
from .pipeline import outstanding_sends
from .sampling import Sampler, SamplingParams, read_logprobs, token_logprobs


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


def sequence_logits(model, ids, decode_from: int | None = None, prefill_step: int | None = None,
                    compiled: bool = True) -> np.ndarray:
    """float32 [T, V] logits for every position of `ids`.

    Tokens [0, decode_from) (all of them by default) are fed as a prompt with a
    fresh cache, in one pass or in chunks of `prefill_step`; the rest go one at
    a time through the decode path generation uses (decode.DecodeStep,
    compiled unless `compiled` is False).
    """
    ids = check_tokens(ids, vocab_size(model))
    T = len(ids)
    end = T if decode_from is None else decode_from
    if not 1 <= end <= T:
        raise UserError(f"--decode-from must be in [1, {T}] for {T} tokens, got {decode_from}")
    check_generation_options(prefill_step=prefill_step)
    step = prefill_step or end
    cache = model.make_cache()
    out = []
    pos = 0
    while pos < end:
        n = min(step, end - pos)
        logits = model(mx.array(ids[pos : pos + n])[None], cache)
        out.append(np.array(logits[0].astype(mx.float32)))
        pos += n
    if pos < T:
        decode = decode_step_for(model)
        decode.start(cache, pos, compiled)
        try:
            # The inputs are known, so step j+1 is launched before step j's
            # logits are read: the host copy overlaps the device's next step.
            pending = None
            for j in range(pos, T):
                nxt = decode(mx.array(ids[j : j + 1])[None])[None].astype(mx.float32)
                mx.async_eval(nxt)
                if pending is not None:
                    out.append(np.array(pending))
                pending = nxt
            out.append(np.array(pending))
        finally:  # the model keeps its DecodeStep, not its buffers
            decode.release()
    return np.concatenate(out, axis=0)


# Generation ---------------------------------------------------------------------
#
# Every rank runs the whole loop below: prefill, sample, agreement check, EOS,
# detokenise, stop strings. Only rank 0 prints what it yields. All ranks take
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
        # and the host count it stands for (None: not made yet)
        self._dev = None
        self._dev_at = None
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

    # The pipelined decode loop (TokenGenerator) schedules the check of a
    # token before the host has read it: `pending_rows` builds the same
    # gathered [size, 3] matrix on the device from the lazy id, and `commit`
    # records the id once read and judges the matrix read with it.

    def due(self) -> bool:
        """Whether the next id triggers a check."""
        return bool(self.every) and self.count + 1 - self.checked >= self.every

    def pending_rows(self, tok: mx.array) -> mx.array | None:
        """The lazy all_sum of the check the next id `tok` (a lazy int32
        scalar, not read yet) triggers: row r = rank r's (count, checksum, last
        id) after it. None when no check is due or with one rank (no
        collective; `commit` then checks on the host, as `add`).

        The count and checksum are carried on the device from token to token
        (a lazy int64 [2], advanced from `tok` here), so no array is made from
        host data per token: on MLX's CUDA backend such an array cost about 4
        ms per token at np 2 on two H200s (docs/benchmarks-log.md, "np 2
        timeline"). Call it once per generated id, before its `commit`."""
        if self.group.single or not self.every:
            return None
        due = self.due()
        if self._consts is None:  # made once (Python scalars in ops would be arrays from host data too)
            n = self.group.size()
            mine = mx.arange(n) == mx.array(self.group.rank())
            self._consts = (mx.array(1, mx.int64), mx.array(self.MUL, mx.int64), mx.array(self.MOD, mx.int64),
                            mine[:, None], mx.zeros((n, 3), mx.int32))
        one, mul, mod, mine, zeros = self._consts
        t = tok.reshape(1).astype(mx.int64)
        if self._dev_at != self.count:  # first use (or ids recorded by `add` since): from the host record
            self._dev = (mx.zeros((2,), mx.int64) if self.count == 0
                         else mx.array([self.count, self.checksum], mx.int64))
        # (checksum * MUL + tok + 1) % MOD: < 2^51 before the modulo, exact in int64
        self._dev = mx.concatenate([self._dev[:1] + one, (self._dev[1:] * mul + t + one) % mod])
        self._dev_at = self.count + 1
        if not due:
            return None
        row = mx.concatenate([self._dev, t]).astype(mx.int32)
        return self.group.all_sum(mx.where(mine, row[None], zeros))  # Group.gather_rows_lazy, from the cached parts

    def commit(self, tok_id: int, rows=None) -> None:
        """Record an id read from the device; `rows` is its `pending_rows`
        matrix, read in the same sync (None: as `add`)."""
        if rows is None:
            self.add(tok_id)
            return
        self._record(tok_id)
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


def _cache_state(cache) -> list:
    return [c.state for c in cache] if cache else []


class TokenGenerator:
    """Iterating yields generated ids (each already agreed on, per the guard's
    schedule) until EOS or `max_tokens`; a caller may also stop early (stop
    strings). Call `finish()` afterwards, on every rank: it runs the final
    agreement check and returns GenStats.

    Prefill: all prompt tokens but the last go through the cache in chunks of
    `prefill_step` (default DEFAULT_PREFILL_STEP), evaluating only the cache
    (the output head never runs on them: its result is never evaluated), so a
    long prompt costs memory linear in its length (masks and scores
    [chunk, keys]) and a sliding layer's keys stay capped; the last prompt
    token then goes through the decode path, whose logits give the first id.

    Decode is pipelined as mlx-lm's generate_step: the forward pass for token
    n+1 (from the lazy id n) is built and handed to `mx.async_eval` before the
    host reads id n, so graph building overlaps the device's work, and the one
    host sync per token reads the id together with its agreement check (built
    on the device from the same lazy id, scheduled before the next forward
    pass). Every rank therefore always issues the next step's collectives,
    also after EOS (one step of wasted work, like mlx-lm), and takes every
    decision after reading agreed ids, so collectives stay paired. The
    single-token steps run through `decode.DecodeStep`: one compiled graph on
    static KV buffers (eager with `compiled=False`).
    """

    def __init__(self, model, prompt_ids, max_tokens: int, sampling: SamplingParams | None = None,
                 eos_ids=(), prefill_step: int | None = None, group: Group = SINGLE, check_every: int = 1,
                 compiled: bool = True, on_compile=None, logprobs: int | None = None, grammar=None):
        self.prompt = check_tokens(prompt_ids, vocab_size(model))
        check_generation_options(max_tokens, check_every, prefill_step)
        self.model = model
        # grammar.Matcher (generate --json-schema): each id drawn under its mask, which needs the id
        # before it read, so the forward stays pipelined and the draw waits for the host
        self.grammar = grammar
        self.max_tokens = max_tokens
        self.sampler = Sampler(faults.sampling(sampling or SamplingParams(), group), prompt_len=len(self.prompt))
        self.eos = set(int(e) for e in eos_ids)
        self.prefill_step = prefill_step or DEFAULT_PREFILL_STEP
        self.guard = RankAgreement(group, check_every)
        self.rank = group.rank()
        self.compiled = compiled
        self.decode = None  # decode.DecodeStep, from the end of the prefill on
        self.stats = GenStats(prompt_tokens=len(self.prompt))
        if logprobs is not None and (isinstance(logprobs, bool) or logprobs < 0):
            raise UserError(f'logprobs must be None or an integer >= 0, got {logprobs}')
        # None: off (nothing extra is built). k >= 0: the log-probability of
        # each generated id and the k most likely ids (stats.logprobs).
        self.logprobs = logprobs
        self._t_decode = None
        # The first step of a new decode graph compiles kernels (seconds to a
        # minute the first time on a machine): `on_compile()` runs (on a timer
        # thread) when that takes longer than COMPILE_NOTICE_S, and the time is
        # reported as compile_s, not as prompt speed.
        self.on_compile = on_compile
        self._t_chunks = None
        self._notice = None
        self._compiling = False
        self.margin = 0  # decode.DecodeStep.start's (spec.SpecGenerator: its draft length)

    def _prefill(self, cache) -> mx.array:
        """Feed the prompt; the lazy logits [V] of its last position."""
        prompt, step = self.prompt, self.prefill_step
        last = len(prompt) - 1
        for i in range(0, last, step):
            self.model(mx.array(prompt[i : min(i + step, last)])[None], cache)
            mx.eval(_cache_state(cache), outstanding_sends(self.model))  # (a pipeline stage's send too)
        self.decode = decode_step_for(self.model)
        self._t_chunks, traces = time.perf_counter(), self.decode.traces
        if last == 0:  # nothing cached yet: the one prompt token goes the eager way
            logits = self.model(mx.array(prompt[:1])[None], cache)[0, -1]
            self.decode.start(cache, 1, self.compiled, self.margin)
            return logits
        self.decode.start(cache, last, self.compiled, self.margin)
        logits = self.decode(mx.array(prompt[last:])[None])
        if self.decode.traces > traces:  # a new graph: its kernels compile when it first runs
            self._compiling = True
            if self.on_compile is not None:
                self._notice = threading.Timer(COMPILE_NOTICE_S, self.on_compile)
                self._notice.daemon = True
                self._notice.start()
        return logits


    def _logprobs(self, logits, context, pending, tok, mask=None) -> tuple:
        """Lazy sampling.token_logprobs when the logprobs option is on; () when off, so nothing is built."""
        if self.logprobs is None:
            return ()
        return token_logprobs(logits, context, self.sampler.params, pending, tok, self.logprobs, self.sampler.prompt_len,
                              mask)

    def _draw(self, logits, context) -> tuple:
        """A constrained id (all of `context` read) and its logprobs, scheduled."""
        mask = mx.array(self.grammar.mask())
        y = self.sampler.sample(logits, context, mask=mask)
        lp = self._logprobs(logits, context, None, y, mask)
        mx.async_eval(y, *lp)
        return y, lp

    def __iter__(self):
        stats = self.stats
        if self.max_tokens == 0:
            stats.finish_reason = "length"
            return
        context = self.prompt.tolist()
        cache = self.model.make_cache()
        t0 = time.perf_counter()
        faults.at("prefill", self.rank)
        logits = self._prefill(cache)
        if self.grammar is not None:
            y, lp = self._draw(logits, context)
        else:
            y = self.sampler.sample(logits, context)
            lp = self._logprobs(logits, context, None, y)  # () when off
            mx.async_eval(y, *lp)
        while True:
            # y: the lazy id of generated token n, scheduled, not read yet.
            n = stats.generated + 1
            rows = self.guard.pending_rows(y)
            packed = y.reshape(1) if rows is None else mx.concatenate([y.reshape(1), rows.reshape(-1)])
            mx.async_eval(packed)  # the check runs before the next forward pass
            if n < self.max_tokens:
                if n == 2:
                    faults.at("decode", self.rank)
                logits = self.decode(y.reshape(1, 1))
                if self.grammar is None:
                    next_y = self.sampler.sample(logits, context, pending=y)
                    next_lp = self._logprobs(logits, context, y, next_y)
                    mx.async_eval(next_y, *next_lp)
                else:
                    mx.async_eval(logits)  # drawn below, once this id is read
            got = np.array(packed)  # the one host sync of this token
            tok = int(got[0])
            if self._t_decode is None:
                self._t_decode = time.perf_counter()
                if self._notice is not None:
                    self._notice.cancel()
                if self._compiling:  # the last prompt token's step built the graph: time it apart
                    stats.compile_s = self._t_decode - self._t_chunks
                    stats.prefill_s = self._t_chunks - t0
                    stats.prefill_timed_tokens = len(self.prompt) - 1
                else:
                    stats.prefill_s = self._t_decode - t0
                    stats.prefill_timed_tokens = len(self.prompt)
            stats.generated += 1
            stats.tokens.append(tok)
            if lp:  # computed with the id, so already there
                stats.logprobs.append(read_logprobs(lp))
            context.append(tok)
            self.guard.commit(tok, None if rows is None else got[1:].reshape(-1, 3))
            if self.grammar is not None:
                self.grammar.advance(tok)
            if tok in self.eos:
                stats.finish_reason = "eos"
                return
            yield tok
            if stats.generated >= self.max_tokens:
                stats.finish_reason = "length"
                return
            if self.grammar is not None:
                next_y, next_lp = self._draw(logits, context)
            y, lp = next_y, next_lp

    def finish(self) -> GenStats:
        if self.decode is not None:
            self.decode.release()
        self.guard.finish()
        if self._t_decode is not None:
            self.stats.decode_s = time.perf_counter() - self._t_decode
        self.stats.checks = self.guard.checks
        return self.stats


def generate_tokens(model, prompt_ids, max_tokens: int, sampling: SamplingParams | None = None, eos_ids=(),
                    prefill_step: int | None = None, group: Group = SINGLE, check_every: int = 1):
    """Yield generated ids (EOS is not yielded); returns GenStats via
    StopIteration.value."""
    gen = TokenGenerator(model, prompt_ids, max_tokens, sampling, eos_ids, prefill_step, group, check_every)
    yield from gen
    return gen.finish()


def generate_text(model, tokenizer, prompt_ids, max_tokens: int, sampling: SamplingParams | None = None,
                  stop=(), eos_ids=None, prefill_step: int | None = None, group: Group = SINGLE, check_every: int = 1,
                  context_tokens: int = 4, on_compile=None,
                  logprobs: int | None = None, on_token=None, grammar=None, drafter=None):
    """Yield text chunks as they become final; returns GenStats via
    StopIteration.value. `grammar`: a grammar.Matcher the ids must follow.

    Stops at EOS (not printed), after `max_tokens`, or at the first occurrence
    of a stop string (neither it nor any part of it is yielded). Text is
    yielded only when it is whole UTF-8 and cannot be the start of a stop
    string. The prompt's last `context_tokens` ids are the detokenizer's left
    context (never yielded). Every rank must run this, not only the one that
    prints: stop strings decide when generation ends.

    `logprobs` (None = off): TokenGenerator's option; `on_token(id, entry)`
    is called for each generated id (EOS excepted) before the text it
    completes is yielded, `entry` being its (logprob, top) or None.
    `drafter` (spec.DraftModel / spec.PromptLookup): speculative decoding
    (spec.SpecGenerator), the same ids at temperature 0."""
    from .tokenizer import StopStrings, StreamDecoder

    stopper = StopStrings(stop)
    eos = tokenizer.eos_ids if eos_ids is None else eos_ids
    if drafter is not None:
        from .spec import SpecGenerator

        if logprobs is not None or grammar is not None:
            raise UserError("logprobs and constrained decoding are not available with drafts")
        gen = SpecGenerator(model, prompt_ids, max_tokens, drafter, sampling, eos, prefill_step, group, check_every)
    elif callable(getattr(model, "generate_ids", None)):  # the model's own generation loop (HookGenerator)
        if grammar is not None:
            raise UserError(f"constrained decoding is not available for {model.args.model_type} "
                            "(its own generation loop)")
        gen = HookGenerator(model, prompt_ids, max_tokens, sampling, eos, group, check_every, logprobs)
    else:
        gen = TokenGenerator(model, prompt_ids, max_tokens, sampling, eos, prefill_step, group, check_every,
                             on_compile=on_compile, logprobs=logprobs, grammar=grammar)
    decoder = StreamDecoder(tokenizer, context=list(prompt_ids)[-context_tokens:] if context_tokens else ())
    for tok in gen:
        if on_token is not None:
            on_token(tok, gen.stats.logprobs[-1] if logprobs is not None else None)
        text = stopper.feed(decoder.add(tok))
        if text:
            yield text
        if stopper.stopped is not None:
            break
    if stopper.stopped is None:
        tail = stopper.feed(decoder.flush())
        tail += stopper.flush()
        if tail:
            yield tail
    stats = gen.finish()
    if stopper.stopped is not None:
        stats.finish_reason, stats.stop = "stop", stopper.stopped
    return stats


def rank_resources(group: Group, load_s: float) -> np.ndarray:
    """[size, 3] on every rank: load seconds, MLX peak memory (MiB), peak RSS
    (MiB) of each rank, gathered with one all_sum."""
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_mib = rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux
    return group.gather_rows([load_s, mx.get_peak_memory() / 2**20, rss_mib])


class HookGenerator:
    """TokenGenerator's interface (iterate, then `finish()`) over a model's
    own generation loop: a model with `generate_ids(prompt_ids, max_tokens,
    sampling, eos_ids, group)` (an iterator of ids, EOS not yielded; e.g.
    DiffusionGemma's block diffusion, which is no token-by-token decode)
    generates through it. Every rank runs it; the ids go through the same
    rank-agreement guard as TokenGenerator's."""

    def __init__(self, model, prompt_ids, max_tokens: int, sampling: SamplingParams | None = None,
                 eos_ids=(), group: Group = SINGLE, check_every: int = 1, logprobs: int | None = None):
        self.prompt = check_tokens(prompt_ids, vocab_size(model))
        check_generation_options(max_tokens, check_every)
        if logprobs is not None:
            raise UserError(f"logprobs are not available for {model.args.model_type} (its own generation loop)")
        self.model, self.max_tokens, self.group = model, max_tokens, group
        self.sampling = sampling or SamplingParams()
        self.eos = tuple(int(e) for e in eos_ids)
        self.guard = RankAgreement(group, check_every)
        self.stats = GenStats(prompt_tokens=len(self.prompt))
        self._t0 = None

    def __iter__(self):
        stats = self.stats
        self._t0 = time.perf_counter()
        for tok in self.model.generate_ids(self.prompt, self.max_tokens, self.sampling, self.eos, self.group):
            if stats.generated == 0:
                stats.prefill_s = time.perf_counter() - self._t0
                stats.prefill_timed_tokens = len(self.prompt)
            stats.generated += 1
            stats.tokens.append(int(tok))
            self.guard.add(int(tok))
            yield int(tok)
            if stats.generated >= self.max_tokens:
                break
        stats.finish_reason = "length" if stats.generated >= self.max_tokens else "eos"

    def finish(self) -> GenStats:
        self.guard.finish()
        if self._t0 is not None:
            self.stats.decode_s = max(time.perf_counter() - self._t0 - self.stats.prefill_s, 0.0)
        self.stats.checks = self.guard.checks
        return self.stats
