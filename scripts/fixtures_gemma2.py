#!/usr/bin/env python
"""Tiny random Gemma2 reference fixtures (tests/fixtures/gemma2/<case>/).

    /work/venv/bin/python scripts/fixtures_gemma2.py

See scripts/fixture_common.py for what each case directory holds. Features
exercised: attention-score tanh softcapping (transformers' eager path applies
it before the mask), final logit softcapping, query_pre_attn_scalar != head_dim,
alternating sliding/full layers (sliding first) with a real window, GemmaRMSNorm
(1 + w) pre/post norms, the sqrt(hidden) embedding scale, tied embeddings.
"""

from __future__ import annotations

import copy
import sys

from transformers import Gemma2Config, Gemma2ForCausalLM

from fixture_common import FULL, SLIDING, make_family, pattern_layer_types

FAMILY = "gemma2"
INIT = dict(embed_std=0.2, linear_std=0.25, norm_center=0.0, norm_std=0.3, final_norm_shift=1.0, other_std=0.1)
COMMON = dict(
    head_dim=16,
    rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh",
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
    tie_word_embeddings=True,
)


def to_t4(cfg: dict):
    """transformers-4 form: rope_theta/rope_scaling, no layer_types (the legacy
    alternation derives them), torch_dtype."""
    d = copy.deepcopy(cfg)
    assert d.pop("layer_types") == pattern_layer_types(d["num_hidden_layers"], 2)
    rp = d.pop("rope_parameters")
    d["rope_theta"] = rp["rope_theta"]
    d["rope_scaling"] = None if rp.get("rope_type", "default") == "default" else {
        k: v for k, v in rp.items() if k != "rope_theta"
    }
    d.pop("use_bidirectional_attention", None)
    d["torch_dtype"] = d.pop("dtype")
    d["cache_implementation"] = "hybrid"
    d["transformers_version"] = "4.44.0"
    return d, d


def _no_attn_softcap(m):
    m.config.attn_logit_softcapping = None
    for layer in m.model.layers:
        layer.self_attn.attn_logit_softcapping = None


def _no_final_softcap(m):
    m.config.final_logit_softcapping = None


def _scale_by_head_dim(m):
    for layer in m.model.layers:
        layer.self_attn.scaling = 16**-0.5


CASES = [
    dict(
        name="gqa_fp32",
        description=(
            "8 q / 2 kv heads, 6 layers alternating sliding (window 16) / full, attn softcap 4, final softcap 8, "
            "query_pre_attn_scalar 24, rope theta 20000"
        ),
        seed=2001,
        T=80,
        config=dict(
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=2,
            sliding_window=16,
            layer_types=pattern_layer_types(6, 2),
            query_pre_attn_scalar=24,
            attn_logit_softcapping=4.0,
            final_logit_softcapping=8.0,
            rope_parameters={"rope_type": "default", "rope_theta": 20_000.0},
        ),
        t4=to_t4,
        ablations={
            "no_attn_softcap": _no_attn_softcap,
            "no_final_softcap": _no_final_softcap,
            "scale_by_head_dim": _scale_by_head_dim,
        },
    ),
    dict(
        name="mha_nocap_fp32",
        description=(
            "4 q / 4 kv heads, 5 layers (s,f,s,f,s), window 8, no softcaps (null), untied lm_head, "
            "linear RoPE scaling x2"
        ),
        seed=2002,
        T=48,
        config=dict(
            num_hidden_layers=5,
            num_attention_heads=4,
            num_key_value_heads=4,
            sliding_window=8,
            layer_types=[SLIDING, FULL, SLIDING, FULL, SLIDING],
            query_pre_attn_scalar=16,
            attn_logit_softcapping=None,
            final_logit_softcapping=None,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "linear", "rope_theta": 10_000.0, "factor": 2.0},
        ),
        t4=to_t4,
    ),
]


if __name__ == "__main__":
    sys.exit(make_family(FAMILY, CASES, Gemma2ForCausalLM, Gemma2Config, INIT, COMMON, "scripts/fixtures_gemma2.py"))
