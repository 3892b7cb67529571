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

from .errors import UserError


class CollectiveError(UserError):
    """Raised on every rank alike (they shared the data that decided it), so
    only rank 0 prints it (cli's error handler)."""


class Group:
    """A job's ranks as seen from this one. `raw` is an mx.distributed.Group
    (None: a single process, or a planned group of `size` ranks)."""

    def __init__(self, raw=None, *, size: int | None = None, rank: int | None = None):
        self.raw = raw
        self._size = raw.size() if raw is not None else (1 if size is None else size)
        self._rank = raw.rank() if raw is not None else (0 if rank is None else rank)
        if self._size < 1 or not 0 <= self._rank < self._size:
            raise ValueError(f"bad rank {self._rank} of {self._size}")

    @classmethod
    def planned(cls, size: int, rank: int) -> "Group":
        """Rank `rank` of a `size`-rank job, on paper: shapes and slices only."""
        return cls(None, size=size, rank=rank)

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

    # Device collectives (lazy) -------------------------------------------------
    def all_sum(self, x):
        if self.single:
            return x
        import mlx.core as mx

        return mx.distributed.all_sum(x, group=self._need_raw("all_sum"))

    def all_gather(self, x):
        """Concatenation of every rank's x along axis 0, in rank order."""
        if self.single:
            return x
        import mlx.core as mx

        return mx.distributed.all_gather(x, group=self._need_raw("all_gather"))

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
