"""Latency of MLX's all_sum over a backend, the way decode uses it.

    python benchmarks/nccl_allsum.py --np 2 --backend nccl      # two GPUs
    python benchmarks/nccl_allsum.py --np 2 --backend mpi       # CPU ranks

Each rank (this file re-run through mlxcel_dist.cluster.launcher.launch) times, for
a [1, 1, hidden] array of --dtype:

- one: `--iters` all_sums, each evaluated on its own (host waits each time);
- chain: `--chain` all_sums that depend on each other (x = all_sum(x) * c)
  built as one graph and evaluated once: the decode step's situation, where
  97 of them sit between the matmuls of 48 layers;
- chain-compiled: the same chain inside mx.compile;
- chain+matmul: each link also multiplies by a [hidden, hidden] matrix, so
  the collectives interleave with device work as in a real step.

Rank 0 prints one JSON line: microseconds per all_sum for each.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def worker(a) -> None:
    import mlx.core as mx

    from mlxcel_dist.parallel.distributed import init_from_env

    group = init_from_env()
    dt = getattr(mx, a.dtype)
    x = mx.ones((1, 1, a.hidden), dt)
    w = (mx.random.normal((a.hidden, a.hidden), key=mx.random.key(0)) * 0.01).astype(dt)
    half = mx.array(0.5, dt)
    mx.eval(x, w)

    def chain(x, mm=False):
        for _ in range(a.chain):
            if mm:
                x = x @ w
            x = group.all_sum(x) * half
        return x

    compiled = mx.compile(chain)
    res = {"np": group.size(), "backend": a.backend, "hidden": a.hidden, "dtype": a.dtype, "chain": a.chain,
           "device": str(mx.default_device())}

    def timed(label, fn, n, per):
        for _ in range(3):
            mx.eval(fn())
        group.barrier()
        t = time.perf_counter()
        for _ in range(n):
            mx.eval(fn())
        res[label] = round(1e6 * (time.perf_counter() - t) / (n * per), 1)

    timed("one_us", lambda: group.all_sum(x), a.iters, 1)
    timed("chain_us", lambda: chain(x), a.reps, a.chain)
    timed("chain_compiled_us", lambda: compiled(x), a.reps, a.chain)
    timed("chain_matmul_us", lambda: chain(x, True), a.reps, a.chain)
    timed("matmul_only_us", lambda: _mm_only(x, w, a.chain), a.reps, a.chain)
    if group.rank() == 0:
        print(json.dumps(res), flush=True)


def _mm_only(x, w, n):
    for _ in range(n):
        x = x @ w
    return x


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--hidden", type=int, default=3840)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--chain", type=int, default=97)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return 0
    from mlxcel_dist.cluster.launcher import launch

    args = ["--worker", "--backend", a.backend, "--hidden", str(a.hidden), "--dtype", a.dtype,
            "--chain", str(a.chain), "--iters", str(a.iters), "--reps", str(a.reps)]
    return launch(args, a.np, a.backend, script=__file__)


if __name__ == "__main__":
    sys.exit(main())
