#!/usr/bin/env python
"""Generate tiny random gpt-oss reference fixtures with Hugging Face transformers.

Run from the repository root:

    /work/venv/bin/python scripts/fixtures_gpt_oss.py   (or scripts/make_fixtures.py --family gpt_oss)

For every case it writes ``tests/fixtures/gpt_oss/<case>/``:

* ``config.json``, ``model.safetensors`` (single file, 0644),
  ``generation_config.json`` exactly as ``save_pretrained`` writes them (the
  unquantized expert layout: ``mlp.experts.gate_up_proj`` [E, hidden, 2I] with
  gate/up interleaved, ``gate_up_proj_bias``, ``down_proj`` [E, I, hidden],
  ``down_proj_bias``; ``mlp.router.weight``/``bias``; ``self_attn.sinks``);
* ``reference.npz``: ``ids`` int32 [T], ``logits`` float32 [T, V] from ONE
  full forward pass (no cache) of the model reloaded from disk with eager
  attention and the eager (per-expert loop) experts implementation, in the
  checkpoint's dtype; it is checked against transformers' default
  ``grouped_mm`` experts too. bf16 cases add ``logits_fp32``: the same
  bf16-rounded weights upcast, float32 forward (the exact answer);
* ``config_t4.json`` (cases with ``t4``): the same config in the
  transformers-4 form (``rope_theta`` + ``rope_scaling``, ``torch_dtype``, no
  ``swiglu_alpha`` (4.x hard-codes 1.702), ``experts_per_token`` as openai's
  configs carry, no ``layer_types``), checked to load to identical logits;
* ``fixture_info.json``: statistics, the smallest router margin (k-th minus
  (k+1)-th router logit: how far every routing decision is from a tie),
  ablations (how much each feature moves the logits), weight-name prefixes.

Re-initialisation: every parameter random (seeded, in name order), sinks
~ N(0.5, 1) so they take a real share of the softmax, norms ~ N(1, 0.3), the
SwiGLU clamp set low enough that it actually clips.

The common steps (and determinism) are scripts/fixture_lib.py's.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from transformers import GptOssConfig, GptOssForCausalLM

from fixture_lib import (
    BASE_COLUMNS,
    FULL,
    SLIDING,
    Family,
    Readme,
    Rule,
    anything,
    bf16_vs_fp32,
    endswith,
    full_logits,
    is_embedding,
    no_window,
    run,
    t4_config,
)

# Smaller q/k and expert weights: at 0.25 the un-normalised q/k give very peaked
# attention and the experts large activations, so transformers' own fp32 run is
# ~7e-6 of the logit scale from a float64 run (bf16: 15%); at these, ~7e-7 (bf16: 1.5%).
INIT = dict(
    embed_std=0.2,
    linear_std=0.25,
    qk_std=0.12,
    expert_std=0.15,
    norm_mean=1.0,
    norm_std=0.3,
    bias_std=0.1,
    sink_mean=0.5,
    sink_std=1.0,
)
INIT_RULES = (
    Rule(is_embedding, "embed_std"),
    Rule(endswith("norm.weight"), "norm_std", ("norm_mean",)),
    Rule(endswith("sinks"), "sink_std", ("sink_mean",)),
    Rule(endswith("q_proj.weight", "k_proj.weight"), "qk_std"),
    Rule(endswith("experts.gate_up_proj", "experts.down_proj"), "expert_std"),
    Rule(endswith("bias"), "bias_std"),  # .bias and experts' *_proj_bias
    Rule(anything, "linear_std"),
)

COMMON = dict(
    head_dim=16,
    rms_norm_eps=1e-5,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
    tie_word_embeddings=False,
)


def no_sinks(m) -> None:
    for layer in m.model.layers:
        layer.self_attn.sinks.fill_(-1e4)


def no_swiglu_clamp(m) -> None:
    for layer in m.model.layers:
        layer.mlp.experts.limit = 1e9


def no_yarn_attention_scaling(m) -> None:
    m.model.rotary_emb.attention_scaling = 1.0


def gate_up_as_halves(m) -> None:
    """A loader that read gate/up as the two halves instead of interleaved."""
    for layer in m.model.layers:
        ex = layer.mlp.experts
        half = ex.gate_up_proj.shape[-1] // 2
        for p in (ex.gate_up_proj, ex.gate_up_proj_bias):
            p.copy_(torch.stack([p[..., :half], p[..., half:]], dim=-1).reshape(p.shape))


def softmax_before_topk(m) -> None:
    """Route by top-k of the softmax over all experts (same set, other weights)."""
    for layer in m.model.layers:
        r = layer.mlp.router

        def fwd(h, r=r):
            logits = torch.nn.functional.linear(h, r.weight, r.bias)
            probs = torch.softmax(logits, dim=-1)
            vals, idx = torch.topk(probs, r.top_k, dim=-1)
            return logits, vals, idx

        r.forward = fwd


ABLATIONS = {
    "no_sinks": no_sinks,
    "no_sliding_window": no_window,
    "no_swiglu_clamp": no_swiglu_clamp,
    "no_yarn_attention_scaling": no_yarn_attention_scaling,
    "gate_up_as_halves": gate_up_as_halves,
    "softmax_before_topk_unnormalised": softmax_before_topk,
}


def to_t4_config(cfg_v5: dict) -> dict:
    """The transformers-4 (openai 4.55) form of a transformers-5 gpt_oss config.json."""
    assert cfg_v5["swiglu_alpha"] == 1.702, "transformers 4 hard-codes swiglu alpha 1.702"
    return t4_config(
        cfg_v5,
        pattern=2,  # 4.x alternates sliding / full
        drop=("swiglu_alpha",),
        version="4.55.0",
        experts_per_token=cfg_v5["num_experts_per_tok"],
        initial_context_length=cfg_v5["rope_parameters"]["original_max_position_embeddings"],
    )


CASES = [
    dict(
        name="gqa_fp32",
        description=(
            "8 q / 2 kv heads, 4 experts top-2 (I=64), window 8 on alternate layers (s,f,s,f), "
            "yarn x4 (truncate false, original 64, theta 50000), swiglu limit 2 (clips), float32, T=48."
        ),
        seed=2001,
        T=48,
        t4=to_t4_config,
        ablations=ABLATIONS,
        config=dict(
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            intermediate_size=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            layer_types=[SLIDING, FULL, SLIDING, FULL],
            swiglu_limit=2.0,
            max_position_embeddings=256,  # = factor x original: no transformers warning
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 50_000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    dict(
        name="mha_fp32",
        description=(
            "4 q / 4 kv heads, 6 experts top-3 (I=32), window 16, layer_types s,s,f,s (not the "
            "alternating default), yarn x8 (truncate default true, original 32), swiglu alpha 1.3 / "
            "limit 3, max_position_embeddings 512 != factor x original (the explicit factor wins), float32, T=80."
        ),
        seed=2002,
        T=80,
        ablations=ABLATIONS,
        config=dict(
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=32,
            num_local_experts=6,
            num_experts_per_tok=3,
            sliding_window=16,
            layer_types=[SLIDING, SLIDING, FULL, SLIDING],
            swiglu_alpha=1.3,
            swiglu_limit=3.0,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 20_000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    dict(
        name="gqa_bf16",
        description=(
            "8 q / 2 kv heads, bfloat16 weights and forward; 2 experts top-2 (every token uses both, so "
            "bf16 rounding cannot flip a routing choice), window 16, layer_types default (s,f,s,f), "
            "yarn x4 (original 64, truncate false), T=64."
        ),
        seed=2003,
        T=64,
        dtype=torch.bfloat16,
        ablations=ABLATIONS,
        config=dict(
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            intermediate_size=64,
            num_local_experts=2,
            num_experts_per_tok=2,
            sliding_window=16,
            swiglu_limit=2.5,
            max_position_embeddings=256,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150_000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
]



def grouped_mm_check(ctx) -> list[str]:
    """transformers' default grouped_mm experts agree with the eager reference."""
    grouped = full_logits(ctx.load(ctx.out, experts_implementation="grouped_mm"), ctx.ids)
    rel = float(np.abs(grouped - ctx.ref32).max() / np.abs(ctx.ref32).max())
    assert rel < 1e-5, f"{ctx.case['name']}: eager vs grouped_mm experts differ by {rel}"
    return [
        "reference: eager attention, eager experts (per-expert loop); transformers' default grouped_mm "
        f"experts agree to {rel:.1e} of the logit scale (float32)",
    ]


@torch.no_grad()
def router_margin(ctx) -> dict:
    """Smallest (k-th - (k+1)-th) router logit over every token and layer of the
    float32 model (None when every token uses every expert)."""
    model = ctx.exact
    k, margins = model.config.num_experts_per_tok, []

    def hook(_m, _inp, out):
        logits = out[0].float()
        top = torch.topk(logits, min(k + 1, logits.shape[-1]), dim=-1).values
        if top.shape[-1] > k:
            margins.append(float((top[:, k - 1] - top[:, k]).min()))

    hs = [layer.mlp.router.register_forward_hook(hook) for layer in model.model.layers]
    full_logits(model, ctx.ids)
    for h in hs:
        h.remove()
    return {"router_min_margin": round(min(margins), 5) if margins else None}


def rope_info(ctx) -> dict:
    return dict(
        rope_parameters=ctx.reloaded.config.rope_parameters,
        rope_attention_scaling=float(ctx.reloaded.model.rotary_emb.attention_scaling),
    )


def router_cell(info, case):
    margin = info["router_min_margin"]
    return margin if margin is not None else "- (top-k = all experts)"


FAMILY = Family(
    "gpt_oss",
    __file__,
    GptOssForCausalLM,
    GptOssConfig,
    CASES,
    common=COMMON,
    init=INIT,
    init_rules=INIT_RULES,
    load_kwargs=dict(experts_implementation="eager"),
    check_in_memory=False,
    ablate_in_fp32=True,
    min_ablation=0.0,  # with top-k = all experts (gqa_bf16) the routing ablation cannot matter
    extra_outputs=grouped_mm_check,
    info_fields=(rope_info, bf16_vs_fp32, router_margin),
    t4_fields=("layer_types_equal", "rope_parameters_equal", "rope_parameters_loaded", "logits_max_abs_diff"),
    t4_note="config_t4.json: transformers-4 form; transformers 5 loads it to identical logits",
    readme=Readme(
        runtime="eager attention, eager experts, CPU.",
        about=(
            "Each case: `config.json` / `model.safetensors` / `generation_config.json` as `save_pretrained` wrote",
            "them (unquantized expert layout), `reference.npz` (`ids` int32 [T], `logits` float32 [T, V], one full",
            "forward pass without cache; bf16 cases add `logits_fp32`), `fixture_info.json` (statistics, router",
            "margin, ablations, notes); `config_t4.json` is the transformers-4 form.",
        ),
        columns=BASE_COLUMNS + (("min router margin", router_cell),),
    ),
)

if __name__ == "__main__":
    sys.exit(run(FAMILY))
