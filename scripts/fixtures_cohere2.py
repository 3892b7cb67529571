#!/usr/bin/env python
"""Tiny random Cohere2 reference fixtures (tests/fixtures/cohere2/<case>/).

    /work/venv/bin/python scripts/fixtures_cohere2.py   (or scripts/make_fixtures.py --family cohere2)

See scripts/fixture_lib.py for what each case directory holds. Features
exercised: the parallel block (one weight-only LayerNorm feeding attention and
MLP), interleaved RoPE on sliding layers only (full layers have none),
logit_scale, tied and untied embeddings, attention biases, layer kinds from
layer_types and from the legacy sliding_window_pattern (default 4).
"""

from __future__ import annotations

import sys

from transformers import Cohere2Config, Cohere2ForCausalLM

from fixture_lib import GEMMA2_STYLE, Family, no_window, pattern_layer_types, run, t4_config

# Tied logits are h @ E^T * logit_scale: a larger embedding std keeps a spread of several units.
INIT = dict(embed_std=0.6, linear_std=0.25, norm_center=1.0, norm_std=0.3, other_std=0.1)
COMMON = dict(layer_norm_eps=1e-5, hidden_act="silu", pad_token_id=0, bos_token_id=5, eos_token_id=255)


def t4_form(pattern: int | None):
    """transformers-4 form: rope_theta (+ rope_scaling), sliding_window_pattern
    (or nothing: the default 4) instead of layer_types, no head_dim (derived
    from hidden / heads), torch_dtype."""
    extra = {} if pattern is None else {"sliding_window_pattern": pattern}
    return lambda cfg: t4_config(
        cfg, pattern=pattern or 4, drop=("head_dim",), version="4.48.0", cache_implementation="hybrid", **extra
    )


def _no_logit_scale(m):
    m.logit_scale = 1.0


CASES = [
    dict(
        name="gqa_fp32",
        description=(
            "4 q / 2 kv heads (head_dim 16), 6 layers pattern 3 (s,s,f), window 16, logit_scale 0.5, tied, "
            "rope theta 20000"
        ),
        seed=3001,
        T=80,
        config=dict(
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=16,
            layer_types=pattern_layer_types(6, 3),
            logit_scale=0.5,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 20_000.0},
        ),
        t4=t4_form(3),
        ablations={"no_sliding_window": no_window, "no_logit_scale": _no_logit_scale},
    ),
    dict(
        name="mha_bias_fp32",
        description=(
            "4 q / 4 kv heads, 5 layers from the default pattern 4 (s,s,s,f,s), window 8, attention biases, "
            "untied lm_head, logit_scale 0.8"
        ),
        seed=3002,
        T=48,
        init=dict(embed_std=0.3),
        config=dict(
            num_hidden_layers=5,
            num_attention_heads=4,
            num_key_value_heads=4,
            sliding_window=8,
            layer_types=pattern_layer_types(5, 4),
            logit_scale=0.8,
            attention_bias=True,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        ),
        t4=t4_form(None),
        ablations={"no_sliding_window": no_window},
    ),
]


FAMILY = Family(
    "cohere2", __file__, Cohere2ForCausalLM, Cohere2Config, CASES, common=COMMON, init=INIT, **GEMMA2_STYLE
)

if __name__ == "__main__":
    sys.exit(run(FAMILY))
