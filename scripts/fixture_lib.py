"""Shared recipe for the per-family fixture scripts (scripts/fixtures_<family>.py)
of the llama-style families: build a tiny random transformers model, re-initialise
it so the logits spread over several units, save it, reload it from disk and
record ONE eager full-sequence forward pass as the reference.

Each case directory tests/fixtures/<family>/<case>/ gets:

* ``config.json``, ``model.safetensors`` (single file, 0644), ``generation_config.json``
  as ``save_pretrained`` writes them (``edit_config`` may then drop keys, e.g. an
  optional ``head_dim``; the reload proves transformers reads it to the same model);
* ``reference.npz``: ``ids`` int32 [T], ``logits`` float32 [T, V];
* ``config_t4.json`` (when the case has ``t4``): the same config in the
  transformers-4 form, checked to load to identical logits;
* ``fixture_info.json``: shapes, statistics, ablations (how much each feature
  moves the logits, so a loader that drops it fails), weight-name prefixes.

Deterministic: fixed seeds, single-threaded torch, fixed zip timestamps.

Why not scripts/fixture_common.py (the gemma2/cohere2/olmo3/exaone4 helper,
written at the same time): these families need post-save config.json edits
(an absent head_dim or layer_types, an unused window), the Auto class as the
loader (a mistral config.json with layer_types loads as ministral), configs
without layer_types (llama, mistral, ministral3), and a smaller projection std
(0.15, with a 0.3 output head): at 0.25 the pre-norm residual stream grows so
fast that transformers' own fp32 run is ~1e-5 of the logit scale from float64.
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
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_fixtures import full_logits, safetensors_dtypes, top1_gap, weight_prefixes, write_npz  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"

EMBED_STD = 0.2
LINEAR_STD = 0.15  # projections: larger makes the pre-norm residual stream grow and fp32 noisier
HEAD_STD = 0.3  # untied output head: logits spread over several units
NORM_MEAN, NORM_STD = 1.0, 0.3  # llama-style RMSNorm scales by w (not 1 + w)
BIAS_STD = 0.1
MIN_ABLATION = 0.05  # every exercised feature must move the logits by >= 5% of their std

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)


def reinit_(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random, in a fixed order, so the model has informative logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if "embed_tokens" in name:
                new = torch.randn(p.shape, generator=gen) * EMBED_STD
            elif name.endswith("norm.weight"):
                new = NORM_MEAN + torch.randn(p.shape, generator=gen) * NORM_STD
            elif name.startswith("lm_head."):
                new = torch.randn(p.shape, generator=gen) * HEAD_STD
            elif name.endswith(".bias"):
                new = torch.randn(p.shape, generator=gen) * BIAS_STD
            else:
                new = torch.randn(p.shape, generator=gen) * LINEAR_STD
            p.copy_(new.to(p.dtype))


def load(directory: Path):
    # The Auto class, as users load checkpoints (it can pick another class than
    # the config's own: a mistral config.json with layer_types loads as ministral).
    return AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager", dtype=torch.float32).eval()


def make_case(family: str, config_cls, model_cls, case: dict) -> dict:
    """case: name, description, seed, T, config (kwargs over COMMON), and optional
    edit_config(dict) -> dict (with edit_changes_model=True when the edited file
    is meant to load as a different model), t4(dict) -> dict, ablations
    {name: fn(model) -> None}, notes."""
    name = case["name"]
    out = FIXTURES / family / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)

    torch.manual_seed(case["seed"])
    cfg = config_cls(**{**COMMON, **copy.deepcopy(case["config"])})
    cfg._attn_implementation = "eager"
    model = model_cls(cfg)
    reinit_(model, case["seed"])
    model = model.to(torch.float32).eval()

    ids = np.random.default_rng(case["seed"]).integers(0, COMMON["vocab_size"], size=case["T"]).astype(np.int32)
    logits_mem = full_logits(model, ids)
    model.save_pretrained(out, safe_serialization=True)
    st_path = out / "model.safetensors"
    os.chmod(st_path, 0o644)  # save_pretrained leaves it 0600
    assert st_path.exists() and not list(out.glob("*.index.json")), "expected a single safetensors file"
    if case.get("edit_config"):
        cfg_path = out / "config.json"
        edited = case["edit_config"](json.loads(cfg_path.read_text()))
        cfg_path.write_text(json.dumps(edited, indent=2, sort_keys=True) + "\n")

    # The reference comes from the checkpoint as written (and, if edited, as edited).
    reloaded = load(out)
    logits = full_logits(reloaded, ids)
    sd_mem, sd_new = model.state_dict(), reloaded.state_dict()
    assert sd_mem.keys() == sd_new.keys() and all(torch.equal(sd_mem[k], sd_new[k]) for k in sd_mem)
    same = np.array_equal(logits, logits_mem)
    assert same != bool(case.get("edit_changes_model")), f"{name}: reloaded vs in-memory logits equal={same}"
    write_npz(out / "reference.npz", {"ids": ids, "logits": logits.astype(np.float32)})

    notes = list(case.get("notes", []))
    t4_result = None
    if case.get("t4"):
        t4 = case["t4"](json.loads((out / "config.json").read_text()))
        (out / "config_t4.json").write_text(json.dumps(t4, indent=2, sort_keys=True) + "\n")
        with tempfile.TemporaryDirectory() as td:
            td = Path(td)
            shutil.copy(out / "config_t4.json", td / "config.json")
            os.symlink(st_path, td / "model.safetensors")
            m_t4 = load(td)
            lt4 = full_logits(m_t4, ids)
            t4_result = dict(
                rope_parameters_loaded=m_t4.config.rope_parameters,
                layer_types_loaded=getattr(m_t4.config, "layer_types", None),
                logits_max_abs_diff=float(np.abs(lt4 - logits).max()),
            )
            assert np.array_equal(lt4, logits), f"{name}: t4 config gives different logits {t4_result}"
        notes.append("config_t4.json: the same model in transformers-4 config form; loads to identical logits")

    std = float(logits.std())
    ablations = {}
    for what, mutate in case.get("ablations", {}).items():
        m = copy.deepcopy(reloaded)
        with torch.no_grad():
            mutate(m)
        change = float(np.abs(full_logits(m, ids) - logits).max() / std)
        ablations[what] = round(change, 3)
        assert change >= MIN_ABLATION, f"{name}: ablation {what!r} barely matters ({change:.4f})"

    info = dict(
        case=name,
        description=case["description"],
        hf_class=type(reloaded).__name__,
        transformers_version=transformers.__version__,
        torch_version=torch.__version__,
        dtype="float32",
        safetensors_dtypes=safetensors_dtypes(st_path),
        T=int(case["T"]),
        vocab_size=COMMON["vocab_size"],
        sliding_window=getattr(reloaded.config, "sliding_window", None),
        layer_types=getattr(reloaded.config, "layer_types", None),
        npz_keys={"ids": ["int32", [len(ids)]], "logits": ["float32", list(logits.shape)]},
        logits_std=round(std, 4),
        logits_min_top1_gap=round(top1_gap(logits), 4),
        ablation_max_rel_change=ablations,
        weight_prefixes=weight_prefixes(st_path),
        t4_check=t4_result,
        init=dict(
            embed_std=EMBED_STD,
            linear_std=LINEAR_STD,
            head_std=HEAD_STD,
            norm_mean=NORM_MEAN,
            norm_std=NORM_STD,
            bias_std=BIAS_STD,
            seed=case["seed"],
        ),
        notes=notes,
        safetensors_bytes=st_path.stat().st_size,
    )
    (out / "fixture_info.json").write_text(json.dumps(info, indent=2, default=str) + "\n")
    return info


def write_readme(family: str, script: str, infos: list[dict], extra_notes=()) -> None:
    lines = [
        f"# {family} reference fixtures",
        "",
        f"Generated by `scripts/{script}` (do not edit by hand; rerun the script).",
        f"transformers {transformers.__version__}, torch {torch.__version__}, eager attention, CPU, float32.",
        "",
        "Each case directory holds the checkpoint as `save_pretrained` wrote it, `reference.npz` (`ids` int32 [T],",
        "`logits` float32 [T, V] from one full forward pass without cache) and `fixture_info.json`",
        "(statistics, ablations, weight-name prefixes). `config_t4.json` is the transformers-4 form of `config.json`.",
        "",
        "| case | description | T | logit std | min top-1 gap | ablations (max abs change / std) |",
        "|---|---|---|---|---|---|",
    ]
    for info in infos:
        abl = ", ".join(f"{k} {v}" for k, v in info["ablation_max_rel_change"].items()) or "-"
        lines.append(
            f"| {info['case']} | {info['description']} | {info['T']} | {info['logits_std']} | "
            f"{info['logits_min_top1_gap']} | {abl} |"
        )
    lines += ["", "Notes:", ""]
    for info in infos:
        lines += [f"- `{info['case']}`: {note}" for note in info["notes"]]
    lines += [f"- {note}" for note in extra_notes]
    (FIXTURES / family / "README.md").write_text("\n".join(lines) + "\n")


def run(family: str, script: str, config_cls, model_cls, cases: list[dict], extra_notes=()) -> int:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    infos = []
    for case in cases:
        info = make_case(family, config_cls, model_cls, case)
        infos.append(info)
        print(
            f"{family}/{info['case']}: T={info['T']} logit std={info['logits_std']:.3f} "
            f"min top1 gap={info['logits_min_top1_gap']:.4f} size={info['safetensors_bytes'] / 1e6:.2f} MB"
        )
        print(f"    ablations: {info['ablation_max_rel_change']}")
    write_readme(family, script, infos, extra_notes)
    return 0


def no_window(m) -> None:
    """Ablation: sliding layers see the whole causal prefix (masks read config.sliding_window)."""
    m.config.sliding_window = 1_000_000


def zero_biases(m) -> None:
    for name, p in m.named_parameters():
        if name.endswith(".bias"):
            p.zero_()


def default_rope(m) -> None:
    """Ablation: plain RoPE (same theta) instead of the scaled one."""
    rot = m.model.rotary_emb
    theta = m.config.rope_parameters["rope_theta"]
    dim = m.config.head_dim
    rot.inv_freq.copy_(1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)))
    rot.attention_scaling = 1.0


def t4_config(cfg_v5: dict, legacy_type_key: bool = False, drop=(), version: str = "4.46.0") -> dict:
    """A transformers-5 config.json with one RoPE, in the transformers-4 form:
    top-level rope_theta, rope_scaling (None for default RoPE; the legacy "type"
    key when asked), torch_dtype; `drop` removes keys 4.x did not write."""
    d = copy.deepcopy(cfg_v5)
    rp = dict(d.pop("rope_parameters"))
    d["rope_theta"] = rp.pop("rope_theta")
    rope_type = rp.pop("rope_type", "default")
    if rope_type == "default":
        d["rope_scaling"] = None
    else:
        d["rope_scaling"] = {("type" if legacy_type_key else "rope_type"): rope_type, **rp}
    d["torch_dtype"] = d.pop("dtype")
    for key in drop:
        d.pop(key, None)
    d["transformers_version"] = version
    return d
