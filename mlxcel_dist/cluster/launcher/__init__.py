"""Start N ranks of a program, supervise them, return the job's exit code.

    launch(argv, np, backend, hostfile=None, *, python=sys.executable,
           module="mlxcel_dist.cli", script=None, env=None, ...) -> int

Every rank runs ``python -m <module> *argv`` (or ``python <script> *argv``)
with ``MLXCEL_DIST_WORLD=<np>`` and ``MLXCEL_DIST_BACKEND=<backend>`` in its
environment plus what the backend needs; on the rank side
:func:`mlxcel_dist.parallel.distributed.init_from_env` picks that up. (Precisely:
``python -c RANK_BOOTSTRAP -m <module> *argv``, which runs the module as
``__main__`` and turns a failing exit into ``os._exit`` so that a failed rank
never sits in MPI_Finalize waiting for ranks that wait for it.)

What each backend needs (ports, per-rank variables, files, one process per
rank or one command such as mpirun that starts them all, what ``auto``
picks) is its class in :mod:`mlxcel_dist.cluster.backends`; :func:`launch` resolves
the placement, asks ``backends.get(name).plan(job)`` what to start, and
starts it: a :class:`~mlxcel_dist.cluster.backends.Processes` plan one process per
rank (here, or over ``ssh`` on other hosts after one reachability probe per
host), a :class:`~mlxcel_dist.cluster.backends.Command` plan that one command.

Supervision: rank 0 gets the terminal's stdin and stdout; its stderr, and
the other ranks' stdout and stderr, go to our stderr a whole line at a time
(the others prefixed ``[rank N]``).
The first rank to fail is named in one stderr line and the others are
stopped (SIGTERM, then SIGKILL); SIGINT/SIGTERM on the launcher stops every
rank; each rank runs in its own session, which is swept at the end, so
nothing is left behind. A rank silent (no heartbeat) for the stall timeout
stops the job with exit 124.

Here: the job's validation, placement, environment and plan, and the start
of each rank in order; ``supervisor.py`` watches them, ``output.py`` carries
their lines, ``ssh.py`` reaches other hosts.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from .. import backends
from ..backends import (  # noqa: F401 - re-exported: the launcher's public API before backends/
    Command,
    Job,
    Processes,
    build_mpirun_command,
    default_backend,
    find_libmpi,
    find_mpirun,
)
from ...parallel.distributed import ENV_BACKEND, ENV_RANK, ENV_WORLD, RANK_BOOTSTRAP
from ...errors import UserError
from ..hostfile import host_ip, read_hostfile, total_slots
from ..watchdog import (
    DEFAULT_STALL_TIMEOUT_S,
    ENV_HEARTBEAT,
    ENV_LAUNCHER,
    INTERVAL_S as HEARTBEAT_S,
    HeartbeatMonitor,
    advertise_address,
    launcher_identity,
)
from .output import _say
from .ssh import SSH_OPTIONS, _preflight_hosts, ssh_command  # noqa: F401 - SSH_OPTIONS: the earlier public name
from .supervisor import GRACE_S, _Supervisor

__all__ = [
    "launch",
    "BACKEND_CHOICES",
    "default_backend",
    "find_mpirun",
    "find_libmpi",
    "build_mpirun_command",
    "ssh_command",
    "SSH_OPTIONS",
]

BACKEND_CHOICES = backends.names() + ("auto",)  # at import; launch() asks the registry

_PKG_ROOT = str(Path(__file__).resolve().parent.parent.parent.parent)  # the directory that holds mlxcel_dist


def _with_pythonpath(env: dict[str, str]) -> None:
    """Ranks import the same mlxcel_dist as the launcher, installed or not."""
    current = env.get("PYTHONPATH", "")
    parts = [p for p in current.split(os.pathsep) if p]
    if _PKG_ROOT not in parts:
        env["PYTHONPATH"] = os.pathsep.join([_PKG_ROOT, *parts])


# --------------------------------------------------------------------------- #
# Commands
# --------------------------------------------------------------------------- #


def _rank_command(python: str, module: str, script: str | None, argv: Sequence[str]) -> list[str]:
    """``python -m module argv`` through mlxcel_dist.parallel.distributed's bootstrap,
    which makes a failing rank exit without MPI_Finalize (see
    :func:`mlxcel_dist.parallel.distributed.exit_rank`)."""
    if script is not None:
        return [python, "-c", RANK_BOOTSTRAP, "--script", script, *argv]
    return [python, "-c", RANK_BOOTSTRAP, "-m", module, *argv]


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


def _wait_listening(ports: list[int], sup: _Supervisor, timeout: float) -> None:
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
    # Write the per-job files once (identical for every rank).
    local_files: dict[str, str] = {}
    for s in specs:
        for k, content in s.files.items():
            if k not in local_files:
                path = os.path.join(workdir, f"{k.lower()}.json")
                with open(path, "w", encoding="utf-8") as f:
                    f.write(content)
                local_files[k] = path

    def start() -> None:
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

    return sup.run(start)


def _launch_command(plan: Command, verbose: bool, grace: float, watch: dict) -> int:
    """One command (e.g. mpirun) that starts every rank itself; its stderr
    goes through the plan's filter, a failure is named by the plan."""
    if verbose:
        _say(shlex.join(plan.argv))
    sup = _Supervisor(grace, **watch)
    describe = None if plan.describe_failure is None else (lambda _proc, rc: plan.describe_failure(rc))

    def start() -> None:
        sup.spawn(plan.label, plan.argv, plan.env, terminal=True, pipe_stderr_filter=plan.stderr_filter,
                  demux_stdout=plan.reports_on_stdout)

    return sup.run(start, describe)
