"""A tiny rank program for the launcher tests.

Every rank: init_from_env(), all_sum of (rank + 1), check it equals
n(n+1)/2, print one line. Options:

  --fail-rank R --code C   rank R exits with code C right after init
  --kill-rank R            rank R kills itself with SIGKILL after init
  --stop-rank R            rank R stops itself with SIGSTOP after init (a hung rank)
  --print-host             every rank prints its host name
  --busy S                 every rank computes (matmuls in MLX) for S seconds first
  --sleep S                every rank sleeps S seconds before exiting
  --no-init                skip init (to test launching alone)
  --spam N                 every rank prints N long numbered lines to stdout
  --stream                 rank 0 prints "partial" (no newline), waits 2 s, then " done"
  --collective-error       every rank exits 2 as after an error all raise together;
                           only rank 0 prints it, 0.3 s after the others exit
"""

import argparse
import os
import signal
import sys
import time

from mlxcel_dist.parallel.distributed import init_from_env, launched_world, world
from mlxcel_dist.errors import UserError


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fail-rank", type=int, default=-1)
    ap.add_argument("--kill-rank", type=int, default=-1)
    ap.add_argument("--stop-rank", type=int, default=-1)
    ap.add_argument("--busy", type=float, default=0.0)
    ap.add_argument("--print-host", action="store_true")
    ap.add_argument("--code", type=int, default=3)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--no-init", action="store_true")
    ap.add_argument("--spam", type=int, default=0)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--collective-error", action="store_true")
    args = ap.parse_args()

    if args.no_init:
        print(f"rank {world().rank()} pid {os.getpid()} up", flush=True)
        time.sleep(args.sleep)
        return 0

    if launched_world() is None:
        print("error: not launched (MLXCEL_DIST_WORLD unset)", file=sys.stderr)
        return 2
    try:
        group = init_from_env()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import mlx.core as mx

    r, n = group.rank(), group.size()
    if args.collective_error:
        if r == 0:
            time.sleep(0.3)
            print("error: every rank agrees this failed", file=sys.stderr, flush=True)
        return 2
    if r == args.fail_rank:
        print(f"rank {r} failing on purpose", file=sys.stderr)
        return args.code
    if r == args.kill_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    if r == args.stop_rank:
        os.kill(os.getpid(), signal.SIGSTOP)
    t_end = time.monotonic() + args.busy
    a = mx.random.normal((512, 512), key=mx.random.key(r))
    while time.monotonic() < t_end:
        for _ in range(8):
            a = (a @ a) / 512.0
        mx.eval(a)  # one long graph per eval, GIL released inside

    total = group.all_sum(mx.array([float(r + 1)]))
    mx.eval(total)
    want = n * (n + 1) / 2
    got = total.item()
    if got != want:
        print(f"error: rank {r}: all_sum gave {got}, expected {want}", file=sys.stderr)
        return 1
    group.barrier()
    if args.stream and r == 0:
        sys.stdout.write("partial")
        sys.stdout.flush()
        time.sleep(2)
        print(" done")
    for i in range(args.spam):
        print(f"spam rank={r} line={i} " + "x" * 300)
    if args.print_host:
        import socket

        print(f"rank={r} host={socket.gethostname()}")
    print(f"allsum ok rank={r} size={n} sum={got:g} backend={os.environ['MLXCEL_DIST_BACKEND']}")
    time.sleep(args.sleep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
