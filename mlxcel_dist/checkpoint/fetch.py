"""Sending each host of a job its ranks' shards (the shard cache, shardcache.py).

Before the ranks start, the launching host, which holds MODEL, listens on a
TCP port and starts one receiver per other host (`python -m
mlxcel_dist.checkpoint.fetch`, over ssh as the ranks are started; the same token
against stray connections as the host channel). A receiver connects back
(one stream per host: its ranks share it), gets the job (revision, the
pieces of each of its ranks, the small files), and answers what it needs:
nothing when the host holds MODEL at the same revision; else, per rank, the
pieces its cache entry lacks or holds with a wrong hash, less those another
entry of the same revision on the host already holds (a different split
copies them locally). The launcher then streams those pieces (each followed
by its sha256) and the receiver writes them into `<entry>.partial` (a
preallocated model.safetensors, a journal of finished pieces) and renames it
to the entry once it is whole: a dropped link or a full disk leaves only a
partial, which the next launch resumes after checking the journal's hashes.

`fetch_shards` (the launcher's side) returns the ranks' environment
(shardcache.ENV); `dry=True` only asks each host what a launch would move
(`plan --ask-hosts`).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
import sys
import threading
import time
from pathlib import Path

from . import shardcache as sc
from ..errors import UserError

CHUNK = 1 << 22
CORRUPTED = "arrived corrupted"  # a receiver's word for a piece whose sha256 differs from the one sent
IO_TIMEOUT_S = 120.0  # a link silent this long is dropped
CONNECT_TIMEOUT_S = 60.0


# --------------------------------------------------------------------------- framing


def send_msg(sock, obj) -> int:
    raw = json.dumps(obj).encode()
    sock.sendall(struct.pack("<I", len(raw)) + raw)
    return 4 + len(raw)


def _recv_exact(sock, n: int, buf: bytearray | None = None) -> memoryview:
    """n bytes from the socket (into `buf` when given: no copy per chunk)."""
    view = memoryview(buf if buf is not None and len(buf) >= n else bytearray(n))[:n]
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError("the link dropped")
        got += k
    return view


def recv_msg(sock):
    (n,) = struct.unpack("<I", _recv_exact(sock, 4))
    return json.loads(bytes(_recv_exact(sock, n)))


def _digest(ref, piece: sc.Piece) -> bytes:
    h = hashlib.sha256()
    for chunk in _chunks(ref, piece):
        h.update(chunk)
    return h.digest()


def _chunks(ref, piece: sc.Piece):
    """A piece's bytes (C order of the slice the loader reads) in chunks of
    at most about CHUNK bytes, from the source's memory map."""
    import numpy as np

    a = ref._mm
    if piece.axis is None or piece.axis == 0:
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8) if a.size else np.zeros(0, np.uint8)
        row = flat.size // max(1, a.shape[0]) if a.ndim else flat.size
        spans = [(0, flat.size)] if piece.axis is None else [(s * row, e * row) for s, e in piece.ranges]
        for s, e in spans:
            for o in range(s, e, CHUNK):
                yield memoryview(flat[o:min(e, o + CHUNK)])
        return
    per = max(1, CHUNK // max(1, piece.nbytes // a.shape[0]))  # leading rows a chunk
    idx = (slice(None),) * (piece.axis - 1)
    for i in range(0, a.shape[0], per):
        block = a[i:i + per]
        part = np.concatenate([block[(slice(None),) + idx + (slice(s, e),)] for s, e in piece.ranges],
                              axis=piece.axis)
        yield memoryview(np.ascontiguousarray(part).reshape(-1).view(np.uint8))


# --------------------------------------------------------------------------- launcher side


class _HostState:
    def __init__(self, name: str):
        self.name, self.total, self.sent, self.wire = name, 0, 0, 0
        self.start = self.end = None
        self.hashed: dict[str, str] = {}  # piece key -> sha256 hashed for this host's stream
        self.marks: dict[str, float] = {}  # phase -> time.monotonic() (benchmarks/shard_fetch.py's breakdown)
        self.result: dict | None = None
        self.error: str | None = None


def _serve_host(conn, job: dict, refs: dict, files: dict, st: _HostState, cut_after: int | None,
                known: dict) -> None:
    """One receiving host's stream: the job out, its needs in, the bytes out.
    `known`: the pieces' sha256s hashed at an earlier fetch (the others are
    hashed here, into `st.hashed`)."""
    from concurrent.futures import ThreadPoolExecutor  # here: the receiver imports this module for its framing
    st.wire += send_msg(conn, job)
    conn.settimeout(None)  # the host may first hash its own copy (minutes, once); its exit ends the wait
    need = recv_msg(conn)
    st.marks["needs"] = time.monotonic()
    conn.settimeout(IO_TIMEOUT_S)
    if "error" in need:
        raise RuntimeError(need["error"])
    st.result = need
    if job["dry"] or need.get("local"):
        return
    st.total = need["bytes"]
    st.start = time.monotonic()
    pieces = [sc.Piece.from_json(j) for j in job["pieces"]]
    order = [pieces[i] for i in need["pieces"]]
    pool = ThreadPoolExecutor(1)  # unknown sha256s computed ahead, beside the sends (hashlib frees the GIL)
    try:
        digests = [None if p.key in known else pool.submit(_digest, refs[p.name], p) for p in order]
        for i, p, pending in zip(need["pieces"], order, digests):
            st.wire += send_msg(conn, {"piece": i, "n": p.nbytes})
            for chunk in _chunks(refs[p.name], p):
                if cut_after is not None and st.sent + len(chunk) > cut_after:  # test hook: the link cut here
                    conn.sendall(chunk[:max(0, cut_after - st.sent)])
                    conn.shutdown(socket.SHUT_RDWR)
                    raise ConnectionError("the link dropped (injected)")
                conn.sendall(chunk)
                st.sent += len(chunk)
                st.wire += len(chunk)
            digest = bytes.fromhex(known[p.key]) if pending is None else pending.result()
            if pending is not None:
                st.hashed[p.key] = digest.hex()
            conn.sendall(digest)
            st.wire += 32
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    for name in need["files"]:
        data = files[name].read_bytes()
        st.wire += send_msg(conn, {"file": name, "n": len(data)})
        conn.sendall(data + hashlib.sha256(data).digest())
        st.sent += len(data)
        st.wire += len(data) + 32
    st.wire += send_msg(conn, {"end": True})
    st.marks["sent"] = time.monotonic()
    done = recv_msg(conn)
    st.end = st.marks["done"] = time.monotonic()
    if "error" in done:
        raise RuntimeError(done["error"])
    st.result.update(done)


def _receiver_cmd(python: str, addr: str, token: str, name: str, cache) -> list[str]:
    cmd = [python, "-m", "mlxcel_dist.checkpoint.fetch_receiver", "--connect", addr, "--token", token, "--host", name]
    return cmd + (["--cache", str(cache)] if cache else [])


def _start_receiver(host, cmd: list[str]):
    import subprocess

    from ..cluster.launcher import _PKG_ROOT
    from ..cluster.launcher.ssh import SSH_OPTIONS, _remote_script

    env = {"PYTHONPATH": os.pathsep.join(p for p in (_PKG_ROOT, os.environ.get("PYTHONPATH", "")) if p)}
    if os.environ.get("MLXCEL_DIST_INJECT_FAULT"):
        env["MLXCEL_DIST_INJECT_FAULT"] = os.environ["MLXCEL_DIST_INJECT_FAULT"]
    if host.is_local:
        argv, penv = cmd, dict(os.environ, **env)
    else:
        argv = ["ssh", *SSH_OPTIONS, "-o", "LogLevel=QUIET", host.name, _remote_script(env, {}, cmd, os.getcwd())]
        penv = dict(os.environ)
    return subprocess.Popen(argv, env=penv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)


def receiving_hosts(placement) -> dict:
    """host name -> (Host, its ranks) for the hosts that may lack MODEL: every
    host but this one (`nocopy` fault: this one too)."""
    from ..cluster import faults

    out: dict = {}
    for r, h in enumerate(placement):
        if h is None or (h.is_local and not faults.no_copy()):
            continue
        out.setdefault(h.name, (h, []))[1].append(r)
    return out


def fetch_shards(ck, model_arg: str, hosts: dict, rank_pieces: dict, cache=None, adapter=None,
                 dry: bool = False, python: str = sys.executable, show=None) -> tuple[str | None, dict]:
    """Get every receiving host's ranks their shards (`dry`: only ask what
    that would move). `hosts`: `receiving_hosts`; `rank_pieces`: rank ->
    shardcache.Piece list; `adapter`: the --adapter-path directory.
    Returns (the ranks' shardcache.ENV value, or None when no rank reads a
    cache; host name -> _HostState). A host that fails is one UserError."""
    import secrets
    import subprocess

    from ..cluster import faults
    from ..cluster.hostfile import host_ip
    from ..cluster.watchdog import advertise_address

    if not hosts:
        return None, {}
    t0 = time.monotonic()
    root = sc.cache_root(cache)  # the launching host's own: its files' hashes, kept by stat
    token = secrets.token_hex(16)
    srv = socket.create_server(("", 0), family=socket.AF_INET)
    srv.settimeout(1.0)
    port = srv.getsockname()[1]
    states = {name: _HostState(name) for name in hosts}
    procs, threads, errors = {}, [], {}
    cut = faults.fetch_cut()
    key = None
    try:
        for name, (h, _) in hosts.items():  # they start (ssh, imports) while this host checks its own copy
            ip = "127.0.0.1" if h.is_local else advertise_address(h.ips[0] if h.ips else host_ip(h))
            procs[name] = _start_receiver(h, _receiver_cmd(python, f"{ip}:{port}", token, name, cache))
        rev = sc.revision(ck.dir, root)
        key = sc.revision_key(rev)
        t_rev = time.monotonic()
        known = sc.piece_hashes(root, key)
        files = {n: ck.dir / n for n in sc.small_files(ck.dir)}
        ad = None
        if adapter is not None:
            apath = Path(adapter).expanduser()
            arev = {n: [p.stat().st_size, h] for n, h in sc.file_hashes([apath / n for n in sc.ADAPTER_FILES],
                                                                         root).items() for p in [apath / n]}
            ad = [str(adapter), sc.revision_key(arev), arev]
            files.update({f"adapter/{n}": apath / n for n in sc.ADAPTER_FILES})
        tensors = {n: [r.dtype, list(r.shape)] for n, r in ck.refs.items()}  # every rank sees the whole header
        jobs = {}
        for name, (h, ranks) in hosts.items():
            uniq = {p.key: p for r in ranks for p in rank_pieces[r]}
            order = sorted(uniq)
            jobs[name] = {"model": model_arg, "revision": rev, "key": key, "dry": dry, "cache": cache,
                          "tensors": tensors,
                          "pieces": [uniq[k].to_json() for k in order],
                          "ranks": {str(r): [order.index(p.key) for p in rank_pieces[r]] for r in ranks},
                          "files": {n: [p.stat().st_size] for n, p in files.items()}, "adapter": ad}
        pending = set(hosts)
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        bar = _Progress(states, show) if not dry else None
        while pending and time.monotonic() < deadline:
            for name in list(pending):
                rc = procs[name].poll()
                if rc is not None:
                    errors[name] = _stderr_line(procs[name]) or f"its receiver exited with code {rc}"
                    pending.discard(name)
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            conn.settimeout(IO_TIMEOUT_S)
            try:
                hello = recv_msg(conn)
            except (OSError, ValueError, ConnectionError):
                conn.close()
                continue
            name = hello.get("host") if hello.get("token") == token else None
            if name not in pending:
                conn.close()
                continue
            pending.discard(name)
            states[name].marks.update(t0=t0, revision=t_rev, connected=time.monotonic())
            t = threading.Thread(target=_run_host, args=(conn, jobs[name], ck.refs, files, states[name], cut, errors,
                                                         known), daemon=True)
            t.start()
            threads.append(t)
        for name in pending:
            errors[name] = f"its receiver did not connect back within {CONNECT_TIMEOUT_S:g} s"
        for t in threads:
            t.join()
        if bar is not None:
            bar.stop()
    except BaseException:  # Ctrl-C or a failure here: the receivers stop (their links drop) now
        for p in procs.values():
            p.kill()
        raise
    finally:
        srv.close()
        for name, p in procs.items():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
            if name in errors and p.returncode not in (0, None):
                errors[name] = _stderr_line(p) or errors[name]
        if key is not None and any(CORRUPTED in e for e in errors.values()):
            sc.forget_piece_hashes(root, key)  # a remembered sha256 may be the wrong one: hash them afresh next time
        elif key is not None:  # the pieces hashed this time (also before a dropped link): not again
            sc.remember_piece_hashes(root, key, {k: v for st in states.values() for k, v in st.hashed.items()})
    if errors:
        name = next(n for n in hosts if n in errors)
        more = f" (and {len(errors) - 1} more host(s))" if len(errors) > 1 else ""
        raise UserError(f"fetching the shards to host {name} failed: {errors[name]}{more}")
    if dry:
        return None, states
    ranks = {}
    for name, st in states.items():
        ranks.update(st.result.get("entries", {}))
    spec = {"model": model_arg, "key": key, "ranks": ranks, "cache": cache,
            "adapter": [ad[0], ad[1]] if ad and ranks else None}
    return (json.dumps(spec) if ranks else None), states


def _stderr_line(p) -> str:
    try:
        err = p.stderr.read().decode(errors="replace") if p.stderr else ""
    except (OSError, ValueError):
        return ""
    lines = [x.strip() for x in err.splitlines() if x.strip()]
    line = lines[-1] if lines else ""
    return line[len("error: "):] if line.startswith("error: ") else line


def _run_host(conn, job, refs, files, st, cut, errors, known) -> None:
    try:
        _serve_host(conn, job, refs, files, st, cut, known)
    except (OSError, ConnectionError) as e:
        errors[st.name] = f"the link dropped after {st.sent} of {st.total} bytes ({e})"
    except Exception as e:  # noqa: BLE001 - a bad reply from the host: its message, not a dead thread
        errors[st.name] = str(e) or type(e).__name__
    finally:
        st.end = st.end or time.monotonic()
        conn.close()


class _Progress:
    """Per host: bytes, rate, time left on the launching terminal (rich, as
    huggingface_hub's downloads); nothing when stderr is not a terminal."""

    def __init__(self, states: dict, show=None, console=None):
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, \
            TransferSpeedColumn

        console = console or Console(stderr=True)
        self.states = states
        self.bar = Progress(TextColumn("fetch {task.description}"), BarColumn(), DownloadColumn(),
                            TransferSpeedColumn(), TimeRemainingColumn(), console=console, transient=True,
                            disable=not (console.is_terminal if show is None else show))
        self.tasks = {n: self.bar.add_task(n, total=None) for n in states}
        self.done = threading.Event()
        self.bar.start()
        self.thread = threading.Thread(target=self._tick, daemon=True)
        self.thread.start()

    def _tick(self) -> None:
        while not self.done.wait(0.2):
            for n, st in self.states.items():
                self.bar.update(self.tasks[n], completed=st.sent, total=st.total or None)

    def stop(self) -> None:
        self.done.set()
        self.thread.join()
        self.bar.stop()


def summary(states: dict, dry: bool = False) -> list[str]:
    """One line per host after a fetch (`dry`: what a launch would send)."""
    from ..units import format_size as human_bytes

    out = []
    for name, st in states.items():
        r = st.result or {}
        if r.get("local"):
            out.append(f"{name}: holds MODEL at the same revision, {'would send' if dry else 'sent'} nothing")
            continue
        if dry:
            out.append(f"{name}: would send {human_bytes(r['bytes'])} ({r['bytes']} bytes; its ranks' shards "
                       f"{human_bytes(r['shard_bytes'])}, {human_bytes(r['local_bytes'])} to copy on the host)"
                       + (f" - {r['note']}" if r.get("note") else ""))
            continue
        secs = max(1e-9, (st.end or st.start or 0) - (st.start or 0))
        rate = f" in {secs:.1f} s ({human_bytes(st.sent / secs)}/s)" if st.sent else ""
        out.append(f"{name}: sent {human_bytes(st.sent)} ({st.sent} bytes; its ranks' shards "
                   f"{human_bytes(r.get('shard_bytes', 0))}, {human_bytes(r.get('local_bytes', 0))} copied on "
                   f"the host, {st.wire - st.sent} bytes of framing){rate}{' - ' + r['note'] if r.get('note') else ''}")
    return out
