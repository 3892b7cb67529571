"""From a MODEL argument to a loaded (and, under TP, sharded) model.

resolve_model_dir: local directory, the embedded default, or a Hub repo id.
load_model: config.json -> registry -> ModelArgs -> Model -> quantize the
modules an MLX-quantized checkpoint stores quantized -> shard(group) -> read
exactly this rank's slice of every tensor -> strict load -> cast.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .collectives import SINGLE, Group
from .errors import UserError
from .models import get_model_module
from .quant import foreign_quant_method, quantize_model, read_quantization
from .shard import collect_plan
from .weights import open_checkpoint

DEFAULT_MODEL_NAME = "gemma3-tiny"
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja", "*.txt"]

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def default_model_dir() -> Path:
    """The embedded tiny checkpoint (installed as package data, or the repo's models/)."""
    try:
        from importlib.resources import files

        p = Path(str(files("mlxcel_dist.default_models") / DEFAULT_MODEL_NAME))
        if (p / "config.json").exists():
            return p
    except (ModuleNotFoundError, TypeError):
        pass
    p = Path(__file__).resolve().parent.parent / "models" / DEFAULT_MODEL_NAME
    if (p / "config.json").exists():
        return p
    raise UserError("the embedded default model is not installed; pass a MODEL path")


def looks_like_repo_id(s: str) -> bool:
    """Whether MODEL (not an existing path) names a Hugging Face repo: one
    "owner/name" pair, not a relative or absolute path."""
    return s.count("/") == 1 and not s.startswith((".", "/", "~")) and all(s.split("/"))


def resolve_model_dir(model: str | os.PathLike | None) -> Path:
    if model is None or str(model) == "":
        return default_model_dir()
    p = Path(model).expanduser()
    if p.exists():
        if not p.is_dir():
            raise UserError(f"{p}: MODEL must be a checkpoint directory, not a file")
        return p
    s = str(model)
    if not looks_like_repo_id(s):
        raise UserError(f"{s}: no such model directory")
    return _download(s)


def _rich_tqdm():
    """A rich progress bar for Hub downloads (tqdm's rich front end), on
    stderr; None (the hub's default bars) if it is unavailable."""
    try:
        import warnings

        from tqdm import TqdmExperimentalWarning
        from tqdm.rich import tqdm_rich

        warnings.filterwarnings("ignore", category=TqdmExperimentalWarning)
        return tqdm_rich
    except ImportError:
        return None


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import disable_progress_bars  # noqa: F401
    except ImportError:  # pragma: no cover - a declared dependency
        raise UserError("huggingface-hub is not installed; pass a local MODEL directory") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS, tqdm_class=_rich_tqdm()))
    except Exception as e:  # the hub raises many types; all mean the same to a user
        offline = os.environ.get("HF_HUB_OFFLINE") not in (None, "", "0")
        hint = (
            "it is not in the local cache (HF_HUB_OFFLINE is set)"
            if offline
            else "check the repo id and the network, or pass a local directory (HF_HUB_OFFLINE=1 uses the cache only)"
        )
        raise UserError(f"could not get {repo_id!r} from the Hugging Face Hub: {type(e).__name__}; {hint}") from None


def read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.exists():
        raise UserError(f"{model_dir}: no config.json (is this a checkpoint directory?)")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not valid JSON ({e.msg if hasattr(e, 'msg') else e})") from None
    if not isinstance(config, dict):
        raise UserError(f"{path}: expected a JSON object")
    return config


def config_dtype(config: dict):
    """The checkpoint's compute dtype (transformers 5 'dtype', 4 'torch_dtype')."""
    for src in (config, config.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            name = src.get(key)
            if isinstance(name, str) and name in DTYPES:
                return DTYPES[name]
    return None


def parse_dtype(name: str | None):
    if name is None:
        return None
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r} (choose from {', '.join(DTYPES)})")
    return DTYPES[name]


@dataclass
class Loaded:
    model: nn.Module
    config: dict
    model_dir: Path
    dtype: object
    group: Group = SINGLE


def model_args(config: dict):
    """The family's ModelArgs for this config (no model built)."""
    return get_model_module(config.get("model_type")).ModelArgs.from_dict(config)


def context_length(config: dict) -> int | None:
    """The model's context (`max_position_embeddings` as its ModelArgs read
    it, a multimodal config's text_config included); None when it sets none."""
    n = getattr(model_args(config), "max_position_embeddings", None)
    return int(n) if n else None


def build_model(config: dict):
    module = get_model_module(config.get("model_type"))
    args = module.ModelArgs.from_dict(config)
    return module.Model(args)


def check_shardable(model: str | os.PathLike | None, np_: int, weights=None) -> None:
    """Raise UserError now if `np_` ranks (with these rank weights) cannot
    split this model's heads/MLP, so a bad rank count is one clear line
    instead of N failing ranks."""
    if np_ <= 1:
        return
    model_dir = resolve_model_dir(model)
    config = read_config(model_dir)
    # A quantized checkpoint's tensors say which layers are quantized (and
    # o/down must split into whole quantization groups): read its headers.
    refs = open_checkpoint(model_dir) if read_quantization(config) is not None else None
    for r in range(np_):
        m, _ = _build_for_checkpoint(config, refs)
        m.shard(Group.planned(np_, r, weights))  # on paper: parameters stay lazy


def _build_for_checkpoint(config: dict, raw_refs: dict | None):
    """The model, with the layers the checkpoint stores MLX-quantized swapped
    for quantized ones (before sharding and loading), and its sanitized refs."""
    m = build_model(config)
    refs = m.sanitize(raw_refs) if raw_refs is not None else None
    quant = read_quantization(config)
    if quant is not None:
        quantize_model(m, quant, refs)
    return m, refs


def load_model(model: str | os.PathLike | None, dtype: str | None = None, group: Group = SINGLE,
               progress=None) -> Loaded:
    model_dir = resolve_model_dir(model)
    config = read_config(model_dir)
    m, refs = _build_for_checkpoint(config, open_checkpoint(model_dir))
    full_shapes = {name: tuple(p.shape) for name, p in tree_flatten(m.parameters())}  # before sharding
    if not group.single:
        m.shard(group)
    target = parse_dtype(dtype) or config_dtype(config)
    method = foreign_quant_method(config)
    hint = (
        f"config.json quantization_config has quant_method {method!r}, which mlxcel-dist does not read "
        f"(it reads MLX-quantized checkpoints, e.g. mlx-community or `mlxcel-dist convert --quantize`, and unquantized ones)"
        if method
        else None
    )
    from . import faults

    faults.at("load", group.rank())
    load_weights(m, refs, target, progress=progress, unexpected_hint=hint, full_shapes=full_shapes)
    m.eval()
    return Loaded(m, config, model_dir, target, group)


def load_weights(model: nn.Module, refs: dict, dtype=None, progress=None, unexpected_hint: str | None = None,
                 full_shapes: dict | None = None) -> None:
    """Strict: every parameter must come from the checkpoint with the right
    shape, and every checkpoint tensor must be used. Reads only this rank's slice.
    `unexpected_hint` is added to the error about unexpected tensors;
    `full_shapes` (name -> the unsharded model's shape) names the shape a
    tensor should have when it is too small for this rank's slice."""
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(expected.keys() - refs.keys())
    unexpected = sorted(refs.keys() - expected.keys())
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise UserError(f"checkpoint is missing tensors: {', '.join(missing[:3])}{more}")
    if unexpected:
        more = f" (+{len(unexpected) - 3} more)" if len(unexpected) > 3 else ""
        hint = ""
        if unexpected_hint:
            hint = f" ({unexpected_hint})"
        elif any(n.endswith(".scales") for n in unexpected) and not any(n.endswith(".scales") for n in expected):
            hint = " (quantized tensors, but config.json has no MLX `quantization`)"
        raise UserError(f"checkpoint has unexpected tensors: {', '.join(unexpected[:3])}{more}{hint}")
    plan = collect_plan(model)
    weights = []
    names = sorted(expected)
    for i, name in enumerate(names):
        ref, param = refs[name], expected[name]
        axis, ranges = plan.get(name, (None, None))
        if axis is not None and (axis >= len(ref.shape) or max(e for _, e in ranges) > ref.shape[axis]):
            want = f"expected {list(full_shapes[name])}" if full_shapes and name in full_shapes else \
                f"this rank's slice needs [{ranges[0][0]}, {ranges[-1][1]}) of axis {axis}"
            raise UserError(f"tensor {name!r} has shape {list(ref.shape)}, {want}")
        shape = ref.sliced_shape(axis, ranges)
        if shape != tuple(param.shape):
            full = list(param.shape)
            if axis is not None:
                full[axis] = ref.shape[axis]
            hint = ""
            if param.dtype == mx.uint32 or name.endswith((".scales", ".biases")):
                hint = " (quantized with other bits / group size than config.json's `quantization` says?)"
            raise UserError(f"tensor {name!r} has shape {list(ref.shape)}, expected {full}{hint}")
        if param.dtype == mx.uint32 and ref.dtype != "U32":
            raise UserError(f"tensor {name!r} is {ref.dtype}, expected packed quantized weights (U32)")
        w = ref.read(axis, ranges)
        if dtype is not None and mx.issubdtype(w.dtype, mx.floating):
            w = w.astype(dtype)
        weights.append((name, w))
        if progress is not None:
            progress(i + 1, len(names))
    model.load_weights(weights, strict=True)
    mx.eval(model.parameters())
