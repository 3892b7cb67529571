"""Constrained decoding on N ranks: every rank computes its rows' masks
(what serve does) against rank 0 computing them and shipping them over the
host channel (the alternative), per decode step of R constrained rows.

    python benchmarks/grammar_ship.py                               # np 2, 8 rows, the embedded tokenizer
    python benchmarks/grammar_ship.py --rows 8 --tokenizer path/to/tokenizer.json --vocab 65536

Each rank replays the same valid answer's tokens through R llguidance
matchers (benchmarks/grammar_engines.py's schema and document). Per step:

- compute: every rank fills its R masks itself (its time = the step's
  critical-path cost, the ranks working in parallel);
- ship: rank 0 fills the R masks, then one HostChannel.exchange carries them
  (R x words int32) to every rank (the time rank 0 waits, the other ranks'
  receive included), over the channel serve already uses for its steps;
  the exchange of an empty message, serve's per-step sync, is timed apart
  and subtracted (it is paid either way).

Started through mlxcel_dist.cluster.launcher (ring backend), this file re-run as a
rank with --worker. Rank 0 prints p50 / p90 microseconds per step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def _pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * (len(xs) - 1)))]


def worker(args) -> int:
    import llguidance
    import llguidance.numpy as lln
    import numpy as np
    from tokenizers import Tokenizer

    from grammar_engines import DOC, SCHEMA
    from mlxcel_dist.parallel.collectives import HostChannel
    from mlxcel_dist.parallel.distributed import init_from_env

    group = init_from_env()
    channel = HostChannel.open(group)
    assert channel is not None, "no host channel"
    tok = llguidance.LLTokenizer(open(args.tokenizer).read(), n_vocab=args.vocab)
    g = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    ids = Tokenizer.from_file(args.tokenizer).encode(json.dumps(DOC, separators=(",", ":")),
                                                     add_special_tokens=False).ids
    words = (args.vocab + 31) // 32
    compute, ship, sync = [], [], []
    for _ in range(args.repeats):
        ms = [llguidance.LLMatcher(tok, g) for _ in range(args.rows)]
        bm = np.zeros((args.rows, words), np.int32)
        for tid in ids:
            t = time.perf_counter()
            for i, m in enumerate(ms):
                lln.fill_next_token_bitmask(m, bm, i)
            compute.append(time.perf_counter() - t)
            channel.exchange(np.zeros(1, np.int32), np.zeros(1, np.int32) if group.is_root else None)  # align
            t = time.perf_counter()
            channel.exchange(np.zeros(1, np.int32), np.zeros(1, np.int32) if group.is_root else None)
            sync.append(time.perf_counter() - t)
            t = time.perf_counter()
            if group.is_root:
                for i, m in enumerate(ms):
                    lln.fill_next_token_bitmask(m, bm, i)
                _, got = channel.exchange(np.zeros(1, np.int32), bm.reshape(-1))
            else:
                _, got = channel.exchange(np.zeros(1, np.int32), None)
            ship.append(time.perf_counter() - t)
            assert got.size == bm.size
            for m in ms:
                m.consume_token(tid)
    if group.is_root:
        us = lambda xs: f"p50 {_pct(xs, 0.5) * 1e6:8.1f} us  p90 {_pct(xs, 0.9) * 1e6:8.1f} us"  # noqa: E731
        print(f"np {group.size()}, {args.rows} rows, vocabulary {args.vocab} ({words * 4 * args.rows} mask bytes a "
              f"step), {len(compute)} steps")
        print(f"  every rank computes its masks:   {us(compute)}")
        print(f"  rank 0 computes + ships them:    {us(ship)}")
        print(f"  (serve's per-step sync alone:    {us(sync)}, paid either way)")
    channel.close()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokenizer", default=str(ROOT / "models" / "gemma3-tiny" / "tokenizer.json"))
    ap.add_argument("--vocab", type=int, default=512, help="the model's logits width (mask size)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    from mlxcel_dist.cluster.launcher import launch

    wargs = ["--worker", "--rows", str(args.rows), "--tokenizer", args.tokenizer, "--vocab", str(args.vocab),
             "--repeats", str(args.repeats)]
    return launch(wargs, args.np, "ring", script=__file__)


if __name__ == "__main__":
    sys.exit(main())
