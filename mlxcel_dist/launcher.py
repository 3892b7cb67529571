"""Start N ranks of a program, supervise them, return the job's exit code.

    launch(argv, np, backend, hostfile=None, *, python=sys.executable,
           module="mlxcel_dist.cli", script=None, env=None, ...) -> int

Every rank runs ``python -m <module> *argv`` (or ``python <script> *argv``)
with ``MLXCEL_DIST_WORLD=<np>`` and ``MLXCEL_DIST_BACKEND=<backend>`` in its
environment plus what the backend needs; on the rank side
:func:`mlxcel_dist.distributed.init_from_env` picks that up. (Precisely:
``python -c RANK_BOOTSTRAP -m <module> *argv``, which runs the module as
``__main__`` and turns a failing exit into ``os._exit`` so that a failed rank
never sits in MPI_Finalize waiting for ranks that wait for it.)

What each backend needs (ports, per-rank variables, files, one process per
rank or one command such as mpirun that starts them all, what ``auto``
picks) is its class in :mod:`mlxcel_dist.backends`; :func:`launch` resolves
the placement, asks ``backends.get(name).plan(job)`` what to start, and
starts it: a :class:`~mlxcel_dist.backends.Processes` plan one process per
rank (here, or over ``ssh`` on other hosts after one reachability probe per
host), a :class:`~mlxcel_dist.backends.Command` plan that one command.

Supervision: rank 0 gets the terminal's stdin and stdout; its stderr, and
the other ranks' stdout and stderr, go to our stderr a whole line at a time
(the others prefixed ``[rank N]``).
The first rank to fail is named in one stderr line and the others are
stopped (SIGTERM, then SIGKILL); SIGINT/SIGTERM on the launcher stops every
rank; each rank runs in its own session, which is swept at the end, so
nothing is left behind. A rank silent (no heartbeat) for the stall timeout
stops the job with exit 124.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from . import backends
from .backends import (  # noqa: F401 - re-exported: the launcher's public API before backends.py
    Command,
    Job,
    Processes,
    build_mpirun_command,
    default_backend,
    find_libmpi,
    find_mpirun,
    signame as _signame,
)
from .distributed import ENV_BACKEND, ENV_RANK, ENV_WORLD, RANK_BOOTSTRAP, REPORT_MARKER
from .errors import UserError
from .hostfile import Host, host_ip, read_hostfile, total_slots
from .watchdog import (
    DEFAULT_STALL_TIMEOUT_S,
    ENV_HEARTBEAT,
    EXIT_LINK_LOST,
    ENV_LAUNCHER,
    INTERVAL_S as HEARTBEAT_S,
    HeartbeatMonitor,
    advertise_address,
    launcher_identity,
)

__all__ = [
    "launch",
    "BACKEND_CHOICES",
    "default_backend",
    "find_mpirun",
    "find_libmpi",
    "build_mpirun_command",
]

BACKEND_CHOICES = backends.names() + ("auto",)  # at import; launch() asks the registry

GRACE_S = 3.0  # between SIGINT -> SIGTERM -> SIGKILL
EXIT_STALLED = 124  # like timeout(1)
USAGE_EXIT = UserError.exit_code  # a rank's UserError: bad input, already reported by the rank
CAUSE_WINDOW_S = 0.5  # after the first failure, exits gathered before naming the cause

_PKG_ROOT = str(Path(__file__).resolve().parent.parent)

def _say(msg: str) -> None:
    """One line on the launcher's stderr."""
    try:
        sys.stderr.write(f"mlxcel-dist: {msg}\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # pragma: no cover - closed stderr
        pass



def _with_pythonpath(env: dict[str, str]) -> None:
    """Ranks import the same mlxcel_dist as the launcher, installed or not."""
    current = env.get("PYTHONPATH", "")
    parts = [p for p in current.split(os.pathsep) if p]
    if _PKG_ROOT not in parts:
        env["PYTHONPATH"] = os.pathsep.join([_PKG_ROOT, *parts])


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


# --------------------------------------------------------------------------- #
# Output pumps
# --------------------------------------------------------------------------- #

_out_lock = threading.Lock()
_LINE_RE = re.compile(rb"[^\r\n]*(?:\r\n|\n|\r)")


def _write_stream(stream, data: bytes) -> None:
    with _out_lock:
        try:
            buf = getattr(stream, "buffer", None)
            if buf is not None:
                buf.write(data)
            else:
                stream.write(data.decode("utf-8", errors="replace"))
            stream.flush()
        except (OSError, ValueError):  # pragma: no cover - closed stream
            pass


# Some of MLX's backends log every failed socket operation once a peer is
# gone ("[ring] Socket 6 was closed by the peer" x10 per rank): those whose
# class says ``logs_peer_loss``. The launcher names the rank that failed;
# these lines are shown with --verbose only.
_TRANSPORT_NOISE = re.compile(
    rb"^(?:\[rank \d+\] )?\[(?:"
    + b"|".join(re.escape(b.name.encode()) for b in backends.BACKENDS.values() if b.logs_peer_loss)
    + rb")\] "
)


def _pump_lines(fd: int, prefix: bytes, transform=None, proc=None, show_transport: bool = False) -> None:
    """Copy a pipe to our stderr a whole line at a time (never half a line
    of one rank inside a line of another), each line prefixed. ``transform``
    (line -> bytes to write) may hold lines back or drop them."""
    pending = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            chunk = b""
        if not chunk:
            break
        pending += chunk
        pos = 0
        out = []
        for m in _LINE_RE.finditer(pending):
            line = prefix + m.group(0)
            pos = m.end()
            if not show_transport and _TRANSPORT_NOISE.match(line):
                continue
            out.append(transform(line) if transform is not None else line)
        pending = pending[pos:]
        data = b"".join(out)
        if data and not (proc is not None and proc.muted):
            _write_stream(sys.stderr, data)
    tail = prefix + pending + b"\n" if pending else b""
    if transform is not None:
        tail = (transform(tail) if tail else b"") + transform.finish()
    if tail and not (proc is not None and proc.muted):
        _write_stream(sys.stderr, tail)
    try:
        os.close(fd)
    except OSError:
        pass


_MARK = REPORT_MARKER.encode()


def _demux_reports(fd: int, proc=None) -> None:
    """Copy rank 0's stdout (through a command that relays it, e.g. mpirun)
    to ours as it comes, text streaming unbuffered, except lines that start
    with REPORT_MARKER: those go to our stderr, unmarked, in order."""
    held = b""  # the start of a line that may still become a marked one
    at_line_start = True
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            chunk = b""
        if not chunk:
            break
        data, held = held + chunk, b""
        out, err = [], []
        while data:
            if at_line_start and (data.startswith(_MARK) or _MARK.startswith(data)):
                end = data.find(b"\n")
                if end < 0 or not data.startswith(_MARK):
                    held = data  # the marker or its line is not whole yet
                    break
                err.append(data[len(_MARK) : end + 1])
                data = data[end + 1 :]
                continue
            end = data.find(b"\n")
            piece = data if end < 0 else data[: end + 1]
            out.append(piece)
            at_line_start = end >= 0
            data = data[len(piece) :]
        muted = proc is not None and proc.muted
        if out and not muted:
            _write_stream(sys.stdout, b"".join(out))
        if err and not muted:
            _write_stream(sys.stderr, b"".join(err))
    if held and not (proc is not None and proc.muted):
        _write_stream(sys.stdout, held[len(_MARK):] if held.startswith(_MARK) else held)
    try:
        os.close(fd)
    except OSError:
        pass


# --------------------------------------------------------------------------- #
# Process supervision
# --------------------------------------------------------------------------- #


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
        for p in self.procs:
            # whatever else fails meanwhile is most likely the lost connection
            p.muted = p is not first[0] and p is not speaker
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
                if p is not failed[0]:
                    p.muted = True  # their "peer lost" noise hides the cause

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


# --------------------------------------------------------------------------- #
# Commands
# --------------------------------------------------------------------------- #


def _rank_command(python: str, module: str, script: str | None, argv: Sequence[str]) -> list[str]:
    """``python -m module argv`` through mlxcel_dist.distributed's bootstrap,
    which makes a failing rank exit without MPI_Finalize (see
    :func:`mlxcel_dist.distributed.exit_rank`)."""
    if script is not None:
        return [python, "-c", RANK_BOOTSTRAP, "--script", script, *argv]
    return [python, "-c", RANK_BOOTSTRAP, "-m", module, *argv]


def _remote_script(env: Mapping[str, str], files: Mapping[str, str], cmd: Sequence[str], cwd: str) -> str:
    q = shlex.quote
    parts = ["stty -echo -onlcr 2>/dev/null", f"cd {q(cwd)} 2>/dev/null"]
    for k, v in env.items():
        parts.append(f"export {k}={q(v)}")
    for k, content in files.items():
        parts.append(f'f=$(mktemp) && printf %s {q(content)} >"$f" && export {k}="$f"')
    parts.append("exec " + " ".join(q(a) for a in cmd))
    return "; ".join(parts)


SSH_CONNECT_TIMEOUT_S = 10
# Never prompt (a rank cannot answer), give up on a silent host.
SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_CONNECT_TIMEOUT_S}")


def _preflight_hosts(hosts: Sequence[Host], timeout: float = SSH_CONNECT_TIMEOUT_S + 5) -> None:
    """Reach every remote host over ssh once (in parallel) before starting
    anything, so a host that does not resolve or answer is one clear error
    instead of a rank (or an mpirun daemon) failing mid-start."""
    names = list(dict.fromkeys(h.name for h in hosts))
    failures: dict[str, str] = {}

    def probe(name: str) -> None:
        cmd = ["ssh", *SSH_OPTIONS, name, "true"]
        try:
            p = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, timeout=timeout)
        except FileNotFoundError:
            failures[name] = "no ssh client on this machine"
            return
        except subprocess.TimeoutExpired:
            failures[name] = f"no answer within {timeout:g} s"
            return
        if p.returncode != 0:
            lines = [x for x in p.stderr.decode(errors="replace").splitlines() if x.strip()]
            failures[name] = lines[-1].strip() if lines else f"ssh exited with code {p.returncode}"

    threads = [threading.Thread(target=probe, args=(n,), daemon=True) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        name = next(n for n in names if n in failures)
        more = f" (and {len(failures) - 1} more host(s))" if len(failures) > 1 else ""
        raise UserError(f"cannot reach host {name} over ssh: {failures[name]}{more}")


def ssh_command(host: Host, env: Mapping[str, str], files: Mapping[str, str],
                cmd: Sequence[str], cwd: str) -> list[str]:
    """argv that starts one rank on ``host`` over ssh. ``-tt`` gives the
    remote command a terminal so that ending the local ssh hangs it up."""
    return [
        "ssh", "-tt", *SSH_OPTIONS,
        "-o", "LogLevel=QUIET",
        host.name,
        _remote_script(env, files, cmd, cwd),
    ]



# --------------------------------------------------------------------------- #
# launch()
# --------------------------------------------------------------------------- #


def launch(
    argv: Sequence[str],
    np: int,
    backend: str,
    hostfile: str | None = None,
    *,
    python: str = sys.executable,
    module: str = "mlxcel_dist.cli",
    script: str | None = None,
    env: Mapping[str, str] | None = None,
    mpi_args: Sequence[str] | None = None,
    verbose: bool = False,
    grace: float = GRACE_S,
    stall_timeout: float = DEFAULT_STALL_TIMEOUT_S,
) -> int:
    """Run ``np`` ranks of ``python -m module *argv`` (``python script *argv``
    when ``script`` is given) over ``backend`` and return the job's exit code.

    ``hostfile``: OpenMPI text or MLX JSON; without it every rank runs here.
    ``env``: extra variables for every rank. ``mpi_args``: extra mpirun
    arguments (default: shlex-split ``$MLXCEL_MPI_ARGS``). ``stall_timeout``:
    a rank silent (no heartbeat) this long stops the job with exit 124
    (0 = never).
    Bad input raises UserError.
    """
    if isinstance(np, bool) or not isinstance(np, int):
        raise UserError(f"the number of ranks must be an integer, not {np!r}")
    if np < 1:
        raise UserError(f"the number of ranks must be at least 1, not {np}")
    if not isinstance(stall_timeout, (int, float)) or stall_timeout < 0 or stall_timeout != stall_timeout:
        raise UserError(f"the stall timeout must be >= 0 seconds (0 = off), not {stall_timeout!r}")
    if 0 < stall_timeout < 3 * HEARTBEAT_S:
        raise UserError(f"a stall timeout of {stall_timeout:g} s is shorter than 3 heartbeats "
                        f"({3 * HEARTBEAT_S:g} s)")
    backends.check_choice(backend)
    argv = [str(a) for a in argv]
    if not (os.path.isfile(python) and os.access(python, os.X_OK)) and shutil.which(python) is None:
        raise UserError(f"no such python: {python}")
    if script is not None and not Path(script).is_file():
        raise UserError(f"no such script: {script}")

    if hostfile is not None:
        info = read_hostfile(hostfile)
        slots = total_slots(info.hosts)
        if np > slots:
            raise UserError(
                f"{np} ranks asked for but hostfile {hostfile} has only {slots} slot(s)"
            )
        job = Job.on_hosts(info, np, python=python)
    else:
        job = Job.local(np, python=python)

    if backend == "auto":
        backend = default_backend(job.single_node, job.info, python)
        if verbose:
            _say(f"backend auto -> {backend}")
    job.rank_cmd = _rank_command(python, module, script, argv)
    if mpi_args is None:
        mpi_args = shlex.split(os.environ.get("MLXCEL_MPI_ARGS", ""))
    job.extra_args = list(mpi_args)

    if job.single_node:
        monitor = HeartbeatMonitor("127.0.0.1")
    else:
        # Remote ranks report back to this machine's address on the route to
        # them; the token keeps anyone else's datagrams out.
        first_remote = job.remote_hosts[0]
        remote_ip = first_remote.ips[0] if first_remote.ips else host_ip(first_remote)
        monitor = HeartbeatMonitor("0.0.0.0", advertise_address(remote_ip))
    try:
        return _launch_job(job, backends.get(backend), env, verbose, grace, monitor, stall_timeout)
    finally:
        monitor.close()


def _launch_job(job: Job, backend: backends.Backend, env: Mapping[str, str] | None, verbose: bool,
                grace: float, monitor: HeartbeatMonitor, stall_timeout: float) -> int:
    """Fill in the job's environment, ask the backend what to start, start
    it and supervise it."""
    base_env = dict(os.environ)
    job_env: dict[str, str] = {}
    if job.info is not None:
        job_env.update(job.info.envs)
    if env:
        job_env.update({str(k): str(v) for k, v in env.items()})
    job_env[ENV_WORLD] = str(job.np)
    job_env[ENV_BACKEND] = backend.name
    job_env[ENV_HEARTBEAT] = monitor.env_value
    job_env[ENV_LAUNCHER] = launcher_identity()
    watch = dict(monitor=monitor, stall_timeout=float(stall_timeout), n_ranks=job.np,
                 local_ranks=job.single_node, show_transport=verbose)
    base_env.update(job_env)
    _with_pythonpath(base_env)
    job_env["PYTHONPATH"] = base_env["PYTHONPATH"]
    # A rank's identity inherited from a parent job would make it join the
    # wrong group (the one-rank path starts an unconfigured ring, for one).
    for k in (ENV_RANK, *backends.identity_vars()):
        if k not in job_env:
            base_env.pop(k, None)
    job.env = base_env
    job.exported = list(job_env)

    workdir = tempfile.mkdtemp(prefix="mlxcel-dist-")
    try:
        job.workdir = workdir
        # Validate everything first: the ssh probe is the first packet a job sends.
        plan = backend.plan(job)
        if job.remote_hosts:
            _preflight_hosts(job.remote_hosts)
        for msg in plan.warnings:
            _say(msg)
        if verbose:
            for msg in plan.notes:
                _say(msg)
        if isinstance(plan, Command):
            return _launch_command(plan, verbose, grace, watch)
        return _launch_processes(plan, job.rank_cmd, base_env, job_env, workdir, job.single_node,
                                 verbose, grace, watch)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _listening_ports() -> set[int] | None:
    """TCP ports in LISTEN state on this machine (Linux /proc), or None."""
    ports: set[int] = set()
    found = False
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name, encoding="ascii") as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    if len(fields) > 3 and fields[3] == "0A":  # TCP_LISTEN
                        ports.add(int(fields[1].rsplit(":", 1)[1], 16))
            found = True
        except (OSError, ValueError):
            continue
    return ports if found else None


def _wait_listening(ports: list[int], sup: "_Supervisor", timeout: float) -> None:
    """Wait until ``ports`` listen, a started rank exits, or a signal comes.
    Without /proc (macOS) a short pause stands in."""
    deadline = time.monotonic() + timeout
    if _listening_ports() is None:
        sup.wake.wait(0.3)
        return
    while time.monotonic() < deadline:
        if sup.signals or any(p.popen.poll() is not None for p in sup.procs):
            return
        listening = _listening_ports() or set()
        if all(p in listening for p in ports):
            return
        sup.wake.clear()
        sup.wake.wait(0.01)



def _launch_processes(plan: Processes, rank_cmd: list[str], base_env: dict[str, str],
                      job_env: dict[str, str], workdir: str, single_node: bool, verbose: bool,
                      grace: float, watch: dict) -> int:
    """One process per rank, here or over ssh."""
    sup = _Supervisor(grace, **watch)
    cwd = os.getcwd()
    specs = plan.specs
    try:
        # Write the per-job files once (identical for every rank).
        local_files: dict[str, str] = {}
        for s in specs:
            for k, content in s.files.items():
                if k not in local_files:
                    path = os.path.join(workdir, f"{k.lower()}.json")
                    with open(path, "w", encoding="utf-8") as f:
                        f.write(content)
                    local_files[k] = path
        sup.install()
        for s in specs:
            label = f"rank {s.rank}" + (f" ({s.host.name})" if s.host is not None else "")
            rank_env = {ENV_RANK: str(s.rank), **s.env}
            if s.host is None or s.host.is_local:
                env = dict(base_env)
                env.update(rank_env)
                for k in s.files:
                    env[k] = local_files[k]
                argv = rank_cmd
            else:
                env = dict(base_env)
                remote_env = dict(job_env)
                remote_env.update(rank_env)
                argv = ssh_command(s.host, remote_env, s.files, rank_cmd, cwd)
            if verbose:
                _say(f"{label}: {shlex.join(argv)}")
            if s.rank == len(specs) - 1 and len(specs) > 1 and single_node and plan.last_waits_for:
                _wait_listening(plan.last_waits_for, sup, timeout=30.0)
            sup.spawn(label, argv, env, terminal=(s.rank == 0),
                      prefix=f"[rank {s.rank}] ".encode())
        return sup.supervise()
    except _Interrupted:
        sup.stop_all(signal.SIGTERM)
        sup.join_output()
        return 128 + sup.signals[0]
    finally:
        if sup.procs and any(p.popen.poll() is None for p in sup.procs):
            sup.stop_all(signal.SIGTERM)
        sup.restore()


def _launch_command(plan: Command, verbose: bool, grace: float, watch: dict) -> int:
    """One command (e.g. mpirun) that starts every rank itself; its stderr
    goes through the plan's filter, a failure is named by the plan."""
    if verbose:
        _say(shlex.join(plan.argv))
    sup = _Supervisor(grace, **watch)
    describe = None
    if plan.describe_failure is not None:
        def describe(_proc: _Proc, rc: int) -> str | None:
            return plan.describe_failure(rc)

    try:
        sup.install()
        sup.spawn(plan.label, plan.argv, plan.env, terminal=True, pipe_stderr_filter=plan.stderr_filter,
                  demux_stdout=plan.reports_on_stdout)
        return sup.supervise(describe)
    except _Interrupted:
        sup.stop_all(signal.SIGTERM)
        sup.join_output()
        return 128 + sup.signals[0]
    finally:
        if sup.procs and any(p.popen.poll() is None for p in sup.procs):
            sup.stop_all(signal.SIGTERM)
        sup.restore()
