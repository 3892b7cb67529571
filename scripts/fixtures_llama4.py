#!/usr/bin/env python
"""Tiny random Llama 4 reference fixtures (tests/fixtures/llama4/<case>/).
Run from the repository root: /work/main/.venv/bin/python scripts/fixtures_llama4.py
(or scripts/make_fixtures.py --family llama4).

Small attention chunks (8) so every case's sequence crosses several chunks in
one pass, in chunked prefill and in decode; a small floor_scale so the NoPE
layers' temperature changes within the sequence; llama3 RoPE scaling with a
short original_max_position_embeddings so the scaling moves the logits.
save_pretrained writes the experts stacked in the bmm layout
(`feed_forward.experts.gate_up_proj` [E, H, 2I], `down_proj` [E, I, H]), the
multimodal case's text weights under `language_model.` (with the vision tower
and projector beside them). The reference is the reloaded model's one forward
(eager attention); for the multimodal case, text only (no pixel_values).
See scripts/fixture_lib.py for what each case directory holds.
"""

from __future__ import annotations

import sys

import torch
from transformers import Llama4Config, Llama4ForCausalLM, Llama4ForConditionalGeneration, Llama4TextConfig

from fixture_lib import LLAMA_STYLE, Family, bf16_vs_fp32, default_config, default_rope, run, t4_config

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10_000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}  # fmt: skip


def _text(m):
    return m.language_model if hasattr(m, "language_model") else m


def no_chunks(m) -> None:
    """Chunked layers see the whole causal prefix (the mask reads config.attention_chunk_size)."""
    _text(m).config.attention_chunk_size = 1_000_000


def no_temperature(m) -> None:
    for layer in _text(m).model.layers:
        layer.self_attn.attn_temperature_tuning = False


def no_qk_norm(m) -> None:
    for layer in _text(m).model.layers:
        if hasattr(layer.self_attn, "qk_norm"):
            del layer.self_attn.qk_norm


def rope_everywhere(m) -> None:
    """RoPE on the NoPE layers too."""
    for layer in _text(m).model.layers:
        layer.self_attn.use_rope = True


def _moes(m):
    return [layer.feed_forward for layer in _text(m).model.layers if layer.is_moe_layer]


def no_shared_expert(m) -> None:
    for moe in _moes(m):
        moe.shared_expert.down_proj.weight.zero_()


def scale_outputs(m) -> None:
    """Experts run on the unscaled token and their outputs are scaled instead."""
    for moe in _moes(m):
        def fwd(h, moe=moe):
            h = h.reshape(-1, moe.hidden_dim)
            scores, logits = moe.router(h)
            outs = []
            for e in range(moe.num_experts):
                gu = h @ moe.experts.gate_up_proj[e]
                g, u = gu.chunk(2, dim=-1)
                outs.append(((u * moe.experts.act_fn(g)) @ moe.experts.down_proj[e]) * scores[:, e : e + 1])
            return moe.shared_expert(h) + sum(outs), logits

        moe.forward = fwd


def llama4_default_rope(m) -> None:
    default_rope(_text(m))


ABLATIONS = {
    "chunk_mask": no_chunks,
    "nope_temperature": no_temperature,
    "qk_l2_norm": no_qk_norm,
    "nope_layers": rope_everywhere,
    "shared_expert": no_shared_expert,
    "scaled_expert_input": scale_outputs,
    "llama3_rope_scaling": llama4_default_rope,
}


def t4_hub(cfg: dict) -> dict:
    """The hub's transformers-4 form: rope_theta + rope_scaling, no layer_types
    or moe_layers (derived from no_rope_layers / interleave_moe_layer_step),
    no_rope_layers empty (transformers then derives every 4th layer NoPE)."""
    d = t4_config(cfg, drop=("layer_types", "moe_layers"), version="4.51.0")
    d["no_rope_layers"] = []
    return d


class Llama4TextOnly(Llama4ForConditionalGeneration):
    """Llama4ForConditionalGeneration whose forward without pixel_values is its
    text model's (transformers 5.24's own text-only forward fails: it reads
    `image_outputs` off the text model's output). Same modules and weight
    names; config.json is written back with the real architecture."""

    def forward(self, input_ids=None, **kwargs):
        kwargs.pop("pixel_values", None)
        return self.language_model(input_ids=input_ids, **kwargs)


def real_architecture(cfg: dict) -> dict:
    return {**cfg, "architectures": ["Llama4ForConditionalGeneration"]}


def multimodal_config(family, case):
    text = Llama4TextConfig(**{**family.common, **case["config"]})
    cfg = Llama4Config(text_config=text.to_dict(), vision_config=case["vision"])
    cfg._attn_implementation = "eager"
    return cfg


COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=32,
    intermediate_size_mlp=96,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
    attention_chunk_size=8,
    floor_scale=4,
    attn_scale=0.1,
)

CASES = [
    dict(
        name="gqa_fp32",
        description=(
            "8 q / 2 kv heads, head_dim 16, 4 layers: chunked (chunk 8) RoPE layers 0-2 with q/k L2 norm, "
            "layer 3 NoPE full with temperature tuning (floor_scale 4); MoE on layers 1, 3 "
            "(interleave_moe_layer_step 2): 4 experts top-1 + shared expert; dense MLP (96) on 0, 2; "
            "llama3 RoPE; float32; config_t4.json in the hub's transformers-4 form"
        ),
        seed=6101,
        T=48,
        config=dict(
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,
            no_rope_layer_interval=4,
            rope_parameters=LLAMA3_ROPE,
        ),
        t4=t4_hub,
        ablations=ABLATIONS,
    ),
    dict(
        name="mqa_bf16",
        description=(
            "4 q / 1 kv head, head_dim 16, 3 layers no_rope_layers [1, 0, 1] (chunked, NoPE full, chunked), "
            "no q/k norm (use_qk_norm false), every layer MoE: 2 experts top-2 (every token uses both, so bf16 "
            "rounding cannot flip a routing choice), bfloat16"
        ),
        seed=6102,
        T=48,
        dtype=torch.bfloat16,
        config=dict(
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            num_local_experts=2,
            num_experts_per_tok=2,
            interleave_moe_layer_step=1,
            no_rope_layers=[1, 0, 1],
            use_qk_norm=False,
            rope_parameters=LLAMA3_ROPE,
        ),
        ablations={"chunk_mask": no_chunks, "nope_temperature": no_temperature, "shared_expert": no_shared_expert},
    ),
    dict(
        name="multimodal_fp32",
        description=(
            "Llama4ForConditionalGeneration (text weights under language_model., a 1-layer vision tower and "
            "projector beside them): 12 q / 4 kv heads, head_dim 8, 4 layers (layer 3 NoPE), MoE on every "
            "layer: 4 experts top-2 + shared expert, chunk 8, float32; reference: text only"
        ),
        seed=6103,
        T=44,
        model_cls=Llama4TextOnly,
        edit_config=real_architecture,
        vision=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                    vision_output_dim=32, image_size=28, patch_size=14, projector_input_dim=32,
                    projector_output_dim=64),  # fmt: skip
        config=dict(
            num_hidden_layers=4,
            num_attention_heads=12,
            num_key_value_heads=4,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            interleave_moe_layer_step=1,
            rope_parameters=LLAMA3_ROPE,
        ),
        ablations={"chunk_mask": no_chunks, "nope_temperature": no_temperature, "qk_l2_norm": no_qk_norm,
                   "shared_expert": no_shared_expert, "scaled_expert_input": scale_outputs},  # fmt: skip
        notes=["built and reloaded as Llama4TextOnly (Llama4ForConditionalGeneration whose forward without "
               "pixel_values is its language_model's: transformers 5.24's own text-only forward fails reading "
               "image_outputs); config.json names Llama4ForConditionalGeneration, the weights are its own"],
    ),
]


def build_config(family, case):
    if case.get("vision"):
        return multimodal_config(family, case)
    cfg = default_config(family, case)
    return cfg


NOTES = [
    "transformers 5.24 Llama4: RoPE layers (no_rope_layers[i] = 1) are chunked_attention when "
    "attention_chunk_size is set, the others full NoPE layers with temperature tuning; interleaved RoPE "
    "(complex pairs) then a weightless L2 norm of q/k on RoPE layers (use_qk_norm); the router's top-k "
    "logits -> sigmoid scale each chosen expert's INPUT; shared expert on every token.",
]

STYLE = {**LLAMA_STYLE, "info_fields": LLAMA_STYLE["info_fields"] + (bf16_vs_fp32,), "auto_load": False}
FAMILY = Family(
    "llama4",
    __file__,
    Llama4ForCausalLM,
    Llama4TextConfig,
    CASES,
    common=COMMON,
    readme_notes=NOTES,
    build_config=build_config,
    **{k: v for k, v in STYLE.items() if k != "common"},
)

if __name__ == "__main__":
    sys.exit(run(FAMILY))
