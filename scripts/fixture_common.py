"""Shared steps of the per-family fixture scripts (scripts/fixtures_<family>.py).

A family script lists its CASES and calls `make_family(...)`; for every case
this builds a tiny random transformers model (eager attention, torch CPU),
re-initialises every parameter so the logits have a spread of several units,
saves it with save_pretrained into tests/fixtures/<family>/<case>/, reloads it
from disk and records

* ``reference.npz``: ``ids`` int32 [T], ``logits`` float32 [T, V] from ONE
  full forward pass (no cache) of the reloaded model;
* ``fixture_info.json``: shapes, logit statistics, weight-name prefixes,
  ablations (how much each feature moves the logits: proof it is exercised)
  and notes;
* ``config_t4.json`` when the case asks for it: the same config in the
  transformers-4 form, with the result of loading it into transformers 5.

Deterministic: fixed seeds, single-threaded torch, zip entries with fixed
timestamps; each case directory is deleted and rewritten.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_fixtures import full_logits, safetensors_dtypes, top1_gap, weight_prefixes, write_npz  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
SLIDING = "sliding_attention"
FULL = "full_attention"

SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, max_position_embeddings=512)


def pattern_layer_types(n_layers: int, pattern: int) -> list[str]:
    """transformers' legacy derivation: every `pattern`-th layer is full."""
    return [SLIDING if (i + 1) % pattern else FULL for i in range(n_layers)]


def reinit_(model: torch.nn.Module, seed: int, init: dict) -> None:
    """Re-initialise every parameter: embeddings N(0, embed_std), matrices
    N(0, linear_std), 1-D norm weights N(norm_center, norm_std) (norm_center 0
    for Gemma's 1 + w, 1 otherwise; the final norm gets +final_norm_shift),
    biases N(0, other_std)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            leaf = name.rsplit(".", 1)[0]
            if "embed_tokens" in name:
                new = torch.randn(p.shape, generator=gen) * init["embed_std"]
            elif "norm" in leaf and name.endswith(".weight") and p.ndim == 1:
                new = init["norm_center"] + torch.randn(p.shape, generator=gen) * init["norm_std"]
                if name == "model.norm.weight":
                    new += init.get("final_norm_shift", 0.0)
            elif p.ndim >= 2:
                new = torch.randn(p.shape, generator=gen) * init["linear_std"]
            else:
                new = torch.randn(p.shape, generator=gen) * init["other_std"]
            p.copy_(new.to(p.dtype))


def load(cls, directory: Path, dtype=torch.float32):
    return cls.from_pretrained(directory, attn_implementation="eager", dtype=dtype).eval()


def rel_change(other: np.ndarray, ref: np.ndarray) -> float:
    return round(float(np.abs(other - ref).max() / ref.std()), 3)


def make_case(family: str, case: dict, cls, config_cls, init: dict, common: dict) -> dict:
    name = case["name"]
    out = FIXTURES / family / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)

    torch.manual_seed(case["seed"])
    cfg = config_cls(**{**SIZES, **common, **copy.deepcopy(case["config"])})
    cfg._attn_implementation = "eager"
    model = cls(cfg)
    model.config._attn_implementation = "eager"
    reinit_(model, case["seed"], {**init, **case.get("init", {})})
    model = model.to(torch.float32).eval()

    gen = np.random.default_rng(case["seed"])
    ids = gen.integers(0, SIZES["vocab_size"], size=case["T"]).astype(np.int32)

    logits_mem = full_logits(model, ids)
    model.save_pretrained(out, safe_serialization=True)
    st_path = out / "model.safetensors"
    os.chmod(st_path, 0o644)  # save_pretrained leaves it 0600
    assert st_path.exists() and not list(out.glob("*.index.json")), "expected a single safetensors file"

    reloaded = load(cls, out)
    logits = full_logits(reloaded, ids)
    sd_mem, sd_new = model.state_dict(), reloaded.state_dict()
    assert sd_mem.keys() == sd_new.keys() and all(torch.equal(sd_mem[k], sd_new[k]) for k in sd_mem)
    assert np.array_equal(logits, logits_mem), f"{name}: reloaded logits differ from in-memory model"
    write_npz(out / "reference.npz", {"ids": ids, "logits": logits.astype(np.float32)})
    notes = list(case.get("notes", []))

    t4_result = None
    if case.get("t4") is not None:
        cfg_v5 = json.loads((out / "config.json").read_text())
        t4, hf_t4 = case["t4"](cfg_v5)
        (out / "config_t4.json").write_text(json.dumps(dict(sorted(t4.items())), indent=2) + "\n")
        # What transformers 5 makes of it (hf_t4 may differ from t4 where
        # transformers 5 cannot read the t4 form as written: see the notes).
        with tempfile.TemporaryDirectory() as td:
            td = Path(td)
            (td / "config.json").write_text(json.dumps(hf_t4))
            os.symlink(st_path, td / "model.safetensors")
            try:
                lt4 = full_logits(load(cls, td), ids)
                t4_result = dict(hf_loads=True, hf_logits_rel_change=rel_change(lt4, logits))
            except Exception as e:  # recorded, not fatal: the script's notes explain it
                t4_result = dict(hf_loads=False, hf_error=f"{type(e).__name__}: {e}")
        t4_result["hf_config_differs_from_t4"] = hf_t4 != t4
        if case.get("t4_hf_exact", True):
            assert t4_result.get("hf_logits_rel_change") == 0.0, f"{name}: t4 config mismatch {t4_result}"
            notes.append(
                "config_t4.json: the same model in transformers-4 config form "
                "(transformers 5 loads it to identical logits)"
            )

    sens = {}
    if SLIDING in cfg.layer_types:
        m = copy.deepcopy(reloaded)
        m.config.sliding_window = 1_000_000
        sens["no_sliding_window"] = rel_change(full_logits(m, ids), logits)
    for label, fn in case.get("ablations", {}).items():
        m = copy.deepcopy(reloaded)
        fn(m)
        sens[label] = rel_change(full_logits(m, ids), logits)

    info = dict(
        case=name,
        description=case["description"],
        hf_class=cls.__name__,
        transformers_version=transformers.__version__,
        torch_version=torch.__version__,
        dtype="float32",
        safetensors_dtypes=safetensors_dtypes(st_path),
        T=int(case["T"]),
        vocab_size=SIZES["vocab_size"],
        sliding_window=cfg.sliding_window,
        layer_types=list(cfg.layer_types),
        logits_std=round(float(logits.std()), 4),
        logits_min_top1_gap=round(top1_gap(logits), 4),
        ablation_max_rel_change=sens,
        weight_prefixes=weight_prefixes(st_path),
        t4_check=t4_result,
        init={**init, **case.get("init", {}), "seed": case["seed"]},
        notes=notes,
        safetensors_bytes=st_path.stat().st_size,
    )
    (out / "fixture_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def make_family(family: str, cases: list, cls, config_cls, init: dict, common: dict, script: str) -> int:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    infos = []
    for case in cases:
        info = make_case(family, case, cls, config_cls, init, common)
        infos.append(info)
        print(
            f"{family}/{info['case']:14s} T={info['T']:3d} logit std={info['logits_std']:.3f} "
            f"min top1 gap={info['logits_min_top1_gap']:.4f} size={info['safetensors_bytes'] / 1e6:.2f} MB"
        )
        print(f"    layer types: {info['layer_types']}")
        print(f"    ablations (max|d|/std): {info['ablation_max_rel_change']}")
        if info["t4_check"]:
            print(f"    t4 config: {info['t4_check']}")
    lines = [
        f"# {family} reference fixtures",
        "",
        f"Generated by `{script}` (do not edit by hand; rerun the script).",
        f"transformers {transformers.__version__}, torch {torch.__version__}, eager attention, CPU, float32.",
        "",
        "Each case: `config.json` / `model.safetensors` / `generation_config.json` as `save_pretrained` wrote",
        "them, `reference.npz` (`ids` int32 [T], `logits` float32 [T, V], one full forward pass without cache),",
        "`fixture_info.json` (statistics, ablations, notes); `config_t4.json` is the transformers-4 form.",
        "",
        "| case | description | T | logit std | min top-1 gap |",
        "|---|---|---|---|---|",
    ]
    for info in infos:
        lines.append(
            f"| {info['case']} | {info['description']} | {info['T']} | {info['logits_std']} | "
            f"{info['logits_min_top1_gap']} |"
        )
    lines += ["", "Notes:", ""]
    for info in infos:
        for note in info["notes"]:
            lines.append(f"- `{info['case']}`: {note}")
    (FIXTURES / family / "README.md").write_text("\n".join(lines) + "\n")
    return 0
