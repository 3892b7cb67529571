"""What lock-step costs on this machine, with no model and no MPI.

Two processes, each pinned to its own CPU, run "steps" of `--segments`
matrix-vector products (bf16 [1, K] @ [M, K]^T, MLX on the CPU, as a decode
step's projections), the shape of a TP decode step at np 2 (25 segments ~
the 25 collectives per token of the benchmark model):

- solo:        one process alone;
- independent: both at once, never waiting for each other;
- lock-step:   both at once, meeting after every segment (what tensor
               parallelism's all_sums impose), the early one spinning on
               shared memory as MPI's shared-memory transport does;
- lock-step-sleep: the same with a blocking barrier (multiprocessing's:
               the early one sleeps, its vCPU goes idle, and waking it
               costs what the hypervisor charges).

If each CPU's speed wobbles on its own (a VM's vCPUs share their host with
others), a lock-step segment lasts as long as the slower of the two, so
lock-step / independent > 1 even though neither process does more work.

    python benchmarks/vcpu_sync.py --rounds 3
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time


class SpinBarrier:
    """Two processes meet by spinning on shared counters, as MPI's
    shared-memory transport waits (a waiting CPU never goes idle)."""

    def __init__(self):
        self.counts = mp.RawArray("q", 2)

    def wait(self, me):
        c = self.counts
        c[me] += 1
        while c[1 - me] < c[me]:
            pass


def worker(cpu, me, steps, segments, shape, barrier, out):
    os.sched_setaffinity(0, {cpu})
    import mlx.core as mx

    M, K = shape
    w = mx.random.normal((M, K)).astype(mx.bfloat16)
    x = mx.random.normal((1, K)).astype(mx.bfloat16)
    mx.eval(w, x)
    for _ in range(3):
        mx.eval(x @ w.T)
    wait = (lambda: barrier.wait(me)) if isinstance(barrier, SpinBarrier) else (barrier.wait if barrier else None)
    if wait:
        wait()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for _ in range(segments):
            mx.eval(x @ w.T)
            if wait:
                wait()
        times.append(time.perf_counter() - t0)
    out.put((cpu, times))


def run(mode, steps, segments, shape):
    cpus = sorted(os.sched_getaffinity(0))[:2]
    n = 1 if mode == "solo" else 2
    barrier = {"lock-step": SpinBarrier, "lock-step-sleep": lambda: mp.Barrier(2)}.get(mode, lambda: None)()
    out = mp.Queue()
    procs = [mp.Process(target=worker, args=(cpus[i], i, steps, segments, shape, barrier, out)) for i in range(n)]
    for p in procs:
        p.start()
    res = [out.get() for _ in procs]
    for p in procs:
        p.join()
    # ms per step: the median over steps, of the slower process
    return max(statistics.median(t) for _, t in res) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--segments", type=int, default=25)
    ap.add_argument("--shape", default="3584,1024", help="M,K of the weight (default: the benchmark model's MLP)")
    a = ap.parse_args()
    shape = tuple(int(v) for v in a.shape.split(","))
    if not hasattr(os, "sched_setaffinity"):
        raise SystemExit("error: needs CPU pinning (os.sched_setaffinity: Linux)")
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("error: needs 2 CPUs")
    rows = {m: [] for m in ("solo", "independent", "lock-step", "lock-step-sleep")}
    ratios, ceilings = [], []
    for r in range(a.rounds):
        got = {m: run(m, a.steps, a.segments, shape) for m in rows}
        for m, v in got.items():
            rows[m].append(v)
        ratios.append(got["lock-step"] / got["independent"])
        ceilings.append(2 * got["solo"] / got["lock-step"])
        print(f"round {r + 1}: " + ", ".join(f"{m} {v:.1f} ms" for m, v in got.items())
              + f"; lock-step / independent {ratios[-1]:.2f}x; 2 x solo / lock-step {ceilings[-1]:.2f}x", flush=True)
    print("medians: " + ", ".join(f"{m} {statistics.median(v):.1f} ms" for m, v in rows.items())
          + f"; lock-step / independent {statistics.median(ratios):.2f}x "
          f"(range {min(ratios):.2f}-{max(ratios):.2f}); 2 x solo / lock-step (the np 2 / np 1 this allows) "
          f"{statistics.median(ceilings):.2f}x (range {min(ceilings):.2f}-{max(ceilings):.2f})")


if __name__ == "__main__":
    main()
