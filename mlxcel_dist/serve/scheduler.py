"""Rank 0's scheduler: which requests take a row at each step, and what
each row's ids mean for its client.

`plan()` decides the next :class:`wire.Step` (cancellations and finished
rows as removals, queued requests as admissions up to the concurrency
limits, an idle note or shutdown); the serving loop hands it to every rank
(:func:`protocol.advance`) and gives the result to `absorb()`, which
detokenises each row, applies EOS / stop strings / max_tokens, and queues
the row's events. Events go out through `deliver()` only after the next
sync's rank-agreement verdict on the ids behind them. No rank, engine or
HTTP in here: tests drive it in process against a fake engine.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, replace

from ..engine.sampling import SEED_LIMIT

from ..checkpoint.tokenizer import RowText
from .log import log
from .metrics import Metrics
from .pacing import STALL, MicroParts, Pacer
from .wire import KIND_IDLE, KIND_SHUTDOWN, KIND_STEP, RID_LIMIT, GenRequest, Step

SHUTDOWN_MESSAGE = "the server is shutting down"
IDLE_AFTER_S = 0.5  # without a host channel: idle this long before the followers are told to sleep
IDLE_SLEEP_S = 0.3  # ... for this long (a first request after a quiet spell waits at most this),
IDLE_SLEEP_MAX_S = 1.2  # doubling while the quiet lasts, up to this: a long-idle job wakes less often
# MLXCEL_DIST_STEP_LOG=1: a log line for every step that prefills or admits (its ids, prompt tokens, time)
STEP_LOG = os.environ.get("MLXCEL_DIST_STEP_LOG") == "1"
WAIT_S = 0.2  # how long plan() blocks on an empty queue before it looks at the stop flag again


# Events a job's sink receives, per choice (`index`, 0..n-1) in order: Token
# (with logprobs) / Text ..., then its Done; or one Failed for the whole job.
@dataclass
class Token:
    id: int
    logprob: tuple  # (logprob, [(id, logprob), ...])
    index: int = 0


@dataclass
class Prompt:
    """A choice's prompt, before its tokens (completions' echo)."""

    ids: list
    logprobs: list  # per prompt token: None (the first), else (logprob, [(id, logprob), ...])
    index: int = 0


@dataclass
class Text:
    text: str
    index: int = 0


@dataclass
class Done:
    finish_reason: str  # "eos" | "stop" | "length"
    prompt_tokens: int
    completion_tokens: int  # the ids the client is shown (an EOS that ended the row is not one)
    stop: str | None = None
    index: int = 0


@dataclass
class Failed:
    message: str
    status: int


class Job:
    """One request on rank 0: its GenRequest and where its events go (`sink`
    is called on the scheduler's thread and must not block)."""

    def __init__(self, req: GenRequest, sink, n: int = 1, keep_special: bool = False, prompts: list | None = None):
        """`n` choices: n rows admitted in one step (the engine prefills their
        shared prompt once), row i sampling with seed (req's seed + i) mod 2^64.
        `keep_special`: its text keeps special tokens (harmony's markers).
        `prompts` (several in one completions request; None: req's alone): n
        choices of each, choice p * n + i prompt p's i-th; prompt by prompt
        the groups join the batch as rows free up, together where they fit."""
        self.req = req
        self.keep_special = keep_special
        self.sink = sink
        self.prompts = prompts or [req.prompt_ids]
        self.group = n  # one prompt's rows: admitted together, one prefill
        self.n = n * len(self.prompts)  # rows in all
        self.admitted = 0  # rows admitted so far
        self.left = self.n  # choices not done yet
        self.started = False  # its first token was read (metrics' time to first token)
        self.cancelled = threading.Event()  # its client went away: the row is freed at the next step
        self.arrived = time.monotonic()

    def choice_req(self, i: int) -> GenRequest:
        """Row i's request: its prompt's, choice i % n's seed."""
        return _choice_req(self.req, i % self.group, self.prompts[i // self.group])


@dataclass
class _Row:
    job: Job
    text: RowText  # its text, EOS, stop strings and max_tokens (generate's rule too)
    index: int = 0  # the job's choice this row generates
    last_t: float = 0.0  # when its previous token was read (metrics)

    @property
    def generated(self) -> int:
        return self.text.generated


@dataclass
class StepTimes:
    """Where the loop's time went while rows ran (idle waits excluded): engine
    steps, admissions (removals and prefills), the syncs with the other ranks,
    and the rest (detokenising, events, scheduling)."""

    steps: int = 0
    tokens: int = 0
    step: float = 0.0
    admit: float = 0.0
    groups: int = 0
    prompts: int = 0
    prompt_tokens: int = 0
    sync: float = 0.0
    rest: float = 0.0

    def since(self, before: "StepTimes") -> str:
        """This loop's times since `before` (a copy taken then), per step: what
        grows over a server's life, the engine's step or the host's rest."""
        d = StepTimes(**{k: getattr(self, k) - getattr(before, k) for k in self.__dataclass_fields__})
        n = max(d.steps, 1)
        return (f"{d.steps} steps, {d.tokens / n:.1f} rows a step, {d.prompts} prompts; per step: engine "
                f"{1e3 * d.step / n:.2f} ms, admissions {1e3 * d.admit / n:.2f}, sync {1e3 * d.sync / n:.2f}, "
                f"rest {1e3 * d.rest / n:.2f}")

    def __str__(self) -> str:
        return (f"{self.steps} steps, {self.tokens} tokens ({self.tokens / max(self.steps, 1):.1f} rows a step): "
                f"steps {self.step:.2f} s, admissions {self.admit:.2f} s ({self.prompts} prompts, "
                f"{self.prompt_tokens} tokens, {self.groups} groups), sync {self.sync:.2f} s, rest {self.rest:.2f} s")


class Scheduler:
    def __init__(self, tokenizer, decode_concurrency: int = 32, prompt_concurrency: int = 8,
                 sleeping_followers: bool = True, pace: float | None = STALL, micro: int = 1):
        """`sleeping_followers`: the other ranks wait for the next step asleep
        (host channel, or np 1), so an idle scheduler sends nothing; else it
        sends idle notes that let them sleep between collectives. `pace`: each
        step's prompt tokens from the steps' times, a stream's gap within
        `pace` x its plain one (serve.pacing, --max-stall); None: the
        engine's fixed budget (--max-num-batched-tokens). A grammar
        llguidance gives up on mid-answer (which the ranks' masks turn into
        EOS) ends its request with an error, not "stop": the engine names
        those rows (`StepResult.gave_up`). `micro` (--micro-batches, pipeline stages): each step's rows in up to
        that many micro-batches, where the steps' times show they pay
        (serve.pacing.MicroParts)."""
        self.tok = tokenizer
        self.decode_concurrency = decode_concurrency
        self.prompt_concurrency = prompt_concurrency
        self.sleeping_followers = sleeping_followers
        self.queue: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        self.lock = threading.Lock()  # submit vs fail_all: every job is answered once
        self.open: set = set()  # submitted, not finished yet
        self.rows: dict[int, _Row] = {}
        self.backlog: list = []
        self.removals: list = []
        self.outbox: list = []  # (job, event) of the last step: sent after the next verdict
        self.next_rid = 0
        self.idle_until = None  # an idle note was sent: the followers sleep until then
        self.idle_notes = 0  # idle notes since the last work (each sleep twice the last, up to IDLE_SLEEP_MAX_S)
        self.quiet_since = time.monotonic()
        self.times = StepTimes()
        self._t_rest = None
        self.busy_since = None  # when the engine step in progress started (stuck-rank watchdog)
        self.step_s = 0.0  # moving average of an engine step
        self.metrics = Metrics()  # GET /metrics
        self.pacer = Pacer(pace) if pace else None
        self.micro = MicroParts(micro) if micro > 1 else None  # --micro-batches: each step's, by the steps' times

    # -- HTTP side (any thread) --------------------------------------------------
    def submit(self, job: Job) -> bool:
        """Queue `job`; False once stopping (the caller answers 503)."""
        with self.lock:
            if self.stopping.is_set():
                return False
            self.open.add(job)
            self.queue.put(job)
        return True

    def cancel(self, job: Job) -> None:
        """Its client is gone (or was answered): an open job's row is freed at the next step."""
        with self.lock:
            if job not in self.open:
                return
        job.cancelled.set()
        self.queue.put(None)  # wake an idle plan()

    def stop(self) -> None:
        self.stopping.set()
        self.queue.put(None)

    def fail_all(self, message: str, status: int) -> int:
        """Answer every open job with an error at once (the loop may be stuck
        in a collective of a dead rank); returns how many."""
        with self.lock:
            self.stopping.set()
            jobs, self.open = list(self.open), set()
        for job in jobs:
            self.metrics.ended("error", job.arrived)
            job.sink(Failed(message, status))
        return len(jobs)

    @property
    def active(self) -> int:
        return len(self.rows)

    @property
    def waiting(self) -> int:
        return len(self.backlog) + self.queue.qsize()

    # -- the loop's side ---------------------------------------------------------
    def _emit(self, job: Job, ev) -> None:
        self.outbox.append((job, ev))

    def _end(self, job: Job, ev) -> None:
        with self.lock:
            if job not in self.open:  # fail_all answered it already
                return
            if isinstance(ev, Done) and job.left > 1:  # another choice still runs
                job.left -= 1
                return self._emit(job, ev)
            self.open.discard(job)
        reason = ("stop" if ev.finish_reason == "eos" else ev.finish_reason) if isinstance(ev, Done) \
            else "abort" if ev.status == 499 else "error"
        self.metrics.ended(reason, job.arrived)
        self._emit(job, ev)

    def _take(self, timeout: float | None) -> None:
        try:
            job = self.queue.get(timeout=timeout) if timeout else self.queue.get_nowait()
        except queue.Empty:
            return
        while True:
            if job is not None:
                self.backlog.append(job)
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                return

    def _busy(self) -> bool:
        return bool(self.rows or self.removals or self.outbox or self.backlog)

    def plan(self) -> Step:
        """The next step for every rank (blocks while there is nothing to do)."""
        while True:
            self._take(None)
            if self.stopping.is_set() or self._busy():
                break
            if self.sleeping_followers:
                self._take(WAIT_S)
                continue
            now = time.monotonic()
            due = self.idle_until if self.idle_until is not None else self.quiet_since + IDLE_AFTER_S
            if now < due:
                self._take(min(due - now, WAIT_S))
                continue
            sleep = min(IDLE_SLEEP_MAX_S, IDLE_SLEEP_S * 2 ** self.idle_notes)
            self.idle_notes += 1
            self.idle_until = now + sleep
            return Step(KIND_IDLE, idle_ms=int(sleep * 1000))
        self.idle_until = None
        self.idle_notes = 0
        if self.stopping.is_set():
            for r in self.rows.values():
                self._end(r.job, Failed(SHUTDOWN_MESSAGE, 503))
            for job in self.backlog:
                self._end(job, Failed(SHUTDOWN_MESSAGE, 503))
            self.rows.clear()
            self.backlog.clear()
            return Step(KIND_SHUTDOWN)
        for rid in [rid for rid, r in self.rows.items() if r.job.cancelled.is_set()]:
            r = self.rows.pop(rid)
            self.removals.append(rid)
            log(f"client gone: row freed after {r.generated} of {r.job.req.max_tokens} tokens")
            self._end(r.job, Failed("client gone", 499))  # once per job (its other rows: already ended)
        admissions, keep, jobs, full = [], [], 0, False
        for job in self.backlog:
            if job not in self.open:  # ended while admitted in part (its client gone, a row failed)
                continue
            if job.cancelled.is_set():
                log("client gone: request dropped before it took a row")
                self._end(job, Failed("client gone", 499))
                continue
            while (job.admitted < job.n and jobs < self.prompt_concurrency and not full
                   and len(self.rows) + len(admissions) + job.group <= self.decode_concurrency):
                jobs += 1  # a prompt's n rows share one prefill: one prompt
                for i in range(job.admitted, job.admitted + job.group):
                    admissions.append((self.next_rid, job, i))
                    self.next_rid = (self.next_rid + 1) % RID_LIMIT
                job.admitted += job.group
            if job.admitted < job.n:  # FIFO: a job waiting for rows (n of them) is not overtaken by later ones
                full = full or len(self.rows) + len(admissions) + job.group > self.decode_concurrency
                keep.append(job)
        self.backlog = keep
        step = Step(KIND_STEP, self.removals, [(rid, job.choice_req(i)) for rid, job, i in admissions],
                    prefill_tokens=self.pacer.tokens() if self.pacer is not None else 0,
                    micro=self.micro.choose(len(self.rows)) if self.micro is not None else 0)
        self.removals = []
        for rid, job, i in admissions:
            ids = job.prompts[i // job.group]
            # stop_token_ids end a row as EOS does, also under ignore_eos (vLLM's rule)
            eos = (set() if job.req.ignore_eos else set(self.tok.eos_ids)) | set(job.req.stop_ids)
            text = RowText(self.tok, job.req.stop, eos, job.req.max_tokens, list(ids)[-4:], job.keep_special)
            self.rows[rid] = _Row(job, text, i)
            if i % job.group == 0:
                self.metrics.admitted(len(ids))
        if self._t_rest is not None and (self.rows or step.changes):
            self.times.rest += time.monotonic() - self._t_rest
        return step

    def synced(self, seconds: float) -> None:
        self.times.sync += seconds

    def deliver(self) -> None:
        """The ids behind the outbox agree on every rank: send its events."""
        for job, ev in self.outbox:
            job.sink(ev)
        self.outbox.clear()

    def absorb(self, step: Step, result) -> None:
        """The applied step's ids: each row's text, its end, its events. After
        an idle note the next one is due its sleep after the note's sync ended,
        when the followers' sleep starts too (due from before the sync, a sync
        that once waited X on a late rank kept rank 0 X ahead of them at every
        note after: the first rank in a collective spins, MLX ring's wait
        being a busy one; seen as an idle np 2 job at 73% of a core)."""
        self._t_rest = time.monotonic()
        if step.kind == KIND_IDLE:
            self.idle_until = self._t_rest + step.idle_ms / 1000
        if result is None:
            return
        t = self.times
        if step.admissions:
            t.admit += result.admit_s
            t.groups += 1
            t.prompts += len(step.admissions)
            t.prompt_tokens += sum(len(req.prompt_ids) for _, req in step.admissions)
        if self.pacer is not None:
            self.pacer.observe(result.step_s, len(result.ids), result.prefilled, result.flat, result.traced)
        if self.micro is not None:
            self.micro.observe(result.step_s, len(result.ids), result.prefilled, result.traced, result.micro)
            if STEP_LOG and self.micro.verdict:
                b, timed = self.micro.verdict
                log(f"micro-batches at up to {b} rows: " + ", ".join(
                    f"{'whole' if m == 1 else f'{m} parts'} " + (f"{1e3 * s:.2f} ms a row" if s < float("inf") else "not run")
                    for m, s in timed.items())
                    + f": {'whole' if self.micro.use[b] == 1 else 'parts'} kept")
        if STEP_LOG and (result.prefilled or step.admissions):
            log(f"step: {len(result.ids)} ids, {result.prefilled} prompt tokens ({step.prefill_tokens} paced), "
                f"{1e3 * result.step_s:.1f} ms{', flat' if result.flat else ''}{', traced' if result.traced else ''}")
        if result.ids:
            t.steps += 1
            t.tokens += sum(len(x) if isinstance(x, list) else 1 for x in result.ids.values())
            t.step += result.step_s
            self.step_s = 0.9 * self.step_s + 0.1 * result.step_s
        for rid, message in result.failed.items():
            r = self.rows.pop(rid, None)
            if r is not None:
                log(f"request failed at admission: {message}")
                self._drop_job(r.job, set(result.failed))
                self._end(r.job, Failed(f"generation failed: {message}", 500))
        if result.spec[0]:
            self.metrics.drafted(*result.spec)
        for rid, lps in result.prompt_logprobs.items():  # echo: the prompt first; max_tokens 0 ends there
            r = self.rows.get(rid)
            if r is not None:
                self._emit(r.job, Prompt(list(r.job.prompts[r.index // r.job.group]), lps, r.index))
                if r.job.req.max_tokens == 0:
                    self._finish(rid, r, "length", removal=False)
        for rid, toks in result.ids.items():
            r = self.rows.get(rid)
            if r is None:  # freed at this step's plan: its last id is dropped
                continue
            try:
                # a step with drafts gives a row 1 .. K + 1 ids (a row with logprobs: one)
                ids = toks if isinstance(toks, list) else (toks,)
                since = r.last_t if r.generated else None  # the row's previous step: the gap its ids share
                for tok in ids:
                    if rid not in self.rows:  # ended inside the list (EOS, stop, max_tokens): the rest is dropped
                        break
                    if rid in result.gave_up:  # (a constrained row: one id a step)
                        self._grammar_failed(rid, r, result.gave_up[rid])
                        break
                    self._advance_row(rid, r, tok, result.logprobs.get(rid), since, len(ids))
            except Exception as e:  # noqa: BLE001 - one request's failure ends that request alone
                log(f"request failed: {type(e).__name__}: {e}")
                self.rows.pop(rid, None)
                self.removals.append(rid)
                self._drop_job(r.job, set(result.failed))
                self._end(r.job, Failed(f"generation failed: {type(e).__name__}: {e}", 500))
        if not self.rows and not self.backlog:
            self.quiet_since = time.monotonic()

    def _drop_job(self, job: Job, gone: set) -> None:
        """A failed job's other rows leave too (those not in the engine, `gone`, without a removal)."""
        for rid in [rid for rid, r in self.rows.items() if r.job is job]:
            self.rows.pop(rid)
            if rid not in gone:
                self.removals.append(rid)

    def _advance_row(self, rid: int, r: _Row, tok: int, lp, since: float | None, share: int) -> None:
        text = r.text.add(tok)
        if r.text.reason == "eos":
            if text:
                self._emit(r.job, Text(text, r.index))
            return self._finish(rid, r, "eos")
        first = r.generated == 1
        if first:
            self.metrics.token(r.job.arrived, not r.job.started)
        elif since is None:  # given by the step that gave the row's first id: it came with that one
            self.metrics.token(r.last_t, False)
        else:
            self.metrics.token(since, False, share)
        r.job.started = True
        r.last_t = time.monotonic()
        if r.job.req.logprobs is not None:
            self._emit(r.job, Token(tok, lp, r.index))
        if text:
            self._emit(r.job, Text(text, r.index))
        if r.text.reason is not None:
            self._finish(rid, r, r.text.reason)

    def _grammar_failed(self, rid: int, r: _Row, error: str) -> None:
        log(f"grammar gave up after {r.generated} tokens: {error}")
        self.rows.pop(rid)
        self.removals.append(rid)
        self._drop_job(r.job, set())
        self._end(r.job, Failed(f"constrained decoding stopped after {r.generated} tokens: the request's grammar "
                                f"(response_format or forced tool call) hit a limit of llguidance: {error}; "
                                "a smaller schema (fewer optional properties) avoids it", 400))

    def _finish(self, rid: int, r: _Row, reason: str, removal: bool = True) -> None:
        """`removal` False: the engine holds no row for it (an echo of max_tokens 0)."""
        if r.text.reason is None:  # ended from outside (echo's max_tokens 0): the held-back tail
            tail = r.text.close()
            if tail:
                self._emit(r.job, Text(tail, r.index))
        self.rows.pop(rid)
        if removal:
            self.removals.append(rid)
        prompt = r.job.prompts[r.index // r.job.group]
        self._end(r.job, Done(reason, len(prompt), r.generated, r.text.stopped, r.index))


def _choice_req(req: GenRequest, i: int, prompt: list | None = None) -> GenRequest:
    """Choice i's request: the job's, sampling with seed (seed + i) mod 2^64
    (so choice 0 is what n = 1 gives with the same seed)."""
    if prompt is not None and prompt is not req.prompt_ids:
        req = replace(req, prompt_ids=prompt)
    if i == 0:
        return req
    return replace(req, sampling=replace(req.sampling, seed=(req.sampling.seed + i) % SEED_LIMIT))
