"""The receiving end of a shard fetch (fetch.py): one process per host.

    python -m mlxcel_dist.checkpoint.fetch_receiver --connect ADDR:PORT --token T --host NAME [--cache DIR]

Connects to the launcher, gets the job, answers what this host needs (see
fetch.py), writes the pieces into `<entry>.partial` directories and renames
each to its entry once whole. Any failure is one `error: ...` line naming
the host, exit 2; what was written stays a partial (resumed next time).
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import shutil
import socket
import sys
from pathlib import Path

from ..cluster import faults
from . import shardcache as sc
from ..errors import UserError
from .fetch import CHUNK, CORRUPTED, IO_TIMEOUT_S, _recv_exact, recv_msg, send_msg

JOURNAL = "journal"


class _Rank:
    """One rank's entry being made: `<entry>.partial` with its weights file
    preallocated and a journal of the pieces already in it."""

    def __init__(self, root: Path, key: str, pieces: list):
        self.pieces = pieces
        self.entry = root / key / sc.entry_key(pieces)
        self.partial = self.entry.with_name(self.entry.name + ".partial")
        self.header, offs = sc.safetensors_header(pieces)
        self.offset = {p.key: o for p, o in zip(pieces, offs)}
        self.size = offs[-1] + pieces[-1].nbytes if pieces else len(self.header)
        self.done: dict[str, str] = {}
        self.fd = None

    def check(self, rev_key: str) -> bool:
        """Whether the entry is whole and every piece matches its hash; if
        not, it becomes (or stays) a partial keeping its good pieces."""
        m = sc.read_manifest(self.entry)
        if m is not None:
            good = sc.verified_pieces(self.entry, m) if m.get("key") == rev_key else {}
            files_ok = all(_file_ok(self.entry / n, h) for n, h in m.get("files", {}).items())
            if len(good) == len(self.pieces) and files_ok:
                return True
            shutil.rmtree(self.partial, ignore_errors=True)
            (self.entry / sc.MANIFEST).unlink()  # not valid from here on
            os.replace(self.entry, self.partial)
            self.done = good
            self._journal_all()
            return False
        if self.partial.is_dir():
            try:
                with open(self.partial / sc.WEIGHTS, "rb") as f:
                    same = f.read(len(self.header)) == self.header
                lines = (self.partial / JOURNAL).read_text().split("\n")
            except OSError:
                same, lines = False, []
            if same:
                for line in lines:
                    k, _, h = line.partition(" ")
                    if k in self.offset and sc.piece_digest(self.partial / sc.WEIGHTS, self.offset[k],
                                                            self._piece(k).nbytes) == h:
                        self.done[k] = h
                return False
            shutil.rmtree(self.partial, ignore_errors=True)
        return False

    def _piece(self, key: str):
        return next(p for p in self.pieces if p.key == key)

    def open(self) -> None:
        self.partial.mkdir(parents=True, exist_ok=True)
        path = self.partial / sc.WEIGHTS
        fresh = not path.exists()
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        # a file a crash cut short (entries are not fsynced) gets its header and size back; its pieces
        # that still hash right are in `done` (`check`), the rest are written again
        if fresh or os.fstat(self.fd).st_size != self.size or os.pread(self.fd, len(self.header), 0) != self.header:
            _pwrite(self.fd, self.header, 0)
            os.ftruncate(self.fd, self.size)
        if fresh or not (self.partial / JOURNAL).exists():
            self._journal_all()

    def _journal_all(self) -> None:
        self.partial.mkdir(parents=True, exist_ok=True)
        (self.partial / JOURNAL).write_text("".join(f"{k} {h}\n" for k, h in self.done.items()))

    def wrote(self, key: str, digest: str) -> None:
        self.done[key] = digest
        with open(self.partial / JOURNAL, "a") as f:
            f.write(f"{key} {digest}\n")

    def finish(self, job: dict, files_dir: Path) -> None:
        # No fsync (it was 0.42-0.49 s of a 237 MB first fetch here): every launch
        # hashes each piece of an entry before its ranks use it (`check`), so bytes
        # a crash lost after the manifest are a wrong hash there and are refetched.
        os.close(self.fd)
        self.fd = None
        names = [n for n in job["files"] if not n.startswith("adapter/")]
        for n in names:
            dst = self.partial / n
            dst.unlink(missing_ok=True)
            try:
                os.link(files_dir / n, dst)
            except OSError:
                shutil.copyfile(files_dir / n, dst)
        (self.partial / JOURNAL).unlink(missing_ok=True)
        manifest = {"model": job["model"], "key": job["key"], "revision": job["revision"], "tensors": job["tensors"],
                    "pieces": [p.to_json() for p in self.pieces], "sha256": [self.done[p.key] for p in self.pieces],
                    "files": {n: job["revision"][n][1] for n in names}}
        sc.write_atomic(self.partial / sc.MANIFEST, json.dumps(manifest).encode(), durable=False)
        shutil.rmtree(self.entry, ignore_errors=True)
        os.replace(self.partial, self.entry)


def _pwrite(fd: int, data, offset: int) -> None:
    if faults.disk_full():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _same_copy(job: dict, root: Path) -> tuple[bool, str]:
    """(this host reads MODEL (and the adapter) itself, why it fetches)."""
    here = Path(job["model"]).expanduser()
    if faults.no_copy() or not (here / "config.json").is_file():
        return False, "no copy of MODEL on the host"
    try:
        mine = sc.revision(here, root)
    except (UserError, OSError):
        return False, "its copy of MODEL is unreadable"
    if sc.revision_key(mine) != job["key"]:
        return False, f"its copy of MODEL is a different revision ({sc.revision_diff(mine, job['revision'])} differs)"
    ad = job.get("adapter")
    if ad:
        apath = Path(ad[0]).expanduser()
        if not all((apath / n).is_file() for n in sc.ADAPTER_FILES):
            return False, "no copy of the adapter on the host"
        hashes = sc.file_hashes([apath / n for n in sc.ADAPTER_FILES], root)
        if any(hashes[n] != ad[2][n][1] for n in sc.ADAPTER_FILES):
            return False, "its copy of the adapter differs"
    return True, ""


class _Donors:
    """Pieces held by this host's other whole entries of the same revision
    (a different split's): a needed piece inside one is copied, not fetched."""

    def __init__(self, root: Path, key: str, skip: set):
        self.by_name: dict[str, list] = {}
        self.checked: dict = {}
        base = root / key
        for d in sorted(base.iterdir()) if base.is_dir() else []:
            m = sc.read_manifest(d) if d.name not in skip and not d.name.endswith(".partial") else None
            if m is None or m.get("key") != key:
                continue
            pieces = [sc.Piece.from_json(j) for j in m["pieces"]]
            _, offs = sc.safetensors_header(pieces)
            for p, o, h in zip(pieces, offs, m["sha256"]):
                self.by_name.setdefault(p.name, []).append((p, d, o, h))

    def find(self, want):
        for p, d, o, h in self.by_name.get(want.name, []):
            if p.axis is None or (p.axis == want.axis and p.offsets(want.ranges) is not None):
                ok = self.checked.get((d, p.key))
                if ok is None:
                    ok = self.checked[(d, p.key)] = sc.piece_digest(d / sc.WEIGHTS, o, p.nbytes) == h
                if ok:
                    return p, d, o
        return None

    @staticmethod
    def copy(donor, want) -> bytes:
        import numpy as np  # here only: the receiver's start imports no numpy (most of its start time)

        from .weights import _DTYPES

        p, d, o = donor
        mm = np.memmap(d / sc.WEIGHTS, dtype=np.dtype(_DTYPES[p.dtype][0]), mode="r", offset=o,
                       shape=p.sliced_shape)
        if want.axis is None:
            return np.ascontiguousarray(mm).tobytes()
        idx = (slice(None),) * want.axis
        local = p.offsets(want.ranges)
        return np.ascontiguousarray(np.concatenate([mm[idx + (slice(s, e),)] for s, e in local],
                                                   axis=want.axis)).tobytes()


def _file_ok(path: Path, sha: str) -> bool:
    return path.is_file() and sc.piece_digest(path, 0, path.stat().st_size) == sha


def receive(addr: str, token: str, host: str, cache=None) -> dict:
    """Do this host's part of a fetch; returns what it told the launcher."""
    h, _, port = addr.rpartition(":")
    try:
        sock = socket.create_connection((h, int(port)), timeout=IO_TIMEOUT_S)
    except OSError as e:
        raise UserError(f"host {host}: cannot reach the launcher at {addr}: {e.strerror or e}") from None
    with sock:
        try:
            send_msg(sock, {"token": token, "host": host})
            sock.settimeout(None)  # the launcher may first hash its own copy (minutes, once); its exit ends the wait
            job = recv_msg(sock)
            sock.settimeout(IO_TIMEOUT_S)
        except (OSError, ValueError) as e:
            raise UserError(f"host {host}: the launcher at {addr} closed the link before sending the job "
                            f"({e})") from None
        try:
            return _locked(sock, job, host, sc.cache_root(job.get("cache") or cache))
        except (ConnectionError, TimeoutError) as e:
            raise UserError(f"host {host}: the link to the launcher dropped while receiving its shards ({e}); "
                            "the next launch resumes") from None
        except OSError as e:
            msg = f"host {host}: cannot write the shard cache at {sc.cache_root(job.get('cache') or cache)}: " \
                  f"{e.strerror or e}"
            try:
                send_msg(sock, {"error": msg})
            except OSError:
                pass
            raise UserError(msg) from None
        except UserError as e:
            try:
                send_msg(sock, {"error": f"host {host}: {e}"})
            except OSError:
                pass
            raise UserError(f"host {host}: {e}") from None


def _locked(sock, job: dict, host: str, root: Path) -> dict:
    """`_receive` holding this revision's lock: two launches on one host do
    not write the same entries at once (the second waits, then finds them)."""
    import fcntl

    d = root / job["key"]
    d.mkdir(parents=True, exist_ok=True)
    with open(d / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _receive(sock, job, host, root)


def _receive(sock, job: dict, host: str, root: Path) -> dict:
    for n in job["files"]:  # plain names (an adapter's under adapter/): nothing lands outside the cache
        base = n[len("adapter/"):] if n.startswith("adapter/") else n
        if not base or "/" in base or base.startswith("."):
            raise UserError(f"the launcher named a file {n!r}, not a plain file name")
    local, note = _same_copy(job, root)
    if local:
        send_msg(sock, {"local": True})
        return {"local": True}
    pieces = [sc.Piece.from_json(j) for j in job["pieces"]]
    key = job["key"]
    entries = {}  # entry name -> _Rank (ranks with the same pieces share one)
    ranks = {}
    for r, idx in job["ranks"].items():
        rk = _Rank(root, key, [pieces[i] for i in idx])
        ranks[r] = entries.setdefault(rk.entry.name, rk)
    todo = {name: rk for name, rk in entries.items() if not rk.check(key)}
    files_dir = root / key / "_files"
    ad = job.get("adapter")
    adir = root / "adapters" / ad[1] if ad else None
    sha = {n: job["revision"][n][1] for n in job["revision"]}
    if ad:
        sha.update({f"adapter/{n}": ad[2][n][1] for n in sc.ADAPTER_FILES})
    adapter_ok = ad is None or ((adir / sc.MANIFEST).exists()
                                and all(_file_ok(adir / n, sha[f"adapter/{n}"]) for n in sc.ADAPTER_FILES))
    if not adapter_ok:
        shutil.rmtree(adir, ignore_errors=True)
    dest = {n: (adir / ".partial" / n[8:]) if n.startswith("adapter/") else files_dir / n for n in job["files"]}
    need_files = [n for n in job["files"]
                  if (not adapter_ok if n.startswith("adapter/") else not _file_ok(dest[n], sha[n]))]
    index = {p.key: i for i, p in enumerate(pieces)}
    missing = {p.key: index[p.key] for rk in todo.values() for p in rk.pieces if p.key not in rk.done}
    donors = _Donors(root, key, set(todo))
    local_copies = {k: d for k in missing if (d := donors.find(pieces[missing[k]])) is not None}
    net = sorted(i for k, i in missing.items() if k not in local_copies)
    to_write = sum(p.nbytes for rk in todo.values() for p in rk.pieces if p.key not in rk.done)
    free = shutil.disk_usage(root if root.exists() else _existing_parent(root)).free
    if to_write > free:
        raise UserError(f"not enough disk space for the shard cache at {root}: {to_write} bytes to write, "
                        f"{free} free")
    reply = {"pieces": net, "files": need_files, "bytes": sum(pieces[i].nbytes for i in net)
             + sum(job["files"][n][0] for n in need_files),
             "local_bytes": sum(pieces[missing[k]].nbytes for k in local_copies),
             "shard_bytes": sum(p.nbytes for p in pieces), "note": note}
    send_msg(sock, reply)
    if job["dry"]:
        return reply
    for rk in todo.values():
        rk.open()
    for k, donor in local_copies.items():
        data = _Donors.copy(donor, pieces[missing[k]])
        digest = hashlib.sha256(data).hexdigest()
        for rk in todo.values():
            if k in rk.offset and k not in rk.done:
                _pwrite(rk.fd, data, rk.offset[k])
                rk.wrote(k, digest)
    writer = _Writer()
    try:
        _receive_pieces(sock, pieces, todo, dest, writer)
    finally:
        writer.close()  # what arrived whole is written and journaled, also when the link dropped
    for rk in todo.values():
        lacking = [p.key for p in rk.pieces if p.key not in rk.done]
        if lacking:
            raise UserError(f"the launcher sent no {lacking[0]}")
        rk.finish(job, files_dir)
    if not adapter_ok:
        part = adir / ".partial"
        sc.write_atomic(part / sc.MANIFEST, json.dumps({"adapter": ad[0], "files": ad[2]}).encode())
        for n in sc.ADAPTER_FILES:
            os.replace(part / n, adir / n)
        os.replace(part / sc.MANIFEST, adir / sc.MANIFEST)
        part.rmdir()
    done = {"entries": {r: rk.entry.name for r, rk in ranks.items()}}
    send_msg(sock, done)
    return {**reply, **done}


def _receive_pieces(sock, pieces: list, todo: dict, dest: dict, writer: "_Writer") -> None:
    """The launcher's stream until its end: pieces hashed as they arrive and
    handed to the writer (the disk beside the socket), small files straight
    to their place."""
    while True:
        msg = recv_msg(sock)
        if msg.get("end"):
            return
        n = msg["n"]
        if "piece" in msg:
            p = pieces[msg["piece"]]
            targets = [rk for rk in todo.values() if p.key in rk.offset and p.key not in rk.done]
            h, pos = hashlib.sha256(), 0
            while pos < n:
                buf = writer.buffer()
                view = _recv_exact(sock, min(CHUNK, n - pos), buf)
                h.update(view)  # here, while the writer writes the chunk before (both free the GIL)
                writer.put(("data", buf, len(view), [(rk.fd, rk.offset[p.key] + pos) for rk in targets]))
                pos += len(view)
            writer.put(("end", p, bytes(_recv_exact(sock, 32)), h.digest(), targets))
        else:
            data = bytes(_recv_exact(sock, n))
            if bytes(_recv_exact(sock, 32)) != hashlib.sha256(data).digest():
                raise UserError(f"file {msg['file']} arrived corrupted (sha256 differs)")
            path = dest[msg["file"]]
            path.parent.mkdir(parents=True, exist_ok=True)
            sc.write_atomic(path, data, durable=False)  # hashed again at each launch (`_file_ok`)


class _Writer:
    """Writes a piece's chunks on a thread of its own while the socket's
    thread reads and hashes the next ones (pwrite, sha256 and recv all free
    the GIL), through a few rotating buffers; at a piece's end its digest
    is checked, then journaled. Its first error is raised by the next
    `buffer()` or by `close()`. Nothing is fsynced (`_Rank.finish` says
    why); an fdatasync every 64 MB beside the writes, tried when the entry
    ended with one, made this box's stream slower (2.8-4.8 s against
    1.6-1.8 s for 237 MB)."""

    def __init__(self, n: int = 4):
        import queue
        import threading

        self.q, self.free = queue.Queue(), queue.Queue()
        for _ in range(n):
            self.free.put(bytearray(CHUNK))
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def buffer(self) -> bytearray:
        buf = self.free.get()
        if self.error is not None:
            raise self.error
        return buf

    def put(self, item) -> None:
        self.q.put(item)

    def _run(self) -> None:
        while (item := self.q.get()) is not None:
            try:
                if self.error is None:
                    self._do(item)
            except BaseException as e:  # noqa: BLE001 - handed to the socket's thread
                self.error = e
            finally:
                if item[0] == "data":
                    self.free.put(item[1])

    def _do(self, item) -> None:
        if item[0] == "data":
            _, buf, k, targets = item
            view = memoryview(buf)[:k]
            for fd, offset in targets:
                _pwrite(fd, view, offset)
        else:  # a piece's end, after its writes: journaled only when its bytes are the ones sent
            _, p, sent, got, rks = item
            if sent != got:
                raise UserError(f"piece {p.key} {CORRUPTED} (sha256 differs)")
            for rk in rks:
                rk.wrote(p.key, got.hex())

    def close(self) -> None:
        self.q.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error


def _existing_parent(p: Path) -> Path:
    while not p.exists():
        p = p.parent
    return p


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mlxcel_dist.checkpoint.fetch_receiver")
    ap.add_argument("--connect", required=True)
    ap.add_argument("--token", required=True)
    ap.add_argument("--host", required=True)
    ap.add_argument("--cache")
    a = ap.parse_args(argv)
    try:
        receive(a.connect, a.token, a.host, a.cache)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
