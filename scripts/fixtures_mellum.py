#!/usr/bin/env python
"""Tiny random Mellum reference fixtures (tests/fixtures/mellum/<case>/).
Run from the repository root: /work/venv/bin/python scripts/fixtures_mellum.py
(or scripts/make_fixtures.py --family mellum).

save_pretrained writes the experts one key per expert
(`mlp.experts.N.{gate,up,down}_proj.weight`; transformers 5 stacks them only in
memory) and the router as `mlp.gate.weight`. The reference is the reloaded
model with eager attention and the eager (per-expert loop) experts; it is
checked against transformers' default grouped_mm experts too.
See scripts/fixture_lib.py for what each case directory holds.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from transformers import MellumConfig, MellumForCausalLM

from fixture_lib import FULL, LLAMA_STYLE, SLIDING, Family, bf16_vs_fp32, full_logits, no_window, rope_by_kind, run


def no_qk_norm(m) -> None:
    for layer in m.model.layers:
        layer.self_attn.q_norm = torch.nn.Identity()
        layer.self_attn.k_norm = torch.nn.Identity()


def sliding_theta_as_full(m) -> None:
    """Sliding layers rotated with the full layers' theta (one RoPE for all)."""
    rot = m.model.rotary_emb
    rot.sliding_attention_inv_freq.copy_(rot.full_attention_inv_freq)


def flip_topk_renorm(m) -> None:
    for layer in m.model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.norm_topk_prob = not layer.mlp.gate.norm_topk_prob


def experts_swapped(m) -> None:
    """A loader that mixed up expert order (expert e gets expert e+1's weights)."""
    for layer in m.model.layers:
        if hasattr(layer.mlp, "experts"):
            ex = layer.mlp.experts
            ex.gate_up_proj.copy_(torch.roll(ex.gate_up_proj, 1, dims=0))
            ex.down_proj.copy_(torch.roll(ex.down_proj, 1, dims=0))


COMMON_ABLATIONS = {"sliding_window": no_window, "qk_norm": no_qk_norm, "rope_theta_per_kind": sliding_theta_as_full}

CASES = [
    dict(
        name="gqa_fp32",
        description=(
            "8 q / 2 kv heads, head_dim 8, layers s,f,s,f with window 8, mlp dense (I=64),sparse,sparse,sparse, "
            "4 experts top-2 (I=16) renormalised, rope theta 500000 full / 10000 sliding, float32"
        ),
        seed=4101,
        T=48,
        config=dict(
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=64,
            sliding_window=8,
            layer_types=[SLIDING, FULL, SLIDING, FULL],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            rope_parameters=rope_by_kind(500_000.0, 10_000.0),
        ),
        ablations={**COMMON_ABLATIONS, "topk_renorm": flip_topk_renorm, "expert_order": experts_swapped},
    ),
    dict(
        name="mqa_tied_fp32",
        description=(
            "4 q / 1 kv head, tied embeddings, layers s,s,f,s,f with window 12, mlp dense,dense,sparse,"
            "sparse,sparse, 6 experts top-3 (I=16) NOT renormalised (norm_topk_prob false), float32"
        ),
        seed=4102,
        T=56,
        config=dict(
            num_hidden_layers=5,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            intermediate_size=64,
            tie_word_embeddings=True,
            sliding_window=12,
            layer_types=[SLIDING, SLIDING, FULL, SLIDING, FULL],
            mlp_layer_types=["dense", "dense", "sparse", "sparse", "sparse"],
            num_experts=6,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            moe_intermediate_size=16,
            rope_parameters=rope_by_kind(200_000.0, 5_000.0),
        ),
        ablations={**COMMON_ABLATIONS, "topk_renorm": flip_topk_renorm, "expert_order": experts_swapped},
    ),
    dict(
        name="gqa_bf16",
        description=(
            "8 q / 4 kv heads, bfloat16; 3 experts top-3 (every token uses all three, so bf16 rounding "
            "cannot flip a routing choice), layers s,f,s with window 16, mlp sparse throughout (the default)"
        ),
        seed=4103,
        T=64,
        dtype=torch.bfloat16,
        config=dict(
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=16,
            sliding_window=16,
            layer_types=[SLIDING, FULL, SLIDING],
            num_experts=3,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            rope_parameters=rope_by_kind(500_000.0, 10_000.0),
        ),
        ablations={**COMMON_ABLATIONS, "expert_order": experts_swapped},
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
    """Smallest (k-th - (k+1)-th) router logit over every token and MoE layer
    of the float32 model (None when every token uses every expert)."""
    model = ctx.exact
    k, margins = model.config.num_experts_per_tok, []

    def hook(_m, _inp, out):
        logits = out[0].float()
        top = torch.topk(logits, min(k + 1, logits.shape[-1]), dim=-1).values
        if top.shape[-1] > k:
            margins.append(float((top[:, k - 1] - top[:, k]).min()))

    hs = [layer.mlp.gate.register_forward_hook(hook) for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    full_logits(model, ctx.ids)
    for h in hs:
        h.remove()
    return {"router_min_margin": round(min(margins), 5) if margins else None}


NOTES = [
    "transformers 5.24 MellumConfig: no layer_types means all full; no mlp_layer_types means all sparse; "
    "rope_parameters per layer kind. The router softmaxes all E logits in fp32, takes the top-k "
    "probabilities and (norm_topk_prob) renormalises them.",
]

STYLE = {**LLAMA_STYLE, "info_fields": LLAMA_STYLE["info_fields"] + (bf16_vs_fp32, router_margin)}
FAMILY = Family(
    "mellum",
    __file__,
    MellumForCausalLM,
    MellumConfig,
    CASES,
    readme_notes=NOTES,
    load_kwargs=dict(experts_implementation="eager"),
    check_in_memory=False,  # the in-memory model runs grouped_mm experts; grouped_mm_check compares them
    extra_outputs=grouped_mm_check,
    **STYLE,
)

if __name__ == "__main__":
    sys.exit(run(FAMILY))
