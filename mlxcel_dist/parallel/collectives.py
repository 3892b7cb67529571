"""Every collective the project writes by hand, behind one `Group` object.

A `Group` is this process's view of the job's ranks. It wraps an
`mx.distributed.Group`; a single process is `SINGLE` (size 1), on which every
collective is the identity and issues nothing, so callers never ask "is there
a group?" or "is it one rank?": they call the collective. The patterns:

- `all_sum` / `all_gather` (lazy `mx.array`s; what sharded layers and the
  vocabulary-split head issue inside a forward pass);
- `broadcast(arr)`: rank 0's host array on every rank. Rank 0 contributes the
  data and the other ranks zeros of the same shape and dtype; one all_sum,
  exact for integers (x + 0 = x), so floats travel bit-copied as int32;
- `gather_rows(row)`: every rank's short vector as a [size, n] matrix on every
  rank (rank r fills row r of a zero matrix; one all_sum); `gather_rows_lazy`
  builds the same on the device from a lazy row;
- `barrier()`: one evaluated all_sum of a scalar, checked against the size.

`Group.planned(n, r)` stands in for rank r of n when a model is sharded on
paper before launch (its collectives refuse to run).

`CollectiveError` is the one exception type for "every rank raised this at
once": rank 0 reports it, the other ranks stay quiet.

MLX's own distributed layers (`mlx.nn.layers.distributed`) take the MLX group
itself: `Group.mlx`. Lookups of `mx.distributed.*` happen at call time, so
`bench.CollectiveCounter` (which wraps them) sees every collective.
"""

from __future__ import annotations

import numpy as np

from ..errors import UserError


class CollectiveError(UserError):
    """Raised on every rank alike (they shared the data that decided it), so
    only rank 0 prints it (cli's error handler)."""


def link_lost(err: BaseException) -> bool:
    """`err` says a peer died or the link broke: MLX's backends prefix their
    errors ("[ring] ...", "[mpi] ..."), the host channel "[host channel] ..."."""
    from ..cluster.backends import names

    first = (str(err).strip().splitlines() or [""])[0]
    return isinstance(err, RuntimeError) and (
        first.startswith(CHANNEL_PREFIX) or any(first.startswith(f"[{b}]") for b in names()))


def ends_the_job(err: BaseException) -> bool:
    """Not one request's failure but the job's, which no request may swallow:
    a collective that failed on every rank alike, or a lost link."""
    return isinstance(err, CollectiveError) or link_lost(err)


class Group:
    """A job's ranks as seen from this one. `raw` is an mx.distributed.Group
    (None: a single process, or a planned group of `size` ranks)."""

    def __init__(self, raw=None, *, size: int | None = None, rank: int | None = None, weights=None):
        self.raw = raw
        self._size = raw.size() if raw is not None else (1 if size is None else size)
        self._rank = raw.rank() if raw is not None else (0 if rank is None else rank)
        if self._size < 1 or not 0 <= self._rank < self._size:
            raise ValueError(f"bad rank {self._rank} of {self._size}")
        self.weights = None
        self.set_weights(weights)
        # routed experts' placement (--moe-split, parsed on every rank like the weights): partition.moe_split
        self.moe_split = "intermediate"
        # the stream the collectives run on (None: the backend's, the default CPU stream for ring
        # and MPI); pipeline stages give them one of their own (pipeline.comm_stream)
        self.stream = None
        self.backend = None  # the launched backend's name (distributed.init_from_env)
        # how pipeline stages hand on (--pp-handoff: auto, send, collective; pipeline.handoff_mode)
        self.pp_handoff = "auto"

    def set_weights(self, weights) -> None:
        """Rank weights (--rank-weights): tensor-parallel shares proportional
        to them (`partition.split_counts`); None: as even as possible. Every rank
        must set the same ones before the model is sharded."""
        if weights is not None:
            weights = tuple(weights)
            if len(weights) != self._size:
                raise UserError(f"{len(weights)} rank weights for {self._size} ranks")
            if any(not w > 0 for w in weights):
                raise UserError(f"rank weights must be positive, got {', '.join(map(str, weights))}")
        self.weights = weights

    @classmethod
    def planned(cls, size: int, rank: int, weights=None, moe_split: str | None = None) -> "Group":
        """Rank `rank` of a `size`-rank job, on paper: shapes and slices only."""
        g = cls(None, size=size, rank=rank, weights=weights)
        g.moe_split = moe_split or g.moe_split
        return g

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    @property
    def single(self) -> bool:
        """One rank: every collective is the identity."""
        return self._size == 1

    @property
    def is_root(self) -> bool:
        return self._rank == 0

    @property
    def mlx(self):
        """The group MLX's distributed layers take. A planned group stands in
        for it (their constructors only ask size and rank)."""
        return self.raw if self.raw is not None else self

    def __repr__(self) -> str:
        what = "planned" if self.raw is None and not self.single else "mlx" if self.raw is not None else "single"
        return f"Group(rank {self._rank} of {self._size}, {what})"

    def _need_raw(self, op: str):
        if self.raw is None:
            raise RuntimeError(f"{op} on {self!r}: a planned group runs no collective")
        return self.raw

    def _on_stream(self) -> dict:
        return {} if self.stream is None else {"stream": self.stream}

    # Device collectives (lazy) -------------------------------------------------
    def all_sum(self, x):
        if self.single:
            return x
        import mlx.core as mx

        return mx.distributed.all_sum(x, group=self._need_raw("all_sum"), **self._on_stream())

    def all_gather(self, x):
        """Concatenation of every rank's x along axis 0, in rank order."""
        if self.single:
            return x
        import mlx.core as mx

        return mx.distributed.all_gather(x, group=self._need_raw("all_gather"), **self._on_stream())

    # Host patterns (evaluated) ------------------------------------------------
    def broadcast(self, arr: np.ndarray | None, shape=None, dtype=np.int32) -> np.ndarray:
        """Rank 0's `arr` on every rank (the others pass None and say the
        `shape` and `dtype` to expect). Integer dtypes only: the sum with zeros
        is then exact."""
        if self.is_root:
            arr = np.ascontiguousarray(arr)
            if not np.issubdtype(arr.dtype, np.integer):
                raise TypeError(f"broadcast carries integers only, got {arr.dtype}")
            if self.single:
                return arr
            data = arr
        else:
            data = np.zeros(shape, dtype)
        if data.size == 0:
            return data
        import mlx.core as mx

        return np.array(self.all_sum(mx.array(data)))

    def gather_rows(self, row, dtype=np.float32) -> np.ndarray:
        """Every rank's `row` (a short vector) as a float64 [size, len(row)]
        array on every rank, with one all_sum (int32 or float32 on the wire)."""
        row = np.asarray(row, dtype=dtype).reshape(-1)
        mat = np.zeros((self._size, row.size), dtype=dtype)
        mat[self._rank] = row
        if not self.single:
            import mlx.core as mx

            mat = np.array(self.all_sum(mx.array(mat)))
        return mat.astype(np.float64)

    def gather_rows_lazy(self, row):
        """`gather_rows` built on the device from a lazy 1-D `row` (not read
        yet): the lazy [size, n] all_sum."""
        import mlx.core as mx

        mine = (mx.arange(self._size) == self._rank)[:, None]
        mat = mx.where(mine, row[None], mx.zeros((self._size, row.shape[0]), row.dtype))
        return self.all_sum(mat)

    def barrier(self) -> None:
        """Block until every rank gets here; also checks that the collective
        works (the sum of ones must equal the size)."""
        if self.single:
            return
        import mlx.core as mx

        total = self.all_sum(mx.array(1, dtype=mx.int32))
        mx.eval(total)
        if int(total.item()) != self._size:
            raise RuntimeError(f"barrier all_sum gave {int(total.item())}, expected {self._size}")


SINGLE = Group()


class ChainGroup(Group):
    """Ranks [first, first + size) of the job's `world` group (the tensor
    parallel ranks of one pipeline stage), whose collectives are chains of
    point-to-point messages between neighbouring ranks: MLX's ring backend
    cannot split a group and sends only to its ring neighbours, and
    consecutive ranks are neighbours on every backend.

    all_sum: partial sums go up the chain (rank t adds its x to what rank
    t-1 sent), the last rank's total comes back down: every member gets the
    same bits, 2 (size - 1) messages in sequence. all_gather: the same with
    concatenation. Both trace inside `mx.compile`.

    Order. MLX runs a graph's independent communication ops in an order set
    by the graph's shape, which differs between a chain's ranks; two chains
    that do not feed each other (a parallel block's attention and MLP sums)
    could then meet in different orders on two ranks and wait forever. So
    each chain's input depends on the previous chain's result (`_last`, in
    call order, which is every rank's), and a rank's receive of the total
    depends on its own send up. `reset()` at each forward (Stage.begin)
    drops the previous forward's result (a traced one among them)."""

    def __init__(self, world: Group, first: int, size: int):
        if not 0 <= world.rank() - first < size:
            raise ValueError(f"rank {world.rank()} is not in ranks [{first}, {first + size})")
        super().__init__(None, size=size, rank=world.rank() - first)
        self.world, self.first = world, first
        self._last = None

    def reset(self) -> None:
        self._last = None

    def __repr__(self) -> str:
        return f"ChainGroup(rank {self._rank} of ranks [{self.first}, {self.first + self._size}) of {self.world!r})"

    def _chain(self, x, join, below, total):
        """`below`: the shape ranks first .. me-1 send up; `total`: the whole
        result's, which comes back down."""
        import mlx.core as mx

        raw, me, st = self.world.raw, self.world.rank(), self.world.stream
        if self._last is not None:
            x = mx.depends(x, self._last)
        if self._rank > 0:
            x = join(mx.distributed.recv(below, x.dtype, me - 1, group=raw, stream=st), x)
        if self._rank < self._size - 1:
            up = mx.distributed.send(x, me + 1, group=raw, stream=st)
            (x,) = mx.depends([mx.distributed.recv(total, x.dtype, me + 1, group=raw, stream=st)], [up])
        if self._rank > 0:
            (x,) = mx.depends([x], [mx.distributed.send(x, me - 1, group=raw, stream=st)])
        self._last = x
        return x

    def all_sum(self, x):
        if self.single:
            return x
        return self._chain(x, lambda lower, mine: lower + mine, x.shape, x.shape)

    def all_gather(self, x):
        if self.single:
            return x
        import mlx.core as mx

        n0, rest = x.shape[0], tuple(x.shape[1:])
        return self._chain(x, lambda lower, mine: mx.concatenate([lower, mine]),
                           (n0 * self._rank, *rest), (n0 * self._size, *rest))



class SplitGroup(Group):
    """An MLX group split off the job's (`world.raw.split(color)`): a pipeline
    stage's T ranks where the stage runs without point-to-point ops
    (`--pp-handoff collective` on a backend that splits groups: MPI). Its
    collectives are MLX's over the split group, on the world's stream, each
    made to depend on the previous one's result (in call order, every
    rank's, as `ChainGroup`'s: a stage's ranks' graphs differ where the last
    one hands on); `reset()` at each forward."""

    def __init__(self, world: Group, color: int):
        super().__init__(world.raw.split(color))
        self.world, self.stream, self._last = world, world.stream, None

    def reset(self) -> None:
        self._last = None

    def __repr__(self) -> str:
        return f"SplitGroup(rank {self._rank} of {self._size} of {self.world!r})"

    def _ordered(self, x, op):
        import mlx.core as mx

        if self._last is not None:
            x = mx.depends(x, self._last)
        self._last = op(x)
        return self._last

    def all_sum(self, x):
        return x if self.single else self._ordered(x, super().all_sum)

    def all_gather(self, x):
        return x if self.single else self._ordered(x, super().all_gather)


class HandOff:
    """Pipeline hand-offs without point-to-point ops (MLX's NCCL backend has
    no send/recv): hop k carries stage k's message to stage k + 1 as an
    all_gather, the sender contributing its [B, L, W] and the others zeros,
    each receiver slicing the sender's rows (a copy: bit for bit what
    send/recv moves). Measured on this CPU over ring (benchmarks/pp_handoff.py):
    the all_gather beat an all_sum of the same rows, 146 vs 196 us a
    decode hop and 6.2 vs 22.5 ms a 128-token one at np 2.

    `split` (a backend that splits groups, MPI): hop k runs over its own
    group, stage k's last rank and stage k + 1's ranks (two splits, even and
    odd hops, since a rank may be in two); the others take no part. Else
    over the whole job (T = 1): every rank takes part in every hop of every
    forward, in hop order (each hop's input depends on the previous one's
    result), zeros where it neither sends nor receives; the hops after its
    own send are returned for the forward's outputs to depend on.
    `widths[k]`: the last dimension of hop k's message."""

    def __init__(self, world: Group, P: int, T: int, widths: list, split: bool):
        self.world, self.P, self.T, self.widths = world, P, T, list(widths)
        self.stage, self.member = divmod(world.rank(), T)
        self.hops = {}  # hop k -> (its Group, the sender's index in it): the hops this rank takes part in
        self._last = None
        if split:
            for parity in (0, 1):  # every rank calls both splits, in this order (MPI_Comm_split is collective)
                mine = [k for k in (self.stage - 1, self.stage) if 0 <= k < P - 1 and k % 2 == parity
                        and (k == self.stage - 1 or self.member == T - 1)]
                color = mine[0] if mine else P + world.rank()  # a group of its own: no hop
                g = Group(world.raw.split(color))
                g.stream = world.stream
                if mine:
                    self.hops[mine[0]] = (g, 0)  # ordered by world rank: the sender first
        else:
            if T != 1:
                raise ValueError("a hand-off over the whole group needs one rank per stage")
            self.hops = {k: (world, k) for k in range(P - 1)}

    def reset(self) -> None:
        self._last = None

    def _hop(self, k: int, x):
        import mlx.core as mx

        g, sender = self.hops[k]
        if self._last is not None:
            x = mx.depends(x, self._last)
        B = x.shape[0]
        self._last = g.all_gather(x)[sender * B : (sender + 1) * B]
        return self._last

    def _zeros(self, k: int, B: int, L: int, dtype):
        import mlx.core as mx

        return mx.zeros((B, L, self.widths[k]), dtype)

    def receive(self, shape, dtype):
        """Hop stage - 1's message (after the earlier hops this rank takes part in)."""
        import mlx.core as mx

        B, L = shape[0], shape[1]
        for k in sorted(self.hops):
            if k < self.stage - 1:
                self._hop(k, self._zeros(k, B, L, dtype))
        return self._hop(self.stage - 1, mx.zeros(tuple(shape), dtype))

    def send(self, x) -> list:
        """x on hop stage, then the later hops with zeros: every array the
        forward's outputs must depend on."""
        B, L = x.shape[0], x.shape[1]
        out = [self._hop(self.stage, x)]
        for k in sorted(self.hops):
            if k > self.stage:
                out.append(self._hop(k, self._zeros(k, B, L, x.dtype)))
        return out


# Host channel ------------------------------------------------------------------
CHANNEL_PREFIX = "[host channel]"  # link_lost: a peer gone, not a bug here
CHANNEL_CONNECT_S = 3.0  # per advertised address; a follower tries each in order


class HostChannel:
    """A TCP star between rank 0 and every other rank, for small int32 host
    messages that must not wait on the device.

    A device collective is queued on the stream behind whatever is in flight:
    serve's per-step control (rank 0's batch changes, every rank's agreement
    row) sent as an all_sum waits for the step already launched, so a
    pipelined step loop would lose its overlap. Over this channel it costs a
    loopback / LAN round trip and never touches the device; a rank waiting
    in `exchange` sleeps in recv (no spinning collective).

    `open(group)` advertises rank 0's port, a token and its addresses (the
    source address of its route to the launcher, its host name's addresses,
    loopback) with two broadcasts (length, bytes), closes the port once every
    rank has connected, and agrees by one gather which ranks connected: None
    on every rank alike when any could not, so callers fall back to device
    collectives. Used once per serve job, so these device collectives are
    setup only.
    """

    def __init__(self, group: Group, peers: dict, sock=None):
        self.group = group
        self._peers = peers  # rank 0: {rank: socket}; others: {0: socket}
        self._listener = sock

    # Setup -----------------------------------------------------------------
    @staticmethod
    def _addresses() -> list[str]:
        import socket

        from ..cluster.watchdog import heartbeat_target

        out = []
        target = heartbeat_target()
        if target is not None:  # the source address of the route to the launcher (the head node)
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                    s.connect(target[:2])
                    out.append(s.getsockname()[0])
            except OSError:
                pass
        try:
            out += socket.gethostbyname_ex(socket.gethostname())[2]
        except OSError:
            pass
        out.append("127.0.0.1")
        return list(dict.fromkeys(a for a in out if a))

    @classmethod
    def open(cls, group: Group, connect_s: float = CHANNEL_CONNECT_S) -> "HostChannel | None":
        """Every rank calls this at the same point; None on every rank when the
        star could not be built (or for a single process)."""
        import secrets
        import socket
        import time

        if group.single:
            return None
        listener, peers = None, {}
        if group.is_root:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("0.0.0.0", 0))
            listener.listen(group.size())
            addrs = cls._addresses()
            token = secrets.randbits(31)  # a stray connection to the open port is not a rank
            blob = f"{listener.getsockname()[1]} {token} {' '.join(addrs)}".encode()
            group.broadcast(np.array([len(blob)], np.int32))
            group.broadcast(np.frombuffer(blob, np.uint8).astype(np.int32))
            deadline = time.monotonic() + connect_s * len(addrs) + 2.0
            while len(peers) < group.size() - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                listener.settimeout(left)
                try:
                    conn, _ = listener.accept()
                    conn.settimeout(connect_s)
                    rank, got = (int(x) for x in np.frombuffer(_recv_exact(conn, 8), np.int32))
                except (OSError, ValueError, EOFError):
                    continue
                if got != token or not 0 < rank < group.size() or rank in peers:
                    conn.close()
                    continue
                conn.settimeout(None)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                peers[rank] = conn
            listener.close()  # every rank that will connect has: the port stays open no longer
            listener = None
            ok = [len(peers) == group.size() - 1]
        else:
            n = int(group.broadcast(None, (1,))[0])
            blob = bytes(group.broadcast(None, (n,)).astype(np.uint8))
            port, token, *addrs = blob.decode().split()
            from ..cluster import faults

            addrs = faults.channel_addresses(addrs, group)
            for addr in addrs:
                try:
                    conn = socket.create_connection((addr, int(port)), timeout=connect_s)
                except OSError:
                    continue
                conn.settimeout(None)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.sendall(np.array([group.rank(), int(token)], np.int32).tobytes())
                peers[0] = conn
                break
            ok = [bool(peers)]
        agreed = group.gather_rows(ok, dtype=np.int32)[:, 0]
        chan = cls(group, peers, listener)
        if not agreed.all():
            chan.close()
            return None
        return chan

    def local_address(self) -> str:
        """This rank's address on the star (rank 0: where the other ranks
        reached it; "0.0.0.0" when they reached it at different addresses)."""
        seen = {conn.getsockname()[0] for conn in self._peers.values()}
        return seen.pop() if len(seen) == 1 else "0.0.0.0"

    def root_address(self) -> str:
        """Rank 0's address as this rank reached it."""
        return self._peers[0].getpeername()[0]

    def close(self) -> None:
        for s in list(self._peers.values()) + ([self._listener] if self._listener else []):
            try:
                s.close()
            except OSError:
                pass
        self._peers, self._listener = {}, None

    def gone(self) -> list[int]:
        """The ranks whose end of the star has closed: their process died (the
        kernel closes its sockets at once) or left. A peek, never a read, so
        it may run beside `exchange` on another thread."""
        import socket

        out = []
        for r, conn in list(self._peers.items()):
            try:
                if conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    out.append(r)
            except BlockingIOError:  # open, nothing to read
                pass
            except OSError:  # reset (or closed here: the caller checks it is still running)
                out.append(r)
        return out

    # The one pattern -----------------------------------------------------------
    def exchange(self, row, message: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Every rank's int32 `row` (equal lengths) as a [size, k] matrix on
        every rank, and rank 0's int32 `message` (any length; the others pass
        None) on every rank. Rank 0 reads every row, then sends one frame back."""
        row = np.ascontiguousarray(row, np.int32).reshape(-1)
        size, k = self.group.size(), row.size
        if self.group.is_root:
            rows = np.zeros((size, k), np.int32)
            rows[0] = row
            for r, conn in self._peers.items():
                rows[r] = np.frombuffer(self._recv(conn, r, 4 * k), np.int32)
            msg = np.ascontiguousarray(message if message is not None else np.zeros(0), np.int32).reshape(-1)
            frame = np.concatenate([np.array([msg.size], np.int32), rows.reshape(-1), msg]).tobytes()
            for r, conn in self._peers.items():
                try:
                    conn.sendall(frame)
                except OSError as e:
                    raise RuntimeError(f"{CHANNEL_PREFIX} rank {r} is gone ({e})") from None
            return rows, msg
        conn = self._peers[0]
        try:
            conn.sendall(row.tobytes())
        except OSError as e:
            raise RuntimeError(f"{CHANNEL_PREFIX} rank 0 is gone ({e})") from None
        m = int(np.frombuffer(self._recv(conn, 0, 4), np.int32)[0])
        data = np.frombuffer(self._recv(conn, 0, 4 * (size * k + m)), np.int32)
        return data[: size * k].reshape(size, k).copy(), data[size * k :].copy()

    @staticmethod
    def _recv(conn, rank: int, n: int) -> bytes:
        try:
            return _recv_exact(conn, n)
        except (OSError, EOFError) as e:
            raise RuntimeError(f"{CHANNEL_PREFIX} rank {rank} is gone ({e or 'connection closed'})") from None


def _recv_exact(conn, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("connection closed")
        got += k
    return bytes(buf)
