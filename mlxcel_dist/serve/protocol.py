"""The rank step protocol: every rank, rank 0 included, runs :func:`advance`.

Rank 0's scheduler decides a :class:`wire.Step` (removals, admissions, or an
idle / shutdown note); :meth:`Link.sync` hands it to every rank in one
exchange (over the host channel, or device collectives without one), which
also carries every rank's rank-agreement row, so the ids of the last step are
checked on every rank before rank 0 acts on them; then :func:`apply_step`
makes the same engine calls on every rank. No loop is mirrored by hand: the
followers' loop is :func:`follow`, a loop over the same `advance`.

The engine is a ``batch.BatchEngine`` or ``generation.OneRowEngine`` (a model with
its own generation loop behind the same calls).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..parallel.collectives import Group, HostChannel, ends_the_job
from ..engine.prefill import Request
from . import wire
from .wire import CONTROL_INTS, KIND_IDLE, KIND_SHUTDOWN, KIND_STEP, Step

class Engine(Protocol):
    """What every rank's engine answers (batch.BatchEngine, OneRowEngine, the
    tests' scripted engines): rows by request id, added and removed in the
    step's order, `step` their next ids."""

    want: dict  # rid -> k: logprobs asked with each id (add_many sets it from a record's `logprobs`)
    logprobs: dict  # rid -> logprobs of the last step (rank 0 reads them)
    failed: dict  # rid -> message: prompts whose prefill failed in a step (taken by apply_step)
    prompt_logprobs: dict  # rid -> its prompt's logprobs (echo), once prefilled (taken by apply_step)
    prefilling: bool  # prompts still prefilling, no row yet (a step of prefill alone is never judged stuck)
    prefilled: int  # prompt tokens run through prefill forwards so far
    flat_steps: int  # steps that carried a prompt's chunk in the rows' forward (engine/flat.py), so far
    micro_steps: int  # steps launched in micro-batches (serve --micro-batches), so far
    traces: int  # graphs traced so far (a step that traced one is no measure for pacing)

    def __len__(self) -> int: ...
    def __contains__(self, rid) -> bool: ...
    def add_many(self, items) -> None: ...  # prefill.Request records
    def remove(self, rid) -> None: ...
    def step(self, prefill: int | None = None, micro: int = 0) -> dict: ...  # prefill: this step's prompt tokens
    # (None: its own); micro: the micro-batches of the step it launches (0: its own)


IDLE_MARGIN_S = 0.02  # a follower wakes this much before rank 0 enters the next collective


class Link:
    """How a step crosses from rank 0 to every rank (one per serve job)."""

    def __init__(self, group: Group, channel: HostChannel | None):
        self.group = group
        self.channel = channel

    @classmethod
    def open(cls, group: Group) -> "Link":
        """Every rank, at the same point: the host channel where it can be built."""
        return cls(group, HostChannel.open(group))

    def sync(self, guard, step: Step | None = None) -> Step:
        """Rank 0 passes its step, the others None; every rank gets the decoded
        step back (rank 0 too: every rank applies bit-identical values) after
        the agreement verdict on every id recorded so far (RanksDiverged on
        every rank alike). Over the channel nothing is queued on the device,
        so it never waits behind the step in flight."""
        import mlx.core as mx

        group, n = self.group, self.group.size()
        row = np.array([guard.count, guard.checksum, guard.last], np.int32)
        msg = wire.encode_step(step) if group.is_root else None
        if self.channel is not None:
            rows, msg = self.channel.exchange(row, msg)
            guard._verdict(rows)
            return wire.decode_step(msg)
        if group.single:
            return wire.decode_step(msg)
        # one all_sum of rank 0's control header and every rank's row, then the payload as a broadcast
        vec = np.zeros(CONTROL_INTS + 3 * n, np.int32)
        if group.is_root:
            vec[:CONTROL_INTS] = msg[:CONTROL_INTS]
        vec[CONTROL_INTS + 3 * group.rank():][:3] = row
        vec = np.array(group.all_sum(mx.array(vec)))
        guard._verdict(vec[CONTROL_INTS:].reshape(n, 3))
        m = int(vec[2]) if int(vec[0]) == wire.MAGIC else 0
        payload = group.broadcast(msg[CONTROL_INTS:] if group.is_root else None, (m,)) if m else np.zeros(0, np.int32)
        return wire.decode_step(np.concatenate([vec[:CONTROL_INTS], payload]))

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()


@dataclass
class StepResult:
    """What one applied step gave: each row's id, its logprobs and the rows
    whose grammar gave up (rank 0's engine only), and the admissions that
    failed (every rank alike)."""

    ids: dict = field(default_factory=dict)  # rid -> id, or [ids] (a step with drafts: 1 .. K + 1 a row)
    logprobs: dict = field(default_factory=dict)
    failed: dict = field(default_factory=dict)  # rid -> message
    spec: tuple = (0, 0, 0)  # drafts: (rows that drafted, tokens drafted, drafts accepted) in this step
    step_s: float = 0.0
    admit_s: float = 0.0
    prefilled: int = 0  # prompt tokens the step ran through prefill forwards
    flat: bool = False  # a prompt's chunk rode in the rows' forward (engine/flat.py)
    traced: bool = False  # the step traced a new graph (its time is not the step's: pacing skips it)
    micro: bool = False  # the step it launched ran in micro-batches
    prompt_logprobs: dict = field(default_factory=dict)  # rid -> its prompt's logprobs (echo), rank 0's
    gave_up: dict = field(default_factory=dict)  # rid -> llguidance's reason: its grammar gave up at this id, rank 0's


def _admit(engine, admissions: list, keep_logprobs: bool, failed: dict) -> None:
    """add_many of a step's admissions; when it fails (every rank alike: the
    same data), each is retried alone so only the failing request ends."""
    items = [Request(rid, req.prompt_ids, req.sampling, req.max_tokens, req.grammar, req.speculative, req.echo,
                     req.logprobs if keep_logprobs else None) for rid, req in admissions]
    try:
        engine.add_many(items)
    except Exception as e:  # noqa: BLE001 - isolated below, request by request
        if ends_the_job(e):
            raise
        for (rid, req), item in zip(admissions, items):
            if rid in engine:
                engine.remove(rid)
            try:
                engine.add_many([item])
            except Exception as e:  # noqa: BLE001 - that request's failure alone
                if ends_the_job(e):
                    raise
                failed[rid] = f"{type(e).__name__}: {e}"


def apply_step(engine, step: Step, guard, keep_logprobs: bool = False, busy=None) -> StepResult | None:
    """Every rank: the step's engine calls, in one order. None for an idle
    note (the caller sleeps) or shutdown. `busy(t)` marks when the engine step
    starts, `busy(None)` the prefills and the end of the step: rank 0's
    stuck-rank watchdog reads it (its loop marks the sync before this too)."""
    if step.kind != KIND_STEP:
        return None
    out = StepResult()
    t0 = time.monotonic()
    for rid in step.removals:
        engine.remove(rid)
    if step.admissions:
        if busy:
            busy(None)  # prefills take as long as their prompts: never judged stuck
        _admit(engine, step.admissions, keep_logprobs, out.failed)
    t1 = time.monotonic()
    if busy:
        # a step of prefill forwards alone (no row decodes yet) runs a whole chunk a prompt: never judged stuck
        busy(None if engine.prefilling and not len(engine) else t1)
    before, flats, traces, micros = engine.prefilled, engine.flat_steps, engine.traces, engine.micro_steps
    try:
        out.ids = engine.step(step.prefill_tokens or None, step.micro)
    finally:
        if busy:
            busy(None)
    out.prefilled = engine.prefilled - before
    out.flat, out.traced, out.micro = engine.flat_steps > flats, engine.traces > traces, engine.micro_steps > micros
    if keep_logprobs:
        out.prompt_logprobs = dict(engine.prompt_logprobs)
    engine.prompt_logprobs.clear()
    out.failed.update(engine.failed)  # prompts whose prefill failed in the step (every rank alike)
    engine.failed.clear()
    out.step_s, out.admit_s = time.monotonic() - t1, t1 - t0
    for tok in out.ids.values():
        for t in tok if isinstance(tok, list) else (tok,):
            guard._record(t)
    spec = getattr(engine, "spec", None)
    if spec is not None and out.ids:  # (an empty step ran nothing: its counts are the last step's)
        out.spec = spec.last
    if keep_logprobs:
        out.logprobs = dict(engine.logprobs)
        out.gave_up = dict(getattr(engine, "gave_up", {}))  # (own-loop engines take no grammar)
    return out


def advance(engine, link: Link, guard, step: Step | None = None, keep_logprobs: bool = False,
            agreed=None, busy=None) -> tuple[Step, StepResult | None]:
    """One step of the protocol on any rank: sync, then (rank 0) `agreed()`
    (the last step's events may go out: their ids are checked), then apply.
    An idle note makes the other ranks sleep before their next sync."""
    step = link.sync(guard, step)
    if agreed is not None:
        agreed()
    if step.kind == KIND_IDLE and not link.group.is_root:
        time.sleep(max(step.idle_ms / 1000 - IDLE_MARGIN_S, 0))
    return step, apply_step(engine, step, guard, keep_logprobs, busy)


def follow(engine, link: Link, guard) -> None:
    """Ranks other than 0: advance until rank 0's shutdown note."""
    while advance(engine, link, guard)[0].kind != KIND_SHUTDOWN:
        pass
