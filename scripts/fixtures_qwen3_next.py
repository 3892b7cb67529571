#!/usr/bin/env python
"""Tiny random Qwen3-Next reference fixtures (tests/fixtures/qwen3_next/<case>/).
Run from the repository root: /work/main/.venv/bin/python scripts/fixtures_qwen3_next.py
(or scripts/make_fixtures.py --family qwen3_next).

Features exercised: gated DeltaNet layers (fused in_proj_qkvz / in_proj_ba per
key head, value heads grouped on key heads, causal conv1d of width 4, the
gated delta rule carried across chunks, the gated RMSNorm), gated full
attention (output gate rows in q_proj, (1 + w) q/k norms, partial RoPE),
routed experts with a sigmoid-gated shared expert, dense layers
(mlp_only_layers), (1 + w) norms. save_pretrained (transformers 5.24) writes
the experts one key per expert (`mlp.experts.N.{gate,up,down}_proj.weight`).
Key heads split at np 2, 3 (2, 1, 1) and 4 in whole key-head groups.
The reference is the reloaded model with eager attention and eager experts;
transformers' one pass runs the chunked delta rule (chunks of 64) on CPU.
A_log is drawn around -1 and dt_bias around 0: decays exp(g) around 0.7, so
the recurrent state carries far across chunk boundaries.
See scripts/fixture_lib.py for what each case directory holds.
"""

from __future__ import annotations

import sys

import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from fixture_lib import (BASE_COLUMNS, Family, Readme, Rule, anything, bf16_vs_fp32, endswith, is_embedding,
                         npz_keys, run, t4_config)

INIT = dict(embed_std=0.2, linear_std=0.15, head_std=0.3, norm_center=0.0, norm_std=0.3, gated_norm_mean=1.0,
            a_log_mean=-1.0, a_log_std=0.5, dt_bias_std=0.3, conv_std=0.3)
INIT_RULES = (
    Rule(is_embedding, "embed_std"),
    Rule(endswith("linear_attn.norm.weight"), "norm_std", ("gated_norm_mean",)),  # scales by w
    Rule(endswith("norm.weight"), "norm_std", ("norm_center",)),  # the (1 + w) norms
    Rule(endswith("A_log"), "a_log_std", ("a_log_mean",)),
    Rule(endswith("dt_bias"), "dt_bias_std"),
    Rule(endswith("conv1d.weight"), "conv_std"),
    Rule(lambda name, p: name.startswith("lm_head."), "head_std"),
    Rule(anything, "linear_std"),
)
COMMON = dict(rms_norm_eps=1e-6, hidden_act="silu", pad_token_id=0, eos_token_id=1, bos_token_id=2,
              linear_conv_kernel_dim=4)


def _layers(m, attr):
    return [getattr(layer, attr) for layer in m.model.layers if hasattr(layer, attr)]


def no_recurrence(m) -> None:
    """Each token on its own (decay exp(g) ~ 0): the recurrent state matters."""
    for la in _layers(m, "linear_attn"):
        la.A_log.fill_(6.0)


def no_conv_history(m) -> None:
    """The conv's taps but the last zeroed: the conv state matters."""
    for la in _layers(m, "linear_attn"):
        la.conv1d.weight[..., :-1] = 0.0


def no_output_gate(m) -> None:
    """Attention's output gate rows zeroed (sigmoid 0.5 everywhere)."""
    for at in _layers(m, "self_attn"):
        D = at.head_dim
        w = at.q_proj.weight.view(-1, 2 * D, at.q_proj.weight.shape[1])
        w[:, D:] = 0.0


def no_shared_expert(m) -> None:
    for layer in m.model.layers:
        if hasattr(layer.mlp, "shared_expert"):
            layer.mlp.shared_expert.down_proj.weight.zero_()


def no_value_norm(m) -> None:
    """The gated norm's weight 1 (its w matters)."""
    for la in _layers(m, "linear_attn"):
        la.norm.weight.fill_(1.0)


def t4(cfg: dict) -> dict:
    """The transformers-4 form hub checkpoints (Qwen/Qwen3-Next-80B-A3B-*) use:
    top-level rope_theta and partial_rotary_factor, full_attention_interval
    instead of layer_types."""
    rp = cfg["rope_parameters"]
    d = t4_config(cfg, pattern=None, partial_rotary_factor=rp["partial_rotary_factor"])
    d.pop("layer_types")
    d["full_attention_interval"] = 4
    return d


ABLATIONS = {"no_recurrence": no_recurrence, "no_conv_history": no_conv_history, "no_output_gate": no_output_gate,
             "no_shared_expert": no_shared_expert, "no_value_norm": no_value_norm}

CASES = [
    dict(
        name="hybrid_fp32",
        description=(
            "4 layers (linear, linear, linear, full); DeltaNet 4 key / 8 value heads of 8 / 16 dims; attention "
            "4 q / 2 kv heads of 16, partial rotary 0.25; 8 experts top-2 renormalised + shared expert, "
            "mlp_only_layers [1]; float32; config_t4.json"
        ),
        seed=28101,
        T=48,
        config=dict(
            num_hidden_layers=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_num_key_heads=4,
            linear_num_value_heads=8,
            linear_key_head_dim=8,
            linear_value_head_dim=16,
            intermediate_size=96,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25},
        ),
        t4=t4,
        ablations=ABLATIONS,
    ),
    dict(
        name="full_first_fp32",
        description=(
            "5 layers (full, linear, linear, full, linear): DeltaNet 4 key = 4 value heads of 16 / 8 dims; "
            "attention 8 q / 4 kv heads of 8, partial rotary 0.5, theta 50000; 4 experts top-3 not "
            "renormalised, decoder_sparse_step 2 (dense, sparse, ...); tied head; float32"
        ),
        seed=28102,
        T=48,
        config=dict(
            num_hidden_layers=5,
            layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention",
                         "linear_attention"],
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=8,
            linear_num_key_heads=4,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=8,
            intermediate_size=64,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=4,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            decoder_sparse_step=2,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 50_000.0, "partial_rotary_factor": 0.5},
        ),
        ablations={k: v for k, v in ABLATIONS.items()},
    ),
    dict(
        name="hybrid_bf16",
        description="hybrid_fp32's shapes in bfloat16 (weights and forward; the delta rule in fp32 as transformers)",
        seed=28103,
        T=48,
        dtype=torch.bfloat16,
        init=dict(linear_std=0.08),
        config=dict(
            num_hidden_layers=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_num_key_heads=4,
            linear_num_value_heads=8,
            linear_key_head_dim=8,
            linear_value_head_dim=16,
            intermediate_size=96,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=8,  # every token uses all: bf16 rounding cannot flip a routing choice
            norm_topk_prob=True,
            mlp_only_layers=[1],
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25},
        ),
        ablations={k: ABLATIONS[k] for k in ("no_recurrence", "no_conv_history")},
    ),
]

FAMILY = Family(
    "qwen3_next",
    __file__,
    Qwen3NextForCausalLM,
    Qwen3NextConfig,
    CASES,
    common=COMMON,
    init=INIT,
    init_rules=INIT_RULES,
    load_kwargs=dict(experts_implementation="eager"),
    check_in_memory=False,  # the in-memory model runs grouped_mm experts
    info_fields=(npz_keys, bf16_vs_fp32),
    ablate_in_fp32=True,
    t4_fields=("rope_parameters_loaded", "layer_types_loaded", "logits_max_abs_diff"),
    t4_note="config_t4.json: the same model in the transformers-4 config form hub checkpoints use; loads to "
    "identical logits",
    min_ablation=0.001,
    readme=Readme(
        title="Qwen3-Next",
        runtime="eager attention, eager experts, CPU.",
        about=(
            "Each case: `config.json` / `model.safetensors` / `generation_config.json` as `save_pretrained` wrote",
            "them, `reference.npz` (`ids` int32 [T], `logits` float32 [T, V], one full forward pass without cache),",
            "`fixture_info.json` (statistics, ablations, notes).",
        ),
        columns=BASE_COLUMNS,
    ),
    readme_notes=(
        "transformers 5.24 Qwen3NextForCausalLM: layer_types (or full_attention_interval) picks gated DeltaNet "
        "or gated attention per layer; every mode is compared against the one-pass reference.",
    ),
)

if __name__ == "__main__":
    sys.exit(run(FAMILY))
