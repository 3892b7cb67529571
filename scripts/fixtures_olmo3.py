#!/usr/bin/env python
"""Tiny random OLMo 3 reference fixtures (tests/fixtures/olmo3/<case>/).

    /work/venv/bin/python scripts/fixtures_olmo3.py   (or scripts/make_fixtures.py --family olmo3)

See scripts/fixture_lib.py for what each case directory holds. Features
exercised: q/k RMSNorm over the whole projection (all heads), post-norm blocks
(no input norm) with OLMo's fp32 weight scaling, 3 sliding : 1 full layers,
plain RoPE on sliding layers and yarn on full layers, untied and tied heads,
attention biases. Head counts allow tensor parallelism at np 2 and 4 (with the
KV heads split and, at np 4 for 8/2, replicated).

transformers 5 reads a transformers-4 olmo3 config (rope_theta + rope_scaling)
with rope_theta on the full layers only: its sliding layers get
Olmo3Config.default_theta (500000) whatever rope_theta says (convert_rope_params_to_dict
pops rope_theta twice). transformers 4.57, for which those configs were
written, uses rope_theta on both kinds. gqa_fp32 uses theta 50000 on both kinds
so its config_t4.json shows the difference (recorded in fixture_info.json);
mha_bias_fp32 uses 500000, where both agree.
"""

from __future__ import annotations

import sys

import torch
from transformers import Olmo3Config, Olmo3ForCausalLM

from fixture_lib import (
    FULL,
    GEMMA2_STYLE,
    SLIDING,
    Family,
    no_window,
    pattern_layer_types,
    rope_by_kind,
    run,
    t4_config,
)

INIT = dict(embed_std=0.2, linear_std=0.25, norm_center=1.0, norm_std=0.3, other_std=0.1)
COMMON = dict(head_dim=16, rms_norm_eps=1e-6, hidden_act="silu", pad_token_id=1, eos_token_id=0)


def t4_form(cfg: dict) -> dict:
    """transformers-4 form: rope_theta (both kinds) + rope_scaling (full layers),
    no layer_types (every 4th layer full), torch_dtype."""
    full, sliding = cfg["rope_parameters"][FULL], cfg["rope_parameters"][SLIDING]
    assert sliding == {"rope_type": "default", "rope_theta": full["rope_theta"]}
    return t4_config({**cfg, "rope_parameters": full}, pattern=4, version="4.57.0")


def _per_head_qk_norm(m):
    # What a per-head norm (the common mistake) would give: same weights, statistic per head.
    for layer in m.model.layers:
        a = layer.self_attn
        for norm in (a.q_norm, a.k_norm):
            w, eps = norm.weight, norm.variance_epsilon

            def fwd(x, w=w, eps=eps):
                xs = x.float().unflatten(-1, (-1, 16))
                xs = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + eps)
                return (w * xs.flatten(-2)).to(x.dtype)

            norm.forward = fwd


CASES = [
    dict(
        name="gqa_fp32",
        description=(
            "8 q / 2 kv heads, 6 layers (s,s,s,f,s,s), window 16, untied; rope theta 50000 on both kinds, "
            "yarn x8 (original 64) on full layers"
        ),
        seed=5001,
        T=80,
        config=dict(
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=2,
            sliding_window=16,
            layer_types=pattern_layer_types(6, 4),
            tie_word_embeddings=False,
            rope_parameters=rope_by_kind(
                50_000.0,
                full_scaling={
                    "rope_type": "yarn",
                    "factor": 8.0,
                    "original_max_position_embeddings": 64,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                },
            ),
        ),
        t4=t4_form,
        t4_hf_exact=False,
        notes=[
            "config_t4.json: transformers-4.57 form (rope_theta 50000 for both kinds); transformers 5 loads its "
            "sliding layers with theta 500000 instead (see t4_check.hf_logits_rel_change); the reference logits "
            "follow config.json, which 4.57 semantics of config_t4.json reproduce"
        ],
        ablations={"no_sliding_window": no_window, "per_head_qk_norm": _per_head_qk_norm},
    ),
    dict(
        name="mha_bias_fp32",
        description="4 q / 4 kv heads, 5 layers (s,s,s,f,s), window 8, tied embeddings, attention biases, theta 500000",
        seed=5002,
        T=48,
        config=dict(
            num_hidden_layers=5,
            num_attention_heads=4,
            num_key_value_heads=4,
            sliding_window=8,
            layer_types=pattern_layer_types(5, 4),
            tie_word_embeddings=True,
            attention_bias=True,
            rope_parameters=rope_by_kind(500_000.0),
        ),
        t4=t4_form,
        ablations={"no_sliding_window": no_window, "per_head_qk_norm": _per_head_qk_norm},
    ),
]


FAMILY = Family("olmo3", __file__, Olmo3ForCausalLM, Olmo3Config, CASES, common=COMMON, init=INIT, **GEMMA2_STYLE)

if __name__ == "__main__":
    sys.exit(run(FAMILY))
