"""The rank side of a launched job.

A process started by :func:`mlxcel_dist.cluster.launcher.launch` (or by hand, following
the same contract) finds these variables in its environment:

``MLXCEL_DIST_WORLD``
    number of ranks the job was launched with (the contract's on-switch).
``MLXCEL_DIST_BACKEND``
    a name from :mod:`mlxcel_dist.cluster.backends` (``ring`` | ``mpi`` | ``nccl`` | ``jaccl``).
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

from ..cluster import backends
from ..cluster import faults
from ..cluster.watchdog import env_rank, joining
from .collectives import SINGLE, CollectiveError, Group, link_lost
from ..errors import UserError

ENV_WORLD = "MLXCEL_DIST_WORLD"
ENV_BACKEND = "MLXCEL_DIST_BACKEND"
ENV_RANK = "MLXCEL_DIST_RANK"
# Rank 0's report lines (stats, errors) sent along stdout when the launcher
# asks (MLXCEL_DIST_REPORTS_ON_STDOUT=1): a line starting with this marker
# goes to the launcher's stderr, in order with the text around it.
REPORT_MARKER = "\x1emlxcel-dist-report\x1f"

BACKENDS = backends.names()  # what MLXCEL_DIST_BACKEND may name

_group: Group | None = None  # the joined group, once init_from_env ran

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


def init_from_env() -> Group:
    """Join the launched backend and return its group (`collectives.Group`),
    or `collectives.SINGLE` when this process was not started as a rank
    (``MLXCEL_DIST_WORLD`` unset).

    Raises UserError when the backend cannot start or its group is not the
    launched size. Calling it again returns the same group.
    """
    global _group
    world = launched_world()
    if world is None:
        return SINGLE
    if _group is not None:
        return _group
    backend = os.environ.get(ENV_BACKEND, "").strip()
    if backend not in BACKENDS:
        raise UserError(
            f"{ENV_BACKEND}={backend!r} is not one of {', '.join(BACKENDS)}"
        )

    import mlx.core as mx

    _line_buffer_output()
    spec = backends.get(backend)
    hint = spec.hint
    if world == 1 and not spec.real_at_one_rank:
        # Nothing to connect: a singleton group, without touching the named
        # backend (MLX's MPI backend refuses a 1-process world after MPI_Init
        # and never finalizes, which makes mpirun report a failure). The ring
        # backend, unconfigured, yields the singleton group.
        raw = mx.distributed.init(strict=False, backend="ring")
    else:
        if not mx.distributed.is_available(backend):
            raise UserError(
                f"this mlx build has no {backend} backend ({hint})"
            )
        faults.at("join", env_rank())
        try:
            with joining():  # (the connect holds the GIL: no heartbeats until it returns)
                raw = mx.distributed.init(strict=True, backend=backend)
        except (RuntimeError, ValueError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            detail = spec.failure_detail()
            extra = f"; {detail}" if detail else ""
            raise UserError(
                f"cannot start the {backend} backend for {world} ranks: {first}{extra} ({hint})"
            ) from None
    size = raw.size()
    if size != world:
        detail = spec.failure_detail()
        extra = f"; {detail}" if detail else ""
        raise UserError(
            f"the {backend} backend formed a group of {size} rank(s) but {world} were "
            f"launched{extra} ({hint})"
        )
    expected_rank = os.environ.get(ENV_RANK, "").strip()
    if expected_rank and expected_rank != str(raw.rank()):
        raise UserError(
            f"launched as rank {expected_rank} but the {backend} backend made this "
            f"process rank {raw.rank()}"
        )
    _group = Group(raw)
    _group.backend = backend
    return _group


def world() -> Group:
    """This process's place in the job: the group once :func:`init_from_env`
    joined it; before that, a launched rank's place read from the launch
    environment (``MLXCEL_DIST_RANK``, ``MLX_RANK`` or MPI's variables; a
    planned group, no collective runs); a plain process: `SINGLE`."""
    if _group is not None:
        return _group
    size = launched_world() or 1
    r = env_rank() or 0
    return Group.planned(size, r if 0 <= r < size else 0)


def check_cluster(group: Group, model, present: bool) -> None:
    """Before loading: every rank must run the same mlx and mlxcel-dist and
    be able to reach the model (`present`: this rank's loader.model_present).
    One gather of a small table (a row per rank: host, versions, model
    flag); every rank raises the same one-line CollectiveError, so rank 0
    alone reports it."""
    import socket

    import mlx.core as mx
    import numpy as np

    from .. import __version__
    from ..cluster import faults

    if group.single:
        return
    width = 96
    versions = faults.versions(f"mlx {mx.__version__}, mlxcel-dist {__version__}", group.rank())
    present = faults.model_present(present, group.rank())
    row = np.zeros(2 * width + 1, dtype=np.int32)
    for j, text in enumerate((socket.gethostname(), versions)):
        raw = text.encode()[:width]
        row[j * width : j * width + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    row[-1] = 1 if present else 0
    table = group.gather_rows(row, dtype=np.int32).astype(np.int64)

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
        raise CollectiveError("ranks run different versions: " + "; ".join(parts)
                              + " (install the same versions on every host)")
    missing = [r for r in range(group.size()) if table[r, -1] == 0]
    if missing:
        where = ", ".join(f"rank {r} ({hosts[r]})" for r in missing)
        name = "the embedded default model" if model is None else f"model {model}"
        raise CollectiveError(f"{name} not found on {where} (launch without --no-fetch to send each host "
                              "its shard, or copy it to the same path on every host)")


# --------------------------------------------------------------------------- #
# Rank entry point
# --------------------------------------------------------------------------- #

# What the launcher runs in every rank:
#   python -c RANK_BOOTSTRAP -m <module> <args...>
#   python -c RANK_BOOTSTRAP --script <path> <args...>
# (this rank's GPU first, before anything imports MLX: mpirun's ranks share one environment)
RANK_BOOTSTRAP = ("import mlxcel_dist.cluster.gpus as g; g.place(); "
                  "import mlxcel_dist.parallel.distributed as d; d._rank_main()")


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


def _rank_main() -> None:
    """Run ``-m module`` or ``--script path`` with the remaining arguments as
    ``__main__`` (as ``python -m module args`` would) and turn every failing
    exit into :func:`exit_rank`."""
    import runpy
    import traceback

    from ..cluster.watchdog import EXIT_LINK_LOST, start_rank_watchdog

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
        if link_lost(e):
            # A peer died or the link broke: the launcher names the cause;
            # this rank's traceback would only bury it.
            first = str(e).strip().splitlines()[0]
            print(f"error: rank {world().rank()} lost its connection to the other ranks: {first}",
                  file=sys.stderr)
            code = EXIT_LINK_LOST
        else:
            traceback.print_exc()
            code = 1
    except BaseException:  # noqa: BLE001 - report like the interpreter would
        traceback.print_exc()
        code = 1
    if code != 0 and (launched_world() or 1) > 1:
        exit_rank(code)
    if _group is not None:  # a joined rank that succeeded: the backend's own ending (mpi: finalize)
        backends.get(os.environ[ENV_BACKEND].strip()).finish_rank()
    sys.exit(code)
