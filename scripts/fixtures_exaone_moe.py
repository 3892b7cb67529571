#!/usr/bin/env python
"""Tiny random EXAONE MoE reference fixtures (tests/fixtures/exaone_moe/<case>/).
Run from the repository root: /work/venv/bin/python scripts/fixtures_exaone_moe.py
(or scripts/make_fixtures.py --family exaone_moe).

save_pretrained writes the experts one key per expert
(`mlp.experts.N.{gate,up,down}_proj.weight`), the shared expert as
`mlp.shared_experts.*`, the router as `mlp.gate.weight` and its correction
bias as `mlp.e_score_correction_bias` (a buffer, `mlp.gate.e_score_correction_bias`
in memory: re-initialised here too, or it would stay zero). The reference is
the reloaded model with eager attention and eager experts, checked against
transformers' default grouped_mm experts.
See scripts/fixture_lib.py for what each case directory holds.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from transformers import ExaoneMoeConfig, ExaoneMoeForCausalLM

from fixture_lib import (FULL, LLAMA_STYLE, SLIDING, Family, bf16_vs_fp32, full_logits, gate_bias_in_weights,
                         no_correction_bias, no_window, router_gates, run, with_correction_bias)


def no_qk_norm(m) -> None:
    for layer in m.model.layers:
        layer.self_attn.q_norm = torch.nn.Identity()
        layer.self_attn.k_norm = torch.nn.Identity()


def rope_on_global(m) -> None:
    """RoPE on the global layers too (exaone's global layers are NoPE)."""
    for layer, kind in zip(m.model.layers, m.config.layer_types):
        if kind == FULL:
            layer.self_attn.sliding_window = None  # rotates when None; full layers get no window either way


def no_routed_scaling(m) -> None:
    for g in router_gates(m):
        g.routed_scaling_factor = 1.0


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


COMMON_ABLATIONS = {
    "sliding_window": no_window,
    "qk_norm": no_qk_norm,
    "nope_global_layers": rope_on_global,
    "shared_expert": no_shared_expert,
    "expert_order": experts_swapped,
    "routed_scaling": no_routed_scaling,
}

CASES = [
    dict(
        name="gqa_fp32",
        description=(
            "8 q / 2 kv heads, head_dim 8, window 8 with sliding_window_pattern 4 (s,s,s,f), first layer dense "
            "(first_k_dense_replace 1), 8 experts top-2 in 4 groups (2 kept), correction bias, scaling 2.5, "
            "1 shared expert, float32"
        ),
        seed=4201,
        T=48,
        model_cls=with_correction_bias(ExaoneMoeForCausalLM, 4201),
        config=dict(
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=64,
            sliding_window=8,
            sliding_window_pattern=4,
            num_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            moe_intermediate_size=16,
            routed_scaling_factor=2.5,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        ),
        ablations={
            **COMMON_ABLATIONS,
            "correction_bias": no_correction_bias,
            "bias_only_chooses": gate_bias_in_weights,
            "group_limit": no_group_limit,
        },
    ),
    dict(
        name="mqa_tied_fp32",
        description=(
            "4 q / 1 kv head, tied embeddings, layer_types s,f,s,s,f (window 12), mlp_layer_types "
            "dense,sparse,dense,sparse,sparse, 6 experts top-3 in one group, NOT renormalised, scaling 1.5, "
            "2 shared experts (I=32), float32"
        ),
        seed=4202,
        T=56,
        model_cls=with_correction_bias(ExaoneMoeForCausalLM, 4202),
        config=dict(
            num_hidden_layers=5,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            intermediate_size=64,
            tie_word_embeddings=True,
            sliding_window=12,
            layer_types=[SLIDING, FULL, SLIDING, SLIDING, FULL],
            mlp_layer_types=["dense", "sparse", "dense", "sparse", "sparse"],
            num_experts=6,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            num_shared_experts=2,
            moe_intermediate_size=16,
            routed_scaling_factor=1.5,
            rope_parameters={"rope_type": "default", "rope_theta": 500_000.0},
        ),
        ablations={**COMMON_ABLATIONS, "correction_bias": no_correction_bias, "bias_only_chooses": gate_bias_in_weights},
    ),
    dict(
        name="gqa_bf16",
        description=(
            "8 q / 4 kv heads, bfloat16; 3 experts top-3 (every token uses all three, so bf16 rounding cannot "
            "flip a routing choice; the bias still must not weight), pattern 3 (s,s,f), window 16, all sparse"
        ),
        seed=4203,
        T=64,
        dtype=torch.bfloat16,
        model_cls=with_correction_bias(ExaoneMoeForCausalLM, 4203),
        config=dict(
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=8,
            sliding_window=16,
            sliding_window_pattern=3,
            first_k_dense_replace=0,
            num_experts=3,
            num_experts_per_tok=3,
            moe_intermediate_size=16,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        ),
        ablations={**COMMON_ABLATIONS, "bias_only_chooses": gate_bias_in_weights},
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
    """Smallest (k-th - (k+1)-th) biased score among the allowed experts over
    every token and MoE layer of the float32 model (None when every token
    uses every expert)."""
    model = ctx.exact
    margins = []

    def hook(g, _inp, out):
        logits = out[0].float()
        choice = logits.sigmoid() + g.e_score_correction_bias
        k = g.top_k
        if choice.shape[-1] > k:
            top = torch.topk(choice, k + 1, dim=-1).values
            margins.append(float((top[:, k - 1] - top[:, k]).min()))

    hs = [g.register_forward_hook(hook) for g in router_gates(model)]
    full_logits(model, ctx.ids)
    for h in hs:
        h.remove()
    return {"router_min_margin": round(min(margins), 5) if margins else None}


NOTES = [
    "transformers 5.24 ExaoneMoeConfig: without layer_types every sliding_window_pattern-th layer is global; "
    "global layers get no RoPE when the model has a window; without mlp_layer_types the first "
    "first_k_dense_replace layers are dense. The router is fp32 (sigmoid); the correction bias only chooses; "
    "router_min_margin is taken over all experts (the group limit ignored).",
]

STYLE = {**LLAMA_STYLE, "info_fields": LLAMA_STYLE["info_fields"] + (bf16_vs_fp32, router_margin)}
FAMILY = Family(
    "exaone_moe",
    __file__,
    ExaoneMoeForCausalLM,
    ExaoneMoeConfig,
    CASES,
    readme_notes=NOTES,
    load_kwargs=dict(experts_implementation="eager"),
    check_in_memory=False,  # the in-memory model runs grouped_mm experts; grouped_mm_check compares them
    extra_outputs=grouped_mm_check,
    **STYLE,
)

if __name__ == "__main__":
    sys.exit(run(FAMILY))
