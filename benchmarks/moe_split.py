"""--moe-split experts vs intermediate on a random bf16 qwen3_moe (never committed).

usage: python benchmarks/moe_split.py [--np 2] [--gen-tokens 32]
Writes the checkpoint (mlx-lm's switch_mlp layout, random normal weights, std
0.02, norms 1) under $MLXCEL_BENCH_CACHE or /tmp/mlxcel-bench, then runs
`mlxcel-dist bench --json` once per placement and prints both and the ratio.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from random_ckpt import cache_dir

CONFIG = dict(  # ~0.5B parameters, 32 experts top-4 (Qwen3-30B-A3B's shape, scaled down)
    model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=32768, hidden_size=768,
    intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=96,
    moe_intermediate_size=384, num_experts=32, num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1,
    mlp_only_layers=[], rope_theta=1_000_000.0, rope_scaling=None, rms_norm_eps=1e-6, max_position_embeddings=4096,
    tie_word_embeddings=False, torch_dtype="bfloat16", hidden_act="silu",
)


def checkpoint() -> Path:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlxcel_dist.checkpoint.loader import build_model

    out = cache_dir() / "qwen3_moe_random"
    if (out / "config.json").exists() and json.loads((out / "config.json").read_text()) == CONFIG:
        return out
    out.mkdir(parents=True, exist_ok=True)
    m = build_model(CONFIG)
    mx.random.seed(0)
    params = {}
    for name, p in tree_flatten(m.parameters()):
        w = mx.ones(p.shape) if name.endswith("norm.weight") else 0.02 * mx.random.normal(p.shape)
        params[name] = w.astype(mx.bfloat16)
    mx.save_safetensors(str(out / "model.safetensors"), params, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(CONFIG))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--gen-tokens", type=int, default=32)
    a = ap.parse_args()
    d = checkpoint()
    res = {}
    for split in ("intermediate", "experts"):
        cmd = [sys.executable, "-m", "mlxcel_dist.cli", "bench", str(d), "--np", str(a.np), "--moe-split", split,
               "--gen-tokens", str(a.gen_tokens), "--json"]
        line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        res[split] = json.loads(line)
        print(split, json.dumps(res[split]))
    key = next(k for k in ("decode_tok_s", "gen_tok_s", "tok_s") if k in res["experts"])
    print(f"experts / intermediate {key}: {res['experts'][key] / res['intermediate'][key]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
