"""Processes for tests: run a command without ever hanging the suite, and
find (or kill) what a test started.

subprocess.run(timeout=...) SIGKILLs only the child, then waits for EOF on
pipes that the child's ranks (in sessions of their own) still hold: it can
block forever. `run_cmd` on a timeout first sends SIGTERM (our launcher
stops every rank on it), then kills the child's whole session, and the test
fails with what the command printed so far.

Process trees come from Linux /proc (empty elsewhere). Every process started
under the pytest run inherits ``MLXCEL_TEST_OWNER=<pytest pid>`` (set by
conftest), so one that was orphaned (its launcher killed, reparented to
init) is still found.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

OWNER_ENV = "MLXCEL_TEST_OWNER"


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat fields after the command name: state, ppid, pgrp, session, ..."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pids) -> list[int]:
    """The pids that still run (not gone, not zombies)."""
    return [p for p in pids if (f := _stat(p)) is not None and f[0] != "Z"]


def descendants(root: int | None = None) -> list[int]:
    """Every live process below ``root`` (default: this process), plus every
    member of a session one of them leads (mpirun's ranks, once reparented);
    by default also every process that carries this process's owner marker."""
    me = os.getpid()
    root = me if root is None else root
    rows = {}
    proc = Path("/proc")
    for d in proc.iterdir() if proc.is_dir() else ():
        if d.name.isdigit() and (f := _stat(int(d.name))) is not None and f[0] != "Z":
            rows[int(d.name)] = (int(f[1]), int(f[3]))
    found, changed = {root}, True
    while changed:
        changed = False
        for pid, (ppid, sid) in rows.items():
            if pid not in found and (ppid in found or sid in found):
                found.add(pid)
                changed = True
    if root == me:
        marker = f"{OWNER_ENV}={me}".encode()
        for pid in rows:
            if pid not in found:
                try:
                    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                if marker in env:
                    found.add(pid)
    found.discard(root)
    return sorted(found)


def kill_descendants() -> int:
    """SIGKILL everything `descendants()` finds; how many there were."""
    pids = descendants()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return len(pids)


def run_cmd(argv, *, timeout: float, **kw) -> subprocess.CompletedProcess:
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    kw.setdefault("text", True)
    kw.setdefault("stdin", subprocess.DEVNULL)
    p = subprocess.Popen(argv, start_new_session=True, **kw)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGTERM)
        try:
            out, err = p.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
            kill_descendants()
            out, err = p.communicate(timeout=20)
        raise AssertionError(
            f"timed out after {timeout:.0f} s: {' '.join(map(str, argv))}\n"
            f"--- stdout ---\n{out}\n--- stderr ---\n{err}"
        ) from None
    return subprocess.CompletedProcess(argv, p.returncode, out, err)
