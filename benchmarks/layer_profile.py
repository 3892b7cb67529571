"""One decoder layer's prefill, piece by piece: ours against mlx-lm's.

Issue 19 left llama / mistral prefill at 0.83-0.96x mlx-lm on the H200 with
the same kernel kinds in both graphs, so the gap is not in what runs but in
how long it runs. This times one layer of a FAMILIES shape (gpu_compare.py)
on the very same bf16 weights, for a T-token prompt into an empty cache:

    whole   the layer (norm, attention with the KV cache update, MLP)
    qkv     norm -> q/k/v projections -> [B, heads, T, D] -> RoPE
    sdpa    causal attention of those q/k/v (the same arrays for both)
    o_proj  the output projection of the attention output
    mlp     norm -> gate/up -> activation -> down

Ours runs fused (one q/k/v matmul, one gate/up matmul, as shipped) and
unfused (blocks.FUSE_PROJECTIONS off: three / two matmuls like mlx-lm). Each
piece is evaluated alone `--iters` times (ms per call, median of `--reps`
alternated rounds), so a piece's time includes building its graph; at T =
2048 on a GPU the kernels dominate.

    python benchmarks/layer_profile.py --family llama [--tokens 2048] [--reps 5] [--iters 10] [--small]

--ncu runs each implementation's whole layer once (warm), separated by a
marker kernel (an arange of 7 elements), for Nsight Compute to time every
kernel: `ncu --metrics gpu__time_duration.sum --csv python ... --ncu > k.csv`
then `--parse k.csv` sums the kernels of each segment by name.
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


def _timer(fn, iters: int) -> float:
    mx.eval(fn())  # warm: kernels compiled, buffers in the allocator's cache
    mx.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - t) / iters * 1e3


def pieces(ours_layer, theirs_layer, x, fresh_ours_cache, fresh_theirs_cache):
    """{piece: {impl: fn}}: each fn builds that piece's lazy outputs."""
    from mlxcel_dist.nn import blocks
    from mlxcel_dist.nn.attention import causal_attention

    oa, ta = ours_layer.self_attn, theirs_layer.self_attn
    B, T, _ = x.shape

    def ours_qkv():
        h = ours_layer.input_layernorm(x)
        q, k, v = oa.project(h)
        return oa.position(q, k, 0) + (v,)

    def theirs_qkv():
        h = theirs_layer.input_layernorm(x)
        q, k, v = ta.q_proj(h), ta.k_proj(h), ta.v_proj(h)
        q = q.reshape(B, T, ta.n_heads, -1).transpose(0, 2, 1, 3)
        k = k.reshape(B, T, ta.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = v.reshape(B, T, ta.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return ta.rope(q), ta.rope(k), v

    q, k, v = ours_qkv()
    mx.eval(q, k, v)
    o = causal_attention(q, k, v, oa.scale, mask="causal")
    mx.eval(o)
    o2 = o.transpose(0, 2, 1, 3).reshape(B, T, -1)
    mx.eval(o2)

    def unfused(fn):
        def run():
            saved, blocks.FUSE_PROJECTIONS = blocks.FUSE_PROJECTIONS, False
            try:
                return fn()
            finally:
                blocks.FUSE_PROJECTIONS = saved
        return run

    ours_whole = lambda: ours_layer(x, "causal", fresh_ours_cache())  # noqa: E731
    ours_mlp = lambda: ours_layer.mlp(ours_layer.post_attention_layernorm(x))  # noqa: E731
    return {
        "whole": {"mlx-lm": lambda: theirs_layer(x, "causal", fresh_theirs_cache()),
                  "ours": ours_whole, "ours unfused": unfused(ours_whole)},
        "qkv": {"mlx-lm": theirs_qkv, "ours": ours_qkv, "ours unfused": unfused(ours_qkv)},
        "sdpa": {"mlx-lm": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=ta.scale, mask="causal"),
                 "ours": lambda: causal_attention(q, k, v, oa.scale, mask="causal")},
        "o_proj": {"mlx-lm": lambda: ta.o_proj(o2), "ours": lambda: oa.o_proj(o2)},
        "mlp": {"mlx-lm": lambda: theirs_layer.mlp(theirs_layer.post_attention_layernorm(x)),
                "ours": ours_mlp, "ours unfused": unfused(ours_mlp)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="llama", choices=["llama", "mistral", "qwen3"])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--small", action="store_true", help="a small shape (CPU check of the script)")
    ap.add_argument("--ncu", action="store_true", help="one warm whole layer per implementation, between markers")
    ap.add_argument("--parse", metavar="CSV", help="summarise an ncu --csv kernel log of an --ncu run")
    a = ap.parse_args()
    if a.parse:
        return parse_ncu(a.parse)

    cfg = dict(FAMILIES[a.family], num_hidden_layers=1)
    if a.small:
        cfg.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=64, vocab_size=512)
    _stub_transformers()
    from mlx_lm.models.cache import KVCache as TheirKV

    from mlxcel_dist.cache import KVCache as OurKV

    ours, weights = build_ours(cfg)
    theirs = build_mlx_lm(cfg, weights)
    ol, tl = ours.model.layers[0], theirs.model.layers[0]
    x = (mx.random.normal((1, a.tokens, cfg["hidden_size"]), key=mx.random.key(3))).astype(mx.bfloat16)
    mx.eval(x)
    # the two layers agree (same weights): the whole layer's output, relative
    d = mx.abs(ol(x, "causal", OurKV()).astype(mx.float32) - tl(x, "causal", TheirKV()).astype(mx.float32))
    ref = mx.abs(tl(x, "causal", TheirKV()).astype(mx.float32)).max()
    head = {"family": a.family, "device": str(mx.default_device()), "mlx": mx.__version__, "tokens": a.tokens,
            "layer_max_rel_diff": round(float(d.max() / ref), 5)}
    print(json.dumps(head), flush=True)
    table = pieces(ol, tl, x, OurKV, TheirKV)
    if a.ncu:
        whole = table["whole"]
        for fn in whole.values():  # warm: kernels built before the profiled segment
            mx.eval(fn())
        mx.synchronize()
        for impl, fn in whole.items():
            mx.eval(mx.arange(7))  # marker
            mx.synchronize()
            mx.eval(fn())
            mx.synchronize()
            print(json.dumps({"ncu_segment": impl}), flush=True)
        mx.eval(mx.arange(7))
        return
    got = {p: {impl: [] for impl in fns} for p, fns in table.items()}
    for _ in range(a.reps):
        for p, fns in table.items():
            for impl, fn in fns.items():
                got[p][impl].append(_timer(fn, a.iters))
    for p, impls in got.items():
        row = {"piece": p, **{impl: round(statistics.median(ms), 3) for impl, ms in impls.items()}}
        row["ours/mlx-lm time"] = round(row["ours"] / row["mlx-lm"], 3)
        row["spread_ms"] = {impl: [round(min(ms), 3), round(max(ms), 3)] for impl, ms in impls.items()}
        print(json.dumps(row), flush=True)


def parse_ncu(path: str) -> None:
    """Per segment between marker kernels (arange): total us and the kernels
    by name, longest first."""
    import csv
    import re

    rows = []
    with open(path) as f:
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") == "gpu__time_duration.sum":
            v = float(r["Metric Value"].replace(",", ""))
            unit = r.get("Metric Unit", "nsecond")
            us = v / 1e3 if unit.startswith("n") else v * 1e3 if unit.startswith("m") else v
            rows.append((r["Kernel Name"], us))
    segs, cur = [], None
    for name, us in rows:
        if "arange" in name.lower():
            cur = []
            segs.append(cur)
        elif cur is not None:
            cur.append((name, us))
    for i, seg in enumerate(segs):
        if not seg:
            continue
        by = {}
        for name, us in seg:
            short = re.sub(r"<.*", "", name)[:70]
            n, t = by.get(short, (0, 0.0))
            by[short] = (n + 1, t + us)
        total = sum(us for _, us in seg)
        print(json.dumps({"segment": i, "kernels": len(seg), "total_us": round(total, 1)}))
        for short, (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1]):
            print(f"  {t:10.1f} us  x{n:<3d} {short}")


if __name__ == "__main__":
    main()
