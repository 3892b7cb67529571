"""Batch rows of every cache kind: serve-style decode throughput of the
BatchEngine alone (no HTTP) with R rows in the batch buffers (one forward a
step: quantized KV, recurrent / conv / DeltaNet state included) against the
same rows stepped one by one on their own caches (the engine's path for a
cache it cannot batch, which --kv-bits and the state families took before),
in one process, the two modes alternated so that the ratio holds on a
loaded machine.

    python benchmarks/batch_rows.py                     # the cases below, 8 rows
    python benchmarks/batch_rows.py MODEL [--kv-bits 4 --kv-group-size 64] --rows 8 --steps 64

Default cases: the embedded model with --kv-bits 8 --kv-group-size 32
(quantized KV), the qwen3_next and recurrent_gemma fixtures (DeltaNet;
RG-LRU + sliding attention). Per case and mode: a warm-up pass (the
compiled step's traces), then --repeat timed passes of R seeded prompts
of --prompt tokens admitted together and --steps greedy steps; prints the
median tok/s of each mode and batched / rows (one JSON line per case with
--json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FIXTURES = ROOT / "tests" / "fixtures"
DEFAULT_CASES = [(None, 8, 32), (FIXTURES / "qwen3_next" / "hybrid_fp32", None, 64),
                 (FIXTURES / "recurrent_gemma" / "mqa_fp32", None, 64)]


def one_pass(model, rows: bool, R: int, prompt: int, steps: int, seed: int) -> float:
    """tok/s of `steps` steps over R rows (`rows`: each row on its own caches)."""
    import mlx.core as mx
    import numpy as np

    from mlxcel_dist.engine.batch import BatchEngine
    from mlxcel_dist.engine.sampling import SamplingParams

    eng = BatchEngine(model)
    if rows:
        eng.static = False  # the row-by-row path (decided at the first add otherwise)
    rng = np.random.default_rng(seed)
    V = model.args.vocab_size
    eng.add_many([(i, rng.integers(3, V, prompt).tolist(), SamplingParams(temp=0.0), steps + 1) for i in range(R)])
    eng.step()  # the first step: admission's tail, not decode
    mx.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    mx.synchronize()
    dt = time.perf_counter() - t
    for i in range(R):
        eng.remove(i)
    return R * steps / dt


def run_case(model_dir, bits, group, args) -> dict:
    from mlxcel_dist.cache import KVOptions
    from mlxcel_dist.checkpoint.loader import default_model_dir, load_model

    d = model_dir or default_model_dir()
    model = load_model(d, kv=KVOptions(bits=bits, group_size=group)).model
    got = {"rows": [], "batched": []}
    for rep in range(args.repeat + 1):  # pass 0: warm-up (traces), not counted
        for mode in ("rows", "batched"):
            tps = one_pass(model, mode == "rows", args.rows, args.prompt, args.steps, rep)
            if rep:
                got[mode].append(tps)
    med = {m: statistics.median(v) for m, v in got.items()}
    name = Path(d).parent.name + "/" + Path(d).name if model_dir else "embedded"
    return {"case": name + (f" --kv-bits {bits}" if bits else ""), "rows": args.rows, "steps": args.steps,
            "rows_tok_s": round(med["rows"], 1), "batched_tok_s": round(med["batched"], 1),
            "ratio": round(med["batched"] / med["rows"], 2),
            "ratios": [round(b / r, 2) for r, b in zip(got["rows"], got["batched"])]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="a model directory (default: the cases in the docstring)")
    ap.add_argument("--kv-bits", type=int, default=None)
    ap.add_argument("--kv-group-size", type=int, default=64)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cases = [(args.model, args.kv_bits, args.kv_group_size)] if args.model else DEFAULT_CASES
    for model_dir, bits, group in cases:
        r = run_case(model_dir, bits, group, args)
        if args.json:
            print(json.dumps(r), flush=True)
        else:
            print(f"{r['case']}: {r['rows']} rows, rows one by one {r['rows_tok_s']} tok/s, batched "
                  f"{r['batched_tok_s']} tok/s: x{r['ratio']} (per pass {r['ratios']})", flush=True)


if __name__ == "__main__":
    main()
