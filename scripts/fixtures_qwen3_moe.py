#!/usr/bin/env python
"""Tiny random Qwen3 MoE reference fixtures (tests/fixtures/qwen3_moe/<case>/).
Run from the repository root: /work/main/.venv/bin/python scripts/fixtures_qwen3_moe.py
(or scripts/make_fixtures.py --family qwen3_moe).

save_pretrained (transformers 5.24) writes the experts one key per expert
(`mlp.experts.N.{gate,up,down}_proj.weight`) and the router as
`mlp.gate.weight`; config.json names the expert count `num_local_experts`
(config_t4.json: `num_experts`, top-level rope_theta). The reference is the
reloaded model with eager attention and eager experts, checked against
transformers' default grouped_mm experts. transformers 5.24 windows EVERY
layer when use_sliding_window (max_window_layers is not read): the sliding
case runs T = 48 tokens past a window of 8.
See scripts/fixture_lib.py for what each case directory holds.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from fixture_lib import LLAMA_STYLE, Family, bf16_vs_fp32, full_logits, no_window, run, t4_config


def _moe(m):
    return [layer.mlp for layer in m.model.layers if hasattr(layer.mlp, "gate")]


def no_qk_norm(m) -> None:
    for layer in m.model.layers:
        layer.self_attn.q_norm = torch.nn.Identity()
        layer.self_attn.k_norm = torch.nn.Identity()


def flip_norm_topk(m) -> None:
    for moe in _moe(m):
        moe.gate.norm_topk_prob = not moe.gate.norm_topk_prob


def experts_swapped(m) -> None:
    for moe in _moe(m):
        ex = moe.experts
        ex.gate_up_proj.copy_(torch.roll(ex.gate_up_proj, 1, dims=0))
        ex.down_proj.copy_(torch.roll(ex.down_proj, 1, dims=0))


def top1_only(m) -> None:
    """One expert per token instead of k: the other chosen experts matter."""
    for moe in _moe(m):
        moe.gate.top_k = 1


def dense_layers_sparse(m) -> None:
    """The dense layers' MLP zeroed: they run (mlp_only_layers / decoder_sparse_step)."""
    for layer in m.model.layers:
        if not hasattr(layer.mlp, "gate"):
            layer.mlp.down_proj.weight.zero_()


def t4(cfg: dict) -> dict:
    d = t4_config(cfg, num_experts=cfg["num_local_experts"])
    d.pop("num_local_experts")
    return d


COMMON = {"qk_norm": no_qk_norm, "expert_order": experts_swapped, "top_k": top1_only, "norm_topk_prob": flip_norm_topk}

CASES = [
    dict(
        name="gqa_fp32",
        description=(
            "8 q / 2 kv heads, head_dim 8, 4 layers: mlp_only_layers [1] with decoder_sparse_step 1 (sparse, dense, "
            "sparse, sparse), 8 experts top-2 renormalised, float32; config_t4.json"
        ),
        seed=5301,
        T=48,
        config=dict(
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=96,
            moe_intermediate_size=64,  # two 4-bit groups of 32: the mlx-lm checkpoint splits at np 2
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            decoder_sparse_step=1,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        ),
        t4=t4,
        ablations={**COMMON, "dense_layers": dense_layers_sparse},
    ),
    dict(
        name="mqa_bf16",
        description=(
            "4 q / 1 kv head, head_dim 16, bfloat16, decoder_sparse_step 2 (dense, sparse, dense), 4 experts top-4 "
            "(every token uses all four, so bf16 rounding cannot flip a routing choice), not renormalised, tied"
        ),
        seed=5302,
        T=48,
        dtype=torch.bfloat16,
        config=dict(
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            tie_word_embeddings=True,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=4,
            norm_topk_prob=False,
            decoder_sparse_step=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        ),
        # (norm_topk_prob cannot matter with top-k = E: the probabilities already sum to 1)
        ablations={"qk_norm": no_qk_norm, "expert_order": experts_swapped, "dense_layers": dense_layers_sparse},
    ),
    dict(
        name="sliding_fp32",
        description=(
            "6 q / 2 kv heads, head_dim 8, use_sliding_window (window 8 on every layer, max_window_layers 1 "
            "unread), T 48, 3 layers all sparse, 8 experts top-3 not renormalised, float32; config_t4.json"
        ),
        seed=5303,
        T=48,
        config=dict(
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=8,
            moe_intermediate_size=16,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        ),
        t4=t4,
        ablations={**COMMON, "sliding_window": no_window},
    ),
]


def grouped_mm_check(ctx) -> list[str]:
    """transformers' default grouped_mm experts agree with the eager reference."""
    grouped = full_logits(ctx.load(ctx.out, torch.float32, experts_implementation="grouped_mm"), ctx.ids)
    rel = float(np.abs(grouped - ctx.ref32).max() / np.abs(ctx.ref32).max())
    assert rel < 1e-5, f"{ctx.case['name']}: eager vs grouped_mm experts differ by {rel}"
    return [
        "reference: eager attention, eager experts (per-expert loop); transformers' default grouped_mm "
        f"experts agree to {rel:.1e} of the logit scale (float32)",
    ]


@torch.no_grad()
def router_margin(ctx) -> dict:
    """Smallest (k-th - (k+1)-th) routing probability over every token and
    sparse layer of the float32 model (None when every token uses every expert)."""
    margins = []

    def hook(g, _inp, out):
        probs = torch.softmax(out[0].float(), dim=-1)
        k = g.top_k
        if probs.shape[-1] > k:
            top = torch.topk(probs, k + 1, dim=-1).values
            margins.append(float((top[:, k - 1] - top[:, k]).min()))

    hs = [moe.gate.register_forward_hook(hook) for moe in _moe(ctx.exact)]
    full_logits(ctx.exact, ctx.ids)
    for h in hs:
        h.remove()
    return {"router_min_margin": round(min(margins), 5) if margins else None}


NOTES = [
    "transformers 5.24 Qwen3MoeConfig: layer i is sparse when i is not in mlp_only_layers and "
    "(i + 1) % decoder_sparse_step == 0; the router runs in the hidden dtype, softmax in fp32, the top-k weights "
    "(renormalised when norm_topk_prob) rounded back to the hidden dtype.",
]

STYLE = {**LLAMA_STYLE, "info_fields": LLAMA_STYLE["info_fields"] + (bf16_vs_fp32, router_margin)}
FAMILY = Family(
    "qwen3_moe",
    __file__,
    Qwen3MoeForCausalLM,
    Qwen3MoeConfig,
    CASES,
    readme_notes=NOTES,
    load_kwargs=dict(experts_implementation="eager"),
    check_in_memory=False,  # the in-memory model runs grouped_mm experts; grouped_mm_check compares them
    extra_outputs=grouped_mm_check,
    **STYLE,
)

if __name__ == "__main__":
    sys.exit(run(FAMILY))
