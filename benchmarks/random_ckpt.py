"""Random-weight gemma3 checkpoints for the benchmarks (never committed).

`gemma3_checkpoint(out, **config)` writes config.json (transformers-4 form:
`sliding_window_pattern`, `rope_theta` + `rope_local_base_freq`, which both
mlxcel-dist and mlx-lm read), model.safetensors (random normal weights, std
0.02, norms zero as Gemma's 1 + w; written with mx.save_safetensors) and the
embedded default model's tokenizer files (so `mlx_lm.load` works; its 512
tokens fit in any larger vocabulary). The directory is reused when its
config.json already holds the same config.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

BENCH_200M = dict(  # ~204M parameters, embeddings 16% of them
    hidden_size=1024, intermediate_size=3584, num_hidden_layers=12, num_attention_heads=8,
    num_key_value_heads=4, head_dim=128, vocab_size=32768, sliding_window=512,
)


def cache_dir() -> Path:
    base = os.environ.get("MLXCEL_BENCH_CACHE") or os.path.join(tempfile.gettempdir(), "mlxcel-bench")
    return Path(base)


def gemma3_config(hidden_size: int, intermediate_size: int, num_hidden_layers: int, num_attention_heads: int,
                  num_key_value_heads: int, head_dim: int, vocab_size: int, sliding_window: int,
                  sliding_window_pattern: int = 6, dtype: str = "bfloat16",
                  max_position_embeddings: int = 131072) -> dict:
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "sliding_window": sliding_window,
        "sliding_window_pattern": sliding_window_pattern,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": None,
        "query_pre_attn_scalar": head_dim,
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
        "torch_dtype": dtype,
    }


def param_shapes(c: dict) -> dict:
    H, I, D = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    nq, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], H), "model.norm.weight": (H,)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (nq * D, H),
            p + "self_attn.k_proj.weight": (nkv * D, H),
            p + "self_attn.v_proj.weight": (nkv * D, H),
            p + "self_attn.o_proj.weight": (H, nq * D),
            p + "self_attn.q_norm.weight": (D,),
            p + "self_attn.k_norm.weight": (D,),
            p + "mlp.gate_proj.weight": (I, H),
            p + "mlp.up_proj.weight": (I, H),
            p + "mlp.down_proj.weight": (H, I),
        })
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"):
            shapes[p + n + ".weight"] = (H,)
    return shapes


def n_params(c: dict) -> tuple[int, int]:
    """(all parameters, embedding parameters)."""
    import math

    shapes = param_shapes(c)
    return sum(math.prod(s) for s in shapes.values()), math.prod(shapes["model.embed_tokens.weight"])


def gemma3_checkpoint(out: Path | None = None, seed: int = 0, **kw) -> Path:
    import mlx.core as mx

    config = gemma3_config(**kw)
    if out is None:
        tag = "-".join(str(kw[k]) for k in sorted(kw))
        out = cache_dir() / f"gemma3-{tag}-s{seed}"
    out = Path(out)
    cfg_path = out / "config.json"
    if cfg_path.exists() and (out / "model.safetensors").exists():
        try:
            if json.loads(cfg_path.read_text()) == config:
                return out
        except json.JSONDecodeError:
            pass
    out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(mx, config["torch_dtype"])
    key = mx.random.key(seed)
    weights = {}
    for name, shape in param_shapes(config).items():
        if len(shape) == 1:
            weights[name] = mx.zeros(shape, dtype=dtype)
        else:
            key, sub = mx.random.split(key)
            weights[name] = (mx.random.normal(shape, key=sub) * 0.02).astype(dtype)
        mx.eval(weights[name])
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "models" / "gemma3-tiny" / f, out / f)
    cfg_path.write_text(json.dumps(config, indent=2))
    return out


if __name__ == "__main__":
    import sys

    p = gemma3_checkpoint(**BENCH_200M)
    total, emb = n_params(gemma3_config(**BENCH_200M))
    print(p, f"{total / 1e6:.1f}M params, embeddings {emb / total:.1%}", file=sys.stderr)
