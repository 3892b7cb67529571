"""The registry of backends: ``register`` (a class decorator), ``get``,
``names``, ``check_choice``, ``identity_vars`` and ``default_backend`` (what
``--backend auto`` becomes)."""

from __future__ import annotations

from ...errors import UserError
from ..hostfile import HostfileInfo
from .base import Backend

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
