#!/usr/bin/env python
"""Generate tiny random gpt-oss reference fixtures with Hugging Face transformers.

Run from the repository root:

    /work/venv/bin/python scripts/fixtures_gpt_oss.py

For every case it writes ``tests/fixtures/gpt_oss/<case>/``:

* ``config.json``, ``model.safetensors`` (single file, 0644),
  ``generation_config.json`` exactly as ``save_pretrained`` writes them (the
  unquantized expert layout: ``mlp.experts.gate_up_proj`` [E, hidden, 2I] with
  gate/up interleaved, ``gate_up_proj_bias``, ``down_proj`` [E, I, hidden],
  ``down_proj_bias``; ``mlp.router.weight``/``bias``; ``self_attn.sinks``);
* ``reference.npz``: ``ids`` int32 [T], ``logits`` float32 [T, V] from ONE
  full forward pass (no cache) of the model reloaded from disk with eager
  attention and the eager (per-expert loop) experts implementation, in the
  checkpoint's dtype; it is checked against transformers' default
  ``grouped_mm`` experts too. bf16 cases add ``logits_fp32``: the same
  bf16-rounded weights upcast, float32 forward (the exact answer);
* ``config_t4.json`` (cases with ``t4``): the same config in the
  transformers-4 form (``rope_theta`` + ``rope_scaling``, ``torch_dtype``, no
  ``swiglu_alpha`` (4.x hard-codes 1.702), ``experts_per_token`` as openai's
  configs carry, no ``layer_types``), checked to load to identical logits;
* ``fixture_info.json``: statistics, the smallest router margin (k-th minus
  (k+1)-th router logit: how far every routing decision is from a tie),
  ablations (how much each feature moves the logits), weight-name prefixes.

Re-initialisation: every parameter random (seeded, in name order), sinks
~ N(0.5, 1) so they take a real share of the softmax, norms ~ N(1, 0.3), the
SwiGLU clamp set low enough that it actually clips.

Deterministic (fixed seeds, single-threaded torch, fixed zip timestamps) and
idempotent: each case directory is deleted and rewritten.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import GptOssConfig, GptOssForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_fixtures import full_logits, safetensors_dtypes, top1_gap, weight_prefixes, write_npz  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "tests" / "fixtures" / "gpt_oss"

EMBED_STD = 0.2
LINEAR_STD = 0.25
# Smaller q/k and expert weights: at 0.25 the un-normalised q/k give very peaked
# attention and the experts large activations, so transformers' own fp32 run is
# ~7e-6 of the logit scale from a float64 run (bf16: 15%); at these, ~7e-7 (bf16: 1.5%).
QK_STD = 0.12
EXPERT_STD = 0.15
NORM_MEAN, NORM_STD = 1.0, 0.3
BIAS_STD = 0.1
SINK_MEAN, SINK_STD = 0.5, 1.0

SLIDING, FULL = "sliding_attention", "full_attention"

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
    tie_word_embeddings=False,
)

CASES = [
    dict(
        name="gqa_fp32",
        description=(
            "8 q / 2 kv heads, 4 experts top-2 (I=64), window 8 on alternate layers (s,f,s,f), "
            "yarn x4 (truncate false, original 64, theta 50000), swiglu limit 2 (clips), float32, T=48."
        ),
        seed=2001,
        T=48,
        t4=True,
        config=dict(
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            intermediate_size=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            layer_types=[SLIDING, FULL, SLIDING, FULL],
            swiglu_limit=2.0,
            max_position_embeddings=256,  # = factor x original: no transformers warning
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 50_000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    dict(
        name="mha_fp32",
        description=(
            "4 q / 4 kv heads, 6 experts top-3 (I=32), window 16, layer_types s,s,f,s (not the "
            "alternating default), yarn x8 (truncate default true, original 32), swiglu alpha 1.3 / "
            "limit 3, max_position_embeddings 512 != factor x original (the explicit factor wins), float32, T=80."
        ),
        seed=2002,
        T=80,
        config=dict(
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=32,
            num_local_experts=6,
            num_experts_per_tok=3,
            sliding_window=16,
            layer_types=[SLIDING, SLIDING, FULL, SLIDING],
            swiglu_alpha=1.3,
            swiglu_limit=3.0,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 20_000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    dict(
        name="gqa_bf16",
        description=(
            "8 q / 2 kv heads, bfloat16 weights and forward; 2 experts top-2 (every token uses both, so "
            "bf16 rounding cannot flip a routing choice), window 16, layer_types default (s,f,s,f), "
            "yarn x4 (original 64, truncate false), T=64."
        ),
        seed=2003,
        T=64,
        dtype=torch.bfloat16,
        config=dict(
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            intermediate_size=64,
            num_local_experts=2,
            num_experts_per_tok=2,
            sliding_window=16,
            swiglu_limit=2.5,
            max_position_embeddings=256,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150_000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
]


def reinit_(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if "embed_tokens" in name:
                new = torch.randn(p.shape, generator=gen) * EMBED_STD
            elif name.endswith("norm.weight"):
                new = NORM_MEAN + torch.randn(p.shape, generator=gen) * NORM_STD
            elif name.endswith("sinks"):
                new = SINK_MEAN + torch.randn(p.shape, generator=gen) * SINK_STD
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                new = torch.randn(p.shape, generator=gen) * QK_STD
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                new = torch.randn(p.shape, generator=gen) * EXPERT_STD
            elif name.endswith("bias"):  # .bias and experts' *_proj_bias
                new = torch.randn(p.shape, generator=gen) * BIAS_STD
            else:
                new = torch.randn(p.shape, generator=gen) * LINEAR_STD
            p.copy_(new.to(p.dtype))


def load(directory: Path, experts="eager", dtype=torch.float32):
    return GptOssForCausalLM.from_pretrained(
        directory, attn_implementation="eager", experts_implementation=experts, dtype=dtype
    ).eval()


@torch.no_grad()
def router_margin(model, ids: np.ndarray) -> float | None:
    """Smallest (k-th - (k+1)-th) router logit over every token and layer
    (None when every token uses every expert)."""
    k, margins = model.config.num_experts_per_tok, []

    def hook(_m, _inp, out):
        logits = out[0].float()
        top = torch.topk(logits, min(k + 1, logits.shape[-1]), dim=-1).values
        if top.shape[-1] > k:
            margins.append(float((top[:, k - 1] - top[:, k]).min()))

    hs = [layer.mlp.router.register_forward_hook(hook) for layer in model.model.layers]
    full_logits(model, ids)
    for h in hs:
        h.remove()
    return min(margins) if margins else None


@torch.no_grad()
def ablation(model, ids: np.ndarray, ref: np.ndarray) -> dict:
    """Relative logit change (max |diff| / std) when one feature is removed."""
    std = float(ref.std())
    res = {}

    def rel(m):
        return round(float(np.abs(full_logits(m, ids) - ref).max() / std), 3)

    m = copy.deepcopy(model)
    for layer in m.model.layers:
        layer.self_attn.sinks.fill_(-1e4)
    res["no_sinks"] = rel(m)
    m = copy.deepcopy(model)
    m.config.sliding_window = 1_000_000
    res["no_sliding_window"] = rel(m)
    m = copy.deepcopy(model)
    for layer in m.model.layers:
        layer.mlp.experts.limit = 1e9
    res["no_swiglu_clamp"] = rel(m)
    m = copy.deepcopy(model)
    m.model.rotary_emb.attention_scaling = 1.0
    res["no_yarn_attention_scaling"] = rel(m)
    m = copy.deepcopy(model)  # a loader that read gate/up as the two halves
    for layer in m.model.layers:
        ex = layer.mlp.experts
        half = ex.gate_up_proj.shape[-1] // 2
        for p in (ex.gate_up_proj, ex.gate_up_proj_bias):
            p.copy_(torch.stack([p[..., :half], p[..., half:]], dim=-1).reshape(p.shape))
    res["gate_up_as_halves"] = rel(m)
    m = copy.deepcopy(model)  # route by top-k of the softmax over all experts (same set, other weights)
    for layer in m.model.layers:
        r = layer.mlp.router

        def fwd(h, r=r):
            logits = torch.nn.functional.linear(h, r.weight, r.bias)
            probs = torch.softmax(logits, dim=-1)
            vals, idx = torch.topk(probs, r.top_k, dim=-1)
            return logits, vals, idx

        r.forward = fwd
    res["softmax_before_topk_unnormalised"] = rel(m)
    return res


def to_t4_config(cfg_v5: dict) -> dict:
    """The transformers-4 (openai 4.55) form of a transformers-5 gpt_oss config.json."""
    d = copy.deepcopy(cfg_v5)
    rp = d.pop("rope_parameters")
    d["rope_theta"] = rp.pop("rope_theta")
    d["rope_scaling"] = rp
    alpha = d.pop("swiglu_alpha")
    assert alpha == 1.702, "transformers 4 hard-codes swiglu alpha 1.702"
    d.pop("layer_types")  # derived: alternating sliding / full
    d["experts_per_token"] = d["num_experts_per_tok"]
    d["initial_context_length"] = rp["original_max_position_embeddings"]
    d["torch_dtype"] = d.pop("dtype")
    d["transformers_version"] = "4.55.0"
    return dict(sorted(d.items()))


def make_case(case: dict) -> dict:
    name = case["name"]
    out = OUT_DIR / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)

    torch.manual_seed(case["seed"])
    cfg = GptOssConfig(**{**COMMON, **copy.deepcopy(case["config"])})
    model = GptOssForCausalLM(cfg)
    reinit_(model, case["seed"])
    dtype = case.get("dtype", torch.float32)
    model = model.to(dtype).eval()

    ids = np.random.default_rng(case["seed"]).integers(0, COMMON["vocab_size"], size=case["T"]).astype(np.int32)
    model.save_pretrained(out)
    st_path = out / "model.safetensors"
    os.chmod(st_path, 0o644)  # save_pretrained leaves it 0600
    assert st_path.exists() and not list(out.glob("*.index.json")), "expected a single safetensors file"

    # The reference is the model as reloaded from disk (for bf16, from_pretrained
    # keeps the norms in fp32 and RoPE buffers in fp32, unlike model.to(bf16)).
    reloaded = load(out, dtype=dtype)
    sd_mem, sd_new = model.state_dict(), reloaded.state_dict()
    assert sd_mem.keys() == sd_new.keys() and all(torch.equal(sd_mem[k].float(), sd_new[k].float()) for k in sd_mem)
    logits = full_logits(reloaded, ids)
    arrays = {"ids": ids, "logits": logits.astype(np.float32)}
    exact = reloaded
    if dtype == torch.bfloat16:
        exact = load(out, dtype=torch.float32)
        arrays["logits_fp32"] = full_logits(exact, ids).astype(np.float32)
    grouped = full_logits(load(out, experts="grouped_mm"), ids)
    ref32 = arrays.get("logits_fp32", logits)
    grouped_rel = float(np.abs(grouped - ref32).max() / np.abs(ref32).max())
    assert grouped_rel < 1e-5, f"{name}: eager vs grouped_mm experts differ by {grouped_rel}"
    write_npz(out / "reference.npz", arrays)

    notes = [
        "reference: eager attention, eager experts (per-expert loop); transformers' default grouped_mm "
        f"experts agree to {grouped_rel:.1e} of the logit scale (float32)",
    ]
    if dtype == torch.bfloat16:
        notes.append("logits: bf16 forward; logits_fp32: same bf16-rounded weights upcast, float32 forward")
    t4_result = None
    if case.get("t4"):
        t4 = to_t4_config(json.loads((out / "config.json").read_text()))
        (out / "config_t4.json").write_text(json.dumps(t4, indent=2) + "\n")
        with tempfile.TemporaryDirectory() as td:
            td = Path(td)
            shutil.copy(out / "config_t4.json", td / "config.json")
            os.symlink(st_path, td / "model.safetensors")
            m4 = load(td)
            same_types = m4.config.layer_types == reloaded.config.layer_types
            same_rope = m4.config.rope_parameters == reloaded.config.rope_parameters
            l4 = full_logits(m4, ids)
            t4_result = dict(
                layer_types_equal=same_types,
                rope_parameters_equal=same_rope,
                rope_parameters_loaded=m4.config.rope_parameters,
                logits_max_abs_diff=float(np.abs(l4 - logits).max()),
            )
            assert same_types and same_rope and np.array_equal(l4, logits), f"{name}: t4 mismatch {t4_result}"
        notes.append("config_t4.json: transformers-4 form; transformers 5 loads it to identical logits")

    margin = router_margin(exact, ids)
    info = dict(
        case=name,
        description=case["description"],
        hf_class="GptOssForCausalLM",
        transformers_version=transformers.__version__,
        torch_version=torch.__version__,
        dtype=str(dtype).replace("torch.", ""),
        safetensors_dtypes=safetensors_dtypes(st_path),
        T=int(case["T"]),
        vocab_size=COMMON["vocab_size"],
        sliding_window=case["config"]["sliding_window"],
        layer_types=reloaded.config.layer_types,
        rope_parameters=reloaded.config.rope_parameters,
        rope_attention_scaling=float(reloaded.model.rotary_emb.attention_scaling),
        logits_std=round(float(logits.std()), 4),
        logits_min_top1_gap=round(top1_gap(logits), 4),
        bf16_vs_fp32_max_abs_diff=(
            round(float(np.abs(arrays["logits"] - arrays["logits_fp32"]).max()), 4) if "logits_fp32" in arrays else None
        ),
        router_min_margin=None if margin is None else round(margin, 5),
        ablation_max_rel_change=ablation(exact, ids, ref32),
        weight_prefixes=weight_prefixes(st_path),
        t4_check=t4_result,
        init=dict(
            embed_std=EMBED_STD,
            linear_std=LINEAR_STD,
            qk_std=QK_STD,
            expert_std=EXPERT_STD,
            norm_mean=NORM_MEAN,
            norm_std=NORM_STD,
            bias_std=BIAS_STD,
            sink_mean=SINK_MEAN,
            sink_std=SINK_STD,
            seed=case["seed"],
        ),
        notes=notes,
        safetensors_bytes=st_path.stat().st_size,
    )
    (out / "fixture_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def write_index(infos: list[dict]) -> None:
    lines = [
        "# gpt_oss reference fixtures",
        "",
        "Generated by `scripts/fixtures_gpt_oss.py` (do not edit by hand; rerun the script).",
        f"transformers {transformers.__version__}, torch {torch.__version__}, eager attention, eager experts, CPU.",
        "",
        "Each case: `config.json` / `model.safetensors` / `generation_config.json` as `save_pretrained` wrote",
        "them (unquantized expert layout), `reference.npz` (`ids` int32 [T], `logits` float32 [T, V], one full",
        "forward pass without cache; bf16 cases add `logits_fp32`), `fixture_info.json` (statistics, router",
        "margin, ablations, notes); `config_t4.json` is the transformers-4 form.",
        "",
        "| case | description | T | logit std | min top-1 gap | min router margin |",
        "|---|---|---|---|---|---|",
    ]
    for i in infos:
        lines.append(
            f"| {i['case']} | {i['description']} | {i['T']} | {i['logits_std']} | {i['logits_min_top1_gap']} "
            f"| {i['router_min_margin'] if i['router_min_margin'] is not None else '- (top-k = all experts)'} |"
        )
    lines += ["", "Notes:", ""]
    lines += [f"- `{i['case']}`: {n}" for i in infos for n in i["notes"]]
    (OUT_DIR / "README.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    infos = [make_case(c) for c in CASES]
    write_index(infos)
    for i in infos:
        print(
            f"{i['case']}: {i['safetensors_bytes']} bytes, logit std {i['logits_std']}, "
            f"router margin {i['router_min_margin']}, ablations {i['ablation_max_rel_change']}"
        )


if __name__ == "__main__":
    main()
