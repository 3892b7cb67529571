"""How far MLX's async_eval lets the host run ahead of the CPU device.

Builds a graph of N chained small matmuls ([1, D] x [D, D], what a decode
step is on a small model), and times (a) mx.async_eval's return, (b) the
wait after it, and (c) a plain mx.eval of the same graph. If (a) is close to
(c), the host cannot queue a second graph (micro-batch) while the first runs:
the CPU stream's back-pressure waits for the queued work.

    python benchmarks/async_eval_cpu.py [--ops 400] [--dim 512] [--rounds 5]
"""

import argparse
import time

import mlx.core as mx


def graph(x, ws):
    for w in ws:
        x = mx.tanh(x @ w)
    return x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", type=int, default=400)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    ws = [mx.random.normal((a.dim, a.dim)) * a.dim**-0.5 for _ in range(8)]
    x = mx.random.normal((1, a.dim))
    mx.eval(ws, x)
    for r in range(a.rounds):
        y = graph(x, ws * (a.ops // 8))
        t0 = time.perf_counter()
        mx.async_eval(y)
        t1 = time.perf_counter()
        mx.eval(y)
        t2 = time.perf_counter()
        z = graph(x + 1, ws * (a.ops // 8))
        t3 = time.perf_counter()
        mx.eval(z)
        t4 = time.perf_counter()
        print(f"round {r}: async_eval returned after {1e3 * (t1 - t0):.2f} ms, then waited {1e3 * (t2 - t1):.2f} ms;"
              f" eval alone {1e3 * (t4 - t3):.2f} ms  (device {mx.default_device()})")


if __name__ == "__main__":
    main()
