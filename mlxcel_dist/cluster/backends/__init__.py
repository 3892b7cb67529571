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
  :func:`mlxcel_dist.parallel.distributed.init_from_env` adds to its one-line error
  when the backend does not start.

:mod:`mlxcel_dist.cluster.launcher` starts and supervises what ``plan`` returns and
has no per-backend code. Adding a backend is one module here (its class registered with
``@register``, imported below) plus its tests (tests/test_backends.py).

Only the standard library at import time (the CLI's ``--help`` imports this
module; mlx is imported only to ask whether CUDA is there), and never
distributed.py (see watchdog.py: ranks under MPI must not import it early).
"""

from __future__ import annotations

from .base import Backend, Command, Job, Processes, RankSpec, free_ports, port_from_env, signame
from .registry import BACKENDS, check_choice, default_backend, get, identity_vars, names, register

# Each module registers its class on import, in names()' order (the CLI's choices).
from .ring import Ring  # noqa: I001 - the order is the registry's
from .mpi import Mpi, MpirunStderr, build_mpirun_command, find_libmpi, find_mpirun
from .nccl import Nccl
from .jaccl import Jaccl

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
    "Ring",
    "Mpi",
    "Nccl",
    "Jaccl",
    "free_ports",
    "port_from_env",
    "signame",
]
