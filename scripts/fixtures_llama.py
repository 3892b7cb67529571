#!/usr/bin/env python
"""Tiny random Llama reference fixtures (tests/fixtures/llama/<case>/).

Run from the repository root: /work/venv/bin/python scripts/fixtures_llama.py
(or scripts/make_fixtures.py --family llama).
See scripts/fixture_lib.py for what each case directory holds.
"""

from __future__ import annotations

import sys

from transformers import LlamaConfig, LlamaForCausalLM

from fixture_lib import LLAMA_STYLE, Family, default_rope, run, t4_config, zero_biases

CASES = [
    dict(
        name="gqa_fp32",
        description=(
            "8 q / 2 kv heads, head_dim 16 != hidden/heads (8), llama3 RoPE (theta 20000, factor 8, "
            "original 64), attention_bias + mlp_bias, untied head, 6 layers"
        ),
        seed=2001,
        T=64,
        config=dict(
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 20_000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        t4=t4_config,
        ablations={"llama3_rope": default_rope, "biases": zero_biases},
    ),
    dict(
        name="mqa_tied_fp32",
        description=(
            "4 q / 1 kv head, no head_dim key (hidden/heads = 16), tied embeddings, linear RoPE x2 "
            "(theta 50000), no biases, 4 layers"
        ),
        seed=2002,
        T=48,
        config=dict(
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "linear", "rope_theta": 50_000.0, "factor": 2.0},
        ),
        edit_config=lambda c: {k: v for k, v in c.items() if k != "head_dim"},
        # transformers 4 wrote the legacy {"type": "linear"} form.
        t4=lambda c: t4_config(c, legacy_type_key=True),
        ablations={"linear_rope": default_rope},
    ),
]

FAMILY = Family("llama", __file__, LlamaForCausalLM, LlamaConfig, CASES, **LLAMA_STYLE)

if __name__ == "__main__":
    sys.exit(run(FAMILY))
