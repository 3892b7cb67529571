"""A pipeline hand-off (stage 0's h to stage 1) by each way MLX can move it:
send/recv, an all_sum or an all_gather over the whole group (every rank
takes part: the sender gives h, the others zeros), and an all_sum over a
two-rank group split off the world (MPI only: ring, NCCL and JACCL cannot
split). Issue 41: which collective the pipeline uses where a backend has no
point-to-point ops (NCCL).

    python benchmarks/pp_handoff.py                       # ring and mpi, np 2 and 4
    python benchmarks/pp_handoff.py --np 2 --backends ring --hidden 4096

Each configuration is launched through mlxcel_dist.cluster.launcher (this file
re-run as a rank with --worker). Every way is timed over --iters hand-offs
of [1, L, hidden] float32, one evaluated at a time (what a decode step's
hop is), L = 1 (decode) and --prefill (a prompt chunk), ways interleaved
round by round so background load hits them alike; rank 1 prints the
median microseconds per hand-off.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def worker(a) -> None:
    import mlx.core as mx

    from mlxcel_dist.parallel import distributed

    g = distributed.init_from_env().raw
    r, n = g.rank(), g.size()
    pair = None
    if os.environ.get("MLXCEL_DIST_BACKEND") == "mpi":
        pair = g.split(0 if r < 2 else 1 + r)  # ranks 0 and 1 together, the others alone

    def ways(x):
        zeros = mx.zeros_like(x)
        mine = x if r == 0 else zeros
        out = {
            "all_sum (world)": lambda: mx.distributed.all_sum(mine, group=g),
            "all_gather (world)": lambda: mx.distributed.all_gather(mine, group=g)[: x.shape[0]],
        }
        if r == 0:
            out["send/recv"] = lambda: mx.distributed.send(x, 1, group=g)
        elif r == 1:
            out["send/recv"] = lambda: mx.distributed.recv_like(x, 0, group=g)
        if pair is not None and r < 2:
            out["all_sum (pair split)"] = lambda: mx.distributed.all_sum(mine, group=pair)
        return out

    results = {}
    for L in (1, a.prefill):
        x = mx.random.normal((1, L, a.hidden))
        mx.eval(x)
        fns = ways(x)
        names = ["all_sum (world)", "all_gather (world)", "send/recv", "all_sum (pair split)"]
        times = {k: [] for k in names}
        for _ in range(a.iters):
            for k in names:  # every rank runs the same sequence of collectives
                if k == "send/recv" and r >= 2:
                    continue
                if k == "all_sum (pair split)" and (pair is None or r >= 2):
                    continue
                t = time.perf_counter()
                mx.eval(fns[k]())
                times[k].append(time.perf_counter() - t)
        results[L] = {k: 1e6 * sorted(v)[len(v) // 2] for k, v in times.items() if v}
    if r == 1:
        print("RESULT " + json.dumps(results), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--np", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--backends", nargs="+", default=["ring", "mpi"])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--iters", type=int, default=200)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    rows = []
    for backend in a.backends:
        for n in a.np:
            code = (f"import sys; from mlxcel_dist.cluster.launcher import launch; "
                    f"sys.exit(launch({['--worker', '--hidden', str(a.hidden), '--prefill', str(a.prefill), '--iters', str(a.iters)]!r}, "
                    f"{n}, {backend!r}, script={os.path.abspath(__file__)!r}))")
            p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            line = next((l for l in (p.stdout + p.stderr).splitlines() if "RESULT " in l), None)
            if line is None:
                print(f"{backend} np {n}: failed\n{p.stderr[-2000:]}", file=sys.stderr)
                continue
            for L, res in json.loads(line.split("RESULT ", 1)[1]).items():
                for way, us in res.items():
                    rows.append((backend, n, int(L), way, us))
    print(f"{'backend':8} {'np':>3} {'L':>4}  {'way':22} {'us/hand-off':>12}")
    for backend, n, L, way, us in rows:
        print(f"{backend:8} {n:>3} {L:>4}  {way:22} {us:12.1f}")


if __name__ == "__main__":
    main()
