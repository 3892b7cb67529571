"""Rebuild tests/fixtures/mlx_lm/: checkpoints quantized by mlx-lm itself, and
mlx-lm's logits for them, so tests/test_quantized.py checks "same logits as
mlx-lm" (np 1 and np 2) without mlx-lm installed.

usage: python scripts/make_mlx_lm_fixtures.py      (needs `pip install -e ".[dev]"`)

Each case starts from a reference fixture's fp32 weights with its
transformers-4 config (`config_t4.json`: mlx-lm reads `rope_theta` /
`rope_scaling` / `sliding_window_pattern`, not transformers 5's
`rope_parameters` / `layer_types`) and the embedded default model's tokenizer
(`mlx_lm.convert` loads one), runs `mlx_lm.convert(quantize=True, q_bits=4,
q_group_size=64)`, and saves `mlx_lm_reference.npz`: `ids` (the reference
fixture's ids) and `logits` float32 [T, V] from mlx-lm's `load_model` and one
forward pass without cache. Deterministic: rerunning gives the same bytes.

The MoE cases (minimax_m2, llama4) are in mlx-lm's stacked expert layout
(`switch_mlp.*` / `experts.*_proj` [E, I, H], QuantizedSwitchLinear where
the input dimension is whole groups of 64: gate/up, not down). mlx-lm needs
the hub config forms: minimax's
`shared_intermediate_size` (0 on the hub), llama4 as the multimodal wrapper
(`text_config`, weights under `language_model.`: mlx-lm's llama4_text model
has no MoE), whose rope/chunk layer pattern it fixes at every 4th layer (the
source case has that pattern) and whose MoE runs top-1 only.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
OUT = FIXTURES / "mlx_lm"
TOKENIZER = ROOT / "models" / "gemma3-tiny"

def _minimax(config: dict, weights: dict):
    return {**config, "shared_intermediate_size": 0}, weights


def _llama4_multimodal(config: dict, weights: dict):
    """A Llama4ForCausalLM checkpoint as the multimodal wrapper mlx-lm reads."""
    cfg = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "text_config": config,
           "vision_config": {}, "tie_word_embeddings": False, "torch_dtype": config.get("torch_dtype", "float32")}
    return cfg, {f"language_model.{k}": v for k, v in weights.items()}


def _kimi_k2(config: dict, weights: dict):
    """Kimi K2's config is already in the transformers-4 form; mlx-lm's convert loads the tokenizer through
    transformers, which has no kimi_k2 type (mlx-lm itself reads kimi_k2 as deepseek_v3)."""
    return {**config, "model_type": "deepseek_v3"}, weights


def _qwen3_5_fused_experts(config: dict, weights: dict):
    """qwen3_5_moe/hub_fp32 with its experts fused as the hub stores them (mlx-lm's qwen3_5_moe reads
    `mlp.experts.gate_up_proj` [E, 2I, H] / `mlp.experts.down_proj` [E, H, I] only)."""
    import re

    out, per = {}, {}
    for k, v in weights.items():
        m = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", k)
        if m:
            per.setdefault(m[1], {})[(int(m[2]), m[3])] = v
        else:
            out[k] = v
    for base, d in per.items():
        E = 1 + max(e for e, _ in d)
        out[f"{base}.gate_up_proj"] = np.stack([np.concatenate([d[(e, "gate")], d[(e, "up")]]) for e in range(E)])
        out[f"{base}.down_proj"] = np.stack([d[(e, "down")] for e in range(E)])
    return config, out


# case name -> (source reference fixture, description[, options: edit(config, weights) -> what mlx-lm is given,
# config: the source's config file (config_t4.json), group_size (GROUP_SIZE)])
CASES = {
    "gemma3_q4": ("gemma3/gqa_fp32", "gemma3_text, 8 q / 2 kv heads, window 16 (pattern 3), tied quantized embedding"),
    "llama_q4": ("llama/gqa_fp32", "llama, 8 q / 2 kv heads, llama3 RoPE, q/k/v/o and MLP biases, quantized untied lm_head"),
    "minimax_m2_q4": ("minimax_m2/hub_layout_fp32", "minimax_m2 from the hub layout: block_sparse_moe.switch_mlp "
                      "stacks (gate/up 4-bit, down [E, 64, 16] unquantized), 8-bit router", {"edit": _minimax}),
    "llama4_q4": ("llama4/gqa_fp32", "llama4 (the multimodal wrapper of llama4/gqa_fp32's text model): "
                  "feed_forward.experts stacks (gate/up 4-bit, down [E, 64, 32] unquantized)",
                  {"edit": _llama4_multimodal}),
    # MoE: mlx-lm stacks the per-expert tensors into switch_mlp [E, out, in] and quantizes them
    # (group size 32: the experts' intermediate size is 64, two groups, so np 2 splits it)
    "qwen3_moe_q4": ("qwen3_moe/gqa_fp32", "qwen3_moe, switch_mlp 8 experts top-2 quantized (and the router), "
                     "a dense layer among sparse ones", {"group_size": 32}),
    "glm4_moe_q4": ("glm4_moe/gqa_fp32", "glm4_moe, switch_mlp 8 experts top-2 in 4 groups quantized, correction "
                    "bias, shared expert, partial rotary", {"group_size": 32}),
    "deepseek_v3_q4": ("deepseek_v3/kimi_k2_fp32", "deepseek_v3 (Kimi K2's config, given to mlx-lm as deepseek_v3): "
                       "MLA 6 heads (kv_b_proj as embed_q / unembed_out, unquantized at these dims), switch_mlp 6 "
                       "experts top-3 (gate/up 4-bit, down [E, 64, 16] unquantized), shared expert, a dense layer; "
                       "group size 32", {"edit": _kimi_k2, "config": "config.json", "group_size": 32}),
    "qwen3_next_q4": ("qwen3_next/hybrid_fp32", "qwen3_next: gated DeltaNet (conv1d moved to [C, K, 1], (1 + w) norms "
                      "stored as 1 + w), gated attention, switch_mlp 8 experts top-2 + gated shared expert quantized, "
                      "8-bit router and shared-expert gate; group size 32", {"group_size": 32}),
    "qwen3_5_moe_q4": ("qwen3_5_moe/hub_fp32", "qwen3_5_moe from the hub layout (multimodal config, experts fused as "
                       "gate_up_proj, vision tower dropped by mlx-lm): switch_mlp 8 experts top-2 + gated shared "
                       "expert; group size 32",
                       {"edit": _qwen3_5_fused_experts, "config": "config.json", "group_size": 32}),
    "deepseek_v32_q4": ("deepseek_v32/yarn_fp32", "deepseek_v32: MLA 8 heads with the lightning indexer (wk and "
                        "weights_proj 4-bit, wq_b unquantized at q_lora 24), top-8 keys, switch_mlp 8 experts "
                        "top-2 (gate/up 4-bit), shared expert, a dense layer (down 4-bit); group size 64"),
}
BITS, GROUP_SIZE = 4, 64


def build(name: str, src_case: str, options: dict | None = None) -> dict:
    import mlx.core as mx
    from mlx_lm.convert import convert
    from mlx_lm.utils import load_model
    from safetensors.numpy import load_file, save_file

    options = options or {}
    group_size = options.get("group_size", GROUP_SIZE)

    src = FIXTURES / src_case
    out = OUT / name
    if out.exists():
        shutil.rmtree(out)
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"
        hf.mkdir()
        if options.get("edit"):
            cfg, weights = options["edit"](json.loads((src / options.get("config", "config_t4.json")).read_text()),
                                           load_file(src / "model.safetensors"))
            save_file(weights, hf / "model.safetensors", metadata={"format": "pt"})
            (hf / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        else:
            shutil.copyfile(src / "model.safetensors", hf / "model.safetensors")
            shutil.copyfile(src / "config_t4.json", hf / "config.json")
        shutil.copyfile(src / "generation_config.json", hf / "generation_config.json")
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(TOKENIZER / f, hf / f)
        convert(str(hf), str(out), quantize=True, q_bits=BITS, q_group_size=group_size)
    (out / "README.md").unlink(missing_ok=True)  # mlx-lm's model card (names the temp dir)
    ids = np.load(src / "reference.npz")["ids"].astype(np.int32)
    model, _ = load_model(out)
    logits = model(mx.array(ids)[None])[0].astype(mx.float32)
    np.savez(out / "mlx_lm_reference.npz", ids=ids, logits=np.array(logits))
    return {"case": name, "source": src_case, "T": len(ids), "group_size": group_size,
            "bytes": sum(p.stat().st_size for p in out.iterdir())}


def main() -> int:
    import mlx.core as mx
    import mlx_lm

    OUT.mkdir(exist_ok=True)
    rows = [build(name, src, *rest[1:]) for name, (src, *rest) in CASES.items()]
    lines = [
        "# mlx-lm quantized fixtures",
        "",
        "Generated by `scripts/make_mlx_lm_fixtures.py` (do not edit by hand; rerun the script).",
        f"mlx-lm {mlx_lm.__version__}, mlx {mx.__version__}, CPU.",
        "",
        f"Each case directory is what `mlx_lm.convert(quantize=True, q_bits={BITS}, q_group_size=G)` wrote (G the",
        "case's group size, 64 unless the table says otherwise)",
        "for a reference fixture's fp32 weights with its transformers-4 config (`config_t4.json`, the form mlx-lm",
        "reads) and the embedded default model's tokenizer, plus `mlx_lm_reference.npz` (`ids` int32 [T], `logits`",
        "float32 [T, V] from mlx-lm's `load_model` and one forward pass without cache). The MoE families' cases",
        "start from the config forms mlx-lm needs (see the script's docstring).",
        "",
        "| case | source | T | group size | files (bytes) | what |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['case']} | {r['source']} | {r['T']} | {r['group_size']} | {r['bytes']} | {CASES[r['case']][1]} |")
    (OUT / "README.md").write_text("\n".join(lines) + "\n")
    print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
