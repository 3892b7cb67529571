"""The per-host shard cache: what a rank reads, kept as a small checkpoint.

A rank's reads are recorded by running its load on paper (`rank_pieces`:
the loader's own build, stage cut, shard and read plan, against refs that
note each `read(axis, ranges)` and hand back a lazy zero array), so every
placement the loader has (uneven TP, --moe-split experts, pp, pp x tp,
quantized layers, a family's sanitize views) is covered by construction.
Each read is a `Piece`: a source tensor, an axis and ranges of it.

On a host without the checkpoint, a rank's pieces live in one entry
directory, `<root>/<model key>/<entry key>/`: `model.safetensors` (one tensor
per piece), the checkpoint's small files (config, tokenizer, chat template)
and `shards.json`, the manifest (source revision, each piece's sha256),
written last: an entry is valid only once its manifest is there. The model
key is a hash of the source revision (each file's size and sha256), so a
different revision is a different entry. `open_cached` gives the loader
`PartialRef`s with the source's full shapes, which read only the pieces
held: the rank then loads exactly as from the checkpoint (strict,
memory-mapped). Filling entries (network, resume) is fetch.py's.

Ranks find their entry through `ENV` (set by the launcher): `local_model`
and `local_adapter` turn MODEL / --adapter-path into cache directories.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import namedtuple
from pathlib import Path

from ..errors import UserError
from .weights import TensorRef, read_header, stored_bytes

ENV = "MLXCEL_DIST_FETCH"  # JSON for the ranks: {"model", "key", "ranks": {rank: entry}, "adapter", "cache"}
CACHE_ENV = "MLXCEL_DIST_CACHE"
MANIFEST = "shards.json"
WEIGHTS = "model.safetensors"
HUB_FILES = ("*.json", "tokenizer.model", "*.jinja", "*.txt")  # loader.HUB_PATTERNS less the weights
ADAPTER_FILES = ("adapter_config.json", "adapters.safetensors")


def cache_root(override=None) -> Path:
    """--shard-cache, else $MLXCEL_DIST_CACHE, else ~/.cache/mlxcel-dist (read on each host)."""
    raw = override or os.environ.get(CACHE_ENV) or "~/.cache/mlxcel-dist"
    return Path(raw).expanduser()


# --------------------------------------------------------------------------- pieces


class Piece(namedtuple("Piece", "name axis ranges dtype shape")):
    """`ranges` of `axis` of source tensor `name` (axis None: all of it);
    `shape` is the source tensor's. A named tuple, not a dataclass: the
    receiver's start (fetch_receiver.py) then imports no dataclasses/inspect."""

    __slots__ = ()

    @property
    def key(self) -> str:
        if self.axis is None:
            return self.name
        return f"{self.name}@{self.axis}:" + ",".join(f"{s}-{e}" for s, e in self.ranges)

    @property
    def sliced_shape(self) -> tuple:
        if self.axis is None:
            return tuple(self.shape)
        s = list(self.shape)
        s[self.axis] = sum(e - b for b, e in self.ranges)
        return tuple(s)

    @property
    def nbytes(self) -> int:
        return stored_bytes(self, self.sliced_shape)

    def offsets(self, ranges) -> list | None:
        """`ranges` of this piece's axis as ranges of its stored tensor, or
        None when it does not hold them all."""
        if self.axis is None:
            return list(ranges)
        out = []
        for s, e in ranges:
            base = 0
            for b, f in self.ranges:
                if b <= s and e <= f:
                    out.append((base + s - b, base + e - b))
                    break
                base += f - b
            else:
                return None
        return out

    def to_json(self) -> list:
        return [self.name, self.axis, [list(r) for r in self.ranges] if self.ranges else None, self.dtype,
                list(self.shape)]

    @classmethod
    def from_json(cls, j) -> "Piece":
        name, axis, ranges, dtype, shape = j
        return cls(name, axis, tuple(tuple(r) for r in ranges) if ranges else None, dtype, tuple(shape))


class _Recorder(TensorRef):
    """A source tensor that notes each read and returns lazy zeros of its shape."""

    __slots__ = ("log",)

    def __init__(self, ref: TensorRef, log: dict):
        super().__init__(ref.file, ref.name, ref.dtype, ref.shape, None)
        self.log = log

    def read(self, axis=None, ranges=None):
        import mlx.core as mx

        from .weights import _DTYPES

        key = (tuple(tuple(r) for r in ranges) if axis is not None else None)
        p = Piece(self.name, axis, key, self.dtype, tuple(self.shape))
        self.log.setdefault(p.key, p)
        return mx.zeros(self.sliced_shape(axis, ranges), _DTYPES[self.dtype][1])


def rank_pieces(ck, size: int, rank: int, pp: int = 1, weights=None, moe_split=None) -> list[Piece]:
    """What rank `rank` of a `size`-rank job reads from checkpoint `ck`
    (loader.Checkpoint), found by its load on paper (`ck.rank_reads`:
    nothing is read)."""
    from ..parallel.collectives import Group

    log: dict = {}
    recording = {name: _Recorder(ref, log) for name, ref in ck.refs.items()}
    group = Group.planned(size, rank, weights, moe_split)
    for ref, axis, ranges in ck.rank_reads(group, pp, recording):
        ref.read(axis, ranges)  # views (join, swap, range) turn into reads of the source tensors
    return sorted(log.values(), key=lambda p: p.key)


def entry_key(pieces) -> str:
    return hashlib.sha256("\n".join(p.key for p in pieces).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- revisions


def small_files(model_dir: Path) -> list[str]:
    """The files that travel whole (config, tokenizer, chat template)."""
    names = {p.name for pat in HUB_FILES for p in model_dir.glob(pat) if p.is_file()}
    return sorted(n for n in names if not n.endswith(".safetensors.index.json") and n != MANIFEST)


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def file_hashes(paths, root: Path) -> dict[str, str]:
    """sha256 of each file, remembered in `root`/hashes.json by path, size,
    inode and mtime (a 700 GB checkpoint is hashed once per host, not per launch)."""
    from concurrent.futures import ThreadPoolExecutor

    store = root / "hashes.json"
    try:
        known = json.loads(store.read_text())
    except (OSError, ValueError):
        known = {}
    stamps = {}
    for p in paths:
        st = p.stat()
        stamps[p] = f"{p.resolve()}|{st.st_size}|{st.st_ino}|{st.st_mtime_ns}"
    todo = [p for p in paths if stamps[p] not in known]
    with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as pool:  # hashlib frees the GIL
        for p, digest in zip(todo, pool.map(_file_sha256, todo)):
            known[stamps[p]] = digest
    if todo:
        try:
            root.mkdir(parents=True, exist_ok=True)
            write_atomic(store, json.dumps(known).encode())
        except OSError:
            pass  # a read-only cache only costs a re-hash next time
    return {p.name: known[stamps[p]] for p in paths}


def piece_hashes(root: Path, key: str) -> dict[str, str]:
    """The source's piece sha256s this host has sent before (piece key ->
    hex), kept per revision key in `root`/pieces/<key>.json: a launching
    host hashes each piece it serves once, not at every fetch."""
    try:
        known = json.loads((root / "pieces" / f"{key}.json").read_text())
        return known if isinstance(known, dict) else {}
    except (OSError, ValueError):
        return {}


def remember_piece_hashes(root: Path, key: str, hashes: dict) -> None:
    if not hashes:
        return
    try:
        (root / "pieces").mkdir(parents=True, exist_ok=True)
        write_atomic(root / "pieces" / f"{key}.json", json.dumps({**piece_hashes(root, key), **hashes}).encode())
    except OSError:
        pass  # a read-only cache only costs hashing them again next time


def forget_piece_hashes(root: Path, key: str) -> None:
    (root / "pieces" / f"{key}.json").unlink(missing_ok=True)


def revision(model_dir: Path, root: Path) -> dict:
    """{file name: [size, sha256]} of the weight files and the small files."""
    from .weights import open_checkpoint

    weights = sorted({ref.file for ref in open_checkpoint(model_dir).values()})
    paths = weights + [model_dir / n for n in small_files(model_dir)]
    hashes = file_hashes(paths, root)
    return {p.name: [p.stat().st_size, hashes[p.name]] for p in paths}


def revision_key(rev: dict) -> str:
    return hashlib.sha256(json.dumps(rev, sort_keys=True).encode()).hexdigest()[:16]


def revision_diff(mine: dict, theirs: dict) -> str:
    """The first file that differs, for a message."""
    for name in sorted(set(mine) | set(theirs)):
        if mine.get(name) != theirs.get(name):
            return name if name in mine and name in theirs else f"{name} ({'missing' if name in theirs else 'extra'})"
    return "nothing"


def write_atomic(path: Path, data: bytes, durable: bool = True) -> None:
    """`path` holds all of `data` or its old content, never a part.
    `durable=False` skips the fsync: for what is hashed again before each use
    (an entry's files and manifest, `verified_pieces`), where a crash that
    loses the bytes is caught as a wrong hash, not trusted."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


# --------------------------------------------------------------------------- entries


def safetensors_header(pieces) -> tuple[bytes, list[int]]:
    """The header of an entry's model.safetensors and each piece's data offset
    in the file (8-byte aligned, as safetensors writers pad)."""
    table, offsets, pos = {}, [], 0
    for p in pieces:
        table[p.key] = {"dtype": p.dtype, "shape": list(p.sliced_shape), "data_offsets": [pos, pos + p.nbytes]}
        offsets.append(pos)
        pos += p.nbytes
    table["__metadata__"] = {"format": "mlxcel-dist shard cache"}
    raw = json.dumps(table, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)
    base = 8 + len(raw)
    return len(raw).to_bytes(8, "little") + raw, [base + o for o in offsets]


def piece_digest(path: Path, offset: int, nbytes: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        left = nbytes
        while left:
            chunk = f.read(min(left, 1 << 22))
            if not chunk:
                return ""  # short file
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def read_manifest(entry: Path) -> dict | None:
    try:
        m = json.loads((entry / MANIFEST).read_text())
        return m if isinstance(m, dict) else None
    except (OSError, ValueError):
        return None


def verified_pieces(entry: Path, manifest: dict) -> dict[str, str]:
    """piece key -> sha256 of the pieces whose bytes in `entry` match the manifest."""
    pieces = [Piece.from_json(j) for j in manifest.get("pieces", [])]
    _, offsets = safetensors_header(pieces)
    good = {}
    for p, off, want in zip(pieces, offsets, manifest.get("sha256", [])):
        if piece_digest(entry / WEIGHTS, off, p.nbytes) == want:
            good[p.key] = want
    return good


class PartialRef(TensorRef):
    """A source tensor of which a cache entry holds some pieces: the source's
    shape and dtype, reads served from the pieces (the same bytes the source
    would give), a read of what no piece holds is one error."""

    __slots__ = ("pieces", "entry")

    def __init__(self, name: str, dtype: str, shape: tuple, pieces: list, entry: Path):
        super().__init__(entry / WEIGHTS, name, dtype, shape, None)
        self.pieces, self.entry = pieces, entry  # [(Piece, TensorRef of its stored tensor)]

    def read(self, axis=None, ranges=None):
        for p, stored in self.pieces:
            if p.axis is None:
                return stored.read(axis, ranges)
            if axis == p.axis:
                local = p.offsets(ranges)
                if local is not None:
                    return stored.read(axis, local)
            if axis is None and p.ranges == ((0, self.shape[p.axis]),):
                return stored.read()
        want = "all of it" if axis is None else f"{[list(r) for r in ranges]} of axis {axis}"
        raise UserError(f"{self.entry}: the shard cache entry holds no {want} of {self.name!r} "
                        "(made for another split; launch without --no-fetch to refetch)")


def open_cached(entry: Path) -> dict:
    """A cache entry's tensors as the source checkpoint's (name -> PartialRef)."""
    manifest = read_manifest(entry)
    if manifest is None:
        raise UserError(f"{entry}: no valid {MANIFEST} (an unfinished shard cache entry)")
    stored = read_header(entry / WEIGHTS)
    by_name: dict[str, list] = {}
    for j in manifest["pieces"]:
        p = Piece.from_json(j)
        by_name.setdefault(p.name, []).append((p, stored[p.key]))
    # every tensor of the source, held or not: the stage plan and the strict check see the whole header
    return {name: PartialRef(name, dtype, tuple(shape), by_name.get(name, []), entry)
            for name, (dtype, shape) in manifest["tensors"].items()}


# --------------------------------------------------------------------------- rank side


def _spec() -> dict | None:
    raw = os.environ.get(ENV)
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        raise UserError(f"{ENV} is not valid JSON") from None


def local_model(model) -> Path | None:
    """This rank's cache entry when the launcher fetched MODEL's shard to its
    host (None: the rank reads MODEL itself)."""
    spec = _spec()
    if not spec or model is None or str(model) != spec.get("model"):
        return None
    from ..parallel.distributed import world

    entry = spec.get("ranks", {}).get(str(world().rank()))
    if entry is None:
        return None
    path = cache_root(spec.get("cache")) / spec["key"] / entry
    if read_manifest(path) is None:
        raise UserError(f"{path}: the shard cache entry for MODEL {model} is missing or unfinished on this host")
    return path


def local_adapter(path) -> Path | None:
    """The cached copy of --adapter-path on a host the launcher sent it to."""
    spec = _spec()
    if not spec or path is None or not spec.get("adapter"):
        return None
    arg, key = spec["adapter"]
    if str(path) != arg:
        return None
    from ..parallel.distributed import world

    if str(world().rank()) not in spec.get("ranks", {}):
        return None
    return cache_root(spec.get("cache")) / "adapters" / key
