"""deepseek_v32: what the lightning indexer costs and saves a decode step,
against the same MLA model without it (deepseek_v3: every step attends every
cached key), on one random model: cache values per token and layer, decode
ms/token (bench's timed generation: compiled steps on static buffers),
prefill tok/s, peak memory over the weights.

usage: python benchmarks/deepseek_v32_decode.py [--prompt 4096] [--gen 32] [--topk 256]
"""

from __future__ import annotations

import argparse
import gc
import json

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from mlxcel_dist.bench import run_bench
from mlxcel_dist.checkpoint.loader import build_model

CONFIG = dict(  # MLA at a quarter of DeepSeek-V3.2's head count and dims, its indexer at a quarter too
    vocab_size=4096, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
    num_attention_heads=32, q_lora_rank=384, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16,
    v_head_dim=32, n_routed_experts=None, max_position_embeddings=16384, index_n_heads=16, index_head_dim=32,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--topk", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    mx.random.seed(0)
    rows = []
    for r in range(a.rounds):
        for model_type in ("deepseek_v3", "deepseek_v32"):
            cfg = {**CONFIG, "model_type": model_type, "index_topk": a.topk}
            m = build_model(cfg)
            m.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.02, m.parameters()))
            mx.eval(m.parameters())
            per_token = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] + (cfg["index_head_dim"] if m.args.indexed else 0)
            res = run_bench(m, a.prompt, a.gen)
            rows.append({"round": r, "model_type": model_type, "index_topk": a.topk if m.args.indexed else None,
                         "cache_values_per_token_layer": per_token,
                         "params": sum(p.size for _, p in tree_flatten(m.parameters())),
                         "decode_ms_per_token": round(res["decode_ms_per_token"], 2),
                         "prefill_tok_s": round(res["prefill_tok_s"], 1),
                         "peak_over_weights_mb": round(1e3 * (res["peak_mem_gb"] - res["weights_gb"]), 1)})
            print(json.dumps(rows[-1]), flush=True)
            del m
            gc.collect()
            mx.clear_cache()


if __name__ == "__main__":
    main()
