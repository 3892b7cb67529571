"""The one recipe behind every reference-fixture script.

A family script (scripts/fixtures_<family>.py, and gemma3 in scripts/make_fixtures.py)
describes its cases in a `Family` and calls `run(family)`; `scripts/make_fixtures.py
--all` (or `--family NAME`) rebuilds any of them. For every case this builds a tiny
random transformers model (eager attention, torch CPU), re-initialises every
parameter (`Rule`s, seeded, in name order) so the logits spread over several
units, saves it with save_pretrained into tests/fixtures/<family>/<case>/
(single ``model.safetensors``, 0644), optionally edits the saved config.json,
reloads it from disk (through the model class or the Auto class) and records

* ``reference.npz``: ``ids`` int32 [T], ``logits`` float32 [T, V] from ONE full
  forward pass (no cache) of the reloaded model in the checkpoint's dtype;
  non-float32 cases add ``logits_fp32`` (the same rounded weights upcast, float32
  forward); a family hook may add more;
* ``config_t4.json`` (cases with ``t4``): the same config in the transformers-4
  form, with the result of loading it into transformers 5;
* ``fixture_info.json``: shapes, logit statistics, ablations (how much each
  feature moves the logits: proof it is exercised), weight-name prefixes, notes;
* ``README.md`` per family: a table of the cases and their notes.

A case is a dict: name, description, seed, T, config (kwargs over SIZES and the
family's common), and optionally dtype, init (overrides of the family's init
values), model_cls (built and loaded instead of the family's), id_high (ids drawn
below it), edit_config(dict) -> dict (edit_changes_model=True when the edited file
is meant to load as another model), t4(dict) -> dict, t4_hf(t4, config) -> dict
(what transformers 5 is given when it cannot read the t4 form as written),
t4_hf_exact (default True: assert identical logits, layer kinds and RoPE),
ablations {label: fn(model) -> None or extra forward kwargs}, notes.

Deterministic (fixed seeds, single-threaded torch, zip entries with fixed
timestamps, sorted JSON) and idempotent: each case directory is deleted and
rewritten. The record formats differ between family groups only because the
committed fixtures do: the presets below reproduce them byte for byte.
"""

from __future__ import annotations

import copy
import io
import json
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import numpy as np
import torch
import transformers
from safetensors import safe_open
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
SLIDING, FULL = "sliding_attention", "full_attention"

SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, max_position_embeddings=512)
# gemma2 and gemma3 configs (GemmaRMSNorm 1 + w, gelu-tanh MLP, tied embeddings)
GEMMA_COMMON = dict(
    head_dim=16,
    rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh",
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
    tie_word_embeddings=True,
)
MIN_ABLATION = 0.05  # every ablation must move the logits by >= 5% of their std (unless a family says otherwise)


# --------------------------------------------------------------------------- files and arrays


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
        cut = []
        for part in k.split(".")[:-1]:
            if part.isdigit():
                break
            cut.append(part)
        pre = ".".join(cut[:3]) + "."
        prefixes[pre] = prefixes.get(pre, 0) + 1
    return dict(sorted(prefixes.items()))


def safetensors_dtypes(st_path: Path) -> list[str]:
    with safe_open(st_path, "pt") as f:
        return sorted({str(f.get_slice(k).get_dtype()) for k in f.keys()})


@torch.no_grad()
def full_logits(model, ids: np.ndarray, **kwargs) -> np.ndarray:
    """One full forward pass without cache; float32 [T, V]."""
    out = model(input_ids=torch.from_numpy(ids.astype(np.int64))[None], use_cache=False, **kwargs)
    logits = out.logits[0].float().numpy()
    assert np.isfinite(logits).all(), "non-finite HF logits"
    return logits


def top1_gap(logits: np.ndarray) -> float:
    top2 = np.sort(logits, axis=-1)[:, -2:]
    return float((top2[:, 1] - top2[:, 0]).min())


def rel_change(other: np.ndarray, ref: np.ndarray) -> float:
    """max |other - ref| in units of the reference logits' std."""
    return float(np.abs(other - ref).max() / float(ref.std()))


# --------------------------------------------------------------------------- configs


def pattern_layer_types(n_layers: int, pattern: int) -> list[str]:
    """transformers' legacy derivation from sliding_window_pattern: every `pattern`-th layer is full."""
    return [SLIDING if (i + 1) % pattern else FULL for i in range(n_layers)]


def rope_by_kind(full_theta: float, sliding_theta: float | None = None, full_scaling: dict | None = None) -> dict:
    """rope_parameters of a family with one RoPE per layer kind: plain RoPE on
    sliding layers (same theta unless given), optional scaling on full layers."""
    return {
        FULL: {"rope_type": "default", "rope_theta": full_theta, **(full_scaling or {})},
        SLIDING: {"rope_type": "default", "rope_theta": full_theta if sliding_theta is None else sliding_theta},
    }


def t4_config(
    cfg_v5: dict, legacy_type_key: bool = False, drop=(), version: str = "4.46.0", pattern: int | None = None, **extra
) -> dict:
    """A transformers-5 config.json with one RoPE, in the transformers-4 form:
    top-level rope_theta, rope_scaling (None for default RoPE; the legacy "type"
    key when asked), torch_dtype; `drop` removes keys 4.x did not write; with
    `pattern`, layer_types goes too, after checking that 4.x derives the same
    kinds from it; `extra` keys are set as given."""
    d = copy.deepcopy(cfg_v5)
    if pattern is not None:
        types = d.pop("layer_types")
        assert types == pattern_layer_types(len(types), pattern), f"layer_types do not follow pattern {pattern}"
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
    d.update(extra)
    d["transformers_version"] = version
    return d


# --------------------------------------------------------------------------- re-initialisation


@dataclass(frozen=True)
class Rule:
    """Parameters for which `test(name, param)` holds (the first matching rule
    wins) become mean + N(0, init[std]); `mean` sums init values (an absent key
    counts 0) and plain numbers."""

    test: Callable[[str, torch.Tensor], bool]
    std: str
    mean: tuple = ()


def reinit_(model: torch.nn.Module, seed: int, init: dict, rules) -> None:
    """Every parameter random, in name order, so the random model has informative logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            rule = next(r for r in rules if r.test(name, p))
            new = torch.randn(p.shape, generator=gen) * init[rule.std]
            mean = sum(init.get(m, 0.0) if isinstance(m, str) else m for m in rule.mean)
            if mean:
                new = mean + new
            p.copy_(new.to(p.dtype))


def endswith(*suffixes: str):
    return lambda name, p: name.endswith(suffixes)


def is_embedding(name: str, p) -> bool:
    return "embed_tokens" in name


def is_norm_vector(name: str, p) -> bool:
    """A 1-D weight of a module whose name says norm (RMSNorm / weight-only LayerNorm)."""
    return "norm" in name.rsplit(".", 1)[0] and name.endswith(".weight") and p.ndim == 1


def is_matrix(name: str, p) -> bool:
    return p.ndim >= 2


def anything(name: str, p) -> bool:
    return True


# --------------------------------------------------------------------------- ablations (fn(model), on a copy)


def no_window(m) -> None:
    """Sliding layers see the whole causal prefix (masks read config.sliding_window)."""
    m.config.sliding_window = 1_000_000


def zero_biases(m) -> None:
    for name, p in m.named_parameters():
        if name.endswith(".bias"):
            p.zero_()


# Routers' correction bias (deepseek_v3, glm4_moe, exaone_moe: `mlp.gate.e_score_correction_bias`;
# minimax_m2: `mlp.e_score_correction_bias`): a buffer, so the re-initialisation here (parameters
# only) leaves it zero; the fixtures draw it.
BIAS_STD = 0.1  # comparable to the sigmoid scores' spread, so it changes choices


def router_gates(m) -> list:
    """Every MoE layer's router (`mlp.gate`), in layer order."""
    return [layer.mlp.gate for layer in m.model.layers if hasattr(layer.mlp, "gate")]


def correction_biases(m) -> list:
    """Every MoE layer's correction bias, in layer order."""
    out = []
    for layer in m.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "e_score_correction_bias"):
            out.append(gate.e_score_correction_bias)
        elif hasattr(layer.mlp, "e_score_correction_bias"):
            out.append(layer.mlp.e_score_correction_bias)
    return out


def draw_correction_biases(model, seed: int):
    """Every correction bias drawn from N(0, BIAS_STD^2), in layer order, from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for b in correction_biases(model):
            b.copy_(torch.randn(b.shape, generator=gen) * BIAS_STD)
    return model


def with_correction_bias(model_cls, seed: int):
    """A case's model_cls: build model_cls(cfg), then draw its correction biases."""

    def build(cfg):
        return draw_correction_biases(model_cls(cfg), seed)

    return build


def no_correction_bias(m) -> None:
    for b in correction_biases(m):
        b.zero_()


def gate_bias_in_weights(m) -> None:
    """Routers (`mlp.gate` returning logits, weights, indices; deepseek_v3-style:
    norm_topk_prob, routed_scaling_factor) that weight experts by the biased
    scores (the bias must only choose)."""
    for g in router_gates(m):
        orig = g.forward

        def fwd(h, g=g, orig=orig):
            logits, _, idx = orig(h)
            s = logits.sigmoid() + g.e_score_correction_bias
            w = s.gather(1, idx)
            if g.norm_topk_prob:
                w = w / (w.sum(-1, keepdim=True) + 1e-20)
            return logits, w * g.routed_scaling_factor, idx

        g.forward = fwd


def default_rope(m) -> None:
    """Plain RoPE (same theta) instead of the scaled one."""
    rot = m.model.rotary_emb
    theta = m.config.rope_parameters["rope_theta"]
    dim = m.config.head_dim
    rot.inv_freq.copy_(1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)))
    rot.attention_scaling = 1.0


def no_attn_softcap(m) -> None:
    m.config.attn_logit_softcapping = None
    for layer in m.model.layers:
        layer.self_attn.attn_logit_softcapping = None


def no_final_softcap(m) -> None:
    m.config.final_logit_softcapping = None


def scale_by_head_dim(m) -> None:
    """Scores scaled by head_dim**-0.5 instead of query_pre_attn_scalar**-0.5."""
    for layer in m.model.layers:
        layer.self_attn.scaling = m.config.head_dim**-0.5


def ablate(model, ids: np.ndarray, ref: np.ndarray, ablations: dict, min_change: float) -> dict:
    res = {}
    for label, fn in ablations.items():
        m = copy.deepcopy(model)
        with torch.no_grad():
            kwargs = fn(m) or {}
        change = rel_change(full_logits(m, ids, **kwargs), ref)
        res[label] = round(change, 3)
        assert change >= min_change, f"ablation {label!r} barely matters ({change:.4f})"
    return res


# --------------------------------------------------------------------------- fixture_info.json fields


def npz_keys(ctx) -> dict:
    return {"npz_keys": {k: [str(v.dtype), list(v.shape)] for k, v in ctx.arrays.items()}}


def bf16_vs_fp32(ctx) -> dict:
    a = ctx.arrays
    diff = round(float(np.abs(a["logits"] - a["logits_fp32"]).max()), 4) if "logits_fp32" in a else None
    return {"bf16_vs_fp32_max_abs_diff": diff}


INFO_ORDER = (
    "case", "description", "hf_class", "transformers_version", "torch_version", "dtype", "safetensors_dtypes",
    "T", "vocab_size", "sliding_window", "layer_types", "npz_keys", "rope_parameters", "rope_attention_scaling",
    "logits_std", "logits_min_top1_gap", "bf16_vs_fp32_max_abs_diff", "bf16_vs_fp32_top1_agreement",
    "router_min_margin", "indexer_min_margin", "ablation_max_rel_change", "weight_prefixes", "t4_check", "init", "notes",
    "safetensors_bytes",
)  # fmt: skip


# --------------------------------------------------------------------------- family description


@dataclass(frozen=True)
class Readme:
    """Layout of tests/fixtures/<family>/README.md: `columns` are (header, fn(info, case) -> cell)."""

    runtime: str
    about: tuple[str, ...]
    columns: tuple
    title: str | None = None  # default: the family name


BASE_COLUMNS = (
    ("case", lambda i, c: i["case"]),
    ("description", lambda i, c: i["description"]),
    ("T", lambda i, c: i["T"]),
    ("logit std", lambda i, c: i["logits_std"]),
    ("min top-1 gap", lambda i, c: i["logits_min_top1_gap"]),
)


@dataclass
class Family:
    name: str  # tests/fixtures/<name>/
    script: str  # the family script's __file__ (named in the README)
    model_cls: type
    config_cls: type
    cases: list[dict]
    readme: Readme
    common: dict = field(default_factory=dict)  # config kwargs over SIZES, under each case's config
    init: dict = field(default_factory=dict)  # re-initialisation values (recorded in fixture_info.json)
    init_rules: tuple = ()
    build_config: Callable | None = None  # (family, case) -> config, for more than config_cls(**kwargs)
    auto_load: bool = False  # reload through AutoModelForCausalLM (as users load checkpoints)
    load_kwargs: dict = field(default_factory=dict)  # more from_pretrained kwargs
    check_in_memory: bool = True  # float32: the reloaded logits equal the in-memory model's
    ablate_in_fp32: bool = False  # ablate the float32-upcast model of non-float32 cases
    min_ablation: float = MIN_ABLATION
    extra_outputs: Callable | None = None  # (ctx) -> notes; may add ctx.arrays entries
    info_fields: tuple = ()  # (ctx) -> dict of extra fixture_info.json fields (named in INFO_ORDER)
    t4_fields: tuple = ()  # which t4 results fixture_info.json records, in order (see check_t4)
    t4_note: str = ""
    readme_notes: tuple = ()  # family-wide README notes


def config_kwargs(family: Family, case: dict) -> dict:
    return {**SIZES, **family.common, **copy.deepcopy(case["config"])}


def default_config(family: Family, case: dict):
    cfg = family.config_cls(**config_kwargs(family, case))
    cfg._attn_implementation = "eager"
    return cfg


def loader(family: Family, case: dict):
    cls = AutoModelForCausalLM if family.auto_load else case.get("model_cls", family.model_cls)

    def load(directory: Path, dtype=torch.float32, **overrides):
        kwargs = {**family.load_kwargs, **overrides}
        return cls.from_pretrained(directory, attn_implementation="eager", dtype=dtype, **kwargs).eval()

    return load


# --------------------------------------------------------------------------- one case


def save_checkpoint(model, out: Path, case: dict) -> Path:
    model.save_pretrained(out, safe_serialization=True)
    st_path = out / "model.safetensors"
    os.chmod(st_path, 0o644)  # save_pretrained leaves it 0600
    assert st_path.exists() and not list(out.glob("*.index.json")), "expected a single safetensors file"
    if case.get("edit_config"):
        cfg_path = out / "config.json"
        edited = case["edit_config"](json.loads(cfg_path.read_text()))
        cfg_path.write_text(json.dumps(edited, indent=2, sort_keys=True) + "\n")
    return st_path


def same_rope(a: dict, b: dict) -> bool:
    """Equal rope_parameters (per kind or not), but for a legacy "type" key that repeats rope_type."""

    def norm(rp):
        if all(isinstance(v, dict) for v in rp.values()):
            return {k: norm(v) for k, v in rp.items()}
        return {k: v for k, v in rp.items() if not (k == "type" and v == rp.get("rope_type"))}

    return norm(a) == norm(b)


def check_t4(family: Family, ctx, notes: list) -> dict | None:
    """Write config_t4.json and load it (or t4_hf of it) into transformers 5.
    Results: hf_loads / accepted (the same), hf_error, hf_logits_rel_change,
    logits_max_abs_diff, layer_types_equal, rope_parameters_equal,
    rope_parameters_loaded, layer_types_loaded, hf_config_differs_from_t4;
    family.t4_fields picks what is recorded."""
    case = ctx.case
    if not case.get("t4"):
        return None
    cfg_v5 = json.loads((ctx.out / "config.json").read_text())
    t4 = case["t4"](cfg_v5)
    (ctx.out / "config_t4.json").write_text(json.dumps(t4, indent=2, sort_keys=True) + "\n")
    hf_t4 = case["t4_hf"](t4, cfg_v5) if case.get("t4_hf") else t4
    exact = case.get("t4_hf_exact", True)
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        (td / "config.json").write_text(json.dumps(hf_t4, indent=2, sort_keys=True))  # the order is kept on load
        os.symlink(ctx.st_path, td / "model.safetensors")
        try:
            m4 = ctx.load(td, ctx.dtype)
            lt4 = full_logits(m4, ctx.ids)
        except Exception as e:  # recorded, not fatal unless exactness is asked: the case's notes explain it
            if exact:
                raise
            res = dict(hf_loads=False, accepted=False, hf_error=f"{type(e).__name__}: {e}")
        else:
            c4, c = m4.config.get_text_config(), ctx.reloaded.config.get_text_config()
            types4 = getattr(c4, "layer_types", None)
            res = dict(
                hf_loads=True,
                accepted=True,
                hf_logits_rel_change=round(rel_change(lt4, ctx.logits), 3),
                layer_types_equal=types4 == getattr(c, "layer_types", None),
                rope_parameters_equal=same_rope(c4.rope_parameters, c.rope_parameters),
                rope_parameters_loaded=c4.rope_parameters,
                layer_types_loaded=types4,
                logits_max_abs_diff=float(np.abs(lt4 - ctx.logits).max()),
            )
            same = res["layer_types_equal"] and res["rope_parameters_equal"] and np.array_equal(lt4, ctx.logits)
            assert same or not exact, f"{case['name']}: t4 config mismatch {res}"
    res["hf_config_differs_from_t4"] = hf_t4 != t4
    if exact:
        notes.append(family.t4_note)
    return {k: res[k] for k in family.t4_fields if k in res}


def make_case(family: Family, case: dict) -> dict:
    """Write one case directory; returns its fixture_info. Hooks get a ctx with case, out,
    st_path, ids, dtype, load, reloaded, logits, exact (the float32 model: reloaded,
    or the upcast one of a bf16 case), ref32 (its logits) and arrays (reference.npz)."""
    name = case["name"]
    out = FIXTURES / family.name / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    dtype = case.get("dtype", torch.float32)

    torch.manual_seed(case["seed"])
    cfg = (family.build_config or default_config)(family, case)
    model = case.get("model_cls", family.model_cls)(cfg)
    model.config._attn_implementation = "eager"
    init = {**family.init, **case.get("init", {})}
    reinit_(model, case["seed"], init, family.init_rules)
    model = model.to(dtype).eval()

    vocab = model.config.get_text_config().vocab_size
    ids = np.random.default_rng(case["seed"]).integers(0, case.get("id_high", vocab), size=case["T"]).astype(np.int32)
    # (bf16: model.to(bfloat16) also casts the RoPE buffers, from_pretrained keeps them float32:
    # only the reloaded model is the reference.)
    in_memory = full_logits(model, ids) if family.check_in_memory and dtype == torch.float32 else None
    st_path = save_checkpoint(model, out, case)

    # The reference comes from the checkpoint as written (and, if edited, as edited).
    load = loader(family, case)
    reloaded = load(out, dtype)
    logits = full_logits(reloaded, ids)
    sd_mem, sd_new = model.state_dict(), reloaded.state_dict()
    assert sd_mem.keys() == sd_new.keys() and all(torch.equal(sd_mem[k].float(), sd_new[k].float()) for k in sd_mem)
    if in_memory is not None:
        same = np.array_equal(logits, in_memory)
        assert same != bool(case.get("edit_changes_model")), f"{name}: reloaded vs in-memory logits equal={same}"
    arrays = {"ids": ids, "logits": logits.astype(np.float32)}
    ctx = SimpleNamespace(case=case, out=out, st_path=st_path, ids=ids, dtype=dtype, load=load, reloaded=reloaded,
                          logits=logits, exact=reloaded, ref32=logits, arrays=arrays)  # fmt: skip
    dtype_notes = []
    if dtype != torch.float32:
        assert dtype == torch.bfloat16, "notes and records assume bf16"
        ctx.exact = load(out, torch.float32)
        assert ctx.exact.get_input_embeddings().weight.dtype == torch.float32
        arrays["logits_fp32"] = ctx.ref32 = full_logits(ctx.exact, ids).astype(np.float32)
        dtype_notes.append("logits: bf16 forward; logits_fp32: same bf16-rounded weights upcast, float32 forward")

    notes = list(case.get("notes", [])) + (family.extra_outputs(ctx) if family.extra_outputs else []) + dtype_notes
    write_npz(out / "reference.npz", arrays)
    t4_check = check_t4(family, ctx, notes)

    abl_model, abl_ref = (ctx.exact, ctx.ref32) if family.ablate_in_fp32 else (reloaded, logits)
    text_cfg = reloaded.config.get_text_config()
    fields = dict(
        case=name,
        description=case["description"],
        hf_class=type(reloaded).__name__,
        transformers_version=transformers.__version__,
        torch_version=torch.__version__,
        dtype=str(dtype).replace("torch.", ""),
        safetensors_dtypes=safetensors_dtypes(st_path),
        T=int(case["T"]),
        vocab_size=vocab,
        sliding_window=getattr(text_cfg, "sliding_window", None),
        layer_types=getattr(text_cfg, "layer_types", None),
        logits_std=round(float(logits.std()), 4),
        logits_min_top1_gap=round(top1_gap(logits), 4),
        ablation_max_rel_change=ablate(abl_model, ids, abl_ref, case.get("ablations", {}), family.min_ablation),
        weight_prefixes=weight_prefixes(st_path),
        t4_check=t4_check,
        init={**init, "seed": case["seed"]},
        notes=notes,
        safetensors_bytes=st_path.stat().st_size,
    )
    for fn in family.info_fields:
        fields.update(fn(ctx))
    assert set(fields) <= set(INFO_ORDER), f"unknown fixture_info fields {set(fields) - set(INFO_ORDER)}"
    info = {k: fields[k] for k in INFO_ORDER if k in fields}
    (out / "fixture_info.json").write_text(json.dumps(info, indent=2, default=str) + "\n")
    return info


# --------------------------------------------------------------------------- a family


def write_readme(family: Family, infos: list[dict]) -> None:
    r = family.readme
    lines = [
        f"# {r.title or family.name} reference fixtures",
        "",
        f"Generated by `scripts/{Path(family.script).name}` (do not edit by hand; rerun the script).",
        f"transformers {transformers.__version__}, torch {torch.__version__}, {r.runtime}",
        "",
        *r.about,
        "",
        "| " + " | ".join(header for header, _ in r.columns) + " |",
        "|" + "---|" * len(r.columns),
    ]
    for info, case in zip(infos, family.cases):
        lines.append("| " + " | ".join(str(cell(info, case)) for _, cell in r.columns) + " |")
    lines += ["", "Notes:", ""]
    lines += [f"- `{info['case']}`: {note}" for info in infos for note in info["notes"]]
    lines += [f"- {note}" for note in family.readme_notes]
    (FIXTURES / family.name / "README.md").write_text("\n".join(lines) + "\n")


def run(family: Family) -> int:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    infos = []
    for case in family.cases:
        info = make_case(family, case)
        infos.append(info)
        print(
            f"{family.name}/{info['case']}: {info['dtype']} T={info['T']} logit std={info['logits_std']:.3f} "
            f"min top1 gap={info['logits_min_top1_gap']:.4f} size={info['safetensors_bytes'] / 1e6:.2f} MB"
        )
        print(f"    layer types: {info['layer_types']}")
        print(f"    ablations (max|d|/std): {info['ablation_max_rel_change']}")
        if info["t4_check"]:
            print(f"    t4 config: {info['t4_check']}")
    write_readme(family, infos)
    return 0


# --------------------------------------------------------------------------- presets of the family groups

# gemma2, cohere2, olmo3, exaone4: init by shape (norm_center 0 for Gemma's 1 + w
# norms, 1 otherwise; the final norm gets + final_norm_shift), the model class as
# loader; init values and common config keys are the family's own.
GEMMA2_STYLE = dict(
    init_rules=(
        Rule(is_embedding, "embed_std"),
        Rule(lambda name, p: name == "model.norm.weight", "norm_std", ("norm_center", "final_norm_shift")),
        Rule(is_norm_vector, "norm_std", ("norm_center",)),
        Rule(is_matrix, "linear_std"),
        Rule(anything, "other_std"),
    ),
    t4_fields=("hf_loads", "hf_logits_rel_change", "hf_error", "hf_config_differs_from_t4"),
    t4_note=(
        "config_t4.json: the same model in transformers-4 config form (transformers 5 loads it to identical logits)"
    ),
    readme=Readme(
        runtime="eager attention, CPU, float32.",
        about=(
            "Each case: `config.json` / `model.safetensors` / `generation_config.json` as `save_pretrained` wrote",
            "them, `reference.npz` (`ids` int32 [T], `logits` float32 [T, V], one full forward pass without cache),",
            "`fixture_info.json` (statistics, ablations, notes); `config_t4.json` is the transformers-4 form.",
        ),
        columns=BASE_COLUMNS,
    ),
)

# llama, qwen3, mistral, ministral, ministral3: the Auto class as loader (a mistral
# config.json with layer_types loads as ministral), a smaller projection std (0.15,
# with a 0.3 output head): at 0.25 the pre-norm residual stream grows so fast that
# transformers' own fp32 run is ~1e-5 of the logit scale from float64.
LLAMA_STYLE = dict(
    common=dict(rms_norm_eps=1e-6, hidden_act="silu", pad_token_id=0, eos_token_id=1, bos_token_id=2),
    init=dict(embed_std=0.2, linear_std=0.15, head_std=0.3, norm_mean=1.0, norm_std=0.3, bias_std=0.1),
    init_rules=(
        Rule(is_embedding, "embed_std"),
        Rule(endswith("norm.weight"), "norm_std", ("norm_mean",)),  # llama-style RMSNorm scales by w
        Rule(lambda name, p: name.startswith("lm_head."), "head_std"),
        Rule(endswith(".bias"), "bias_std"),
        Rule(anything, "linear_std"),
    ),
    auto_load=True,
    info_fields=(npz_keys,),
    t4_fields=("rope_parameters_loaded", "layer_types_loaded", "logits_max_abs_diff"),
    t4_note="config_t4.json: the same model in transformers-4 config form; loads to identical logits",
    readme=Readme(
        runtime="eager attention, CPU, float32.",
        about=(
            "Each case directory holds the checkpoint as `save_pretrained` wrote it, `reference.npz` (`ids` int32 [T],",
            "`logits` float32 [T, V] from one full forward pass without cache) and `fixture_info.json`",
            "(statistics, ablations, weight-name prefixes). "
            "`config_t4.json` is the transformers-4 form of `config.json`.",
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
