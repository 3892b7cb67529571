"""A rank program for the host channel tests (tests/test_channel.py).

Every rank opens `collectives.HostChannel`, then runs --steps exchanges:
each rank's row is seeded by (step, rank), rank 0's message by the step, and
every rank checks what it got against the same data gathered by a device
all_sum. Rank 0 (the launcher shows its output) prints one line for the
job: "channel ok ranks=N steps=K" when every rank's checks passed. Options:

  --kill-rank R --at K   rank R kills itself (SIGKILL) before exchange K
  --refuse               ranks other than 0 cannot connect (every connect
                         fails): open() must give None on every rank
"""

import argparse
import os
import signal
import socket
import sys

import numpy as np

from mlxcel_dist.parallel.collectives import HostChannel
from mlxcel_dist.parallel.distributed import init_from_env


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--kill-rank", type=int, default=-1)
    ap.add_argument("--at", type=int, default=0)
    ap.add_argument("--refuse", action="store_true")
    args = ap.parse_args()
    group = init_from_env()
    r, n = group.rank(), group.size()
    if args.refuse and r != 0:
        def refuse(*a, **kw):
            raise ConnectionRefusedError("refused by the test")
        socket.create_connection = refuse
    chan = HostChannel.open(group, connect_s=0.5)
    if args.refuse:
        nones = int(group.gather_rows([chan is None], dtype=np.int32).sum())
        if r == 0:
            print(f"channel none on {nones} of {n} ranks", flush=True)
        return 0
    if chan is None:
        print(f"error: rank {r}: no channel", file=sys.stderr)
        return 1
    ok = True
    for step in range(args.steps):
        if r == args.kill_rank and step == args.at:
            os.kill(os.getpid(), signal.SIGKILL)
        row = np.random.default_rng([step, r]).integers(-2**31, 2**31 - 1, size=5, dtype=np.int32)
        size = 300_000 if step == 3 else step % 7  # one long prompt's worth (many TCP segments)
        msg = np.random.default_rng([step, 99]).integers(-2**31, 2**31 - 1, size=size, dtype=np.int32)
        rows, got = chan.exchange(row, msg if r == 0 else None)
        want_rows = group.gather_rows(row, dtype=np.int32).astype(np.int32)
        if not (np.array_equal(rows, want_rows) and np.array_equal(got, msg)):
            print(f"error: rank {r} step {step}: rows {rows.tolist()} / {want_rows.tolist()}, "
                  f"message {got[:8].tolist()} ({got.size}) / {msg[:8].tolist()} ({msg.size})", file=sys.stderr)
            ok = False
    chan.close()
    good = int(group.gather_rows([ok], dtype=np.int32).sum())
    if r == 0 and good == n:
        print(f"channel ok ranks={n} steps={args.steps}", flush=True)
    return 0 if good == n else 1


if __name__ == "__main__":
    sys.exit(main())
