#!/usr/bin/env python
"""Tiny random EXAONE 4.0 reference fixtures (tests/fixtures/exaone4/<case>/).

    /work/venv/bin/python scripts/fixtures_exaone4.py   (or scripts/make_fixtures.py --family exaone4)

See scripts/fixture_lib.py for what each case directory holds. Features
exercised: the LLLG layer pattern (layer_types; config_t4.json carries the
string "LLLG" instead), global layers without RoPE, per-head q/k RMSNorm,
post-norm blocks (no input norm), llama3 RoPE scaling, and the window-less form
(every layer global and rotated, tied embeddings) of the small checkpoints.

transformers 5 cannot derive layer_types from a string sliding_window_pattern
(`(i + 1) % "LLLG"` raises TypeError) nor without a sliding window (`% 0`), so
the transformers check of config_t4.json loads it with layer_types added.
"""

from __future__ import annotations

import sys

from transformers import Exaone4Config, Exaone4ForCausalLM

from fixture_lib import FULL, GEMMA2_STYLE, Family, no_window, pattern_layer_types, run, t4_config

INIT = dict(embed_std=0.2, linear_std=0.25, norm_center=1.0, norm_std=0.3, other_std=0.1)
COMMON = dict(head_dim=16, rms_norm_eps=1e-5, hidden_act="silu", bos_token_id=0, eos_token_id=2, pad_token_id=0)


def t4_form(cfg: dict) -> dict:
    """EXAONE's published (transformers 4.54) form: rope_theta/rope_scaling,
    sliding_window_pattern "LLLG" (or no window), no layer_types."""
    if cfg["sliding_window"] is None:
        assert set(cfg["layer_types"]) == {FULL}
        return t4_config(cfg, drop=("layer_types", "sliding_window_pattern"), version="4.54.0")
    return t4_config(cfg, pattern=4, version="4.54.0", sliding_window_pattern="LLLG")


def with_layer_types(t4: dict, cfg: dict) -> dict:
    # What transformers 5 is given: it cannot derive layer_types from "LLLG" nor without a window.
    return dict(t4, layer_types=cfg["layer_types"])


def _rope_on_global_layers(m):
    # The reference rotates a layer iff its attention has no window or slides.
    for kind, layer in zip(m.config.layer_types, m.model.layers):
        if kind == FULL:
            layer.self_attn.sliding_window = None


CASES = [
    dict(
        name="gqa_fp32",
        description=(
            "8 q / 2 kv heads, 6 layers LLLG (s,s,s,f,s,s), window 16, llama3 RoPE (factor 4) on sliding "
            "layers only"
        ),
        seed=4001,
        T=80,
        config=dict(
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=2,
            sliding_window=16,
            sliding_window_pattern=4,
            layer_types=pattern_layer_types(6, 4),
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 1_000_000.0,
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        t4=t4_form,
        t4_hf=with_layer_types,
        notes=[
            "config_t4.json uses sliding_window_pattern \"LLLG\" without layer_types "
            "(transformers 5 checked with layer_types added)"
        ],
        ablations={"no_sliding_window": no_window, "rope_on_global_layers": _rope_on_global_layers},
    ),
    dict(
        name="nowindow_fp32",
        description="4 q / 4 kv heads, 4 layers, no sliding window (all global, all with RoPE), tied embeddings",
        seed=4002,
        T=48,
        config=dict(
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            sliding_window=None,
            layer_types=[FULL] * 4,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 500_000.0},
        ),
        t4=t4_form,
        t4_hf=with_layer_types,
        notes=[
            "config_t4.json has no sliding window and no layer_types "
            "(transformers 5 checked with layer_types added)"
        ],
    ),
]


FAMILY = Family(
    "exaone4", __file__, Exaone4ForCausalLM, Exaone4Config, CASES, common=COMMON, init=INIT, **GEMMA2_STYLE
)

if __name__ == "__main__":
    sys.exit(run(FAMILY))
