#!/usr/bin/env python
"""Tiny random Qwen3.5 MoE reference fixtures (tests/fixtures/qwen3_5_moe/<case>/).
Run from the repository root: /work/main/.venv/bin/python scripts/fixtures_qwen3_5_moe.py
(or scripts/make_fixtures.py --family qwen3_5_moe).

Two forms: `hub_fp32` is a Qwen3_5MoeForConditionalGeneration (a one-block
vision tower beside the text model) saved as hub checkpoints are: config.json
with text_config / vision_config (model_type qwen3_5_moe), the text weights
under `model.language_model.*`, the vision tower's under `model.visual.*`; its
reference is that model's logits for the ids alone (text positions, equal on
every mrope axis). `text_fp32` is a Qwen3_5MoeForCausalLM (model_type
qwen3_5_moe_text) with a config_t4.json. Features exercised: Qwen3.5's gated
DeltaNet projections (in_proj_qkv / in_proj_z / in_proj_b / in_proj_a, value
heads grouped on key heads, conv1d width 4, the delta rule across chunks),
gated attention (output gate in q_proj, (1 + w) q/k norms, partial RoPE with
mrope sections), every layer a routed MoE with a sigmoid-gated shared expert.
save_pretrained (transformers 5.24) writes one key per expert. Key heads
split at np 2, 3 and 4 in whole key-head groups.
See scripts/fixture_lib.py for what each case directory holds.
"""

from __future__ import annotations

import sys

from transformers import (Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration,
                          Qwen3_5MoeTextConfig)

from fixture_lib import (BASE_COLUMNS, SIZES, Family, Readme, Rule, anything, endswith, is_embedding, npz_keys, run,
                         t4_config)

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


VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=64, patch_size=4,
              spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)


def _text(m):
    return m.model.language_model if hasattr(m.model, "language_model") else m.model


def _layers(m, attr):
    return [getattr(layer, attr) for layer in _text(m).layers if hasattr(layer, attr)]


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
    for mlp in _layers(m, "mlp"):
        mlp.shared_expert.down_proj.weight.zero_()


def no_value_norm(m) -> None:
    """The gated norm's weight 1 (its w matters)."""
    for la in _layers(m, "linear_attn"):
        la.norm.weight.fill_(1.0)


def t4(cfg: dict) -> dict:
    """The transformers-4 form: top-level rope_theta and partial_rotary_factor,
    the mrope sections in rope_scaling (layer_types kept: they do not follow
    full_attention_interval here)."""
    rp = dict(cfg["rope_parameters"])
    mrope = {k: rp.pop(k) for k in ("mrope_section", "mrope_interleaved")}
    d = t4_config({**cfg, "rope_parameters": rp}, partial_rotary_factor=rp.pop("partial_rotary_factor"))
    d["rope_scaling"] = {"rope_type": "default", **mrope}
    return d


def build_config(family, case):
    kwargs = {**SIZES, **family.common, **case["config"]}
    kwargs.pop("intermediate_size")  # Qwen3.5 MoE has no dense MLP
    if case.get("multimodal"):
        cfg = Qwen3_5MoeConfig(text_config=kwargs, vision_config=VISION)
    else:
        cfg = Qwen3_5MoeTextConfig(**kwargs)
    cfg._attn_implementation = "eager"
    return cfg


ABLATIONS = {"no_recurrence": no_recurrence, "no_conv_history": no_conv_history, "no_output_gate": no_output_gate,
             "no_shared_expert": no_shared_expert, "no_value_norm": no_value_norm}

CASES = [
    dict(
        name="hub_fp32",
        description=(
            "Qwen3_5MoeForConditionalGeneration (hub layout, one-block vision tower): 4 layers (linear x3, full); "
            "DeltaNet 4 key / 8 value heads of 8 / 16 dims; attention 4 q / 2 kv heads of 16, partial rotary "
            "0.25, mrope [1, 1, 0]; 8 experts top-2 + shared expert; float32"
        ),
        seed=28201,
        T=48,
        multimodal=True,
        model_cls=Qwen3_5MoeForConditionalGeneration,
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
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25,
                             "mrope_section": [1, 1, 0], "mrope_interleaved": True},
        ),
        ablations=ABLATIONS,
    ),
    dict(
        name="text_fp32",
        description=(
            "Qwen3_5MoeForCausalLM: 5 layers (full, linear, linear, full, linear); DeltaNet 4 key = 4 value heads "
            "of 16 / 8 dims; attention 8 q / 4 kv heads of 8, partial rotary 0.5, theta 50000; 4 experts top-3 + "
            "shared expert; tied head; float32; config_t4.json"
        ),
        seed=28202,
        T=48,
        model_cls=Qwen3_5MoeForCausalLM,
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
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=4,
            num_experts_per_tok=3,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 50_000.0, "partial_rotary_factor": 0.5,
                             "mrope_section": [1, 1, 0], "mrope_interleaved": True},
        ),
        t4=t4,
        ablations=ABLATIONS,
    ),
]

FAMILY = Family(
    "qwen3_5_moe",
    __file__,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeConfig,
    CASES,
    common=COMMON,
    init=INIT,
    init_rules=INIT_RULES,
    build_config=build_config,
    load_kwargs=dict(experts_implementation="eager"),
    check_in_memory=False,  # the in-memory model runs grouped_mm experts
    info_fields=(npz_keys,),
    t4_fields=("rope_parameters_loaded", "layer_types_loaded", "logits_max_abs_diff"),
    t4_note="config_t4.json: the same model in the transformers-4 config form; loads to identical logits",
    min_ablation=0.001,
    readme=Readme(
        title="Qwen3.5 MoE",
        runtime="eager attention, eager experts, CPU, float32.",
        about=(
            "Each case: `config.json` / `model.safetensors` / `generation_config.json` as `save_pretrained` wrote",
            "them, `reference.npz` (`ids` int32 [T], `logits` float32 [T, V], one full forward pass without cache),",
            "`fixture_info.json` (statistics, ablations, notes).",
        ),
        columns=BASE_COLUMNS,
    ),
    readme_notes=(
        "transformers 5.24 Qwen3_5Moe*: every layer a routed MoE with a gated shared expert; every mode is "
        "compared against the one-pass reference.",
    ),
)

if __name__ == "__main__":
    sys.exit(run(FAMILY))
