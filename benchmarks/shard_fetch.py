"""The shard cache's cost (issue 43): bytes on the wire against the shard's
bytes, and the first launch's fetch + load against (shard bytes / link rate
+ a load from a local checkpoint), on one machine.

The "second host" is a receiver process on loopback with its own cache
directory and no copy of the model (MODEL is a path that does not exist
there), as tests/test_shardcache.py does. The link's rate is measured first
(one TCP stream over loopback, the bytes the fetch would move). Loads are
rank 1's at np 2 / pp 2 on paper (a planned group: the same reads, no
collective), from the checkpoint and from the cache entry.

    PYTHONPATH=$PWD python benchmarks/shard_fetch.py [--layers 12] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from random_ckpt import BENCH_200M, gemma3_checkpoint  # noqa: E402

from mlxcel_dist.checkpoint import fetch, shardcache as sc  # noqa: E402
from mlxcel_dist.parallel.collectives import Group  # noqa: E402
from mlxcel_dist.cluster.hostfile import Host  # noqa: E402
from mlxcel_dist.checkpoint.loader import load_model, open_model  # noqa: E402


def link_rate(nbytes: int) -> float:
    """Bytes/s of one TCP stream over loopback (what the fetch's link gives)."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    got = [0]

    def sink():
        c, _ = srv.accept()
        while chunk := c.recv(1 << 22):
            got[0] += len(chunk)
        c.close()

    t = threading.Thread(target=sink)
    t.start()
    buf = bytes(1 << 22)
    s = socket.create_connection(("127.0.0.1", port))
    t0 = time.perf_counter()
    sent = 0
    while sent < nbytes:
        s.sendall(buf)
        sent += len(buf)
    s.close()
    t.join()
    srv.close()
    return got[0] / (time.perf_counter() - t0)


def machine_rates(work: Path, nbytes: int = 1 << 28) -> dict:
    """sha256 (each side hashes every byte) and write + fsync (the cache is
    kept on disk) in bytes/s: what bounds a fetch besides the link."""
    import hashlib
    import os

    data = os.urandom(1 << 22) * (nbytes >> 22)
    t0 = time.perf_counter()
    hashlib.sha256(data).digest()
    sha = len(data) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    with open(work / "w.bin", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    disk = len(data) / (time.perf_counter() - t0)
    (work / "w.bin").unlink()
    return {"sha256_Bps": sha, "write_fsync_Bps": disk}


def load_time(model, np_: int, rank: int, pp: int) -> float:
    t0 = time.perf_counter()
    load_model(model, group=Group.planned(np_, rank), pp=pp)
    return time.perf_counter() - t0


def _cpu(who) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def _first(ck, hosts, pieces, cache: Path) -> tuple:
    """A fetch's wall time, spec, host state, and CPU seconds: the receiver's
    (a child process, waited for) and this process's (the launcher's side),
    which a busy box inflates far less than the wall time."""
    c0, s0 = _cpu(resource.RUSAGE_CHILDREN), _cpu(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    spec, states = fetch.fetch_shards(ck, "/nonexistent/model", hosts, pieces, str(cache))
    wall = time.perf_counter() - t0
    cpu = {"receiver_cpu_s": _cpu(resource.RUSAGE_CHILDREN) - c0, "launcher_cpu_s": _cpu(resource.RUSAGE_SELF) - s0}
    return wall, spec, states["hostb"], cpu


def _phases(st) -> dict:
    """The launcher's view of a fetch's phases (this tree's fetch.py records them)."""
    m = getattr(st, "marks", None)
    if not m:
        return {}
    return {"revision_s": m["revision"] - m["t0"], "receiver_up_s": m["connected"] - m["t0"],
            "needs_s": m["needs"] - m["connected"], "stream_s": m["sent"] - m["needs"],
            "finish_s": m["done"] - m["sent"]}


def one(src: Path, pp: int, work: Path) -> dict:
    """Rank 1's first fetch to a host with nothing cached, twice: "cold" (the
    launching host never hashed its copy either) and "warm" (it has: its
    hashes.json and remembered piece sha256s copied from the cold run, as
    after any earlier launch), then a second launch; loads from the
    checkpoint and from the entry."""
    np_, rank = 2, 1
    ck = open_model(src)
    pieces = {rank: sc.rank_pieces(ck, np_, rank, pp)}
    shard = sum(p.nbytes for p in pieces[rank])
    files = sum((src / n).stat().st_size for n in sc.small_files(src))
    cold, warm = work / f"cold-pp{pp}", work / f"warm-pp{pp}"
    hosts = {"hostb": (Host("localhost"), [rank])}
    cold_s, _, cst, _ = _first(ck, hosts, pieces, cold)
    warm.mkdir()
    shutil.copy(cold / "hashes.json", warm / "hashes.json")
    if (cold / "pieces").is_dir():
        shutil.copytree(cold / "pieces", warm / "pieces")
    first_s, spec, st, cpu = _first(ck, hosts, pieces, warm)
    entry = warm / json.loads(spec)["key"] / json.loads(spec)["ranks"][str(rank)]
    t0 = time.perf_counter()
    _, again = fetch.fetch_shards(ck, "/nonexistent/model", hosts, pieces, str(warm))
    second_s = time.perf_counter() - t0
    rate = max(link_rate(st.sent) for _ in range(3))  # the link's rate: its best of 3 (a busy box lowers some)
    load_full = min(load_time(src, np_, rank, pp) for _ in range(2))
    load_cache = min(load_time(entry, np_, rank, pp) for _ in range(2))
    bound = shard / rate + load_full
    return {
        "placement": f"pp {pp}" if pp > 1 else "np 2", "checkpoint_bytes": sum(ck.tensor_bytes().values()),
        "shard_bytes": shard, "small_file_bytes": files, "data_bytes_sent": st.sent, "wire_bytes": st.wire,
        "overhead_vs_shard": (st.wire - shard) / shard, "link_rate_Bps": rate, "bound_s": bound,
        "load_full_s": load_full, "load_cache_s": load_cache,
        "cold_fetch_s": cold_s, "cold_ratio_to_bound": (cold_s + load_cache) / bound,
        **{f"cold_{k}": v for k, v in _phases(cst).items()},
        "first_fetch_s": first_s, "first_launch_s": first_s + load_cache, "goal_s": 1.2 * bound,
        "ratio_to_bound": (first_s + load_cache) / bound, **_phases(st), **cpu,
        "second_fetch_s": second_s, "second_bytes_sent": again["hostb"].sent,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=BENCH_200M["num_hidden_layers"])
    ap.add_argument("--out")
    a = ap.parse_args()
    src = gemma3_checkpoint(**dict(BENCH_200M, num_hidden_layers=a.layers))
    work = Path(tempfile.mkdtemp(prefix="mlxcel-fetch-bench-"))
    try:
        rates = machine_rates(work)
        rows = [dict(one(src, pp, work), **rates) for pp in (1, 2)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for r in rows:
        print(json.dumps(r))
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
