#!/usr/bin/env python
"""Tiny random DeepSeek-V3.2 reference fixtures (tests/fixtures/deepseek_v32/<case>/).
Run from the repository root: python scripts/fixtures_deepseek_v32.py
(or scripts/make_fixtures.py --family deepseek_v32).

DeepseekV32ForCausalLM is DeepSeek-V3 (MLA, noaux_tc MoE; the checkpoint
layout of scripts/fixtures_deepseek_v3.py) plus a lightning indexer per layer
(`self_attn.indexer.{wq_b, wk, k_norm, weights_proj}`) that keeps each
query's `index_topk` best keys. The cases keep index_topk small (8, 12)
against 48-56 tokens, so the selection decides most rows of every feeding
mode; fixture_info.json records `indexer_min_margin`, the smallest gap
between the k-th and (k+1)-th index score over every row that selects
(relative to that row's largest |score|): a selection that near a tie would
be decided by rounding, so a case must keep it well above fp32's.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

from fixture_lib import LLAMA_STYLE, Family, bf16_vs_fp32, default_rope, full_logits, run
from fixtures_deepseek_v3 import (BIAS_STD, YARN, _gates, no_latent_norms, no_mscale, no_rope_on_k,
                                  no_shared_experts, router_margin, t4_form)

MIN_INDEX_MARGIN = 1e-5  # of a row's largest |index score|: 10x the ~1e-6 that fp32 ports agree to


def with_correction_bias(seed: int):
    """DeepseekV32ForCausalLM whose routers' correction biases are drawn at
    construction (a buffer: fixture_lib re-initialises parameters only)."""

    class Model(DeepseekV32ForCausalLM):
        def __init__(self, cfg):
            super().__init__(cfg)
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for g in _gates(self):
                    b = g.e_score_correction_bias
                    b.copy_(torch.randn(b.shape, generator=gen) * BIAS_STD)

    Model.__name__ = Model.__qualname__ = "DeepseekV32ForCausalLM"  # the architectures entry
    return Model


def _indexers(m):
    return [layer.self_attn.indexer for layer in m.model.layers]


def every_key(m) -> None:
    """No selection: each query attends all its causal keys."""
    for ix in _indexers(m):
        ix.index_topk = 1_000_000


def index_rope_off(m) -> None:
    """The indexer's q and k unrotated (its positions must rotate them)."""
    for ix in _indexers(m):
        orig = ix.forward

        def fwd(x, q_resid, position_embeddings, *args, orig=orig, **kwargs):  # called positionally
            cos, sin = position_embeddings
            return orig(x, q_resid, (torch.ones_like(cos), torch.zeros_like(sin)), *args, **kwargs)

        ix.forward = fwd


def k_norm_bias_off(m) -> None:
    for ix in _indexers(m):
        ix.k_norm.bias.zero_()


def head_weights_flat(m) -> None:
    """Every index head weighted alike (weights_proj's per-token, per-head weights matter)."""
    for ix in _indexers(m):
        w = ix.weights_proj.weight
        w.copy_(w.mean(dim=0, keepdim=True).expand_as(w).abs() + 0.1)


def no_relu(m) -> None:
    """Negative q.k count (the reference clamps each head's score at 0)."""
    import transformers.models.deepseek_v32.modeling_deepseek_v32 as mod

    class Relu:
        def __enter__(self):
            self.orig = mod.F.relu
            mod.F.relu = lambda x: x

        def __exit__(self, *exc):
            mod.F.relu = self.orig

    for ix in _indexers(m):
        orig = ix.forward

        def fwd(*args, orig=orig, **kwargs):
            with Relu():
                return orig(*args, **kwargs)

        ix.forward = fwd


INDEX_ABLATIONS = {
    "selection": every_key,
    "index_rope": index_rope_off,
    "index_k_norm_bias": k_norm_bias_off,
    "index_head_weights": head_weights_flat,
    "index_relu": no_relu,
}
MLA_ABLATIONS = {
    "latent_norms": no_latent_norms,
    "rope": no_rope_on_k,
    "shared_experts": no_shared_experts,
}


def v32_t4_form(cfg: dict) -> dict:
    """DeepSeek-V3.2-Exp's config.json form: transformers-4 RoPE keys, no
    derived head_dim / qk_head_dim, no layer_types / mlp_layer_types (the
    dense layers from first_k_dense_replace), DeepSeek's own routing keys."""
    d = t4_form(cfg)
    for key in ("layer_types", "mlp_layer_types"):
        d.pop(key, None)
    d.update(moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid")
    return d


CASES = [
    dict(
        name="yarn_fp32",
        description=(
            "8 heads, q_lora 24, kv_lora 16, nope/rope/v 8/8/12, yarn factor 8 (mscale 0.707, mscale_all_dim 1); "
            "indexer 16 heads x 16 (8 rotated), top-8 keys; 3 layers (first dense), 8 experts top-2 in 2 groups "
            "(1 kept), correction bias, 1 shared expert, float32"
        ),
        seed=5321,
        T=48,
        model_cls=with_correction_bias(5321),
        config=dict(
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=8,  # MLA: per-head k/v (the default 128 would break eager repeat_kv)
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=12,
            index_topk=8,
            index_n_heads=16,
            index_head_dim=16,
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
        t4=v32_t4_form,
        ablations={**INDEX_ABLATIONS, **MLA_ABLATIONS, "mscale": no_mscale, "yarn": default_rope},
    ),
    dict(
        name="rope_only_index_fp32",
        description=(
            "4 heads, q_lora 32, kv_lora 32, nope/rope/v 16/8/16, default rope theta 50000; indexer 16 heads x 8 "
            "(all rotated), top-12 keys; 2 layers (first dense), 4 experts top-2 in 2 groups (both kept), "
            "NOT renormalised, scaling 1.5, 2 shared experts, float32"
        ),
        seed=5322,
        T=56,
        model_cls=with_correction_bias(5322),
        config=dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            index_topk=12,
            index_n_heads=16,
            index_head_dim=8,
            first_k_dense_replace=1,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=2,
            norm_topk_prob=False,
            n_shared_experts=2,
            moe_intermediate_size=16,
            routed_scaling_factor=1.5,
            rope_parameters={"rope_type": "default", "rope_theta": 50_000.0},
        ),
        t4=v32_t4_form,
        ablations={k: v for k, v in INDEX_ABLATIONS.items() if k != "index_rope"} | MLA_ABLATIONS,
    ),
]


def grouped_mm_check(ctx) -> list[str]:
    """transformers' default grouped_mm experts agree with the eager reference."""
    m = DeepseekV32ForCausalLM.from_pretrained(ctx.out, attn_implementation="eager", dtype=torch.float32,
                                               experts_implementation="grouped_mm").eval()
    grouped = full_logits(m, ctx.ids)
    rel = float(np.abs(grouped - ctx.ref32).max() / np.abs(ctx.ref32).max())
    assert rel < 1e-5, f"{ctx.case['name']}: eager vs grouped_mm experts differ by {rel}"
    return [
        "reference: eager attention, eager experts (per-expert loop); transformers' default grouped_mm "
        f"experts agree to {rel:.1e} of the logit scale (float32)",
    ]


@torch.no_grad()
def indexer_margin(ctx) -> dict:
    """Smallest (k-th - (k+1)-th) index score over the rows that select (more
    than index_topk visible keys), relative to the row's largest |score|, and
    how many rows select, over every layer of the float32 model."""
    rows, margins, active = [], [], [False]
    orig_topk = torch.Tensor.topk

    def topk(t, k, *args, **kwargs):
        if active[0] and t.shape[-1] > k:
            finite = t > -1e30  # the causally masked keys carry the mask's -3.4e38
            sel = finite.sum(-1) > k
            if sel.any():
                v = orig_topk(t, k + 1, dim=-1).values[sel]
                scale = torch.where(finite, t.abs(), torch.zeros_like(t)).amax(-1)[sel]
                margins.append(float(((v[:, k - 1] - v[:, k]) / scale).min()))
                rows.append(int(sel.sum()))
        return orig_topk(t, k, *args, **kwargs)

    def wrap(ix):
        orig = ix.forward

        def fwd(*args, **kwargs):
            active[0] = True
            try:
                return orig(*args, **kwargs)
            finally:
                active[0] = False

        ix.forward = fwd
        return orig

    saved = [(ix, wrap(ix)) for ix in _indexers(ctx.exact)]
    torch.Tensor.topk = topk
    try:
        full_logits(ctx.exact, ctx.ids)
    finally:
        torch.Tensor.topk = orig_topk
        for ix, orig in saved:
            ix.forward = orig
    m = min(margins)
    assert m > MIN_INDEX_MARGIN, f"{ctx.case['name']}: an index selection within {m:.2e} of a tie"
    return {"indexer_min_margin": {"relative": float(f"{m:.3g}"), "selecting_rows": sum(rows)}}


NOTES = [
    "transformers 5.24 DeepseekV32: DeepseekV3 plus DeepseekV32Indexer per layer (fp32 scores: relu(q.k) * "
    "index_head_dim^-0.5 weighted by weights_proj(x) * index_n_heads^-0.5, summed over the index heads; the "
    "causal mask added; top min(index_topk, keys) indices; the attention mask set to min at the unselected "
    "keys). The indexer's RoPE is half-split over its first qk_rope_head_dim features, MLA's interleaved "
    "(always: DeepseekV32Config has no rope_interleave); weights_proj stays float32 in half-precision models.",
]

STYLE = {**LLAMA_STYLE, "info_fields": LLAMA_STYLE["info_fields"] + (bf16_vs_fp32, router_margin, indexer_margin)}
FAMILY = Family(
    "deepseek_v32",
    __file__,
    DeepseekV32ForCausalLM,
    DeepseekV32Config,
    CASES,
    readme_notes=NOTES,
    load_kwargs=dict(experts_implementation="eager"),
    check_in_memory=False,  # the in-memory model runs grouped_mm experts; grouped_mm_check compares them
    extra_outputs=grouped_mm_check,
    **{**STYLE, "auto_load": False},  # the case's class loads (its correction biases drawn at construction)
)

if __name__ == "__main__":
    sys.exit(run(FAMILY))
