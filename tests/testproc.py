"""Run a command from a test without ever hanging the suite.

subprocess.run(timeout=...) SIGKILLs only the child, then waits for EOF on
pipes that the child's ranks (in sessions of their own) still hold: it can
block forever. Here a timeout first sends SIGTERM (our launcher stops every
rank on it), then kills the child's whole session, and the test fails with
what the command printed so far.
"""

from __future__ import annotations

import os
import signal
import subprocess


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
            from conftest import kill_descendants

            kill_descendants()
            out, err = p.communicate(timeout=20)
        raise AssertionError(
            f"timed out after {timeout:.0f} s: {' '.join(map(str, argv))}\n"
            f"--- stdout ---\n{out}\n--- stderr ---\n{err}"
        ) from None
    return subprocess.CompletedProcess(argv, p.returncode, out, err)
