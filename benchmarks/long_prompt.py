"""Peak memory of a long prompt, chunked (the default) vs one pass.

    python benchmarks/long_prompt.py                       # 4k, 8k, 16k, 32k tokens chunked; one pass up to 4k
    python benchmarks/long_prompt.py --lengths 2048,4096 --one-pass 2048 --prefill-step 256

A small random-weight gemma3 (benchmarks/random_ckpt.py, float32): hidden
128, 2 layers [sliding (window 1024), full], 2 query heads / 1 KV head of 64,
MLP 512, vocab 1024; written to the benchmark cache dir. For each length T,
in this process: reset MLX's peak-memory counter, run
generation.Generation on T seeded random ids for one generated token (the
whole prompt through the cache, then the first decode step), record the peak
(mx.get_peak_memory) and the time.

Chunked (prefill step S, default engine.DEFAULT_PREFILL_STEP = 2048), the largest arrays are the full
layer's scores [heads, S, T] and mask, and its KV cache [T, kv_heads, 64]
x 2: all linear in T, while the sliding layer's cache and masks stay capped
at the window. One pass builds [T, T] masks and scores: quadratic.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

LONG_MODEL = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=64, vocab_size=1024, sliding_window=1024,
                  sliding_window_pattern=2, dtype="float32")


def measure(model, T: int, step: int) -> dict:
    import mlx.core as mx

    from mlxcel_dist.bench import prompt_ids
    from mlxcel_dist.engine.generation import Generation

    gc.collect()
    mx.clear_cache()
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    gen = Generation(model, prompt_ids(model.args.vocab_size, T, seed=T), 1, prefill_step=step)
    ids = list(gen)
    gen.finish()
    mx.synchronize()
    dt = time.perf_counter() - t0
    peak = mx.get_peak_memory()
    del gen
    return {"T": T, "step": step, "peak_mb": peak / 1e6, "above_weights_mb": (peak - base) / 1e6,
            "s": dt, "tok_s": T / dt, "first_id": ids[0] if ids else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="4096,8192,16384,32768")
    ap.add_argument("--prefill-step", type=int, default=2048, help="chunk size (the engine default)")
    ap.add_argument("--one-pass", default="1024,2048,4096", help="lengths also run in one pass ('' = none)")
    args = ap.parse_args()

    from random_ckpt import gemma3_checkpoint

    from mlxcel_dist.checkpoint.loader import load_model

    path = gemma3_checkpoint(**LONG_MODEL)
    model = load_model(path).model
    print(f"model: {path} (window {model.args.sliding_window}, layers {model.args.layer_types})", file=sys.stderr)

    rows = []
    for T in [int(x) for x in args.one_pass.split(",") if x]:
        rows.append(("one pass", measure(model, T, T)))
        print(f"  one pass {T}: {rows[-1][1]['peak_mb']:.1f} MB", file=sys.stderr)
    for T in [int(x) for x in args.lengths.split(",") if x]:
        rows.append((f"chunks of {args.prefill_step}", measure(model, T, args.prefill_step)))
        print(f"  chunked {T}: {rows[-1][1]['peak_mb']:.1f} MB, {rows[-1][1]['s']:.0f} s", file=sys.stderr)

    print("| prefill | prompt tokens | peak MB | above weights MB | added per 1k more tokens MB | time s | tok/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    prev = {}
    for how, r in rows:
        p = prev.get(how)
        slope = "-" if p is None else f"{(r['above_weights_mb'] - p['above_weights_mb']) / (r['T'] - p['T']) * 1024:.2f}"
        prev[how] = r
        print(f"| {how} | {r['T']} | {r['peak_mb']:.1f} | {r['above_weights_mb']:.1f} | {slope} | "
              f"{r['s']:.1f} | {r['tok_s']:.0f} |")
    chunked = [r for how, r in rows if how != "one pass"]
    if len(chunked) >= 2:
        a, b = chunked[0], chunked[-1]
        print(f"\nchunked: {b['T'] / a['T']:.0f}x the tokens -> {b['above_weights_mb'] / a['above_weights_mb']:.2f}x "
              f"the memory above the weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())
