#!/usr/bin/env python
"""Tiny random Mistral reference fixtures (tests/fixtures/mistral/<case>/).

Run from the repository root: /work/venv/bin/python scripts/fixtures_mistral.py
(or scripts/make_fixtures.py --family mistral).
See scripts/fixture_lib.py for what each case directory holds. Every case has a
sliding window smaller than T: without layer_types transformers windows every
mistral layer.
"""

from __future__ import annotations

import sys

from transformers import MistralConfig, MistralForCausalLM

from fixture_lib import FULL, LLAMA_STYLE, SLIDING, Family, no_window, run, t4_config


def with_layer_types(c: dict) -> dict:
    # MistralConfig drops layer_types; written into config.json, AutoConfig loads
    # the checkpoint as ministral and the kinds apply per layer.
    c = dict(c)
    c["layer_types"] = [SLIDING, FULL] * (c["num_hidden_layers"] // 2)
    return c


CASES = [
    dict(
        name="gqa_fp32",
        description="8 q / 2 kv heads (head_dim 8 = hidden/heads), window 8 on every layer, theta 1e6, 6 layers",
        seed=4001,
        T=48,
        config=dict(
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=2,
            sliding_window=8,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        ),
        t4=t4_config,
        ablations={"sliding_window": no_window},
    ),
    dict(
        name="mqa_headdim_fp32",
        description=(
            "4 q / 1 kv head, head_dim 32 != hidden/heads (16, as Mistral Nemo), window 16, "
            "layer_types (s, f, s, f) added to config.json: Auto loads it as MinistralForCausalLM, 4 layers"
        ),
        seed=4002,
        T=64,
        config=dict(
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            sliding_window=16,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        ),
        edit_config=with_layer_types,
        edit_changes_model=True,
        notes=[
            "model_type mistral + a layer_types key: transformers' AutoConfig treats it as ministral "
            "(AutoModelForCausalLM -> MinistralForCausalLM, layer_types honoured); MistralForCausalLM"
            ".from_pretrained would ignore layer_types and window every layer. The reference is the Auto path."
        ],
        ablations={"sliding_window": no_window},
    ),
]

NOTES = [
    "transformers 5.24 MistralModel windows every layer when sliding_window is set (mlx-lm ignores the window).",
]

FAMILY = Family("mistral", __file__, MistralForCausalLM, MistralConfig, CASES, readme_notes=NOTES, **LLAMA_STYLE)

if __name__ == "__main__":
    sys.exit(run(FAMILY))
