"""A long prompt beside decoding rows, in process: the engine's step times
with the prompt's chunks in the rows' forward (engine/flat.py) and in a
forward of their own, alternated in one run (no HTTP, no pacing: a fixed
token budget a step).

    python benchmarks/mixed_step.py --model DIR [--rows 4] [--prompt 1500] [--budgets 64,256] [--rounds 2]

Per (mode, budget): the plain step (rows only, median), the mixed steps
(median, longest) and their ratio to the plain one, the prompt's time to its
first id, and that time with no rows decoding ("alone"). Modes: flat
(MLXCEL_DIST_FLAT=1), apart (=0; on a CPU without the side stream, so the
two compare forward for forward), side (=0 with the side stream: one CPU
process's default). JSON lines on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np


def one(model, rows: int, plen: int, budget: int, mode: str, seed: int) -> dict:
    import mlx.core as mx

    from mlxcel_dist.engine.batch import BatchEngine
    from mlxcel_dist.engine.prefill import Budget
    from mlxcel_dist.engine.sampling import SamplingParams

    os.environ["MLXCEL_DIST_FLAT"] = "1" if mode == "flat" else "0"
    V = model.args.vocab_size
    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, V, plen)
    model.engine = None
    eng = BatchEngine(model, budget=Budget(budget))
    if mode != "side":
        eng.side = None
    t0 = time.perf_counter()  # alone: the prompt with no row decoding
    eng.add_many([("alone", prompt, SamplingParams(), 1)])
    while "alone" not in eng.step():
        pass
    alone = time.perf_counter() - t0
    eng.add_many([(i, rng.integers(3, V, 8), SamplingParams(), 10**6) for i in range(rows)])
    plain = []
    for i in range(40):
        t0 = time.perf_counter()
        eng.step()
        if i >= 20:
            plain.append(time.perf_counter() - t0)
    eng.add_many([("long", prompt + 1, SamplingParams(), 1)])
    mixed, t0 = [], time.perf_counter()
    while True:
        s0 = time.perf_counter()
        out = eng.step()
        mixed.append(time.perf_counter() - s0)
        if "long" in out:
            break
    ttft = time.perf_counter() - t0
    for i in range(rows):
        eng.remove(i)
    mx.synchronize()
    d = statistics.median(plain)
    return {"mode": mode, "budget": budget, "prompt": plen, "rows": rows, "plain_ms": round(1e3 * d, 2),
            "mixed_median_ms": round(1e3 * statistics.median(mixed), 2), "mixed_max_ms": round(1e3 * max(mixed), 2),
            "stall_x": round(max(mixed) / d, 2), "steps": len(mixed), "ttft_s": round(ttft, 3),
            "alone_s": round(alone, 3), "ttft_x": round(ttft / alone, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=1500)
    ap.add_argument("--budgets", default="64,256")
    ap.add_argument("--modes", default="flat,apart")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    from mlxcel_dist.checkpoint.loader import load_model

    model = load_model(a.model).model
    for r in range(a.rounds):
        for budget in map(int, a.budgets.split(",")):
            for mode in a.modes.split(","):
                row = one(model, a.rows, a.prompt, budget, mode, seed=r)
                print(json.dumps({"round": r, **row}), flush=True)


if __name__ == "__main__":
    main()
