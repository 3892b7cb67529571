#!/usr/bin/env python
"""Tiny random Gemma 3n reference fixtures (tests/fixtures/gemma3n/<case>/).

    .venv/bin/python scripts/fixtures_gemma3n.py   (or scripts/make_fixtures.py --family gemma3n)

See scripts/fixture_lib.py for what each case directory holds. Gemma3nForCausalLM
(model_type gemma3n_text). Features exercised: AltUp (predict / correct over
the streams, magnitude-matched projections in and out, the active index and
the corrected-output scale), LAuReL, per-layer embeddings (their scale, the
model projection and its norm, the per-layer gate and projection; token ids
past vocab_size_per_layer_input, which look up row 0), KV sharing of both
layer kinds (the last num_kv_shared_layers layers reuse the KV of the last
earlier layer of their kind), Gaussian top-k activation sparsity on some
layers, per-layer intermediate sizes, sliding/full layers with their own RoPE
bases, q/k/v norms, the final logit softcap, tied and untied heads. Head
counts split at np 2 and 4 (KV heads replicated at np 4, and at np 2 for the
single-KV-head case).
"""

from __future__ import annotations

import sys

import torch
from transformers import (
    Gemma3nAudioConfig,
    Gemma3nConfig,
    Gemma3nForCausalLM,
    Gemma3nForConditionalGeneration,
    Gemma3nTextConfig,
    Gemma3nVisionConfig,
)
from transformers.models.gemma3n.modeling_gemma3n import (
    Gemma3nModel,
    Gemma3nMultimodalEmbedder,
    Gemma3nPreTrainedModel,
    Gemma3nTextModel,
)

from fixture_lib import (
    FULL,
    GEMMA2_STYLE,
    SLIDING,
    Family,
    Rule,
    anything,
    config_kwargs,
    default_config,
    endswith,
    is_embedding,
    is_matrix,
    is_norm_vector,
    no_window,
    run,
)

INIT = dict(embed_std=0.3, linear_std=0.25, norm_center=1.0, norm_std=0.3, scale_center=1.0, other_std=0.3)
RULES = (
    Rule(is_embedding, "embed_std"),
    Rule(endswith("correct_output_scale"), "other_std", ("scale_center",)),
    Rule(is_norm_vector, "norm_std", ("norm_center",)),  # Gemma3nRMSNorm scales by w (not 1 + w)
    Rule(is_matrix, "linear_std"),
    Rule(anything, "other_std"),
)
COMMON = dict(
    vocab_size=256,
    vocab_size_per_layer_input=200,  # ids 200..255 take the out-of-table path
    hidden_size=32,
    hidden_size_per_layer_input=16,
    head_dim=16,
    laurel_rank=8,
    rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh",
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)


def rope_by_kind(full_theta: float, sliding_theta: float) -> dict:
    return {FULL: {"rope_type": "default", "rope_theta": full_theta},
            SLIDING: {"rope_type": "default", "rope_theta": sliding_theta}}  # fmt: skip


def t4_form(cfg: dict) -> dict:
    """transformers-4.53 form (as google/gemma-3n-* ship): rope_theta,
    rope_local_base_freq, rope_scaling null, torch_dtype."""
    d = dict(cfg)
    rp = d.pop("rope_parameters")
    d["rope_theta"] = rp[FULL]["rope_theta"]
    d["rope_local_base_freq"] = rp[SLIDING]["rope_theta"]
    d["rope_scaling"] = None
    d["torch_dtype"] = d.pop("dtype")
    d["transformers_version"] = "4.53.0"
    return d


def no_final_softcap(m) -> None:
    m.config.final_logit_softcapping = 1e9  # the strict config wants a float: a cap that never bites


def no_sparsity(m) -> None:
    for layer in m.model.layers:
        layer.mlp.activation_sparsity = 0.0


def no_laurel(m) -> None:
    for layer in m.model.layers:
        layer.laurel.forward = lambda x: x


def no_per_layer_inputs(m) -> None:
    for layer in m.model.layers:
        layer.per_layer_projection.weight.zero_()


def in_table_ids(m) -> None:
    """What treating every id as in the per-layer table would give (ids clipped into it)."""
    model = m.model
    orig = model.get_per_layer_inputs

    def get(input_ids):
        vpl = model.config.vocab_size_per_layer_input
        e = model.embed_tokens_per_layer(torch.remainder(input_ids, vpl))
        return e.reshape(*input_ids.shape, model.config.num_hidden_layers, model.hidden_size_per_layer_input)

    assert orig is not None
    model.get_per_layer_inputs = get


def no_altup_correct_scale(m) -> None:
    m.config.altup_correct_scale = False


ABLATIONS = {
    "no_sliding_window": no_window,
    "no_activation_sparsity": no_sparsity,
    "no_laurel": no_laurel,
    "no_per_layer_inputs": no_per_layer_inputs,
    "per_layer_ids_wrapped": in_table_ids,
    "no_final_softcap": no_final_softcap,
}

class TowerlessGemma3nModel(Gemma3nModel):
    """transformers' Gemma3nModel without its vision tower (timm, not installed
    here) and audio tower: one-weight stand-ins keep their names in the
    checkpoint (for sanitize to drop). Gemma3nModel.forward runs unchanged:
    with token ids only it never calls the towers."""

    def __init__(self, config):
        Gemma3nPreTrainedModel.__init__(self, config)
        self.vision_tower = torch.nn.Linear(4, 4, bias=False)
        self.vocab_size = config.text_config.vocab_size
        self.language_model = Gemma3nTextModel(config.text_config)
        self.vocab_size_per_layer_input = config.text_config.vocab_size_per_layer_input
        self.audio_tower = torch.nn.Linear(4, 4, bias=False)
        self.embed_vision = Gemma3nMultimodalEmbedder(config.vision_config, config.text_config)
        self.embed_audio = Gemma3nMultimodalEmbedder(config.audio_config, config.text_config)
        self.post_init()


class TowerlessGemma3nForConditionalGeneration(Gemma3nForConditionalGeneration):
    """Gemma3nForConditionalGeneration (its forward and head unchanged) over TowerlessGemma3nModel."""

    def __init__(self, config):
        Gemma3nPreTrainedModel.__init__(self, config)
        self.model = TowerlessGemma3nModel(config)
        self.lm_head = torch.nn.Linear(config.text_config.hidden_size, config.text_config.vocab_size, bias=False)
        self.post_init()


def build_config(family, case):
    if not case.get("multimodal"):
        return default_config(family, case)
    kw = config_kwargs(family, case)
    vision, audio = kw.pop("vision_config"), kw.pop("audio_config")
    cfg = Gemma3nConfig(
        text_config=Gemma3nTextConfig(**kw).to_dict(),
        vision_config=Gemma3nVisionConfig(**vision).to_dict(),
        audio_config=Gemma3nAudioConfig(**audio).to_dict(),
    )
    cfg._attn_implementation = "eager"
    return cfg


def multimodal_ids_as_text(m) -> None:
    """No id in the vision/audio ranges goes through its embedder."""
    m.model.embed_vision.vocab_offset = 10**6
    m.model.embed_audio.vocab_offset = 10**6


def no_window_text(m) -> None:
    m.config.text_config.sliding_window = 1_000_000


def as_conditional_generation(cfg: dict) -> dict:
    return {**cfg, "architectures": ["Gemma3nForConditionalGeneration"]}


CASES = [
    dict(
        name="gqa_fp32",
        description=(
            "4 q / 2 kv heads, 6 layers (s,s,f | s,s,f shared: read layers 1, 1, 2), window 16, tied, "
            "4 AltUp streams, sparsity on 4 layers, per-layer intermediate sizes, final softcap 10"
        ),
        seed=7001,
        T=55,
        config=dict(
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=[64, 64, 96, 64, 32, 64],
            sliding_window=16,
            layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
            num_kv_shared_layers=3,
            activation_sparsity_pattern=[0.95, 0.9, 0.8, 0.0, 0.95, 0.0],
            altup_num_inputs=4,
            final_logit_softcapping=10.0,
            rope_parameters=rope_by_kind(1_000_000.0, 10_000.0),
            tie_word_embeddings=True,
        ),
        t4=t4_form,
        ablations=ABLATIONS,
    ),
    dict(
        name="mqa_untied_fp32",
        description=(
            "4 q / 1 kv head, 5 layers (s,f,s | f,s shared: read layers 1, 2), window 8, untied head, "
            "3 AltUp streams with active index 1, no corrected-output scale, sparsity on 2 layers"
        ),
        seed=7002,
        T=48,
        config=dict(
            num_hidden_layers=5,
            num_attention_heads=4,
            num_key_value_heads=1,
            intermediate_size=64,
            sliding_window=8,
            layer_types=[SLIDING, FULL, SLIDING, FULL, SLIDING],
            num_kv_shared_layers=2,
            activation_sparsity_pattern=[0.0, 0.95, 0.0, 0.7, 0.0],
            altup_num_inputs=3,
            altup_active_idx=1,
            altup_correct_scale=False,
            final_logit_softcapping=15.0,
            rope_parameters=rope_by_kind(50_000.0, 5_000.0),
            tie_word_embeddings=False,
        ),
        ablations={k: v for k, v in ABLATIONS.items() if k != "no_final_softcap"},
    ),
    dict(
        name="multimodal_fp32",
        description=(
            "Gemma3nForConditionalGeneration's text path (model_type gemma3n, text_config): 4 q / 2 kv heads, "
            "5 layers (s,s,f | s,f shared), window 8, vision ids 200-207 and audio ids 208-215 through their "
            "embedders, towers dropped"
        ),
        seed=7003,
        T=48,
        multimodal=True,
        model_cls=TowerlessGemma3nForConditionalGeneration,
        edit_config=as_conditional_generation,
        config=dict(
            vocab_size=216,
            num_hidden_layers=5,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            sliding_window=8,
            layer_types=[SLIDING, SLIDING, FULL, SLIDING, FULL],
            num_kv_shared_layers=2,
            activation_sparsity_pattern=[0.95, 0.0, 0.9, 0.0, 0.0],
            final_logit_softcapping=12.0,
            rope_parameters=rope_by_kind(1_000_000.0, 10_000.0),
            vision_config=dict(hidden_size=24, vocab_size=8, vocab_offset=200, rms_norm_eps=1e-6),
            audio_config=dict(hidden_size=20, vocab_size=8, vocab_offset=208, rms_norm_eps=1e-6),
        ),
        notes=[
            "transformers' Gemma3nForConditionalGeneration.forward / Gemma3nModel.forward unchanged; its vision "
            "tower (timm) and audio tower are one-weight stand-ins (token ids never reach them)"
        ],
        ablations={"multimodal_ids_as_text": multimodal_ids_as_text, "no_sliding_window": no_window_text},
    ),
]


FAMILY = Family(
    "gemma3n",
    __file__,
    Gemma3nForCausalLM,
    Gemma3nTextConfig,
    CASES,
    common=COMMON,
    init=INIT,
    build_config=build_config,
    **{**GEMMA2_STYLE, "init_rules": RULES},
)

if __name__ == "__main__":
    sys.exit(run(FAMILY))
