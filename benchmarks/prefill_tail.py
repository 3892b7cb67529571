"""Where a prompt's time goes between its last chunk and its first id: ours
against mlx-lm's, on the same weights (a FAMILIES shape of gpu_compare.py).

gpu_compare.py's prefill tok/s is prompt / time-to-first-id. For ours that
holds the chunked prefill (all prompt tokens but the last), then moving the
eager KV cache into a row of the engine's static buffers (`place_prefilled`),
then the last prompt token's decode step; for mlx-lm the chunk, then its last
token's step (its KV cache grows by a step there). This times each stage
apart with a device sync after it, per rep (the allocator's cache cleared
before each, as gpu_compare does), alternating the two:

    python benchmarks/prefill_tail.py --family llama [--prompt 2048] [--reps 4] [--small]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import mlx.core as mx

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpu_compare import FAMILIES, _stub_transformers, build_mlx_lm, build_ours  # noqa: E402


def _lap(t: list) -> float:
    mx.synchronize()
    now = time.perf_counter()
    dt, t[0] = (now - t[0]) * 1e3, now
    return round(dt, 2)


def ours_stages(model, engine, prompt) -> dict:
    import numpy as np

    from mlxcel_dist.engine.prefill import Admission

    last = len(prompt) - 1
    cache = model.make_cache()
    t = [time.perf_counter()]
    out = {}
    model(mx.array(prompt[:last])[None], cache)
    mx.eval([c.state for c in cache])
    out["chunk"] = _lap(t)
    ids = np.asarray(prompt, np.int32)
    engine._decide(ids[:1])
    engine.place_prefilled(Admission("tail", ids, last, None, 0, None, 2), cache)  # into its row's buffers
    mx.eval(list(engine.buffers.values()))
    out["start"] = _lap(t)
    row, y = engine.rows[0], None
    for name, tok in (("first step", mx.array([prompt[last]], mx.int32)), ("second step", None)):
        x = engine.steps.forward_rows(tok if tok is not None else y.reshape(1))[1][0]
        row.pos += 1
        y = mx.argmax(x.reshape(-1)).astype(mx.int32)
        mx.eval(y)
        out[name] = _lap(t)
    engine.remove("tail")
    return out


def theirs_stages(model, prompt) -> dict:
    from mlx_lm.models.cache import make_prompt_cache

    last = len(prompt) - 1
    cache = make_prompt_cache(model)
    t = [time.perf_counter()]
    out = {}
    model(mx.array(prompt[:last])[None], cache=cache)
    mx.eval([c.state for c in cache])
    out["chunk"] = _lap(t)
    mx.clear_cache()  # as generate_step does after each chunk
    out["start"] = _lap(t)
    y = mx.argmax(model(mx.array(prompt[last:])[None], cache=cache)[0, -1])
    mx.eval(y)
    out["first step"] = _lap(t)
    mx.eval(mx.argmax(model(y.reshape(1, 1), cache=cache)[0, -1]))
    out["second step"] = _lap(t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="llama", choices=["llama", "mistral", "qwen3"])
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--small", action="store_true", help="a small shape (CPU check of the script)")
    a = ap.parse_args()
    cfg = dict(FAMILIES[a.family])
    if a.small:
        cfg.update(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, vocab_size=512)
    _stub_transformers()
    from mlxcel_dist.engine.batch import BatchEngine

    ours, weights = build_ours(cfg)
    theirs = build_mlx_lm(cfg, weights)
    prompt = mx.random.randint(0, cfg["vocab_size"], (a.prompt,), key=mx.random.key(1)).tolist()
    step = BatchEngine(ours)
    got = {"ours": [], "mlx-lm": []}
    for rep in range(a.reps):
        for impl in got:
            mx.clear_cache()
            r = ours_stages(ours, step, prompt) if impl == "ours" else theirs_stages(theirs, prompt)
            r["to first id"] = round(r["chunk"] + r["start"] + r["first step"], 2)
            print(json.dumps({"family": a.family, "rep": rep, "impl": impl, **r}), flush=True)
            got[impl].append(r)
    for impl, rs in got.items():  # rep 0 compiles kernels: left out
        rs = rs[1:] or rs
        print(json.dumps({"family": a.family, "impl": impl, "median_ms": {
            k: round(statistics.median(r[k] for r in rs), 2) for k in rs[0]}}), flush=True)


if __name__ == "__main__":
    main()
