"""Liveness between the launcher and its ranks (stdlib only: a rank starts
this before it imports anything heavy).

Ranks -> launcher: each rank's daemon thread sends a UDP heartbeat,
``"<token> <rank> <pid>"``, every ``INTERVAL_S`` to the address in
``MLXCEL_DIST_HEARTBEAT`` (``host:port:token``). MLX and numpy release the GIL
while they compute and Python threads switch every few ms, so a rank that is
loading, downloading or in a long prefill keeps beating; only a rank that is
stopped (SIGSTOP, a frozen host) or cut off from the launcher goes quiet. The
launcher's :class:`HeartbeatMonitor` names the first rank silent for the stall
timeout and the job is stopped. A collective stuck on a silent peer does not
silence the waiting ranks, so the rank named is the one that stopped.

Launcher -> ranks: the same thread ends the rank when its parent (the
launcher, mpirun's daemon, or sshd) is gone, so a launcher killed with
SIGKILL leaves no rank behind blocked in a collective.

Joining: MLX's backends hold the GIL while they connect (`mx.distributed.init`
waits for every peer with the heartbeat thread starved), so a rank says
``joining`` first and the launcher allows it `JOIN_TIMEOUT_S` of silence: a
peer late to start (a loaded box) is not a stall; a peer stopped before it
joins is still named by its own silence.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading
import time

ENV_HEARTBEAT = "MLXCEL_DIST_HEARTBEAT"
ENV_LAUNCHER = "MLXCEL_DIST_LAUNCHER"  # "host:pid:start" of the launcher process
INTERVAL_S = 1.0
DEFAULT_STALL_TIMEOUT_S = 30.0
JOIN_TIMEOUT_S = 120.0  # the silence allowed a rank inside its backend's connect
JOINING = b"+joining"  # the beat that says so (the next plain beat ends it)
EXIT_ORPHANED = 75  # a rank whose launcher is gone (nobody reads this code)
# A rank whose collective failed because a peer died or the link broke
# (EX_IOERR): the launcher blames another rank's exit before this one.
EXIT_LINK_LOST = 74


def env_rank() -> int | None:
    """The rank the launch environment gives this process (ours, the ring's,
    or MPI's variables), or None when it gives none. distributed.rank() uses
    it; it lives here because this module must not import distributed.py:
    when it did, MPI ranks exited without MPI_Finalize (prterun: "exiting
    improperly"), seen in tests/test_launcher.py::test_allsum_job."""
    for var in ("MLXCEL_DIST_RANK", "MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"):
        v = os.environ.get(var, "").strip()
        if v.isdigit():
            return int(v)
    return None


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks (Linux), to tell a pid reused
    by another process from the one we knew; "" where /proc is missing."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def launcher_identity() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{_start_time(os.getpid())}"


def _launcher_alive(identity: str) -> bool:
    """False only when the launcher ran on this host and is gone."""
    try:
        host, pid_s, start = identity.rsplit(":", 2)
        pid = int(pid_s)
    except ValueError:
        return True
    if host != socket.gethostname():
        return True  # another host's: its ssh or mpirun ends us
    if start:
        return _start_time(pid) == start
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass
    return True


def _parse_target(value: str) -> tuple[str, int, str] | None:
    try:
        host, port, token = value.rsplit(":", 2)
        return host.strip("[]"), int(port), token
    except ValueError:
        return None


def heartbeat_target() -> tuple[str, int, str] | None:
    """(launcher host, port, token) from this rank's environment, or None."""
    return _parse_target(os.environ.get(ENV_HEARTBEAT, ""))


def start_rank_watchdog() -> threading.Thread | None:
    """Start the heartbeat / orphan thread of a launched rank (idempotent)."""
    if getattr(start_rank_watchdog, "_thread", None) is not None:
        return start_rank_watchdog._thread  # type: ignore[attr-defined]
    target = heartbeat_target()
    rank = env_rank()
    parent = os.getppid()
    launcher = os.environ.get(ENV_LAUNCHER, "")
    sock = None
    addr = None
    if target is not None and rank is not None:
        try:
            infos = socket.getaddrinfo(target[0], target[1], type=socket.SOCK_DGRAM)
            family, _, _, _, addr = infos[0]
            sock = socket.socket(family, socket.SOCK_DGRAM)
            # connected: bound to the route's source address (loopback for a
            # single-node job), never to every interface
            sock.connect(addr)
        except OSError:
            sock = None
    message = f"{target[2]} {rank} {os.getpid()}".encode() if sock is not None else b""

    def run() -> None:
        while True:
            if os.getppid() != parent or (launcher and not _launcher_alive(launcher)):
                # Orphaned: whoever started us is gone (under mpirun: the
                # launcher above mpirun) and nobody will read our output or
                # stop us; peers blocked on us end the same way.
                os._exit(EXIT_ORPHANED)
            if sock is not None:
                try:
                    sock.send(message)
                except OSError:
                    pass
            time.sleep(INTERVAL_S)

    t = threading.Thread(target=run, name="mlxcel-dist-heartbeat", daemon=True)
    t.start()
    start_rank_watchdog._thread = t  # type: ignore[attr-defined]
    start_rank_watchdog._beat = (sock, message) if sock is not None else None  # type: ignore[attr-defined]
    return t


@contextlib.contextmanager
def joining():
    """Around the backend's connect, where this rank cannot beat: the
    launcher told before, and beaten to at once after (a rank not started
    by the launcher: nothing to tell)."""
    _beat_now(JOINING)
    try:
        yield
    finally:
        _beat_now()


def _beat_now(*extra: bytes) -> None:
    beat = getattr(start_rank_watchdog, "_beat", None)
    if beat is not None:
        try:
            beat[0].send(b" ".join([beat[1], *extra]))
        except OSError:
            pass


class HeartbeatMonitor:
    """The launcher's end: one UDP socket, one thread recording when each
    rank was last heard from. Datagrams without the job's token are ignored."""

    def __init__(self, bind_host: str = "127.0.0.1", advertise_host: str | None = None) -> None:
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        self.sock.bind((bind_host, 0))
        self.port = self.sock.getsockname()[1]
        self.token = secrets.token_hex(16)
        self.advertise = advertise_host or bind_host
        self.last: dict[int, float] = {}
        self.pids: dict[int, int] = {}
        self.info: dict[int, list] = {}  # what a beat carries after the pid (serve's: host and memory)
        self.joining: set[int] = set()  # ranks inside their backend's connect (`joining`)
        self.started = time.monotonic()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="mlxcel-dist-heartbeats", daemon=True)
        self._thread.start()

    @property
    def env_value(self) -> str:
        host = f"[{self.advertise}]" if ":" in self.advertise else self.advertise
        return f"{host}:{self.port}:{self.token}"

    def _run(self) -> None:
        tok = self.token.encode()
        while not self._closed:
            try:
                data, _ = self.sock.recvfrom(512)
            except OSError:
                return
            parts = data.split()
            if len(parts) < 3 or parts[0] != tok:
                continue
            try:
                rank, pid = int(parts[1]), int(parts[2])
            except ValueError:
                continue
            self.last[rank] = time.monotonic()
            self.pids[rank] = pid
            if parts[3:] == [JOINING]:
                self.joining.add(rank)
                continue
            self.joining.discard(rank)
            self.info[rank] = [p.decode("utf-8", "replace") for p in parts[3:]]

    def stalled(self, n_ranks: int, timeout: float) -> tuple[int, float] | None:
        """(rank, seconds silent) of the rank silent longest past ``timeout``
        (counted from the job's start for a rank not yet heard from; a rank
        joining its backend past `JOIN_TIMEOUT_S` at least)."""
        now = time.monotonic()
        worst = None
        for r in range(n_ranks):
            silent = now - self.last.get(r, self.started)
            allowed = max(timeout, JOIN_TIMEOUT_S) if r in self.joining else timeout
            if silent > allowed and (worst is None or silent > worst[1]):
                worst = (r, silent)
        return worst

    def close(self) -> None:
        self._closed = True
        try:
            self.sock.close()
        except OSError:  # pragma: no cover
            pass


def advertise_address(remote_host: str) -> str:
    """This machine's address as the given remote host would reach it (the
    source address of a route to it; no packet is sent)."""
    try:
        infos = socket.getaddrinfo(remote_host, 9, type=socket.SOCK_DGRAM)
        family, _, _, _, addr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()
