#!/usr/bin/env python
"""Tiny random Ministral 3 reference fixtures (tests/fixtures/ministral3/<case>/).

Run from the repository root: /work/venv/bin/python scripts/fixtures_ministral3.py
(or scripts/make_fixtures.py --family ministral3).
See scripts/fixture_lib.py for what each case directory holds. original_max_position_embeddings
is far below T so the Llama-4 query scaling takes several values within a sequence.
"""

from __future__ import annotations

import sys

from transformers import Ministral3Config, Ministral3ForCausalLM

from fixture_lib import FULL, LLAMA_STYLE, SLIDING, Family, default_rope, no_window, run


def no_query_scaling(m) -> None:
    # The attention reads the beta from config.rope_parameters at every forward.
    m.config.rope_parameters["llama_4_scaling_beta"] = 0.0


def with_ignored_layer_types(c: dict) -> dict:
    # Ministral3Config warns about layer_types and the model never reads them.
    c = dict(c)
    c["layer_types"] = [SLIDING, FULL] * (c["num_hidden_layers"] // 2)
    return c


CASES = [
    dict(
        name="gqa_window_fp32",
        description=(
            "8 q / 2 kv heads, head_dim 16, window 8 on every layer, yarn (factor 4, original 16, no mscale "
            "keys: attention factor 1.139), llama_4_scaling_beta 0.3, a layer_types key (s, f, ...) that "
            "transformers ignores, 6 layers"
        ),
        seed=6001,
        T=48,
        config=dict(
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=8,
            max_position_embeddings=64,  # = factor x original, as yarn expects
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1_000_000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "llama_4_scaling_beta": 0.3,
            },
        ),
        edit_config=with_ignored_layer_types,
        ablations={"sliding_window": no_window, "llama_4_scaling": no_query_scaling, "yarn_rope": default_rope},
    ),
    dict(
        name="full_tied_fp32",
        description=(
            "4 q / 2 kv heads, head_dim 16, no window (full attention), tied embeddings, yarn as released "
            "(factor 16, mscale = mscale_all_dim = 1, legacy 'type' key, beta 0.1) with original 16, 4 layers"
        ),
        seed=6002,
        T=64,
        config=dict(
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=None,
            tie_word_embeddings=True,
            max_position_embeddings=256,
            rms_norm_eps=1e-5,
            rope_parameters={
                "type": "yarn",
                "rope_theta": 1_000_000.0,
                "factor": 16.0,
                "original_max_position_embeddings": 16,
                "max_position_embeddings": 256,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale_all_dim": 1.0,
                "mscale": 1.0,
                "llama_4_scaling_beta": 0.1,
            },
        ),
        ablations={"llama_4_scaling": no_query_scaling, "yarn_rope": default_rope},
    ),
]

NOTES = [
    "transformers 5.24 Ministral3Model windows every layer when sliding_window is set and never reads "
    "layer_types (fixture_info's layer_types is the ignored config key). Queries are scaled after RoPE by "
    "1 + llama_4_scaling_beta * log(1 + floor(pos / original_max_position_embeddings)).",
]

FAMILY = Family(
    "ministral3", __file__, Ministral3ForCausalLM, Ministral3Config, CASES, readme_notes=NOTES, **LLAMA_STYLE
)

if __name__ == "__main__":
    sys.exit(run(FAMILY))
