"""Do two pipeline stages overlap their micro-batches on MLX's CPU backend?

A synthetic two-stage pipeline with the engine's primitives only: stage 0 runs
`--layers` [D, D] matmuls on a micro-batch and sends it to stage 1, which runs
as many and produces "logits" that one all_sum over both ranks hands to every
rank (stage 0 adds zeros after its send, as pipeline.Stage.logits does); the
next step's input of each micro-batch is its own logits, so part j of step
k+1 needs only part j of step k. Steps are pipelined as the batch engine's
(step k+1 launched before step k is read). Per variant: ms per step.

    python benchmarks/pp_overlap.py                       # every variant, 2 ranks over ring
    python benchmarks/pp_overlap.py --variants whole,micro2-comm

Variants: `whole` (one part of all rows), `microM` (M parts, every op on the
default stream), `microM-comm` (sends, receives and the all_sum on a stream of
their own), `microM-comm-streams` (each part's compute on a
stream of its own too), and, first, one process running the two stages'
layers back to back at all rows and at half of them (the serial bound, and
how a part's cost follows its rows). Every rank must issue its point-to-point
messages and all_sums in one order: the ring backend carries both over the
same sockets (a stage that sent part B before part A's all_sum would hand
B's hidden state to the other rank's all_sum).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run(args) -> None:
    import mlx.core as mx

    from mlxcel_dist.parallel.distributed import init_from_env

    group = init_from_env()
    raw, rank = group.raw, group.rank()
    D, R = args.dim, args.rows
    mx.random.seed(rank)
    ws = [mx.random.normal((D, D)) * (D ** -0.5) for _ in range(args.layers)]
    mx.eval(ws)

    def layers(x, s):
        for w in ws:
            x = mx.tanh(mx.matmul(x, w, stream=s), stream=s)
        return x

    def part(x, comm, s=None):
        kw = {"stream": comm} if comm is not None else {}
        if rank == 0:
            h = mx.distributed.send(layers(x, s), 1, group=raw, **kw)
            out = mx.depends(mx.zeros(x.shape, x.dtype, stream=s), [h])
            return mx.distributed.all_sum(out, group=raw, **kw), h
        h = mx.distributed.recv(x.shape, x.dtype, 0, group=raw, **kw)
        return mx.distributed.all_sum(layers(h, s), group=raw, **kw), None

    say = print if rank == 0 else (lambda *a, **k: None)
    for name in args.variants.split(","):
        M = 1 if name == "whole" else int(name.split("-")[0][5:])
        comm = mx.new_stream(mx.cpu) if "comm" in name else None
        # "streams": each part's compute on a stream of its own, so a part whose input is late
        # does not hold up the next one (one FIFO stream runs them in launch order)
        streams = [mx.new_stream(mx.cpu) for _ in range(M)] if "streams" in name else [None] * M
        xs = [mx.ones((R // M, D)) * 0.1 for _ in range(M)]
        inflight, times = [], []
        t_last = time.perf_counter()
        for step in range(args.steps + 1):
            outs = []
            for x, s in zip(xs, streams):
                o, _ = part(x, comm, s)
                mx.async_eval(o)
                outs.append(o)
            inflight.append(outs)
            xs = [o * 0.5 for o in outs]
            if len(inflight) > 1:
                mx.eval(inflight.pop(0))  # the host read of the step before
                now = time.perf_counter()
                if step > 2:
                    times.append(now - t_last)
                t_last = now
        mx.eval(inflight)
        times.sort()
        say(f"{name:>20}: {1e3 * times[len(times) // 2]:7.2f} ms/step median "
            f"(min {1e3 * times[0]:.2f}, max {1e3 * times[-1]:.2f}) over {len(times)} steps", flush=True)


def alone(args) -> None:
    import mlx.core as mx

    D, R = args.dim, args.rows
    ws = [mx.random.normal((D, D)) * (D ** -0.5) for _ in range(2 * args.layers)]
    mx.eval(ws)
    for rows in (R, R // 2):
        x = mx.ones((rows, D)) * 0.1
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            for w in ws:
                x = mx.tanh(x @ w)
            mx.eval(x)
            times.append(time.perf_counter() - t)
        times.sort()
        print(f"{f'alone, {rows} rows':>20}: {1e3 * times[len(times) // 2]:7.2f} ms/step median", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--layers", type=int, default=24, help="matmuls per stage")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--backend", default="ring")
    ap.add_argument("--variants", default="whole,micro2,micro2-comm,micro2-comm-streams")
    args = ap.parse_args()
    if not os.environ.get("MLXCEL_DIST_WORLD"):
        alone(args)
        from mlxcel_dist.cluster.launcher import launch

        return launch(sys.argv[1:], 2, args.backend, script=__file__)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
