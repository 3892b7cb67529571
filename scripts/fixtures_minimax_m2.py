#!/usr/bin/env python
"""Tiny random MiniMax-M2 reference fixtures (tests/fixtures/minimax_m2/<case>/).
Run from the repository root: /work/main/.venv/bin/python scripts/fixtures_minimax_m2.py
(or scripts/make_fixtures.py --family minimax_m2).

save_pretrained writes the experts stacked (`mlp.experts.gate_up_proj` [E, 2I,
H], `mlp.experts.down_proj` [E, H, I]), the router as `mlp.gate.weight` and
its correction bias as `mlp.e_score_correction_bias` (a buffer: re-initialised
here too, or it would stay zero). The hub case rewrites the file AFTER the
reference in the hub's per-expert layout (`block_sparse_moe.experts.N.w1/w3/w2`).
The reference is the reloaded model with eager attention and eager experts,
checked against transformers' default grouped_mm experts.
See scripts/fixture_lib.py for what each case directory holds.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

from fixture_lib import (LLAMA_STYLE, Family, bf16_vs_fp32, full_logits, no_correction_bias, run, t4_config,
                         with_correction_bias)


def per_head_qk_norm(m) -> None:
    """q/k RMS-normalised per head instead of over the whole projection."""
    for layer in m.model.layers:
        a = layer.self_attn
        for name in ("q_norm", "k_norm"):
            norm = getattr(a, name)
            w, eps, D = norm.weight, norm.variance_epsilon, a.head_dim

            def fwd(x, w=w, eps=eps, D=D):
                xs = x.float().reshape(*x.shape[:-1], -1, D)
                xs = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + eps)
                return w * xs.reshape(x.shape).to(x.dtype)

            norm.forward = fwd


def no_qk_norm(m) -> None:
    for layer in m.model.layers:
        layer.self_attn.q_norm = torch.nn.Identity()
        layer.self_attn.k_norm = torch.nn.Identity()


def full_rotary(m) -> None:
    """Every feature of a head rotates (not only the first rotary_dim)."""
    rot = m.model.rotary_emb
    theta, dim = m.config.rope_parameters["rope_theta"], m.config.head_dim
    rot.inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def bias_in_weights(m) -> None:
    """A router that weights experts by the biased scores (the bias must only choose)."""
    for layer in m.model.layers:
        g = layer.mlp.gate

        def fwd(h, bias, g=g):
            logits = torch.nn.functional.linear(h.reshape(-1, g.hidden_dim).to(g.weight.dtype), g.weight)
            s = logits.float().sigmoid() + bias
            _, idx = torch.topk(s, g.top_k, dim=-1, sorted=False)
            w = s.gather(1, idx)
            return logits, w / w.sum(-1, keepdim=True), idx

        g.forward = fwd


def experts_swapped(m) -> None:
    for layer in m.model.layers:
        ex = layer.mlp.experts
        ex.gate_up_proj.copy_(torch.roll(ex.gate_up_proj, 1, dims=0))
        ex.down_proj.copy_(torch.roll(ex.down_proj, 1, dims=0))


ABLATIONS = {
    "whole_projection_qk_norm": per_head_qk_norm,
    "qk_norm": no_qk_norm,
    "partial_rotary": full_rotary,
    "bias_only_chooses": bias_in_weights,
    "expert_order": experts_swapped,
}


def t4_hub(cfg: dict) -> dict:
    """transformers-4 / hub form: rope_theta and rotary_dim at the top level,
    no rope_parameters (MiniMaxM2Config turns rotary_dim into partial_rotary_factor)."""
    d = dict(cfg)
    rp = dict(d.pop("rope_parameters"))
    factor = rp.pop("partial_rotary_factor")
    d = t4_config({**d, "rope_parameters": rp})
    d["rotary_dim"] = int(factor * d["head_dim"])
    return d


CASES = [
    dict(
        name="gqa_fp32",
        description=(
            "8 q / 2 kv heads, head_dim 16 (rotary 8: partial_rotary_factor 0.5), 3 layers, 8 experts top-2 "
            "(I=16), correction bias, float32; config_t4.json in the hub form (rope_theta, rotary_dim)"
        ),
        seed=5101,
        T=48,
        model_cls=with_correction_bias(MiniMaxM2ForCausalLM, 5101),
        config=dict(
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=16,
            num_local_experts=8,
            num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.5},
        ),
        t4=t4_hub,
        ablations={**ABLATIONS, "correction_bias": no_correction_bias},
    ),
    dict(
        name="mqa_bf16",
        description=(
            "4 q / 1 kv head, head_dim 16 (rotary 4), 2 layers, 4 experts top-4 (every token uses all: bf16 "
            "rounding cannot flip a routing choice; the bias must still not weight), bfloat16"
        ),
        seed=5102,
        T=48,
        dtype=torch.bfloat16,
        model_cls=with_correction_bias(MiniMaxM2ForCausalLM, 5102),
        config=dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            intermediate_size=16,
            num_local_experts=4,
            num_experts_per_tok=4,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.25},
        ),
        ablations={"whole_projection_qk_norm": per_head_qk_norm, "bias_only_chooses": bias_in_weights},
    ),
    dict(
        name="hub_layout_fp32",
        description=(
            "12 q / 4 kv heads, head_dim 8 (rotary 4), 2 layers, 6 experts top-3, tied embeddings, float32; "
            "model.safetensors rewritten in the hub layout (block_sparse_moe.experts.N.w1/w3/w2); "
            "config_t4.json the hub's config form"
        ),
        seed=5103,
        T=44,
        model_cls=with_correction_bias(MiniMaxM2ForCausalLM, 5103),
        hub_layout=True,
        t4=t4_hub,  # the hub's config form beside its weight layout (transformers converts both)
        config=dict(
            num_hidden_layers=2,
            num_attention_heads=12,
            num_key_value_heads=4,
            head_dim=8,
            intermediate_size=16,
            num_local_experts=6,
            num_experts_per_tok=3,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.5},
        ),
        ablations={**ABLATIONS, "correction_bias": no_correction_bias},
    ),
]


def extra_outputs(ctx) -> list[str]:
    """grouped_mm cross-check, then (hub case) the hub-layout rewrite."""
    grouped = full_logits(ctx.load(ctx.out, torch.float32, experts_implementation="grouped_mm"), ctx.ids)
    rel = float(np.abs(grouped - ctx.ref32).max() / np.abs(ctx.ref32).max())
    assert rel < 1e-5, f"{ctx.case['name']}: eager vs grouped_mm experts differ by {rel}"
    notes = [
        "reference: eager attention, eager experts (per-expert loop); transformers' default grouped_mm "
        f"experts agree to {rel:.1e} of the logit scale (float32)",
    ]
    if ctx.case.get("hub_layout"):
        notes.append(to_hub_layout(ctx))
    return notes


def to_hub_layout(ctx) -> str:
    sd = load_file(ctx.st_path)
    out = {}
    for name, w in sd.items():
        name = name.replace(".mlp.", ".block_sparse_moe.")
        if name.endswith(".experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            inter = w.shape[1] // 2
            for e in range(w.shape[0]):
                out[f"{base}{e}.w1.weight"] = w[e, :inter].contiguous()
                out[f"{base}{e}.w3.weight"] = w[e, inter:].contiguous()
            continue
        if name.endswith(".experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e in range(w.shape[0]):
                out[f"{base}{e}.w2.weight"] = w[e].contiguous()
            continue
        out[name] = w
    save_file(dict(sorted(out.items())), ctx.st_path, metadata={"format": "pt"})
    os.chmod(ctx.st_path, 0o644)
    return (
        "model.safetensors rewritten AFTER the reference was computed, in the hub layout: mlp.* -> "
        "block_sparse_moe.*, experts.gate_up_proj [E, 2I, H] -> experts.N.w1.weight (rows :I) + "
        "experts.N.w3.weight (rows I:), experts.down_proj -> experts.N.w2.weight"
    )


@torch.no_grad()
def router_margin(ctx) -> dict:
    """Smallest (k-th - (k+1)-th) biased score over every token and layer of
    the float32 model (None when every token uses every expert)."""
    margins = []

    def hook(g, inp, out):
        logits = out[0].float()
        choice = logits.sigmoid() + inp[1].float()
        k = g.top_k
        if choice.shape[-1] > k:
            top = torch.topk(choice, k + 1, dim=-1).values
            margins.append(float((top[:, k - 1] - top[:, k]).min()))

    hs = [layer.mlp.gate.register_forward_hook(hook) for layer in ctx.exact.model.layers]
    full_logits(ctx.exact, ctx.ids)
    for h in hs:
        h.remove()
    return {"router_min_margin": round(min(margins), 5) if margins else None}


NOTES = [
    "transformers 5.24 MiniMaxM2: every layer full attention; q_norm/k_norm RMS over the whole projection; "
    "partial RoPE (rotate-half on the first partial_rotary_factor * head_dim features); router logits in the "
    "weights' dtype, sigmoid in fp32, the correction bias only chooses, weights renormalised.",
]

STYLE = {**LLAMA_STYLE, "info_fields": LLAMA_STYLE["info_fields"] + (bf16_vs_fp32, router_margin)}
FAMILY = Family(
    "minimax_m2",
    __file__,
    MiniMaxM2ForCausalLM,
    MiniMaxM2Config,
    CASES,
    readme_notes=NOTES,
    load_kwargs=dict(experts_implementation="eager"),
    check_in_memory=False,  # the in-memory model runs grouped_mm experts; extra_outputs compares them
    extra_outputs=extra_outputs,
    **STYLE,
)

if __name__ == "__main__":
    sys.exit(run(FAMILY))
