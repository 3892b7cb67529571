"""deepseek_v3: what the cache keeps, per-head K/V vs the latent (+ k_pe) with
absorbed decode steps (models/deepseek_v3.py LATENT_CACHE), on one random
MLA model: cache bytes per token and layer, decode ms/token (bench's timed
generation: compiled steps on static buffers), peak memory.

usage: python benchmarks/deepseek_v3_cache.py [--prompt 2048] [--gen 32] [--cache latent|per-head]
(one process per cache kind gives clean peak-memory figures; without --cache both alternate)
"""

from __future__ import annotations

import argparse
import gc
import json

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from mlxcel_dist.bench import run_bench
from mlxcel_dist.checkpoint.loader import build_model
from mlxcel_dist.models import deepseek_v3

CONFIG = dict(  # MLA at a quarter of DeepSeek-V3's head count and dims, dense layers only
    model_type="deepseek_v3", vocab_size=4096, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
    num_attention_heads=32, q_lora_rank=384, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16,
    v_head_dim=32, n_routed_experts=None, max_position_embeddings=8192,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cache", choices=("latent", "per-head"))
    a = ap.parse_args()
    mx.random.seed(0)
    rows = []
    for r in range(a.rounds):
        for latent in [a.cache == "latent"] if a.cache else (False, True):
            deepseek_v3.LATENT_CACHE = latent
            m = build_model(CONFIG)
            m.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.02, m.parameters()))
            mx.eval(m.parameters())
            c = CONFIG
            per_token = (c["kv_lora_rank"] + c["qk_rope_head_dim"] if latent else
                         c["num_attention_heads"] * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"] + c["v_head_dim"]))
            res = run_bench(m, a.prompt, a.gen)
            rows.append({"round": r, "cache": "latent" if latent else "per-head", "cache_values_per_token_layer":
                         per_token, "decode_ms_per_token": round(res["decode_ms_per_token"], 2),
                         "prefill_tok_s": round(res["prefill_tok_s"], 1),
                         "peak_over_weights_mb": round(1e3 * (res["peak_mem_gb"] - res["weights_gb"]), 1)})
            print(json.dumps(rows[-1]), flush=True)
            del m
            gc.collect()
            mx.clear_cache()
    print("params", sum(p.size for _, p in tree_flatten(build_model(CONFIG).parameters())))


if __name__ == "__main__":
    main()
