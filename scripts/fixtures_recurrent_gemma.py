#!/usr/bin/env python
"""Tiny random RecurrentGemma reference fixtures (tests/fixtures/recurrent_gemma/<case>/).

    .venv/bin/python scripts/fixtures_recurrent_gemma.py   (or scripts/make_fixtures.py --family recurrent_gemma)

See scripts/fixture_lib.py for what each case directory holds. Features
exercised: RG-LRU recurrent blocks (per-head block-diagonal gates, fp32
recurrence reset at position 0, width-4 causal depthwise conv1d) and local
attention blocks (window attention_window_size, shorter than the sequence)
in the `block_types` pattern, MQA / GQA, partial rotary (half of head_dim),
attention and MLP biases, Gemma's 1 + w norms, the final logit soft-cap and
the bf16-rounded sqrt(hidden) embedding scale. The window is 16 in every case
(the test runners read the modes' window from config.json's sliding_window,
which recurrent_gemma calls attention_window_size: 16 is their default).
Head counts split at np 2 and 4 (MQA's one KV head is replicated).

recurrent_param is drawn around -2 (softplus ~0.13): decays a in (0.35, 1),
so the recurrent state carries far across chunk boundaries.
"""

from __future__ import annotations

import sys

import torch
from transformers import RecurrentGemmaConfig, RecurrentGemmaForCausalLM

from fixture_lib import (
    BASE_COLUMNS,
    Family,
    Readme,
    Rule,
    anything,
    bf16_vs_fp32,
    endswith,
    is_embedding,
    is_matrix,
    is_norm_vector,
    npz_keys,
    run,
    t4_config,
)

INIT = dict(embed_std=0.2, linear_std=0.25, norm_center=0.0, norm_std=0.3, other_std=0.1,
            recurrent_param_mean=-2.0, recurrent_param_std=1.0, bias_std=0.1, gate_std=0.5)
INIT_RULES = (
    Rule(is_embedding, "embed_std"),
    Rule(endswith("rg_lru.recurrent_param"), "recurrent_param_std", ("recurrent_param_mean",)),
    Rule(endswith("_gate_weight"), "gate_std"),
    Rule(is_norm_vector, "norm_std", ("norm_center",)),
    Rule(endswith(".bias", "_gate_bias"), "bias_std"),
    Rule(is_matrix, "linear_std"),
    Rule(anything, "other_std"),
)
COMMON = dict(hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1,
              bos_token_id=2, attention_window_size=16, conv1d_width=4)


def no_window(m) -> None:
    """Attention blocks see the whole causal prefix."""
    m.config.attention_window_size = 1_000_000


def no_recurrence(m) -> None:
    """The RG-LRU without its decay (each token on its own): the recurrent state matters."""
    for layer in m.model.layers:
        lru = getattr(layer.temporal_block, "rg_lru", None)
        if lru is not None:
            lru.recurrent_param.fill_(-30.0)


def no_conv(m) -> None:
    """The conv1d's taps but the last one zeroed: the conv state matters."""
    for layer in m.model.layers:
        conv = getattr(layer.temporal_block, "conv_1d", None)
        if conv is not None:
            conv.weight[..., :-1] = 0.0


def bf16_unrounded_scale(m) -> None:
    """sqrt(hidden) in fp32 instead of bf16-rounded."""
    m.model.normalizer = torch.tensor(m.config.hidden_size**0.5, dtype=torch.float32)


def t4_form(cfg: dict) -> dict:
    """The transformers-4 form real checkpoints (google/recurrentgemma-*) use:
    top-level rope_theta and partial_rotary_factor, no head_dim (derived),
    embeddings_scale_by_sqrt_dim (transformers 5 ignores it: it always scales)."""
    rp = cfg["rope_parameters"]
    return t4_config(cfg, drop=("head_dim",), version="4.40.0", partial_rotary_factor=rp["partial_rotary_factor"],
                     embeddings_scale_by_sqrt_dim=True)


ABLATIONS = {"no_window": no_window, "no_recurrence": no_recurrence, "no_conv_history": no_conv}

CASES = [
    dict(
        name="mqa_fp32",
        description="4 q heads / 1 KV head, hidden 64, 5 layers (r,r,a,r,r), window 16, T=72, float32",
        seed=15001,
        T=72,
        config=dict(num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=1,
                    rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5}),
        t4=t4_form,
        ablations=ABLATIONS,
    ),
    dict(
        name="gqa_bias_fp32",
        description=(
            "4 q / 2 KV heads, hidden 48 (head_dim 12, rotary 6), lru_width 32, block_types (a,r), 4 layers, "
            "attention biases, untied head, rope theta 50000, logits_soft_cap 8 (sqrt(48) = 6.928 rounds to 6.9375 "
            "in bf16); window 16, T=64, float32"
        ),
        seed=15002,
        T=64,
        config=dict(hidden_size=48, lru_width=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    block_types=["attention", "recurrent"], attention_bias=True, tie_word_embeddings=False,
                    logits_soft_cap=8.0,
                    rope_parameters={"rope_type": "default", "rope_theta": 50_000.0, "partial_rotary_factor": 0.5}),
        t4=t4_form,
        ablations={**ABLATIONS, "unrounded_embed_scale": bf16_unrounded_scale},
    ),
    dict(
        name="mqa_bf16",
        description=(
            "4 q heads / 1 KV head, hidden 48, lru_width 48, 4 layers (r,r,a,r), bfloat16 weights and forward "
            "(gates and conv in bf16, the scan in fp32 as transformers); window 16, T=56"
        ),
        seed=15003,
        dtype=torch.bfloat16,
        # At linear_std 0.25 the recurrence amplifies rounding so much that transformers' own bf16 run is
        # 6.6e-2 of the logit scale from its fp32 run (no test could tell a right bf16 run from a wrong one);
        # at 0.15 it is ~1e-2, as the other families' bf16 fixtures.
        init=dict(linear_std=0.15),
        T=56,
        config=dict(hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
                    rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5}),
        ablations=ABLATIONS,
    ),
]

FAMILY = Family(
    "recurrent_gemma",
    __file__,
    RecurrentGemmaForCausalLM,
    RecurrentGemmaConfig,
    CASES,
    common=COMMON,
    init=INIT,
    init_rules=INIT_RULES,
    info_fields=(npz_keys, bf16_vs_fp32),
    ablate_in_fp32=True,
    t4_fields=("rope_parameters_loaded", "layer_types_loaded", "logits_max_abs_diff"),
    t4_note="config_t4.json: the same model in the transformers-4 config form real checkpoints use; loads to "
    "identical logits",
    min_ablation=0.001,
    readme=Readme(
        title="RecurrentGemma",
        runtime="eager attention, CPU, float32.",
        about=(
            "Each case: `config.json` / `model.safetensors` / `generation_config.json` as `save_pretrained` wrote",
            "them, `reference.npz` (`ids` int32 [T], `logits` float32 [T, V], one full forward pass without cache),",
            "`fixture_info.json` (statistics, ablations, notes).",
        ),
        columns=BASE_COLUMNS,
    ),
    readme_notes=(
        "transformers' own chunked prefill zero-pads the conv state (wrong by ~4e-2): every mode is compared "
        "against this one-pass reference.",
    ),
)

if __name__ == "__main__":
    sys.exit(run(FAMILY))
