#!/usr/bin/env python
"""Generate tiny random Gemma3 reference fixtures with Hugging Face transformers.

Run from the repository root:

    /work/venv/bin/python scripts/make_fixtures.py                  # gemma3 (this file's family)
    /work/venv/bin/python scripts/make_fixtures.py --family llama   # one family (repeatable)
    /work/venv/bin/python scripts/make_fixtures.py --all            # every family, one after another
    /work/venv/bin/python scripts/make_fixtures.py --list           # the family names

Families other than gemma3 are described in scripts/fixtures_<family>.py (each
also runs on its own); the shared recipe is scripts/fixture_lib.py.

For every gemma3 case it writes ``tests/fixtures/gemma3/<case>/``:

* ``config.json``, ``model.safetensors`` (and ``generation_config.json``)
  exactly as ``model.save_pretrained(dir, safe_serialization=True)`` writes them;
* ``reference.npz`` with
    - ``ids``    int32 [T]    random token ids,
    - ``logits`` float32 [T, V]: ONE full forward pass over the whole sequence
      (no cache, eager attention) in the checkpoint's dtype, cast to float32;
    - bf16 cases only: ``logits_fp32``: the same bf16-rounded weights upcast to
      float32 and run in float32;
    - ``softcap_fp32`` only: ``logits_attn_softcap``: see the note below;
* ``fixture_info.json``: human/machine readable summary (shapes, dtype, logit
  statistics, weight-name prefixes, notes);
* ``config_t4.json`` (``gqa_fp32`` and ``softcap_fp32``): the same config in the
  transformers-4 form (``rope_theta`` / ``rope_local_base_freq`` /
  ``sliding_window_pattern`` / ``rope_scaling`` instead of ``layer_types`` /
  ``rope_parameters``).  The script checks that transformers loads it into the
  same model (identical logits).

Reference logits are computed from the model *reloaded from the written files*
(``from_pretrained``) and checked to equal the in-memory model's logits.

Note on ``attn_logit_softcapping``: transformers' Gemma3 (checked on 5.24)
never passes ``softcap`` to the attention function, so the config value is
ignored and ``logits`` of ``softcap_fp32`` have NO attention-score softcapping
(only the final-logit softcapping).  The script asserts that.  For a loader
that wants to implement Gemma2-style attention softcapping anyway,
``logits_attn_softcap`` holds HF logits with ``tanh`` softcapping applied to
the scaled attention scores (before the mask), like Gemma2's eager path.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import (
    Gemma3Config,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    SiglipVisionConfig,
)

from fixture_lib import (
    FULL,
    GEMMA_COMMON,
    SLIDING,
    Family,
    Readme,
    Rule,
    anything,
    bf16_vs_fp32,
    config_kwargs,
    default_config,
    endswith,
    full_logits,
    is_embedding,
    no_attn_softcap,
    no_final_softcap,
    no_window,
    npz_keys,
    pattern_layer_types,
    rope_by_kind,
    run,
    scale_by_head_dim,
    t4_config,
)

# Re-initialisation (HF's default init gives near-constant logits):
INIT = dict(
    embed_std=0.2,  # embedding (tied lm_head); scaled by sqrt(hidden) on input
    linear_std=0.25,  # every projection matrix (attention, MLP, vision tower, ...)
    rmsnorm_std=0.3,  # every RMSNorm weight (gemma applies (1 + w)), q_norm/k_norm too
    final_norm_mean=1.0,  # final text norm w ~ N(1, rmsnorm_std): (1+w) ~ 2 -> logits spread
    other_std=0.1,  # biases / layernorm params / position embeddings of the vision tower
)
FINAL_NORMS = ("model.norm.weight", "model.language_model.norm.weight")


def is_gemma_norm(name: str, p) -> bool:
    """The text model's (1 + w) RMSNorms and the multimodal projector's."""
    is_text_rms = "norm" in name.rsplit(".", 1)[0] and "vision_tower" not in name and p.ndim == 1
    return is_text_rms or name.endswith("mm_soft_emb_norm.weight")


INIT_RULES = (
    Rule(is_embedding, "embed_std"),
    Rule(lambda name, p: name in FINAL_NORMS, "rmsnorm_std", ("final_norm_mean",)),
    Rule(is_gemma_norm, "rmsnorm_std"),
    Rule(lambda name, p: p.ndim >= 2 and "position_embedding" not in name, "linear_std"),
    # the rest: vision biases, vision LayerNorm weight/bias (SigLIP: w, not 1 + w), position embeddings
    Rule(endswith("norm.weight", "layer_norm1.weight", "layer_norm2.weight"), "other_std", (1.0,)),
    Rule(anything, "other_std"),
)

COMMON = dict(GEMMA_COMMON, num_hidden_layers=6)


def undo_linear_rope(factor: float):
    def ablation(m) -> None:  # linear scaling divides the full layers' inv_freq by factor
        m.model.rotary_emb.full_attention_inv_freq.mul_(factor)

    return ablation


def to_t4_config(cfg_v5: dict) -> dict:
    """Express a transformers-5 gemma3_text config.json in the transformers-4 form."""
    types = cfg_v5["layer_types"]
    pattern = next(p for p in range(1, len(types) + 1) if pattern_layer_types(len(types), p) == types)
    full, local = cfg_v5["rope_parameters"][FULL], cfg_v5["rope_parameters"][SLIDING]
    assert local.get("rope_type", "default") == "default" and set(local) <= {"rope_type", "rope_theta"}
    return t4_config(
        {**cfg_v5, "rope_parameters": full},
        pattern=pattern,
        drop=("_sliding_window_pattern", "use_bidirectional_attention"),  # the latter did not exist in 4.50
        version="4.50.0",
        rope_local_base_freq=local["rope_theta"],
        sliding_window_pattern=pattern,
        cache_implementation="hybrid",
    )


# sliding layers see the whole causal prefix (tests the sliding-window mask); rope unchanged
WINDOW_ABLATION = {"no_sliding_window_max_rel_change": no_window}

CASES = [
    dict(
        name="gqa_fp32",
        description="GQA 8 q heads / 2 KV heads, float32, pattern 3 (s,s,f), window 16, T=80.",
        seed=1001,
        T=80,
        config=dict(
            num_attention_heads=8,
            num_key_value_heads=2,
            sliding_window=16,
            layer_types=pattern_layer_types(6, 3),
            query_pre_attn_scalar=16,
            # non-default thetas so a loader that hard-codes 1e6/1e4 fails
            rope_parameters=rope_by_kind(500_000.0, 20_000.0),
        ),
        t4=to_t4_config,
        ablations=WINDOW_ABLATION,
    ),
    dict(
        name="mqa_fp32",
        description="MQA 4 q heads / 1 KV head, float32, pattern 3, window 8, T=48.",
        seed=1002,
        T=48,
        config=dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            sliding_window=8,
            layer_types=pattern_layer_types(6, 3),
            query_pre_attn_scalar=16,
            rope_parameters=rope_by_kind(1_000_000.0, 10_000.0),
        ),
        ablations=WINDOW_ABLATION,
    ),
    dict(
        name="gqa_bf16",
        description="GQA 8/2 with bfloat16 weights (saved as bf16), forward in bf16; window 16, T=64.",
        seed=1003,
        dtype=torch.bfloat16,
        T=64,
        config=dict(
            num_attention_heads=8,
            num_key_value_heads=2,
            sliding_window=16,
            layer_types=pattern_layer_types(6, 3),
            query_pre_attn_scalar=16,
            rope_parameters=rope_by_kind(1_000_000.0, 10_000.0),
        ),
        ablations=WINDOW_ABLATION,
    ),
    dict(
        name="softcap_fp32",
        description=(
            "4 q / 2 kv, float32, attn_logit_softcapping=2 (ignored by HF Gemma3, see notes), "
            "final_logit_softcapping=6, linear RoPE scaling x4 on full-attention layers, "
            "query_pre_attn_scalar=24 != head_dim=16, non-default thetas; window 8, T=48."
        ),
        seed=1004,
        T=48,
        config=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=8,
            layer_types=pattern_layer_types(6, 3),
            query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=6.0,
            rope_parameters=rope_by_kind(50_000.0, 5_000.0, {"rope_type": "linear", "factor": 4.0}),
        ),
        t4=to_t4_config,
        ablations={
            **WINDOW_ABLATION,
            "no_final_softcap_max_rel_change": no_final_softcap,
            "no_rope_scaling_max_rel_change": undo_linear_rope(4.0),
            "scale_by_head_dim_max_rel_change": scale_by_head_dim,
            "with_attn_softcap_max_rel_change": lambda m: {"softcap": 2.0},
        },
    ),
    dict(
        name="multimodal_fp32",
        description=(
            "Gemma3ForConditionalGeneration (model_type gemma3) with a tiny SigLIP vision tower; "
            "text 4 q / 2 kv, float32, window 16, T=64; reference = text-only forward (input_ids only)."
        ),
        seed=1005,
        T=64,
        model_cls=Gemma3ForConditionalGeneration,
        config=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=16,
            layer_types=pattern_layer_types(6, 3),
            query_pre_attn_scalar=16,
            rope_parameters=rope_by_kind(1_000_000.0, 10_000.0),
        ),
        vision=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_channels=3,
            image_size=32,
            patch_size=8,
            layer_norm_eps=1e-6,
            vision_use_head=False,
        ),
        # special ids inside the tiny vocab; the random text ids avoid them
        mm=dict(mm_tokens_per_image=4, boi_token_index=253, eoi_token_index=254, image_token_index=255),
        id_high=253,
        notes=[
            "reference = text-only forward (input_ids only, no pixel_values). "
            "ids drawn from [0, 253) to avoid boi/eoi/image token ids. "
            "Gemma3ForConditionalGeneration never applies final_logit_softcapping (not set here anyway)."
        ],
    ),
]



def build_config(family: Family, case: dict):
    if "vision" not in case:
        return default_config(family, case)
    text = Gemma3TextConfig(**config_kwargs(family, case))
    vision = SiglipVisionConfig(**case["vision"])
    return Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), tie_word_embeddings=True, **case["mm"]
    )


def attn_softcap_reference(ctx) -> list[str]:
    """Check that transformers ignores attn_logit_softcapping; record the logits with it applied."""
    cap = ctx.case["config"].get("attn_logit_softcapping")
    if not cap:
        return []
    m_nocap = copy.deepcopy(ctx.reloaded)
    no_attn_softcap(m_nocap)
    same = np.array_equal(full_logits(m_nocap, ctx.ids), ctx.logits)
    assert same, "transformers now applies attn_logit_softcapping: update notes/fixture"
    ctx.arrays["logits_attn_softcap"] = full_logits(ctx.reloaded, ctx.ids, softcap=cap).astype(np.float32)
    return [
        f"transformers {transformers.__version__} Gemma3 IGNORES attn_logit_softcapping={cap}: 'logits' has "
        "no attention softcapping (verified: identical with the field set to None). "
        "'logits_attn_softcap' = HF logits with Gemma2-style tanh softcap on the scaled attention "
        "scores (softcap * tanh(s / softcap), applied before the mask)."
    ]


def bf16_top1_agreement(ctx) -> dict:
    a = ctx.arrays
    if "logits_fp32" not in a:
        return {"bf16_vs_fp32_top1_agreement": None}
    agree = a["logits"].argmax(-1) == a["logits_fp32"].argmax(-1)
    return {"bf16_vs_fp32_top1_agreement": round(float(agree.mean()), 4)}


FAMILY = Family(
    "gemma3",
    __file__,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    CASES,
    common=COMMON,
    init=INIT,
    init_rules=INIT_RULES,
    build_config=build_config,
    extra_outputs=attn_softcap_reference,
    info_fields=(npz_keys, bf16_vs_fp32, bf16_top1_agreement),
    t4_fields=(
        "accepted",
        "layer_types_equal",
        "rope_parameters_equal",
        "rope_parameters_loaded",
        "logits_max_abs_diff",
    ),
    t4_note="config_t4.json: same model in transformers-4 config form; transformers 5 loads it to identical logits",
    readme=Readme(
        title="Gemma3",
        runtime="eager attention, CPU.",
        about=(
            "Each case directory holds `config.json` / `model.safetensors` / `generation_config.json` as written by",
            "`save_pretrained`, `reference.npz` (`ids` int32 [T], `logits` float32 [T, V] from one full",
            "forward pass without cache; bf16 cases add `logits_fp32`), and `fixture_info.json`",
            "(statistics, weight-name prefixes, notes).  "
            "`config_t4.json` is the transformers-4 form of `config.json`.",
        ),
        columns=(
            ("case", lambda i, c: i["case"]),
            ("class", lambda i, c: i["hf_class"]),
            ("dtype", lambda i, c: i["dtype"]),
            ("heads q/kv", lambda i, c: f"{c['config']['num_attention_heads']}/{c['config']['num_key_value_heads']}"),
            ("window", lambda i, c: i["sliding_window"]),
            ("T", lambda i, c: i["T"]),
            ("logit std", lambda i, c: i["logits_std"]),
            ("min top-1 gap", lambda i, c: i["logits_min_top1_gap"]),
            ("extra npz keys", lambda i, c: ", ".join(k for k in i["npz_keys"] if k not in ("ids", "logits")) or "-"),
        ),
    ),
    readme_notes=("HF's sliding window: query i attends keys j with i - window < j <= i (window keys incl. itself).",),
)


# --------------------------------------------------------------------------- every family


def family_names() -> list[str]:
    scripts = Path(__file__).resolve().parent
    return [FAMILY.name] + sorted(p.stem.removeprefix("fixtures_") for p in scripts.glob("fixtures_*.py"))


def load_family(name: str) -> Family:
    return FAMILY if name == FAMILY.name else importlib.import_module(f"fixtures_{name}").FAMILY


def main(argv=None) -> int:
    names = family_names()
    parser = argparse.ArgumentParser(description="Rebuild the reference fixtures in tests/fixtures/ (default: gemma3).")
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--family", action="append", choices=names, metavar="NAME", help=f"rebuild this family (repeatable): {names}"
    )
    which.add_argument("--all", action="store_true", help="rebuild every family, one after another")
    which.add_argument("--list", action="store_true", help="print the family names")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(names))
        return 0
    for name in names if args.all else args.family or [FAMILY.name]:
        if run(load_family(name)):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
