"""Supervising a job's processes: each in its own session (swept at the
end), signals passed on (SIGINT, SIGTERM, then SIGKILL, ``grace`` apart), the
first failing rank named in one line (the root cause, not the peers that
lost it), a rank silent past the stall timeout stopping the job (exit 124)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..backends import signame as _signame
from ...errors import UserError
from ..watchdog import EXIT_LINK_LOST, HeartbeatMonitor
from .output import _demux_reports, _pump_lines, _say

GRACE_S = 3.0  # between SIGINT -> SIGTERM -> SIGKILL
EXIT_STALLED = 124  # like timeout(1)
USAGE_EXIT = UserError.exit_code  # a rank's UserError: bad input, already reported by the rank
CAUSE_WINDOW_S = 0.5  # after the first failure, exits gathered before naming the cause


def _describe_exit(rc: int) -> tuple[str, int]:
    """(how a process ended, exit code the launcher should return)."""
    if rc < 0:
        return f"was killed by {_signame(-rc)}", 128 - rc
    if rc > 128 and rc - 128 < 65:
        # a shell (ssh, sh -c) reporting a signal death
        return f"exited with code {rc} ({_signame(rc - 128)})", rc
    if rc == EXIT_LINK_LOST:
        return f"lost its connection to the other ranks (exit {rc})", rc
    return f"exited with code {rc}", rc


def _session_members(sid: int) -> list[int]:
    """PIDs in session ``sid`` (each launched process leads its own session,
    so this finds everything it started that did not detach on purpose)."""
    me = os.getpid()
    pids: list[int] = []
    proc = Path("/proc")
    if proc.is_dir():
        for d in proc.iterdir():
            if not d.name.isdigit():
                continue
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[-1].split()
            # state ppid pgrp session ...
            if len(fields) > 3 and fields[3] == str(sid) and fields[0] != "Z":
                pid = int(d.name)
                if pid != me:
                    pids.append(pid)
        return pids
    pgrep = shutil.which("pgrep")
    if pgrep:
        try:
            out = subprocess.run([pgrep, "-s", str(sid)], capture_output=True, text=True, timeout=5)
            pids = [int(x) for x in out.stdout.split() if x.isdigit() and int(x) != me]
        except (OSError, subprocess.SubprocessError):
            pass
    return pids


@dataclass
class _Proc:
    label: str  # "rank 1 (host)" / "mpirun"
    popen: subprocess.Popen
    threads: list[threading.Thread] = field(default_factory=list)
    muted: bool = False  # drop its output (set once another rank failed)

    @property
    def sid(self) -> int:
        return self.popen.pid

    def signal_tree(self, sig: int, members_first: float = 0.0) -> None:
        """Signal the process, its process group and every process left in
        its session. ``members_first``: signal the others in its session (the
        ranks under mpirun) first and give them up to that long to exit
        before the process itself: mpirun answers a SIGTERM by killing its
        ranks at once, before rank 0 can answer its clients."""
        if members_first > 0:
            members = [pid for pid in _session_members(self.sid) if pid != self.popen.pid]
            for pid in members:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
            deadline = time.monotonic() + members_first
            while members and time.monotonic() < deadline:
                members = [pid for pid in members if pid in _session_members(self.sid)]
                time.sleep(0.02)
        if self.popen.poll() is None:
            try:
                self.popen.send_signal(sig)
            except OSError:
                pass
        try:
            os.killpg(self.sid, sig)
        except OSError:
            pass
        for pid in _session_members(self.sid):
            try:
                os.kill(pid, sig)
            except OSError:
                pass

    def tree_alive(self) -> bool:
        return self.popen.poll() is None or bool(_session_members(self.sid))


class _Interrupted(Exception):
    pass


class _Supervisor:
    def __init__(self, grace: float, monitor: HeartbeatMonitor | None = None,
                 stall_timeout: float = 0.0, n_ranks: int = 0, local_ranks: bool = True,
                 show_transport: bool = False) -> None:
        self.grace = grace
        self.show_transport = show_transport  # MLX's "[ring] ..." lines (--verbose)
        self.monitor = monitor
        self.stall_timeout = stall_timeout
        self.n_ranks = n_ranks
        self.local_ranks = local_ranks  # ranks' pids are this machine's
        self.procs: list[_Proc] = []
        self.wake = threading.Event()
        self.signals: list[int] = []
        self._saved: dict[int, object] = {}
        self.exits: list[tuple[_Proc, int]] = []  # in the order they happened
        self._exit_lock = threading.Lock()

    # signals ------------------------------------------------------------- #
    def _on_signal(self, signum, _frame) -> None:
        self.signals.append(signum)
        self.wake.set()

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
            if sig is None:
                continue
            try:
                self._saved[sig] = signal.signal(sig, self._on_signal)
            except (ValueError, OSError):  # pragma: no cover
                pass

    def restore(self) -> None:
        for sig, handler in self._saved.items():
            try:
                signal.signal(sig, handler)
            except (ValueError, OSError):  # pragma: no cover
                pass
        self._saved.clear()

    # processes ----------------------------------------------------------- #
    def spawn(self, label: str, argv: list[str], env: dict[str, str], *, terminal: bool,
              pipe_stderr_filter=None, prefix: bytes | None = None,
              cwd: str | None = None, demux_stdout: bool = False) -> _Proc:
        """Start one process in a new session. ``terminal``: it gets our stdin
        and stdout, and its stderr is copied to ours a line at a time (through
        ``pipe_stderr_filter`` if given); otherwise stdout and stderr are
        merged into one pipe, copied to our stderr with ``prefix``."""
        if self.signals:
            raise _Interrupted()
        stdin = None if terminal else subprocess.DEVNULL
        if terminal:
            stdout = subprocess.PIPE if demux_stdout else None
            stderr = subprocess.PIPE
            prefix = b""
        else:
            stdout = subprocess.PIPE
            stderr = subprocess.STDOUT
        try:
            popen = subprocess.Popen(
                argv, env=env, stdin=stdin, stdout=stdout, stderr=stderr,
                start_new_session=True, cwd=cwd, close_fds=True,
            )
        except OSError as e:
            raise UserError(f"cannot start {label}: {argv[0]}: {e.strerror or e}") from None
        proc = _Proc(label, popen)
        pipe = popen.stderr if terminal else popen.stdout
        if pipe is not None:
            fd = os.dup(pipe.fileno())
            pipe.close()
            t = threading.Thread(
                target=_pump_lines,
                args=(fd, prefix or b"", pipe_stderr_filter, proc, self.show_transport),
                name=f"mlxcel-dist-pump-{label}",
                daemon=True,
            )
            t.start()
            proc.threads.append(t)
        if terminal and demux_stdout and popen.stdout is not None:
            fd = os.dup(popen.stdout.fileno())
            popen.stdout.close()
            t = threading.Thread(target=_demux_reports, args=(fd, proc), daemon=True,
                                 name=f"mlxcel-dist-stdout-{label}")
            t.start()
            proc.threads.append(t)
        self.procs.append(proc)
        threading.Thread(target=self._waiter, args=(proc,), daemon=True,
                         name=f"mlxcel-dist-wait-{label}").start()
        return proc

    def _waiter(self, proc: _Proc) -> None:
        rc = proc.popen.wait()
        with self._exit_lock:
            self.exits.append((proc, rc))
        self.wake.set()

    def _wait_all(self, timeout: float, n_signals: int) -> bool:
        """True once every process exited; False after ``timeout`` or as soon
        as another signal arrives (an impatient second Ctrl-C)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not any(p.popen.poll() is None for p in self.procs):
                return True
            if len(self.signals) > n_signals:
                return False
            self.wake.clear()
            self.wake.wait(0.02)
        return not any(p.popen.poll() is None for p in self.procs)

    def stop_all(self, first: int) -> None:
        """first signal, then SIGTERM, then SIGKILL, ``grace`` seconds apart;
        another signal meanwhile goes straight to SIGKILL."""
        n_signals = len(self.signals)
        ladder = [first] + ([signal.SIGTERM] if first != signal.SIGTERM else [])
        for i, sig in enumerate(ladder):
            for p in self.procs:
                if p.popen.poll() is None:
                    p.signal_tree(sig, members_first=min(1.0, self.grace) if i == 0 else 0.0)
            if self._wait_all(self.grace, n_signals) or len(self.signals) > n_signals:
                break
        self.sweep()

    def sweep(self) -> None:
        """SIGKILL whatever is left of every session we started."""
        for p in self.procs:
            if p.tree_alive():
                p.signal_tree(signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        for p in self.procs:
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # pragma: no cover - unkillable
                pass
            # members of its session (e.g. mpirun's ranks) die a moment later
            while _session_members(p.sid) and time.monotonic() < deadline:
                time.sleep(0.01)

    def join_output(self) -> None:
        for p in self.procs:
            for t in p.threads:
                t.join(timeout=2.0)

    def _stop_stalled(self, rank: int, silent: float) -> int:
        """A rank went quiet: kill it (a stopped process only dies of
        SIGKILL), then the rest of the job."""
        _say(f"rank {rank} stopped making progress: no heartbeat for {silent:.0f} s "
             f"(--stall-timeout {self.stall_timeout:g}); stopping the job")
        pid = self.monitor.pids.get(rank) if self.monitor is not None else None
        if pid is not None and self.local_ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for p in self.procs:
            p.muted = True  # the others' "peer lost" noise hides the cause
        self.stop_all(signal.SIGTERM)
        self.join_output()
        return EXIT_STALLED

    def _root_cause(self, first: tuple[_Proc, int]) -> tuple[_Proc, int]:
        """The exit to blame. A killed rank's peers see the lost connection
        and exit with an error, sometimes before the kill is reaped here; so
        gather the exits of the next moment and prefer a death by SIGKILL,
        then by another signal, then the first error, then a lost link (a
        rank still finishing its own failing exit is reaped after the peers
        whose collectives it broke)."""
        # A collective error (exit 2 on every rank) is printed by rank 0 alone:
        # its line is the cause even when another rank's exit is seen first.
        speaker = self.procs[0] if first[1] == USAGE_EXIT else None
        # whatever else fails meanwhile is most likely the lost connection; a first
        # exit that is itself a lost link (exit 74) mutes no one: the cause is still to come
        cause = None if first[1] == EXIT_LINK_LOST else first[0]
        for p in self.procs:
            p.muted = cause is not None and p is not cause and p is not speaker
        deadline = time.monotonic() + CAUSE_WINDOW_S
        while time.monotonic() < deadline and len(self.exits) < len(self.procs):
            self.wake.clear()
            self.wake.wait(0.02)
        with self._exit_lock:
            exits = [(p, rc) for p, rc in self.exits if rc != 0]

        def rank(item):
            p, rc = item
            how = 0 if rc == -signal.SIGKILL else 1 if rc < 0 else 3 if rc == EXIT_LINK_LOST else 2
            return how, 0 if p is speaker and rc == USAGE_EXIT else 1

        return min(exits, key=rank) if exits else first

    def run(self, start, describe_failure=None) -> int:
        """Signals caught, ``start()`` (which spawns), then ``supervise``; a
        signal while starting stops what started, and nothing is left
        running on the way out."""
        try:
            self.install()
            start()
            return self.supervise(describe_failure)
        except _Interrupted:
            self.stop_all(signal.SIGTERM)
            self.join_output()
            return 128 + self.signals[0]
        finally:
            if self.procs and any(p.popen.poll() is None for p in self.procs):
                self.stop_all(signal.SIGTERM)
            self.restore()

    def supervise(self, describe_failure=None) -> int:
        """Wait for the job. Returns 0, the first failing process's code
        (128+N for signal N), or 128+signal when we were interrupted."""
        failed: tuple[_Proc, int] | None = None
        stalled: tuple[int, float] | None = None
        while True:
            if self.signals:
                break
            if self.monitor is not None and self.stall_timeout > 0:
                stalled = self.monitor.stalled(self.n_ranks, self.stall_timeout)
                if stalled is not None:
                    break
            with self._exit_lock:
                exits = list(self.exits)
            # In exit order: a rank that fails takes its peers down with it
            # (lost connection), and the one to name is the first.
            failed = next(((p, rc) for p, rc in exits if rc != 0), None)
            if failed is not None or len(exits) == len(self.procs):
                break
            self.wake.clear()
            self.wake.wait(0.1)
        if failed is not None and not self.signals:
            failed = self._root_cause(failed)
        if stalled is not None and not self.signals:
            return self._stop_stalled(*stalled)
        if failed is not None:
            for p in self.procs:
                p.muted = p is not failed[0]  # the others' "peer lost" noise hides the cause

        if self.signals:
            sig = self.signals[0]
            alive = sum(1 for p in self.procs if p.popen.poll() is None)
            _say(f"got {_signame(sig)}, stopping {alive} process(es)")
            self.stop_all(signal.SIGINT if sig == signal.SIGINT else signal.SIGTERM)
            self.join_output()
            return 128 + sig

        if failed is not None:
            proc, rc = failed
            others = [p for p in self.procs if p is not proc and p.popen.poll() is None]
            if others:
                self.stop_all(signal.SIGTERM)
            else:
                self.sweep()
            self.join_output()
            how, code = _describe_exit(rc)
            msg = describe_failure(proc, rc) if describe_failure else None
            if msg is None:
                msg = f"{proc.label} {how}"
                if others:
                    msg += f"; stopped the other {len(others)} rank(s)"
            if code != USAGE_EXIT:
                _say(msg)  # exit 2: the rank already printed its one "error: ..." line
            return code if code != 0 else 1

        self.sweep()
        self.join_output()
        return 0
