"""Test hooks that make a rank fail for real at a chosen moment.

``MLXCEL_DIST_INJECT_FAULT=ACTION:RANK:PHASE`` with ACTION ``kill`` (SIGKILL)
or ``stop`` (SIGSTOP, a hung rank), RANK the rank that does it, and PHASE one
of ``load`` (before the first tensor is read), ``prefill`` (before the
prompt's forward pass) or ``decode`` (before the second decode step). The
other values of the variable (``wrong-kv-slice``, ``sampler-seed``) are
numerical faults read where they apply. Unset, this costs one dict lookup.
"""

from __future__ import annotations

import os
import signal
import time

ENV = "MLXCEL_DIST_INJECT_FAULT"
_ACTIONS = {"kill": signal.SIGKILL, "stop": getattr(signal, "SIGSTOP", None)}


def at(phase: str, rank: int) -> None:
    spec = os.environ.get(ENV)
    if not spec or spec.count(":") != 2:
        return
    action, r, p = spec.split(":")
    sig = _ACTIONS.get(action)
    if sig is None or p != phase or not r.isdigit() or int(r) != rank:
        return
    stamp = os.environ.get(ENV + "_STAMP")
    if stamp:  # when the fault happened, for tests that time the reaction
        with open(stamp, "w", encoding="ascii") as f:
            f.write(repr(time.time()))
    os.kill(os.getpid(), sig)
