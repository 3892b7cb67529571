#!/usr/bin/env python
"""Tiny random Gemma2 reference fixtures (tests/fixtures/gemma2/<case>/).

    /work/venv/bin/python scripts/fixtures_gemma2.py   (or scripts/make_fixtures.py --family gemma2)

See scripts/fixture_lib.py for what each case directory holds. Features
exercised: attention-score tanh softcapping (transformers' eager path applies
it before the mask), final logit softcapping, query_pre_attn_scalar != head_dim,
alternating sliding/full layers (sliding first) with a real window, GemmaRMSNorm
(1 + w) pre/post norms, the sqrt(hidden) embedding scale, tied embeddings.
"""

from __future__ import annotations

import sys

from transformers import Gemma2Config, Gemma2ForCausalLM

from fixture_lib import (
    FULL,
    GEMMA2_STYLE,
    GEMMA_COMMON,
    SLIDING,
    Family,
    no_attn_softcap,
    no_final_softcap,
    no_window,
    pattern_layer_types,
    run,
    scale_by_head_dim,
    t4_config,
)

INIT = dict(embed_std=0.2, linear_std=0.25, norm_center=0.0, norm_std=0.3, final_norm_shift=1.0, other_std=0.1)


def to_t4(cfg: dict) -> dict:
    """transformers-4 form: rope_theta/rope_scaling, no layer_types (4.x alternates
    sliding / full), torch_dtype."""
    drop = ("use_bidirectional_attention",)
    return t4_config(cfg, pattern=2, drop=drop, version="4.44.0", cache_implementation="hybrid")


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
            "no_sliding_window": no_window,
            "no_attn_softcap": no_attn_softcap,
            "no_final_softcap": no_final_softcap,
            "scale_by_head_dim": scale_by_head_dim,
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
        ablations={"no_sliding_window": no_window},
    ),
]

FAMILY = Family(
    "gemma2", __file__, Gemma2ForCausalLM, Gemma2Config, CASES, common=GEMMA_COMMON, init=INIT, **GEMMA2_STYLE
)

if __name__ == "__main__":
    sys.exit(run(FAMILY))
