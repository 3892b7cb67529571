#!/usr/bin/env python
"""Tiny random GLM-4.5 MoE reference fixtures (tests/fixtures/glm4_moe/<case>/).
Run from the repository root: /work/main/.venv/bin/python scripts/fixtures_glm4_moe.py
(or scripts/make_fixtures.py --family glm4_moe).

save_pretrained (transformers 5.24) writes the experts one key per expert
(`mlp.experts.N.{gate,up,down}_proj.weight`), the shared expert as
`mlp.shared_experts.*`, the router as `mlp.gate.weight` and its correction
bias as `mlp.gate.e_score_correction_bias` (a buffer: re-initialised here, or
it would stay zero). config.json keeps partial_rotary_factor in
rope_parameters; config_t4.json has it at the top level (with rope_theta).
The reference is the reloaded model with eager attention and eager experts,
checked against transformers' default grouped_mm experts.
See scripts/fixture_lib.py for what each case directory holds.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

from fixture_lib import (LLAMA_STYLE, Family, bf16_vs_fp32, full_logits, gate_bias_in_weights, no_correction_bias,
                         router_gates, run, t4_config, with_correction_bias, zero_biases)


def no_qk_norm(m) -> None:
    for layer in m.model.layers:
        layer.self_attn.use_qk_norm = False


def full_rotary(m) -> None:
    """Every feature rotates (partial_rotary_factor 1)."""
    rot = m.model.rotary_emb
    theta, dim = m.config.rope_parameters["rope_theta"], m.config.head_dim
    rot.inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def no_routed_scaling(m) -> None:
    for g in router_gates(m):
        g.routed_scaling_factor = 1.0


def flip_norm_topk(m) -> None:
    for g in router_gates(m):
        g.norm_topk_prob = not g.norm_topk_prob


def no_group_limit(m) -> None:
    for g in router_gates(m):
        g.topk_group = g.num_group


def no_shared_expert(m) -> None:
    for layer in m.model.layers:
        if hasattr(layer.mlp, "shared_experts"):
            layer.mlp.shared_experts.down_proj.weight.zero_()


def experts_swapped(m) -> None:
    for layer in m.model.layers:
        if hasattr(layer.mlp, "experts"):
            ex = layer.mlp.experts
            ex.gate_up_proj.copy_(torch.roll(ex.gate_up_proj, 1, dims=0))
            ex.down_proj.copy_(torch.roll(ex.down_proj, 1, dims=0))


def t4(cfg: dict) -> dict:
    return t4_config(cfg, partial_rotary_factor=cfg["rope_parameters"]["partial_rotary_factor"])


COMMON = {
    "partial_rotary": full_rotary,
    "shared_expert": no_shared_expert,
    "expert_order": experts_swapped,
    "correction_bias": no_correction_bias,
    "bias_only_chooses": gate_bias_in_weights,
}

CASES = [
    dict(
        name="gqa_fp32",
        description=(
            "8 q / 2 kv heads, head_dim 8 (hidden 64), q/k/v biases, qk norm, partial rotary 0.5, 3 layers (first "
            "dense: first_k_dense_replace 1), 8 experts top-2 in 4 groups (2 kept), correction bias, scaling 2.5, "
            "renormalised, 1 shared expert, float32; config_t4.json"
        ),
        seed=5401,
        T=48,
        model_cls=with_correction_bias(Glm4MoeForCausalLM, 5401),
        config=dict(
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=96,
            attention_bias=True,
            use_qk_norm=True,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            moe_intermediate_size=64,  # two 4-bit groups of 32: the mlx-lm checkpoint splits at np 2
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5},
        ),
        t4=t4,
        ablations={**COMMON, "qk_norm": no_qk_norm, "attention_bias": zero_biases, "group_limit": no_group_limit,
                   "routed_scaling": no_routed_scaling, "norm_topk_prob": flip_norm_topk},
    ),
    dict(
        name="mqa_bf16",
        description=(
            "4 q / 1 kv head, head_dim 32 (not hidden / heads), bfloat16, no qk norm, partial rotary 0.25, "
            "3 experts top-3 (bf16 rounding cannot flip a routing choice), 2 shared experts, no dense layer"
        ),
        seed=5402,
        T=48,
        dtype=torch.bfloat16,
        model_cls=with_correction_bias(Glm4MoeForCausalLM, 5402),
        config=dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            n_routed_experts=3,
            num_experts_per_tok=3,
            n_shared_experts=2,
            moe_intermediate_size=16,
            routed_scaling_factor=1.5,
            first_k_dense_replace=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25},
        ),
        ablations={"partial_rotary": full_rotary, "shared_expert": no_shared_expert, "expert_order": experts_swapped,
                   "bias_only_chooses": gate_bias_in_weights},
    ),
    dict(
        name="topk3_fp32",
        description=(
            "6 q / 3 kv heads, head_dim 16, 8 experts top-3 in 2 groups (1 kept), NOT renormalised, scaling 1.0, "
            "first 2 of 4 layers dense, tied embeddings, float32"
        ),
        seed=5403,
        T=48,
        model_cls=with_correction_bias(Glm4MoeForCausalLM, 5403),
        config=dict(
            num_hidden_layers=4,
            num_attention_heads=6,
            num_key_value_heads=3,
            head_dim=16,
            intermediate_size=64,
            use_qk_norm=True,
            tie_word_embeddings=True,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=2,
            topk_group=1,
            norm_topk_prob=False,
            moe_intermediate_size=16,
            first_k_dense_replace=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5},
        ),
        ablations={**COMMON, "qk_norm": no_qk_norm, "group_limit": no_group_limit, "norm_topk_prob": flip_norm_topk},
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
    """Smallest (k-th - (k+1)-th) biased score over every token and sparse
    layer of the float32 model (the group limit ignored; None when every
    token uses every expert)."""
    margins = []

    def hook(g, _inp, out):
        choice = out[0].float().sigmoid() + g.e_score_correction_bias
        k = g.top_k
        if choice.shape[-1] > k:
            top = torch.topk(choice, k + 1, dim=-1).values
            margins.append(float((top[:, k - 1] - top[:, k]).min()))

    hs = [g.register_forward_hook(hook) for g in router_gates(ctx.exact)]
    full_logits(ctx.exact, ctx.ids)
    for h in hs:
        h.remove()
    return {"router_min_margin": round(min(margins), 5) if margins else None}


NOTES = [
    "transformers 5.24 Glm4MoeConfig: the first first_k_dense_replace layers are dense; partial_rotary_factor "
    "defaults to 0.5; the router is fp32 (sigmoid), the correction bias only chooses; o_proj has no bias.",
]

STYLE = {**LLAMA_STYLE, "info_fields": LLAMA_STYLE["info_fields"] + (bf16_vs_fp32, router_margin)}
FAMILY = Family(
    "glm4_moe",
    __file__,
    Glm4MoeForCausalLM,
    Glm4MoeConfig,
    CASES,
    readme_notes=NOTES,
    load_kwargs=dict(experts_implementation="eager"),
    check_in_memory=False,  # the in-memory model runs grouped_mm experts; grouped_mm_check compares them
    extra_outputs=grouped_mm_check,
    **STYLE,
)

if __name__ == "__main__":
    sys.exit(run(FAMILY))
