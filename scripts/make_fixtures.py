#!/usr/bin/env python
"""Generate tiny random Gemma3 reference fixtures with Hugging Face transformers.

Run from the repository root:

    /work/venv/bin/python scripts/make_fixtures.py

For every case it writes ``tests/fixtures/gemma3/<case>/``:

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

Deterministic (fixed seeds, single-threaded torch, zip entries with fixed
timestamps) and idempotent: each case directory is deleted and rewritten.
"""

from __future__ import annotations

import copy
import io
import json
import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors import safe_open
from transformers import (
    Gemma3Config,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    SiglipVisionConfig,
)

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "tests" / "fixtures" / "gemma3"

# Re-initialisation (HF's default init gives near-constant logits):
EMBED_STD = 0.2  # embedding (tied lm_head); scaled by sqrt(hidden) on input
LINEAR_STD = 0.25  # every projection matrix (attention, MLP, vision tower, ...)
NORM_STD = 0.3  # every RMSNorm weight (gemma applies (1 + w)), q_norm/k_norm too
FINAL_NORM_MEAN = 1.0  # final text norm w ~ N(1, NORM_STD): (1+w) ~ 2 -> logits spread
OTHER_STD = 0.1  # biases / layernorm params / position embeddings of the vision tower

SLIDING = "sliding_attention"
FULL = "full_attention"

TEXT_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh",
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
    tie_word_embeddings=True,
)


def pattern_layer_types(n_layers: int, pattern: int) -> list[str]:
    """Layer types as transformers derives them from ``sliding_window_pattern``."""
    return [SLIDING if (i + 1) % pattern else FULL for i in range(n_layers)]


def rope(full_theta: float, local_theta: float, full_scaling: dict | None = None) -> dict:
    full = {"rope_type": "default", "rope_theta": full_theta}
    if full_scaling:
        full.update(full_scaling)
    return {FULL: full, SLIDING: {"rope_type": "default", "rope_theta": local_theta}}


CASES = [
    dict(
        name="gqa_fp32",
        description="GQA 8 q heads / 2 KV heads, float32, pattern 3 (s,s,f), window 16, T=80.",
        seed=1001,
        dtype=torch.float32,
        T=80,
        text=dict(
            num_attention_heads=8,
            num_key_value_heads=2,
            sliding_window=16,
            layer_types=pattern_layer_types(6, 3),
            query_pre_attn_scalar=16,
            # non-default thetas so a loader that hard-codes 1e6/1e4 fails
            rope_parameters=rope(500_000.0, 20_000.0),
        ),
        t4_config=True,
    ),
    dict(
        name="mqa_fp32",
        description="MQA 4 q heads / 1 KV head, float32, pattern 3, window 8, T=48.",
        seed=1002,
        dtype=torch.float32,
        T=48,
        text=dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            sliding_window=8,
            layer_types=pattern_layer_types(6, 3),
            query_pre_attn_scalar=16,
            rope_parameters=rope(1_000_000.0, 10_000.0),
        ),
    ),
    dict(
        name="gqa_bf16",
        description="GQA 8/2 with bfloat16 weights (saved as bf16), forward in bf16; window 16, T=64.",
        seed=1003,
        dtype=torch.bfloat16,
        T=64,
        text=dict(
            num_attention_heads=8,
            num_key_value_heads=2,
            sliding_window=16,
            layer_types=pattern_layer_types(6, 3),
            query_pre_attn_scalar=16,
            rope_parameters=rope(1_000_000.0, 10_000.0),
        ),
    ),
    dict(
        name="softcap_fp32",
        description=(
            "4 q / 2 kv, float32, attn_logit_softcapping=2 (ignored by HF Gemma3, see notes), "
            "final_logit_softcapping=6, linear RoPE scaling x4 on full-attention layers, "
            "query_pre_attn_scalar=24 != head_dim=16, non-default thetas; window 8, T=48."
        ),
        seed=1004,
        dtype=torch.float32,
        T=48,
        text=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=8,
            layer_types=pattern_layer_types(6, 3),
            query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=6.0,
            rope_parameters=rope(50_000.0, 5_000.0, {"rope_type": "linear", "factor": 4.0}),
        ),
        t4_config=True,
    ),
    dict(
        name="multimodal_fp32",
        description=(
            "Gemma3ForConditionalGeneration (model_type gemma3) with a tiny SigLIP vision tower; "
            "text 4 q / 2 kv, float32, window 16, T=64; reference = text-only forward (input_ids only)."
        ),
        seed=1005,
        dtype=torch.float32,
        T=64,
        multimodal=True,
        text=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=16,
            layer_types=pattern_layer_types(6, 3),
            query_pre_attn_scalar=16,
            rope_parameters=rope(1_000_000.0, 10_000.0),
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
    ),
]


# --------------------------------------------------------------------------- helpers


def build_config(case: dict):
    text = Gemma3TextConfig(**TEXT_COMMON, **copy.deepcopy(case["text"]))
    if not case.get("multimodal"):
        text._attn_implementation = "eager"
        return text
    vision = SiglipVisionConfig(**case["vision"])
    cfg = Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        tie_word_embeddings=True,
        **case["mm"],
    )
    return cfg


def reinit_(model: torch.nn.Module, seed: int) -> None:
    """Re-initialise every parameter so the random model has informative logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            leaf = name.rsplit(".", 1)[0]
            is_text_rms = ("norm" in leaf) and "vision_tower" not in name and p.ndim == 1
            if "embed_tokens" in name:
                new = torch.randn(p.shape, generator=gen) * EMBED_STD
            elif is_text_rms or name.endswith("mm_soft_emb_norm.weight"):
                new = torch.randn(p.shape, generator=gen) * NORM_STD
                if name in ("model.norm.weight", "model.language_model.norm.weight"):
                    new += FINAL_NORM_MEAN
            elif p.ndim >= 2 and "position_embedding" not in name:
                new = torch.randn(p.shape, generator=gen) * LINEAR_STD
            else:  # vision biases, vision LayerNorm weight/bias, position embeddings
                new = torch.randn(p.shape, generator=gen) * OTHER_STD
                if name.endswith("norm.weight") or name.endswith("layer_norm1.weight") or name.endswith(
                    "layer_norm2.weight"
                ):
                    new += 1.0  # SigLIP uses standard LayerNorm (w, not 1+w)
            p.copy_(new.to(p.dtype))


def model_class(case: dict):
    return Gemma3ForConditionalGeneration if case.get("multimodal") else Gemma3ForCausalLM


@torch.no_grad()
def full_logits(model, ids: np.ndarray, **kwargs) -> np.ndarray:
    out = model(input_ids=torch.from_numpy(ids.astype(np.int64))[None], use_cache=False, **kwargs)
    logits = out.logits[0].float().numpy()
    assert np.isfinite(logits).all(), "non-finite HF logits"
    return logits


def load(case: dict, directory: Path, dtype=None):
    m = model_class(case).from_pretrained(
        directory, attn_implementation="eager", dtype=dtype if dtype is not None else case["dtype"]
    )
    return m.eval()


def write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """np.savez equivalent with fixed zip timestamps (byte-for-byte reproducible)."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for key, arr in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(arr), allow_pickle=False)
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())


def weight_prefixes(st_path: Path) -> dict[str, int]:
    """Top-level weight-name prefixes (up to the first numeric index) with counts."""
    with safe_open(st_path, "pt") as f:
        keys = list(f.keys())
    prefixes: dict[str, int] = {}
    for k in keys:
        parts = k.split(".")
        cut = []
        for part in parts[:-1]:
            if part.isdigit():
                break
            cut.append(part)
        pre = ".".join(cut[:3]) + "."
        prefixes[pre] = prefixes.get(pre, 0) + 1
    return dict(sorted(prefixes.items()))


def safetensors_dtypes(st_path: Path) -> list[str]:
    with safe_open(st_path, "pt") as f:
        return sorted({str(f.get_slice(k).get_dtype()) for k in f.keys()})


def to_t4_config(cfg_v5: dict) -> dict:
    """Express a transformers-5 gemma3_text config.json in the transformers-4 form."""
    d = copy.deepcopy(cfg_v5)
    layer_types = d.pop("layer_types")
    rp = d.pop("rope_parameters")
    d.pop("_sliding_window_pattern", None)
    d.pop("use_bidirectional_attention", None)  # did not exist in 4.50
    pattern = next(p for p in range(1, len(layer_types) + 1) if pattern_layer_types(len(layer_types), p) == layer_types)
    full, local = rp[FULL], rp[SLIDING]
    assert local.get("rope_type", "default") == "default" and set(local) <= {"rope_type", "rope_theta"}
    scaling = {k: v for k, v in full.items() if k != "rope_theta"}
    d["rope_theta"] = full["rope_theta"]
    d["rope_local_base_freq"] = local["rope_theta"]
    d["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
    d["sliding_window_pattern"] = pattern
    d["torch_dtype"] = d.pop("dtype")
    d["cache_implementation"] = "hybrid"
    d["transformers_version"] = "4.50.0"
    return dict(sorted(d.items()))


def top1_gap(logits: np.ndarray) -> float:
    top2 = np.sort(logits, axis=-1)[:, -2:]
    return float((top2[:, 1] - top2[:, 0]).min())


@torch.no_grad()
def ablation(case: dict, model, ids: np.ndarray, ref: np.ndarray) -> dict:
    """How much the reference depends on each feature (relative logit change)."""
    res = {}
    std = float(ref.std())

    def rel(other):
        return round(float(np.abs(other - ref).max() / std), 3)

    if case.get("multimodal"):
        return res
    # sliding layers see the whole causal prefix (tests the sliding-window mask); rope unchanged
    m2 = copy.deepcopy(model)
    m2.config.sliding_window = 1_000_000
    res["no_sliding_window_max_rel_change"] = rel(full_logits(m2, ids))
    if case["text"].get("final_logit_softcapping"):
        m3 = copy.deepcopy(model)
        m3.config.final_logit_softcapping = None
        res["no_final_softcap_max_rel_change"] = rel(full_logits(m3, ids))
    if case["text"]["rope_parameters"][FULL].get("rope_type") == "linear":
        m4 = copy.deepcopy(model)  # linear scaling divides inv_freq by factor; undo it
        factor = case["text"]["rope_parameters"][FULL]["factor"]
        m4.model.rotary_emb.full_attention_inv_freq.mul_(factor)
        res["no_rope_scaling_max_rel_change"] = rel(full_logits(m4, ids))
    if case["text"]["query_pre_attn_scalar"] != TEXT_COMMON["head_dim"]:
        m5 = copy.deepcopy(model)
        for layer in m5.model.layers:
            layer.self_attn.scaling = TEXT_COMMON["head_dim"] ** -0.5
        res["scale_by_head_dim_max_rel_change"] = rel(full_logits(m5, ids))
    return res


# --------------------------------------------------------------------------- main


def make_case(case: dict) -> dict:
    name = case["name"]
    out = OUT_DIR / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)

    torch.manual_seed(case["seed"])
    cfg = build_config(case)
    cls = model_class(case)
    model = cls(cfg)
    model.config._attn_implementation = "eager"
    reinit_(model, case["seed"])
    model = model.to(case["dtype"]).eval()

    gen = np.random.default_rng(case["seed"])
    vocab = TEXT_COMMON["vocab_size"]
    ids = gen.integers(0, case.get("id_high", vocab), size=case["T"]).astype(np.int32)

    logits_mem = full_logits(model, ids)
    model.save_pretrained(out, safe_serialization=True)
    st_path = out / "model.safetensors"
    os.chmod(st_path, 0o644)  # save_pretrained leaves it 0600
    assert st_path.exists() and not list(out.glob("*.index.json")), "expected a single safetensors file"

    # reference from the checkpoint as written
    reloaded = load(case, out)
    logits = full_logits(reloaded, ids)
    sd_mem, sd_new = model.state_dict(), reloaded.state_dict()
    assert sd_mem.keys() == sd_new.keys() and all(torch.equal(sd_mem[k], sd_new[k]) for k in sd_mem)
    if case["dtype"] == torch.float32:
        assert np.array_equal(logits, logits_mem), f"{name}: reloaded logits differ from in-memory model"
    # (bf16: `model.to(bfloat16)` also casts the non-persistent RoPE inv_freq buffers to bf16, whereas
    # from_pretrained(dtype=bfloat16) keeps them float32, so only the reloaded model is the reference.)
    arrays = {"ids": ids, "logits": logits.astype(np.float32)}

    notes = []
    if case["dtype"] == torch.bfloat16:
        m32 = load(case, out, dtype=torch.float32)
        assert m32.model.embed_tokens.weight.dtype == torch.float32
        arrays["logits_fp32"] = full_logits(m32, ids).astype(np.float32)
        notes.append("logits: bf16 forward; logits_fp32: same bf16-rounded weights upcast, float32 forward")

    if case["text"].get("attn_logit_softcapping"):
        cap = case["text"]["attn_logit_softcapping"]
        m_nocap = copy.deepcopy(reloaded)
        m_nocap.config.attn_logit_softcapping = None
        for layer in m_nocap.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        same = np.array_equal(full_logits(m_nocap, ids), logits)
        assert same, "transformers now applies attn_logit_softcapping: update notes/fixture"
        arrays["logits_attn_softcap"] = full_logits(reloaded, ids, softcap=cap).astype(np.float32)
        notes.append(
            f"transformers {transformers.__version__} Gemma3 IGNORES attn_logit_softcapping={cap}: 'logits' has "
            "no attention softcapping (verified: identical with the field set to None). "
            "'logits_attn_softcap' = HF logits with Gemma2-style tanh softcap on the scaled attention "
            "scores (softcap * tanh(s / softcap), applied before the mask)."
        )
    if case.get("multimodal"):
        notes.append(
            "reference = text-only forward (input_ids only, no pixel_values). "
            f"ids drawn from [0, {case['id_high']}) to avoid boi/eoi/image token ids. "
            "Gemma3ForConditionalGeneration never applies final_logit_softcapping (not set here anyway)."
        )

    write_npz(out / "reference.npz", arrays)

    # transformers-4 form config
    t4_result = None
    if case.get("t4_config"):
        cfg_v5 = json.loads((out / "config.json").read_text())
        t4 = to_t4_config(cfg_v5)
        (out / "config_t4.json").write_text(json.dumps(t4, indent=2) + "\n")
        with tempfile.TemporaryDirectory() as td:
            td = Path(td)
            shutil.copy(out / "config_t4.json", td / "config.json")
            os.symlink(st_path, td / "model.safetensors")
            m_t4 = load(case, td)
            same_types = m_t4.config.layer_types == reloaded.config.layer_types
            same_rope = m_t4.config.rope_parameters == reloaded.config.rope_parameters
            lt4 = full_logits(m_t4, ids)
            t4_result = dict(
                accepted=True,
                layer_types_equal=same_types,
                rope_parameters_equal=same_rope,
                rope_parameters_loaded=m_t4.config.rope_parameters,
                logits_max_abs_diff=float(np.abs(lt4 - logits).max()),
            )
            assert same_types and same_rope and np.array_equal(lt4, logits), f"{name}: t4 config mismatch {t4_result}"
        notes.append("config_t4.json: same model in transformers-4 config form; transformers 5 loads it to identical logits")

    sens = ablation(case, reloaded, ids, logits)
    if "logits_attn_softcap" in arrays:
        d = np.abs(arrays["logits_attn_softcap"] - logits).max() / logits.std()
        sens["with_attn_softcap_max_rel_change"] = round(float(d), 3)
    prefixes = weight_prefixes(st_path)
    info = dict(
        case=name,
        description=case["description"],
        hf_class=cls.__name__,
        transformers_version=transformers.__version__,
        torch_version=torch.__version__,
        dtype=str(case["dtype"]).replace("torch.", ""),
        safetensors_dtypes=safetensors_dtypes(st_path),
        T=int(case["T"]),
        vocab_size=vocab,
        sliding_window=case["text"]["sliding_window"],
        layer_types=case["text"]["layer_types"],
        npz_keys={k: [str(v.dtype), list(v.shape)] for k, v in arrays.items()},
        logits_std=round(float(logits.std()), 4),
        logits_min_top1_gap=round(top1_gap(logits), 4),
        bf16_vs_fp32_max_abs_diff=(
            round(float(np.abs(arrays["logits"] - arrays["logits_fp32"]).max()), 4) if "logits_fp32" in arrays else None
        ),
        bf16_vs_fp32_top1_agreement=(
            round(float((arrays["logits"].argmax(-1) == arrays["logits_fp32"].argmax(-1)).mean()), 4)
            if "logits_fp32" in arrays
            else None
        ),
        ablation_max_rel_change=sens,
        weight_prefixes=prefixes,
        t4_check=t4_result,
        init=dict(
            embed_std=EMBED_STD,
            linear_std=LINEAR_STD,
            rmsnorm_std=NORM_STD,
            final_norm_mean=FINAL_NORM_MEAN,
            other_std=OTHER_STD,
            seed=case["seed"],
        ),
        notes=notes,
        safetensors_bytes=st_path.stat().st_size,
    )
    (out / "fixture_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def write_index(infos: list[dict]) -> None:
    lines = [
        "# Gemma3 reference fixtures",
        "",
        "Generated by `scripts/make_fixtures.py` (do not edit by hand; rerun the script).",
        f"transformers {transformers.__version__}, torch {torch.__version__}, eager attention, CPU.",
        "",
        "Each case directory holds `config.json` / `model.safetensors` / `generation_config.json` as written by",
        "`save_pretrained`, `reference.npz` (`ids` int32 [T], `logits` float32 [T, V] from one full",
        "forward pass without cache; bf16 cases add `logits_fp32`), and `fixture_info.json`",
        "(statistics, weight-name prefixes, notes).  `config_t4.json` is the transformers-4 form of `config.json`.",
        "",
        "| case | class | dtype | heads q/kv | window | T | logit std | min top-1 gap | extra npz keys |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for info, case in zip(infos, CASES):
        extra = ", ".join(k for k in info["npz_keys"] if k not in ("ids", "logits")) or "-"
        heads = f"{case['text']['num_attention_heads']}/{case['text']['num_key_value_heads']}"
        lines.append(
            f"| {info['case']} | {info['hf_class']} | {info['dtype']} | {heads} | {info['sliding_window']} | "
            f"{info['T']} | {info['logits_std']} | {info['logits_min_top1_gap']} | {extra} |"
        )
    lines += ["", "Notes:", ""]
    for info in infos:
        for note in info["notes"]:
            lines.append(f"- `{info['case']}`: {note}")
    lines.append(
        "- HF's sliding window: query i attends keys j with i - window < j <= i (window keys incl. itself)."
    )
    (OUT_DIR / "README.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    infos = []
    for case in CASES:
        info = make_case(case)
        infos.append(info)
        print(
            f"{info['case']:16s} {info['dtype']:9s} T={info['T']:3d} V={info['vocab_size']} "
            f"logit std={info['logits_std']:.3f} min top1 gap={info['logits_min_top1_gap']:.4f} "
            f"size={info['safetensors_bytes'] / 1e6:.2f} MB"
        )
        if info["bf16_vs_fp32_max_abs_diff"] is not None:
            print(
                f"    bf16 vs fp32: max|d|={info['bf16_vs_fp32_max_abs_diff']} "
                f"top1 agreement={info['bf16_vs_fp32_top1_agreement']}"
            )
        if info["ablation_max_rel_change"]:
            print(f"    ablations (max|d|/std): {info['ablation_max_rel_change']}")
        if info["t4_check"]:
            print(f"    t4 config: {info['t4_check']}")
        print(f"    weight prefixes: {info['weight_prefixes']}")
    write_index(infos)
    return 0


if __name__ == "__main__":
    sys.exit(main())
