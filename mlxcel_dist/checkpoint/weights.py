"""Reading safetensors without reading what this rank does not need.

A checkpoint is opened by parsing each file's header (8-byte little-endian
length, JSON table of name -> dtype, shape, byte offsets) and memory-mapping its
data, so a rank materialises only the slices of the tensors it holds. Only
safetensors are read (never pickle). Every header is validated against the file
size, so a truncated download is a clear error rather than garbage or a crash.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from ..errors import UserError

TYPE_CHECKING = False  # typing's, without importing typing
if TYPE_CHECKING:  # the annotations' mx (strings at run time)
    import mlx.core as mx

# numpy and mlx are imported where a tensor is mapped or read, not here: a
# shard fetch's receiver (fetch_receiver.py) reaches this module through
# shardcache and reads no tensor, and numpy's import was most of its start
# (0.3-0.4 s of CPU of 0.45 s; mlx.core another 0.04 s).

# safetensors dtype -> (numpy storage dtype name, bytes per element, mlx dtype name).
# bf16 is stored as uint16 and reinterpreted, since numpy has no bfloat16.
_STORAGE = {
    "F32": ("float32", 4, "float32"),
    "F16": ("float16", 2, "float16"),
    "BF16": ("uint16", 2, "bfloat16"),
    "F64": ("float64", 8, "float32"),
    "I64": ("int64", 8, "int64"),
    "I32": ("int32", 4, "int32"),
    "I16": ("int16", 2, "int16"),
    "I8": ("int8", 1, "int8"),
    "U32": ("uint32", 4, "uint32"),
    "U16": ("uint16", 2, "uint16"),
    "U8": ("uint8", 1, "uint8"),
    "BOOL": ("bool", 1, "bool_"),
}


def __getattr__(name: str):
    """`_DTYPES` (safetensors dtype -> (numpy storage dtype name, mlx dtype)),
    made on first use: it needs mlx."""
    if name == "_DTYPES":
        import mlx.core as mx

        table = {k: (np_name, getattr(mx, mx_name)) for k, (np_name, _, mx_name) in _STORAGE.items()}
        globals()["_DTYPES"] = table
        return table
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Bytes materialised from checkpoint files by this process (tests and --verbose
# use it to show a rank reads only its shard).
bytes_read = 0


def stored_bytes(ref, shape=None) -> int:
    """Bytes of `ref` as stored (or of `shape`, a slice of it), from its header:
    any ref with `shape` and a safetensors `dtype` (TensorRef, or a family's
    view of one such as step3p5's row ranges)."""
    return int(math.prod(ref.shape if shape is None else shape)) * _STORAGE[ref.dtype][1]


class TensorRef:
    """A tensor in a safetensors file, read on demand (whole or a slice)."""

    __slots__ = ("file", "name", "dtype", "shape", "_mm")

    def __init__(self, file: Path, name: str, dtype: str, shape: tuple, mm):
        self.file, self.name, self.dtype, self.shape, self._mm = file, name, dtype, shape, mm

    def read(self, axis: int | None = None, ranges=None) -> mx.array:
        import mlx.core as mx
        import numpy as np

        a = self._mm
        if axis is not None:
            idx = (slice(None),) * axis
            a = np.concatenate([a[idx + (slice(s, e),)] for s, e in ranges], axis=axis)
        a = np.ascontiguousarray(a)  # copies only the selected bytes out of the map
        global bytes_read
        bytes_read += a.nbytes
        if self.dtype == "BF16":
            return mx.array(a).view(mx.bfloat16)
        if self.dtype == "F64":
            return mx.array(a.astype(np.float32))
        return mx.array(a)

    def sliced_shape(self, axis: int | None, ranges) -> tuple:
        if axis is None:
            return self.shape
        shape = list(self.shape)
        shape[axis] = sum(e - s for s, e in ranges)
        return tuple(shape)


def read_header(path: Path) -> dict[str, TensorRef]:
    import numpy as np

    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise UserError(f"{path}: not a safetensors file (truncated header)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8 or n > 100_000_000:
            raise UserError(f"{path}: not a safetensors file or truncated (header length {n}, file {size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"{path}: corrupt safetensors header") from None
    header.pop("__metadata__", None)
    base = 8 + n
    data_len = size - base
    # one map of the file, every tensor a view of it: a map per tensor holds a file descriptor each
    # (mmap dups it), and a per-expert checkpoint (DeepSeek-V3: ~90k tensors) would exhaust them
    whole = np.memmap(path, dtype=np.uint8, mode="r") if data_len > 0 else None
    out = {}
    for name, info in header.items():
        try:
            dtype, shape, (start, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{path}: corrupt safetensors entry for {name!r}") from None
        if dtype not in _STORAGE:
            raise UserError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
        np_dt = np.dtype(_STORAGE[dtype][0])
        count = int(np.prod(shape)) if shape else 1
        if end > data_len:
            raise UserError(
                f"{path}: truncated: tensor {name!r} ends at byte {base + end} but the file has {size} bytes"
            )
        if end - start != count * np_dt.itemsize:
            raise UserError(f"{path}: tensor {name!r} byte range does not match its shape {list(shape)}")
        if count == 0:
            mm = np.zeros(shape, np_dt)
        else:
            mm = whole[base + start:base + end].view(np_dt).reshape(shape)
        out[name] = TensorRef(path, name, dtype, shape, mm)
    return out


def open_checkpoint(model_dir: Path) -> dict[str, TensorRef]:
    """All tensors of a checkpoint directory (sharded index or plain files;
    a shard cache entry is loader.Checkpoint's to open: shardcache.open_cached)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(f"{index}: not a valid safetensors index") from None
        paths = [model_dir / f for f in files]
        missing = [p.name for p in paths if not p.exists()]
        if missing:
            raise UserError(f"{model_dir}: index names missing weight files: {', '.join(missing[:3])}")
    else:
        paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        if list(model_dir.glob("*.bin")) or list(model_dir.glob("*.pt")):
            raise UserError(f"{model_dir}: only pickle weights (.bin/.pt) found; mlxcel-dist reads safetensors only")
        raise UserError(f"{model_dir}: no .safetensors weight files")
    refs: dict[str, TensorRef] = {}
    for p in paths:
        for name, ref in read_header(p).items():
            if name in refs:
                raise UserError(f"{model_dir}: tensor {name!r} appears in two files")
            refs[name] = ref
    return refs


# --------------------------------------------------------------------------- lazy views (a model's sanitize)
# Checkpoint layouts that store a model's tensor in pieces (one per expert,
# gate and up apart) or transposed are joined / swapped by views that read
# like a TensorRef (shape, dtype, sliced_shape, read(axis, ranges)), so a
# rank still reads only its slices. Arrays are joined at once; None (a
# names-only pass) stays None.


class View:
    """What a lazy view shares: its shape after a read of `ranges` along `axis`
    (a subclass sets `shape` and `dtype` and reads with `read(axis, ranges)`)."""

    def sliced_shape(self, axis, ranges) -> tuple:
        if axis is None:
            return self.shape
        shape = list(self.shape)
        shape[axis] = sum(e - s for s, e in ranges)
        return tuple(shape)


class JoinedRef(View):
    """`parts` stacked on a new axis 0 (`stack`; equal shapes) or concatenated along `axis`."""

    def __init__(self, parts: list, axis: int = 0, stack: bool = False):
        self.parts, self.axis, self.stack = parts, axis, stack
        self.dtype = parts[0].dtype
        first = tuple(parts[0].shape)
        if stack:
            self.shape = (len(parts), *first)
        else:
            self.shape = first[:axis] + (sum(p.shape[axis] for p in parts),) + first[axis + 1 :]

    def read(self, axis=None, ranges=None) -> mx.array:
        import mlx.core as mx

        if self.stack:
            if axis == 0:
                return mx.stack([self.parts[i].read() for s, e in ranges for i in range(s, e)])
            return mx.stack([p.read(None if axis is None else axis - 1, ranges) for p in self.parts])
        if axis != self.axis:
            return mx.concatenate([p.read(axis, ranges) for p in self.parts], axis=self.axis)
        out = []  # each range along the joined axis, from the parts it covers, in order
        for s, e in ranges:
            start = 0
            for p in self.parts:
                n = p.shape[self.axis]
                lo, hi = max(s, start), min(e, start + n)
                if lo < hi:
                    out.append(p.read(self.axis, [(lo - start, hi - start)]))
                start += n
        return mx.concatenate(out, axis=self.axis)


class SwappedRef(View):
    """`ref` with its last two axes swapped (a transposed layout)."""

    def __init__(self, ref):
        self.ref, self.dtype = ref, ref.dtype
        self.shape = (*ref.shape[:-2], ref.shape[-1], ref.shape[-2])

    def read(self, axis=None, ranges=None) -> mx.array:
        n = len(self.shape)
        src = {n - 1: n - 2, n - 2: n - 1}.get(axis, axis)
        return self.ref.read(src, ranges).swapaxes(-1, -2)


class RangeRef(View):
    """`ref` cut to [start, stop) along `axis` (e.g. one half of a fused gate_up stack)."""

    def __init__(self, ref, axis: int, start: int, stop: int):
        self.ref, self.axis, self.start, self.dtype = ref, axis, start, ref.dtype
        self.shape = tuple(ref.shape[:axis]) + (stop - start,) + tuple(ref.shape[axis + 1 :])

    def read(self, axis=None, ranges=None) -> mx.array:
        if axis is None or axis == self.axis:
            rng = ranges or [(0, self.shape[self.axis])]
            return self.ref.read(self.axis, [(self.start + s, self.start + e) for s, e in rng])
        x = self.ref.read(axis, ranges)  # the other axis's slices, then this range of them
        return x[(slice(None),) * self.axis + (slice(self.start, self.start + self.shape[self.axis]),)]


def take_range(ref, axis: int, start: int, stop: int):
    """[start, stop) of `ref` along `axis`: arrays now, refs lazily (`RangeRef`), None stays None."""
    import mlx.core as mx

    if ref is None:
        return None
    if isinstance(ref, mx.array):
        return ref[(slice(None),) * axis + (slice(start, stop),)]
    return RangeRef(ref, axis, start, stop)


def join(parts: list, axis: int = 0, stack: bool = False):
    """`parts` (checkpoint refs, arrays or None) joined: arrays now, refs lazily (`JoinedRef`)."""
    import mlx.core as mx

    if any(p is None for p in parts):
        return None
    if all(isinstance(p, mx.array) for p in parts):
        return mx.stack(parts) if stack else mx.concatenate(parts, axis=axis)
    return JoinedRef(parts, axis, stack)


def swap_last_axes(ref):
    """`ref` (a checkpoint ref, an array or None) with its last two axes swapped."""
    import mlx.core as mx

    if ref is None:
        return None
    return ref.swapaxes(-1, -2) if isinstance(ref, mx.array) else SwappedRef(ref)
