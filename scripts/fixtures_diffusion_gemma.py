#!/usr/bin/env python
"""Tiny random DiffusionGemma reference fixtures (tests/fixtures/diffusion_gemma/<case>/).

    .venv/bin/python scripts/fixtures_diffusion_gemma.py   (or scripts/make_fixtures.py --family diffusion_gemma)

See scripts/fixture_lib.py for what each case directory holds. The checkpoint
is transformers' DiffusionGemmaForBlockDiffusion (tiny vision tower included,
as save_pretrained writes it). `logits` are the ENCODER's causal LM logits
(lm_head on the encoder's last hidden state, softcapped): transformers has no
class that returns them, so the fixture's model class (`EncoderLM`) is the HF
class whose forward returns exactly that. The encoder and decoder layer
scalars are set to different random values (their only untied weights).

reference.npz adds (see `decoder_outputs`):
* `canvas_ids` int32 [C], `logits_canvas` float32 [C, V]: the HF model's
  forward (prompt `ids`, T > window, so sliding layers see the last window-1
  prompt keys) with that canvas and no self-conditioning;
* `sc_logits` float32 [C, V] and `logits_canvas_sc`: the same with
  `self_conditioning_logits=sc_logits`;
* `logits_canvas_short`: the canvas after a prompt shorter than the window
  (`ids[:short_len]`, `short_len` int32 [1]);
* `gen_prompt` int32, `gen_ids` int32 (transformers' `sequences` past the
  prompt), `gen_params` float64 [max_new_tokens, max_denoising_steps,
  entropy_bound, t_min, t_max, stability_threshold, confidence_threshold,
  eos, pad], `gen_passes` int32 [1]: HF `generate` with greedy denoiser draws
  (torch.multinomial replaced by the argmax) and the sampler's random canvases
  replaced by `noise_ids(k, C, V)` (k = the draw's index): the deterministic
  block-diffusion run tests/test_diffusion_gemma.py reproduces.
"""

from __future__ import annotations

import copy
import sys
from types import SimpleNamespace

import numpy as np
import torch
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, DiffusionGemmaTextConfig
from transformers.models.diffusion_gemma import generation_diffusion_gemma as gen_mod
from transformers.models.gemma4 import Gemma4VisionConfig

from fixture_lib import BASE_COLUMNS, FULL, SLIDING, Family, Readme, Rule, anything, config_kwargs, run

INIT = dict(
    embed_std=0.2,
    linear_std=0.2,
    expert_std=0.15,
    norm_mean=1.0,
    norm_std=0.3,
    qk_norm_mean=0.5,
    qk_norm_std=0.15,
    scale_mean=1.0,
    scale_std=0.3,
    other_std=0.1,
)
INIT_RULES = (
    Rule(lambda n, p: "embed_tokens" in n, "embed_std"),
    Rule(lambda n, p: n.endswith(("q_norm.weight", "k_norm.weight")), "qk_norm_std", ("qk_norm_mean",)),
    Rule(lambda n, p: "norm" in n.rsplit(".", 1)[0] and n.endswith(".weight") and p.ndim == 1, "norm_std",
         ("norm_mean",)),
    Rule(lambda n, p: n.endswith(("router.scale", "router.per_expert_scale")), "scale_std", ("scale_mean",)),
    Rule(lambda n, p: n.endswith(("experts.gate_up_proj", "experts.down_proj")), "expert_std"),
    Rule(lambda n, p: p.ndim >= 2 and "position_embedding" not in n, "linear_std"),
    Rule(anything, "other_std"),
)
COMMON = dict(rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", pad_token_id=0, eos_token_id=1,
              bos_token_id=2, head_dim=16, hidden_size=32)  # fmt: skip
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=2, head_dim=8, patch_size=4, position_embedding_size=16,
              pooling_kernel_size=2)  # fmt: skip


def rope(full_theta=1_000_000.0, partial=0.25, sliding_theta=10_000.0):
    return {
        SLIDING: {"rope_type": "default", "rope_theta": sliding_theta},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": partial, "rope_theta": full_theta},
    }


def noise_ids(k: int, C: int, V: int) -> np.ndarray:
    """The k-th random canvas of the deterministic run (tests/test_diffusion_gemma.py has the same)."""
    i = np.arange(C, dtype=np.int64) + np.int64(k) * C
    return ((i * 2654435761 + 12345) % (1 << 32) % V).astype(np.int64)


class EncoderLM(DiffusionGemmaForBlockDiffusion):
    """DiffusionGemmaForBlockDiffusion whose forward returns the encoder's causal LM
    logits (its last hidden state through lm_head and the final softcap)."""

    def forward(self, input_ids=None, use_cache=False, **kwargs):
        if "decoder_input_ids" in kwargs:  # generate's decoder passes: the HF forward
            return super().forward(input_ids=input_ids, **kwargs)
        h = self.model.encoder(input_ids=input_ids).last_hidden_state
        logits = self.lm_head(h).float()
        cap = self.final_logit_softcapping
        return SimpleNamespace(logits=torch.tanh(logits / cap) * cap)


def with_layer_scalars(cfg):
    """The model with random, different encoder and decoder layer scalars (buffers a fresh model sets to 1)."""
    m = EncoderLM(cfg)
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for layer in list(m.model.encoder.language_model.layers) + list(m.model.decoder.layers):
            layer.layer_scalar.copy_(0.6 + 0.8 * torch.rand(1, generator=gen))
    return m


with_layer_scalars.from_pretrained = EncoderLM.from_pretrained


def build_config(family: Family, case: dict):
    kw = config_kwargs(family, case)
    canvas = kw.pop("canvas_length")
    text = DiffusionGemmaTextConfig(**kw)
    vision = Gemma4VisionConfig(**VISION)
    cfg = DiffusionGemmaConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), canvas_length=canvas,
                               tie_word_embeddings=True)  # fmt: skip
    cfg._attn_implementation = "eager"
    for c in (cfg, cfg.text_config):
        c._experts_implementation = "eager"  # as the reload (load_kwargs)
    return cfg


def hf_architecture(cfg: dict) -> dict:
    cfg = copy.deepcopy(cfg)
    cfg["architectures"] = ["DiffusionGemmaForBlockDiffusion"]
    return cfg


def unit_encoder_scalars(m) -> None:
    for layer in m.model.encoder.language_model.layers:
        layer.layer_scalar.fill_(1.0)


def no_moe(m) -> None:
    for layer in m.model.decoder.layers:
        layer.experts.down_proj.zero_()


def no_window(m) -> None:
    m.config.text_config.sliding_window = 1_000_000
    m.model.encoder.language_model.config.sliding_window = 1_000_000


@torch.no_grad()
def canvas_forward(model, prompt, canvas, sc=None) -> np.ndarray:
    out = DiffusionGemmaForBlockDiffusion.forward(
        model,
        input_ids=torch.from_numpy(prompt.astype(np.int64))[None],
        decoder_input_ids=torch.from_numpy(canvas.astype(np.int64))[None],
        self_conditioning_logits=None if sc is None else torch.from_numpy(sc)[None],
    )
    return out.logits[0].float().numpy()


@torch.no_grad()
def greedy_generate(model, prompt: np.ndarray, params: dict) -> tuple[np.ndarray, int]:
    """HF generate, deterministic: argmax draws, noise_ids canvases."""
    V = model.config.text_config.vocab_size
    calls = [0]

    def init_canvas(self, batch_size, device):
        k = calls[0]
        calls[0] += 1
        return torch.from_numpy(noise_ids(k, self.canvas_length, V))[None].repeat(batch_size, 1)

    real_multinomial, real_init = torch.multinomial, gen_mod.EntropyBoundSampler.initialize_canvas
    torch.multinomial = lambda probs, num_samples: probs.argmax(dim=-1, keepdim=True)
    gen_mod.EntropyBoundSampler.initialize_canvas = init_canvas
    try:
        out = model.generate(
            torch.from_numpy(prompt.astype(np.int64))[None],
            max_new_tokens=int(params["max_new_tokens"]),
            max_denoising_steps=int(params["max_denoising_steps"]),
            sampler_config=gen_mod.EntropyBoundSamplerConfig(entropy_bound=float(params["entropy_bound"])),
            t_min=float(params["t_min"]),
            t_max=float(params["t_max"]),
            stability_threshold=int(params["stability_threshold"]),
            confidence_threshold=float(params["confidence_threshold"]),
            eos_token_id=int(params["eos"]),
            pad_token_id=int(params["pad"]),
        )
    finally:
        torch.multinomial, gen_mod.EntropyBoundSampler.initialize_canvas = real_multinomial, real_init
    seq = out.sequences[0].numpy()[len(prompt) :]
    passes = round(float(seq.shape[0] - (seq == int(params["pad"])).sum()) / float(out.tokens_per_forward[0]))
    return seq.astype(np.int32), passes


GEN_KEYS = ("max_new_tokens", "max_denoising_steps", "entropy_bound", "t_min", "t_max", "stability_threshold",
            "confidence_threshold", "eos", "pad")  # fmt: skip


def decoder_outputs(ctx) -> list:
    case, model, ids = ctx.case, ctx.reloaded, ctx.ids
    C = model.config.canvas_length
    V = model.config.text_config.vocab_size
    rng = np.random.default_rng(case["seed"] + 1)
    canvas = rng.integers(0, V, size=C).astype(np.int32)
    sc = (rng.standard_normal((C, V)) * 3.0).astype(np.float32)
    short = int(case["short_len"])
    a = ctx.arrays
    a["canvas_ids"], a["sc_logits"], a["short_len"] = canvas, sc, np.array([short], np.int32)
    a["logits_canvas"] = canvas_forward(model, ids, canvas)
    a["logits_canvas_sc"] = canvas_forward(model, ids, canvas, sc)
    a["logits_canvas_short"] = canvas_forward(model, ids[:short], canvas)
    moved = np.abs(a["logits_canvas_sc"] - a["logits_canvas"]).max() / a["logits_canvas"].std()
    assert moved > 0.05, f"self-conditioning barely matters ({moved:.4f})"
    params = case["gen"]
    prompt = ids[: params["prompt_len"]]
    gen_ids, passes = greedy_generate(model, prompt, params)
    a["gen_prompt"], a["gen_ids"], a["gen_passes"] = prompt, gen_ids, np.array([passes], np.int32)
    a["gen_params"] = np.array([params[k] for k in GEN_KEYS], np.float64)
    return [
        f"canvas C={C}: self-conditioning moves the canvas logits by {moved:.2f} std; greedy generate of "
        f"{len(gen_ids)} ids in {passes} decoder passes ({params['max_denoising_steps']} steps max per canvas)"
    ]


MOE = dict(
    num_hidden_layers=4,
    intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    global_head_dim=32,
    num_global_key_value_heads=1,
    sliding_window=8,
    layer_types=[SLIDING, FULL, SLIDING, FULL],
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=16,
    rope_parameters=rope(),
    canvas_length=8,
)

CASES = [
    dict(
        name="moe_fp32",
        description=(
            "4 q heads; sliding layers 2 KV heads x 16, full layers 1 KV head x 32 (v = k), proportional RoPE 1/4; "
            "MoE 4 experts top-2 beside a dense MLP; 4 layers s,f,s,f; window 8, canvas 8, T=48."
        ),
        seed=5001,
        T=48,
        short_len=5,
        model_cls=with_layer_scalars,
        config=dict(MOE),
        edit_config=hf_architecture,
        gen=dict(prompt_len=12, max_new_tokens=20, max_denoising_steps=6, entropy_bound=0.5, t_min=0.4, t_max=0.8,
                 stability_threshold=0, confidence_threshold=4.0, eos=1, pad=0),  # fmt: skip
        ablations={"no_sliding_window": no_window, "unit_encoder_scalars": unit_encoder_scalars, "no_moe": no_moe},
    ),
    dict(
        name="kv4_fp32",
        description=(
            "8 q heads; sliding layers 4 KV heads x 16, full layers 2 KV heads x 32, proportional RoPE 1/2 "
            "(theta 10000, sliding 20000); MoE 8 experts top-3; 3 layers s,s,f; window 6, canvas 6, T=48."
        ),
        seed=5002,
        T=48,
        short_len=3,
        model_cls=with_layer_scalars,
        config=dict(
            MOE,
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=4,
            num_global_key_value_heads=2,
            sliding_window=6,
            layer_types=[SLIDING, SLIDING, FULL],
            num_experts=8,
            top_k_experts=3,
            rope_parameters=rope(10_000.0, 0.5, 20_000.0),
            canvas_length=6,
        ),
        edit_config=hf_architecture,
        gen=dict(prompt_len=9, max_new_tokens=12, max_denoising_steps=5, entropy_bound=1.0, t_min=0.3, t_max=0.9,
                 stability_threshold=1, confidence_threshold=0.005, eos=172, pad=0),  # fmt: skip
        ablations={"no_sliding_window": no_window, "unit_encoder_scalars": unit_encoder_scalars},
    ),
]

FAMILY = Family(
    "diffusion_gemma",
    __file__,
    EncoderLM,
    DiffusionGemmaTextConfig,
    CASES,
    common=COMMON,
    init=INIT,
    init_rules=INIT_RULES,
    build_config=build_config,
    load_kwargs=dict(experts_implementation="eager"),
    check_in_memory=True,
    extra_outputs=decoder_outputs,
    readme=Readme(
        runtime="eager attention, eager experts, CPU, float32.",
        about=(
            "Each case: `config.json` / `model.safetensors` as `save_pretrained` wrote them (architectures set to",
            "DiffusionGemmaForBlockDiffusion), `reference.npz` (`ids` int32 [T], `logits` float32 [T, V]: the",
            "ENCODER's causal LM logits, one full forward pass; canvas logits of the decoder with and without",
            "self-conditioning; a deterministic greedy block-diffusion generate), `fixture_info.json`.",
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
