#!/usr/bin/env python
"""Tiny random Ministral reference fixtures (tests/fixtures/ministral/<case>/).

Run from the repository root: /work/venv/bin/python scripts/fixtures_ministral.py
(or scripts/make_fixtures.py --family ministral).
See scripts/fixture_lib.py for what each case directory holds.
"""

from __future__ import annotations

import sys

from transformers import MinistralConfig, MinistralForCausalLM

from fixture_lib import FULL, LLAMA_STYLE, SLIDING, Family, no_window, run, t4_config

CASES = [
    dict(
        name="mixed_fp32",
        description="8 q / 2 kv heads, head_dim 16, layer_types (s, s, f) x 2, window 8, theta 1e6, 6 layers",
        seed=5001,
        T=48,
        config=dict(
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=8,
            layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        ),
        t4=lambda c: t4_config(c, version="4.54.0"),
        ablations={"sliding_window": no_window},
    ),
    dict(
        name="allsliding_tied_fp32",
        description=(
            "4 q / 4 kv heads, head_dim 16, no layer_types key (all sliding, window 16), tied embeddings, "
            "theta 100000, 4 layers"
        ),
        seed=5002,
        T=64,
        config=dict(
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=16,
            sliding_window=16,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 100_000.0},
        ),
        edit_config=lambda c: {k: v for k, v in c.items() if k != "layer_types"},
        ablations={"sliding_window": no_window},
    ),
]

FAMILY = Family("ministral", __file__, MinistralForCausalLM, MinistralConfig, CASES, **LLAMA_STYLE)

if __name__ == "__main__":
    sys.exit(run(FAMILY))
