"""Test hooks that make a rank fail for real; the only reader of the
``MLXCEL_DIST_INJECT_FAULT`` variable. Unset, each hook costs one dict lookup
and hands its value back unchanged.

Process faults, ``ACTION:RANK:PHASE`` (:func:`at`): ACTION ``kill`` (SIGKILL),
``stop`` (SIGSTOP, a hung rank) or ``late`` (sleeps `LATE_S`, beating: a rank
slow to start on a loaded box), RANK the rank that does it, PHASE one of
``join`` (before the backend connects), ``load`` (before the first tensor is
read), ``prefill`` (before the prompt's forward pass) or ``decode`` (before
the second decode step).
``MLXCEL_DIST_INJECT_FAULT_STAMP`` names a file that gets the time of the fault.

Wrong-data faults, each read by one hook that takes the true value and
returns the faulted one:

- ``wrong-kv-slice``: the last rank takes the wrong KV heads (:func:`kv_heads`);
- ``sampler-seed``: the last rank samples with another seed (:func:`sampling`);
- ``version:RANK``: that rank reports another mlx version (:func:`versions`);
- ``nomodel:RANK``: that rank does not find the model (:func:`model_present`);
- ``no-channel``: the last rank reaches none of rank 0's host channel
  addresses (:func:`channel_addresses`), so the job runs without the channel.

Shard-fetch faults (fetch.py, several joined by commas): ``nocopy`` (every
host acts as if it held no copy of MODEL: :func:`no_copy`), ``fetch-cut:N``
(the launcher cuts each link after N bytes: :func:`fetch_cut`), ``diskfull``
(a receiver's first cache write fails: :func:`disk_full`).
"""

from __future__ import annotations

import os
import signal
import time

ENV = "MLXCEL_DIST_INJECT_FAULT"
_SIGNALS = {"kill": signal.SIGKILL, "stop": getattr(signal, "SIGSTOP", None)}
LATE_S = 6.0  # `late`: this long asleep (the heartbeat thread beats on)


def _spec() -> str:
    return os.environ.get(ENV, "")


def at(phase: str, rank: int) -> None:
    """Kill, stop or delay this process here when the variable names this phase and rank."""
    spec = _spec()
    if not spec or spec.count(":") != 2:
        return
    action, r, p = spec.split(":")
    sig = _SIGNALS.get(action)
    if (sig is None and action != "late") or p != phase or not r.isdigit() or int(r) != rank:
        return
    stamp = os.environ.get(ENV + "_STAMP")
    if stamp:  # when the fault happened, for tests that time the reaction
        with open(stamp, "w", encoding="ascii") as f:
            f.write(repr(time.time()))
    if sig is None:  # late
        time.sleep(LATE_S)
    else:
        os.kill(os.getpid(), sig)


def _last_rank(name: str, group) -> bool:
    return _spec() == name and group.rank() == group.size() - 1


def kv_heads(kv: tuple[int, int], total_kv_heads: int, group) -> tuple[int, int]:
    """This rank's KV head range; shifted by one head on the last rank under
    ``wrong-kv-slice`` (the harness must catch the bad shard)."""
    if not _last_rank("wrong-kv-slice", group):
        return kv
    kv0, kv1 = kv
    start = (kv0 + 1) % total_kv_heads
    return start, start + (kv1 - kv0)


def sampling(params, group):
    """The sampling parameters; another seed on the last rank under ``sampler-seed``."""
    if not _last_rank("sampler-seed", group):
        return params
    from dataclasses import replace

    from ..engine.sampling import SEED_LIMIT

    return replace(params, seed=(params.seed + 1) % SEED_LIMIT)


def versions(text: str, rank: int) -> str:
    """The versions this rank reports to the cluster check (``version:RANK``: an old mlx)."""
    if _spec() != f"version:{rank}":
        return text
    return "mlx 0.0.0, " + text.split(", ", 1)[-1]


def model_present(present: bool, rank: int) -> bool:
    """Whether this rank finds the model (``nomodel:RANK``: it does not)."""
    return False if _spec() == f"nomodel:{rank}" else present


def channel_addresses(addrs: list[str], group) -> list[str]:
    """The addresses a rank tries for rank 0's host channel; none under
    ``no-channel`` on the last rank (the star fails, every rank falls back)."""
    return [] if _last_rank("no-channel", group) else addrs


def no_copy() -> bool:
    """``nocopy``: every host of a fetch acts as if it held no copy of MODEL,
    this one too (the shard cache tested on one machine)."""
    return "nocopy" in _spec().split(",")


def fetch_cut() -> int | None:
    """``fetch-cut:N``: the launcher cuts each fetch's link after N bytes of shard data."""
    for part in _spec().split(","):
        if part.startswith("fetch-cut:") and part[10:].isdigit():
            return int(part[10:])
    return None


def disk_full() -> bool:
    """``diskfull``: a receiver's first write to the shard cache fails with ENOSPC."""
    return "diskfull" in _spec().split(",")
