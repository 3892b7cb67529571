#!/usr/bin/env python
"""Tiny random Gemma 4 reference fixtures (tests/fixtures/gemma4/<case>/).

    .venv/bin/python scripts/fixtures_gemma4.py   (or scripts/make_fixtures.py --family gemma4)

See scripts/fixture_lib.py for what each case directory holds. Features
exercised: `w * x` RMSNorms, attention scale 1 with q/k norms and a weightless
v norm, full layers with their own head_dim and KV-head count, k == v on full
layers (`attention_k_eq_v`), "proportional" partial RoPE on full layers,
per-layer `layer_scalar` (a saved buffer, set to random values here: a fresh
model has ones), per-layer embeddings (PLE), KV sharing of the last layers,
the double-wide MLP of shared layers, the final logit softcap, and the MoE
variant (experts beside the dense MLP, router with its own norm and scales).
transformers 5.24 saves the full layers' overrides as `per_layer_config`; the
`global_head_dim` / `num_global_key_value_heads` form of the published
checkpoints is checked by `config_t4.json` (loads to identical logits).
"""

from __future__ import annotations

import copy
import sys

import torch
from transformers import (
    Gemma4Config,
    Gemma4ForCausalLM,
    Gemma4ForConditionalGeneration,
    Gemma4TextConfig,
    Gemma4VisionConfig,
)

from fixture_lib import (
    BASE_COLUMNS,
    FULL,
    SLIDING,
    Family,
    Readme,
    Rule,
    anything,
    config_kwargs,
    default_config,
    no_window,
    run,
)

INIT = dict(
    embed_std=0.2,
    linear_std=0.2,
    expert_std=0.15,
    norm_mean=1.0,  # Gemma 4 norms scale by w (not 1 + w)
    norm_std=0.3,
    qk_norm_mean=0.5,  # attention scale is 1: keep q.k moderate
    qk_norm_std=0.15,
    scale_mean=1.0,
    scale_std=0.3,
    other_std=0.1,
)
FINAL_NORMS = ("model.norm.weight", "model.language_model.norm.weight")
INIT_RULES = (
    Rule(lambda n, p: "embed_tokens" in n or "embed_tokens_per_layer" in n, "embed_std"),
    Rule(lambda n, p: n.endswith(("q_norm.weight", "k_norm.weight")), "qk_norm_std", ("qk_norm_mean",)),
    Rule(lambda n, p: "norm" in n.rsplit(".", 1)[0] and n.endswith(".weight") and p.ndim == 1, "norm_std",
         ("norm_mean",)),
    Rule(lambda n, p: n.endswith(("router.scale", "router.per_expert_scale")), "scale_std", ("scale_mean",)),
    Rule(lambda n, p: n.endswith(("experts.gate_up_proj", "experts.down_proj")), "expert_std"),
    Rule(lambda n, p: p.ndim >= 2 and "position_embedding" not in n, "linear_std"),
    Rule(anything, "other_std"),
)
COMMON = dict(
    rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh",
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
    head_dim=16,
    hidden_size=32,
)


def rope(full_theta=1_000_000.0, partial=0.25, sliding_theta=10_000.0):
    return {
        SLIDING: {"rope_type": "default", "rope_theta": sliding_theta},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": partial, "rope_theta": full_theta},
    }


def _layers(m):
    return (m.model.language_model if hasattr(m.model, "language_model") else m.model).layers


def with_layer_scalars(cls):
    """The HF class, built with random per-layer `layer_scalar`s (a persistent
    buffer that a fresh model sets to 1, so reinit_ of the parameters leaves it)."""

    def build(cfg):
        m = cls(cfg)
        gen = torch.Generator().manual_seed(1234 + len(_layers(m)))
        with torch.no_grad():
            for layer in _layers(m):
                layer.layer_scalar.copy_(0.6 + 0.8 * torch.rand(1, generator=gen))
        return m

    build.from_pretrained = cls.from_pretrained  # the reload (fixture_lib.loader) goes through the class
    return build


def no_text_final_softcap(m) -> None:
    m.config.get_text_config().final_logit_softcapping = None


def unit_layer_scalar(m) -> None:
    for layer in _layers(m):
        layer.layer_scalar.fill_(1.0)


def no_ple(m) -> None:
    """Per-layer inputs all zero (the gate product vanishes)."""
    for layer in _layers(m):
        layer.per_layer_projection.weight.zero_()


def default_full_rope(m) -> None:
    """Full layers with RoPE over every feature instead of the proportional quarter."""
    lm = m.model.language_model if hasattr(m.model, "language_model") else m.model
    rot = lm.rotary_emb
    inv = getattr(rot, f"{FULL}_inv_freq")
    d = inv.shape[0] * 2
    theta = lm.config.rope_parameters[FULL]["rope_theta"]
    inv.copy_(1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float) / d)))


def no_moe(m) -> None:
    for layer in _layers(m):
        layer.experts.down_proj.zero_()


def to_global_form(cfg: dict) -> dict:
    """The published checkpoints' form: `global_head_dim` and
    `num_global_key_value_heads` instead of transformers 5.24's `per_layer_config`."""
    d = copy.deepcopy(cfg)
    text = d.get("text_config", d)
    plc = text.pop("per_layer_config")
    over = {tuple(sorted(v.items())) for v in plc.values()}
    assert len(over) == 1 and sorted(int(k) for k in plc) == [
        i for i, t in enumerate(text["layer_types"]) if t == FULL
    ], plc
    over = dict(next(iter(over)))
    text["global_head_dim"] = over["head_dim"]
    if "num_key_value_heads" in over:
        text["num_global_key_value_heads"] = over["num_key_value_heads"]
    d["transformers_version"] = "5.5.0"
    return d


DENSE = dict(
    num_hidden_layers=6,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    global_head_dim=32,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    sliding_window=8,
    layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
    num_kv_shared_layers=2,  # layer 4 reads layer 3's KV, layer 5 layer 2's
    use_double_wide_mlp=True,
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=256,
    final_logit_softcapping=10.0,
    rope_parameters=rope(),
)

CASES = [
    dict(
        name="dense_fp32",
        description=(
            "hidden 32, 4 q heads; sliding layers 2 KV heads x 16, full layers 1 KV head x 32 with k == v and proportional "
            "RoPE (1/4); 6 layers s,s,f,s,s,f, the last 2 read layers 3 / 2's KV (double-wide MLP); PLE 8; "
            "final softcap 10; window 8, T=48."
        ),
        seed=4001,
        T=48,
        model_cls=with_layer_scalars(Gemma4ForCausalLM),
        config=dict(DENSE),
        t4=to_global_form,
        ablations={
            "no_sliding_window": no_window,
            "no_final_softcap": no_text_final_softcap,
            "unit_layer_scalar": unit_layer_scalar,
            "no_ple": no_ple,
            "default_full_rope": default_full_rope,
        },
    ),
    dict(
        name="moe_fp32",
        description=(
            "8 q / 2 KV heads (full layers head_dim 32, own v_proj), MoE 4 experts top-2 (I=16) beside a dense "
            "MLP (I=32); 5 layers s,f,s,s,f, the last 2 read layers 2 / 1's KV; PLE 4; untied head; "
            "proportional RoPE 1/2 (theta 10000, sliding 20000); window 8, T=48."
        ),
        seed=4002,
        T=48,
        model_cls=with_layer_scalars(Gemma4ForCausalLM),
        config=dict(
            num_hidden_layers=5,
            num_attention_heads=8,
            num_key_value_heads=2,
            global_head_dim=32,
            attention_k_eq_v=False,
            sliding_window=8,
            layer_types=[SLIDING, FULL, SLIDING, SLIDING, FULL],
            num_kv_shared_layers=2,
            hidden_size_per_layer_input=4,  # transformers 5.24 fails on shared-KV layers without PLE
            vocab_size_per_layer_input=256,
            enable_moe_block=True,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=16,
            intermediate_size=32,
            tie_word_embeddings=False,
            rope_parameters=rope(10_000.0, 0.5, 20_000.0),
        ),
        t4=to_global_form,
        ablations={
            "no_sliding_window": no_window,
            "unit_layer_scalar": unit_layer_scalar,
            "no_moe": no_moe,
            "default_full_rope": default_full_rope,
        },
    ),
    dict(
        name="dense_bf16",
        description="dense_fp32's shapes and features with bfloat16 weights (saved as bf16), forward in bf16; T=48.",
        seed=4004,
        T=48,
        dtype=torch.bfloat16,
        # other weights (smaller projections, larger embeddings): at dense_fp32's, transformers' own bf16 run is
        # 11% of the logit scale from the fp32 answer and a sharded run's separately rounded partial sums move
        # it 3.5% (np 2), more than two correct bf16 runs may differ (8 ulps); here 1.6% (as gemma3's 1.5%)
        init=dict(linear_std=0.12, qk_norm_mean=0.5, qk_norm_std=0.15, norm_std=0.3, norm_mean=1.0, embed_std=0.5),
        model_cls=with_layer_scalars(Gemma4ForCausalLM),
        config=dict(DENSE),
        ablations={"no_sliding_window": no_window, "no_ple": no_ple},
    ),
    dict(
        name="multimodal_fp32",
        description=(
            "Gemma4ForConditionalGeneration (model_type gemma4) with a tiny vision tower; text model as "
            "dense_fp32 (k == v, PLE, shared KV, softcap 10); reference = text-only forward (input_ids only)."
        ),
        seed=4003,
        T=48,
        model_cls=with_layer_scalars(Gemma4ForConditionalGeneration),
        config=dict(DENSE),
        vision=dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=8,
            patch_size=4,
            position_embedding_size=16,
            pooling_kernel_size=2,
        ),
        mm=dict(boi_token_id=250, eoi_token_id=251, image_token_id=252, video_token_id=253,
                boa_token_id=254, eoa_token_index=255, audio_token_id=249),
        id_high=249,
        t4=to_global_form,
        notes=["reference = text-only forward (input_ids only); ids drawn below 249 (the special ids)."],
        ablations={"no_final_softcap": no_text_final_softcap, "unit_layer_scalar": unit_layer_scalar},
    ),
]


def build_config(family: Family, case: dict):
    if "vision" not in case:
        return default_config(family, case)
    text = Gemma4TextConfig(**config_kwargs(family, case))
    vision = Gemma4VisionConfig(**case["vision"])
    cfg = Gemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=None,
                       tie_word_embeddings=True, **case["mm"])
    cfg._attn_implementation = "eager"
    return cfg


def layer_info(ctx) -> dict:
    return {"rope_parameters": ctx.reloaded.config.get_text_config().rope_parameters}


FAMILY = Family(
    "gemma4",
    __file__,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
    CASES,
    common=COMMON,
    init=INIT,
    init_rules=INIT_RULES,
    build_config=build_config,
    load_kwargs=dict(experts_implementation="eager"),
    check_in_memory=True,
    info_fields=(layer_info,),
    t4_fields=("hf_loads", "logits_max_abs_diff", "layer_types_equal", "rope_parameters_equal"),
    t4_note=(
        "config_t4.json: the same model with global_head_dim / num_global_key_value_heads (the published "
        "checkpoints' form) instead of per_layer_config; transformers 5 loads it to identical logits"
    ),
    readme=Readme(
        runtime="eager attention, eager experts, CPU, float32.",
        about=(
            "Each case: `config.json` / `model.safetensors` / `generation_config.json` as `save_pretrained` wrote",
            "them, `reference.npz` (`ids` int32 [T], `logits` float32 [T, V], one full forward pass without cache),",
            "`fixture_info.json` (statistics, ablations, notes); `config_t4.json` is the published checkpoints'",
            "config form (global_head_dim, num_global_key_value_heads).",
        ),
        columns=BASE_COLUMNS
        + (
            (
                "ablations (max abs change / std)",
                lambda i, c: ", ".join(f"{k} {v}" for k, v in i["ablation_max_rel_change"].items()) or "-",
            ),
        ),
    ),
)

if __name__ == "__main__":
    sys.exit(run(FAMILY))
