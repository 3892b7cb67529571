#!/usr/bin/env python
"""Tiny random Qwen3 reference fixtures (tests/fixtures/qwen3/<case>/).

Run from the repository root: /work/venv/bin/python scripts/fixtures_qwen3.py
(or scripts/make_fixtures.py --family qwen3).
See scripts/fixture_lib.py for what each case directory holds.
"""

from __future__ import annotations

import sys

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from fixture_lib import LLAMA_STYLE, Family, default_rope, no_window, run, t4_config, zero_biases


def no_qk_norm(m) -> None:
    for layer in m.model.layers:
        layer.self_attn.q_norm = torch.nn.Identity()
        layer.self_attn.k_norm = torch.nn.Identity()


def unused_window(c: dict) -> dict:
    # A window in the file but use_sliding_window false, and no layer_types:
    # transformers drops the window, so every layer is full.
    c = {k: v for k, v in c.items() if k != "layer_types"}
    c["sliding_window"] = 8
    return c


CASES = [
    dict(
        name="sliding_fp32",
        description=(
            "8 q / 2 kv heads, head_dim 16 != hidden/heads (8), use_sliding_window with window 8 and "
            "max_window_layers 2 (layers 0-1 full, 2-5 sliding), yarn RoPE (factor 4, original 32), 6 layers"
        ),
        seed=3001,
        T=48,
        config=dict(
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=2,
            max_position_embeddings=128,  # = factor x original, as yarn expects
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1_000_000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        # transformers 4.51 wrote no layer_types: derived from max_window_layers.
        t4=lambda c: t4_config(c, drop=("layer_types",), version="4.51.0"),
        ablations={"sliding_window": no_window, "qk_norm": no_qk_norm, "yarn_rope": default_rope},
    ),
    dict(
        name="tied_full_fp32",
        description=(
            "4 q / 2 kv heads, tied embeddings, attention_bias, sliding_window 8 in config.json but "
            "use_sliding_window false (all layers full), theta 1e6, 4 layers"
        ),
        seed=3002,
        T=48,
        config=dict(
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            attention_bias=True,
            tie_word_embeddings=True,
            use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        ),
        edit_config=unused_window,
        ablations={"qk_norm": no_qk_norm, "biases": zero_biases},
    ),
]

NOTES = [
    "transformers 5.24 Qwen3Config: sliding_window is dropped unless use_sliding_window; without layer_types, "
    "layer i slides iff a window is left and i >= max_window_layers. q_norm/k_norm act per head before RoPE.",
]

FAMILY = Family("qwen3", __file__, Qwen3ForCausalLM, Qwen3Config, CASES, readme_notes=NOTES, **LLAMA_STYLE)

if __name__ == "__main__":
    sys.exit(run(FAMILY))
