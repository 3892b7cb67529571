#!/usr/bin/env python
"""Tiny random DeepSeek-V3 reference fixtures (tests/fixtures/deepseek_v3/<case>/).
Run from the repository root: python scripts/fixtures_deepseek_v3.py
(or scripts/make_fixtures.py --family deepseek_v3).

save_pretrained writes the routed experts one key per expert
(`mlp.experts.N.{gate,up,down}_proj.weight`), the shared experts as
`mlp.shared_experts.*`, the router as `mlp.gate.weight` and its correction
bias (a buffer: re-initialised here, or it would stay zero). The reference is
the reloaded model with eager attention and eager experts, checked against
transformers' default grouped_mm experts. The kimi_k2 case is the same
model saved with Kimi K2's model_type and config form (transformers-4 keys),
reloaded through DeepseekV3ForCausalLM (transformers has no kimi_k2 type).
See scripts/fixture_lib.py for what each case directory holds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from fixture_lib import (LLAMA_STYLE, Family, bf16_vs_fp32, default_rope, draw_correction_biases, full_logits,
                         gate_bias_in_weights, no_correction_bias, router_gates, run, t4_config)


def with_correction_bias(seed: int):
    """DeepseekV3ForCausalLM whose routers' correction biases are drawn at
    construction (a buffer: fixture_lib's re-initialisation covers parameters
    only); from_pretrained then loads the saved ones over them."""

    class Model(DeepseekV3ForCausalLM):
        def __init__(self, cfg):
            super().__init__(cfg)
            draw_correction_biases(self, seed)

        @classmethod
        def from_pretrained(cls, directory, **kwargs):
            kwargs.setdefault("config", hf_config(directory))
            return super().from_pretrained(directory, **kwargs)

    Model.__name__ = Model.__qualname__ = "DeepseekV3ForCausalLM"  # the architectures entry
    return Model


def hf_config(directory) -> DeepseekV3Config:
    """The checkpoint's config for transformers: a kimi_k2 config.json read as
    deepseek_v3 (transformers keys its per-expert weight conversion by
    model_type, so under kimi_k2 the experts would stay unloaded)."""
    d = json.loads((Path(directory) / "config.json").read_text())
    if d.get("model_type") == "kimi_k2":
        d["model_type"] = "deepseek_v3"
    return DeepseekV3Config.from_dict(d)


def no_routed_scaling(m) -> None:
    for g in router_gates(m):
        g.routed_scaling_factor = 1.0


def no_group_limit(m) -> None:
    for g in router_gates(m):
        g.topk_group = g.num_group


def no_shared_experts(m) -> None:
    for layer in m.model.layers:
        if hasattr(layer.mlp, "shared_experts"):
            layer.mlp.shared_experts.down_proj.weight.zero_()


def experts_swapped(m) -> None:
    for layer in m.model.layers:
        if hasattr(layer.mlp, "experts"):
            ex = layer.mlp.experts
            ex.gate_up_proj.copy_(torch.roll(ex.gate_up_proj, 1, dims=0))
            ex.down_proj.copy_(torch.roll(ex.down_proj, 1, dims=0))


def no_mscale(m) -> None:
    """Scores scaled by q_head_dim**-0.5 only (no yarn mscale_all_dim factor)."""
    for layer in m.model.layers:
        layer.self_attn.scaling = layer.self_attn.qk_head_dim**-0.5


def rope_not_interleaved(m) -> None:
    m.config.rope_interleave = not m.config.rope_interleave


def no_latent_norms(m) -> None:
    for layer in m.model.layers:
        layer.self_attn.kv_a_layernorm = torch.nn.Identity()
        if layer.self_attn.q_a_layernorm is not None:
            layer.self_attn.q_a_layernorm = torch.nn.Identity()


def no_rope_on_k(m) -> None:
    """k_pe unrotated (the shared rope key must rotate with the position)."""
    for layer in m.model.layers:
        a = layer.self_attn
        orig = a.forward

        def fwd(*args, orig=orig, **kwargs):
            cos, sin = kwargs["position_embeddings"]
            return orig(*args, **{**kwargs, "position_embeddings": (torch.ones_like(cos), torch.zeros_like(sin))})

        a.forward = fwd


MOE_ABLATIONS = {
    "shared_experts": no_shared_experts,
    "expert_order": experts_swapped,
    "routed_scaling": no_routed_scaling,
    "correction_bias": no_correction_bias,
    "bias_only_chooses": gate_bias_in_weights,
    "latent_norms": no_latent_norms,
    "rope": no_rope_on_k,
    "rope_interleave": rope_not_interleaved,
}

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10_000.0,
    "factor": 8.0,
    "mscale": 0.707,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
}


def t4_form(cfg: dict) -> dict:
    # transformers 4 wrote neither the derived head_dim nor qk_head_dim
    return t4_config(cfg, drop=("head_dim", "qk_head_dim"), version="4.48.0")


def kimi_k2_form(cfg: dict) -> dict:
    """Kimi K2's config.json: its own model_type, the transformers-4 keys."""
    d = t4_form(cfg)
    d["model_type"] = "kimi_k2"
    d["architectures"] = ["DeepseekV3ForCausalLM"]
    return d


CASES = [
    dict(
        name="yarn_fp32",
        description=(
            "8 heads, q_lora 24, kv_lora 16, nope/rope/v 8/8/12, yarn factor 8 (mscale 0.707, mscale_all_dim 1), "
            "interleaved rope, 4 layers (first dense), 8 experts top-2 in 2 groups (1 kept), correction bias, "
            "scaling 2.5, 1 shared expert, float32"
        ),
        seed=5301,
        T=48,
        model_cls=with_correction_bias(5301),
        config=dict(
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=8,  # MLA: per-head k/v (the default 128 would break eager repeat_kv)
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=12,
            first_k_dense_replace=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            moe_intermediate_size=16,
            routed_scaling_factor=2.5,
            rope_parameters=dict(YARN),
        ),
        t4=t4_form,
        ablations={
            **MOE_ABLATIONS,
            "group_limit": no_group_limit,
            "mscale": no_mscale,
            "yarn": default_rope,
        },
    ),
    dict(
        name="no_qlora_fp32",
        description=(
            "4 heads, q_proj (q_lora_rank None), kv_lora 32, nope/rope/v 16/8/16, default rope not interleaved, "
            "3 layers (first dense), 4 experts top-2 in 2 groups (both kept), NOT renormalised, scaling 1.5, "
            "2 shared experts, float32"
        ),
        seed=5302,
        T=56,
        model_cls=with_correction_bias(5302),
        config=dict(
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,  # MLA: per-head k/v (the default 128 would break eager repeat_kv)
            q_lora_rank=None,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            first_k_dense_replace=1,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=2,
            norm_topk_prob=False,
            n_shared_experts=2,
            moe_intermediate_size=16,
            routed_scaling_factor=1.5,
            rope_interleave=False,
            rope_parameters={"rope_type": "default", "rope_theta": 50_000.0},
        ),
        t4=t4_form,
        ablations={k: v for k, v in MOE_ABLATIONS.items() if k != "latent_norms"} | {"kv_norm": no_latent_norms},
    ),
    dict(
        name="kimi_k2_fp32",
        description=(
            "Kimi K2's config form (model_type kimi_k2, rope_scaling yarn factor 4, mscale = mscale_all_dim = 1), "
            "6 heads, q_lora 16, kv_lora 16, nope/rope/v 8/4/8, 2 layers (first dense), 6 experts top-3 in one "
            "group, scaling 2.827, float32"
        ),
        seed=5303,
        T=48,
        model_cls=with_correction_bias(5303),
        config=dict(
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=6,  # MLA: per-head k/v (the default 128 would break eager repeat_kv)
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=8,
            first_k_dense_replace=1,
            n_routed_experts=6,
            num_experts_per_tok=3,
            n_group=1,
            topk_group=1,
            n_shared_experts=1,
            moe_intermediate_size=16,
            routed_scaling_factor=2.827,
            rope_parameters={**YARN, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "original_max_position_embeddings": 32},
        ),
        edit_config=kimi_k2_form,
        ablations={**MOE_ABLATIONS, "mscale": no_mscale},
    ),
]


def grouped_mm_check(ctx) -> list[str]:
    """transformers' default grouped_mm experts agree with the eager reference."""
    # the plain class: transformers refuses to set the experts implementation of a subclass
    m = DeepseekV3ForCausalLM.from_pretrained(ctx.out, config=hf_config(ctx.out), attn_implementation="eager",
                                              dtype=torch.float32, experts_implementation="grouped_mm").eval()
    grouped = full_logits(m, ctx.ids)
    rel = float(np.abs(grouped - ctx.ref32).max() / np.abs(ctx.ref32).max())
    assert rel < 1e-5, f"{ctx.case['name']}: eager vs grouped_mm experts differ by {rel}"
    return [
        "reference: eager attention, eager experts (per-expert loop); transformers' default grouped_mm "
        f"experts agree to {rel:.1e} of the logit scale (float32)",
    ]


@torch.no_grad()
def router_margin(ctx) -> dict:
    """Smallest (k-th - (k+1)-th) biased score over every token and MoE layer
    of the float32 model (the group limit ignored)."""
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
    "transformers 5.24 DeepseekV3: layers >= first_k_dense_replace are MoE (moe_layer_freq is not read); the "
    "router is fp32 (sigmoid), the correction bias only chooses; softmax scale q_head_dim^-0.5 times "
    "yarn mscale(factor, mscale_all_dim)^2; q_a_layernorm / kv_a_layernorm use eps 1e-6 whatever rms_norm_eps.",
]

STYLE = {**LLAMA_STYLE, "info_fields": LLAMA_STYLE["info_fields"] + (bf16_vs_fp32, router_margin)}
FAMILY = Family(
    "deepseek_v3",
    __file__,
    DeepseekV3ForCausalLM,
    DeepseekV3Config,
    CASES,
    readme_notes=NOTES,
    load_kwargs=dict(experts_implementation="eager"),
    check_in_memory=False,  # the in-memory model runs grouped_mm experts; grouped_mm_check compares them
    extra_outputs=grouped_mm_check,
    **{**STYLE, "auto_load": False},  # the case's class loads (transformers has no kimi_k2 model_type)
)

if __name__ == "__main__":
    sys.exit(run(FAMILY))
