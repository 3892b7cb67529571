"""What a backend is given and hands back (:class:`Job`, :class:`RankSpec`,
:class:`Processes`, :class:`Command`), the :class:`Backend` base class, and
the small helpers the backends share (free ports, a fixed port from the
environment, signal names). Standard library only."""

from __future__ import annotations

import functools
import os
import signal
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from ...errors import UserError
from ..hostfile import Host, HostfileInfo, assign_ranks


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
