"""From a MODEL argument to a loaded (and, under TP, sharded) model.

open_model: MODEL (local directory, the embedded default, or a Hub repo id)
read once into a Checkpoint (directory, config.json, tensor headers with
their byte sizes, quantization), which the CLI's checks, `info` and the
loader share.
load_model: Checkpoint -> registry -> ModelArgs -> Model -> quantize the
modules an MLX-quantized checkpoint stores quantized -> shard(group) -> read
exactly this rank's slice of every tensor -> strict load -> cast.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..parallel.collectives import SINGLE, Group
from ..errors import UserError
from ..models import get_model_module
from ..nn.quant import foreign_quant_method, quantize_model, read_quantization
from ..parallel.shard import collect_plan
from .weights import open_checkpoint, stored_bytes

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
    p = Path(__file__).resolve().parent.parent.parent / "models" / DEFAULT_MODEL_NAME
    if (p / "config.json").exists():
        return p
    raise UserError("the embedded default model is not installed; pass a MODEL path")


def looks_like_repo_id(s: str) -> bool:
    """Whether MODEL (not an existing path) names a Hugging Face repo: one
    "owner/name" pair, not a relative or absolute path."""
    return s.count("/") == 1 and not s.startswith((".", "/", "~")) and all(s.split("/"))


def model_present(model) -> bool:
    """Whether this host can load ``model`` (distributed.check_cluster asks
    every rank): the embedded default, this rank's shard cache entry, an
    existing path, or a Hub id (each host downloads its own)."""
    from .shardcache import local_model

    if model is None or local_model(model) is not None:
        return True
    m = str(model)
    return Path(m).expanduser().exists() or looks_like_repo_id(m)


def resolve_model_dir(model: str | os.PathLike | None) -> Path:
    if model is None or str(model) == "":
        return default_model_dir()
    from .shardcache import local_model

    cached = local_model(model)  # a rank on a host the launcher sent its shard to
    if cached is not None:
        return cached
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


def build_model(config: dict):
    module = get_model_module(config.get("model_type"))
    args = module.ModelArgs.from_dict(config)
    return module.Model(args)


class Checkpoint:
    """One reading of a checkpoint: its directory and config.json (read at
    once), its tensor headers and quantization (read on first use, once).
    Nothing here reads a tensor's data."""

    def __init__(self, model_dir: Path, config: dict):
        self.dir, self.config = model_dir, config

    @cached_property
    def refs(self) -> dict:
        """Tensor name -> weights.TensorRef (safetensors headers and memory
        maps; a shard cache entry's: its pieces, shardcache.open_cached)."""
        from . import shardcache

        if (self.dir / shardcache.MANIFEST).exists():
            return shardcache.open_cached(self.dir)
        return open_checkpoint(self.dir)

    @cached_property
    def quantization(self):
        return read_quantization(self.config)

    @cached_property
    def foreign_quant(self) -> str | None:
        return foreign_quant_method(self.config)

    @cached_property
    def args(self):
        return model_args(self.config)

    @property
    def dtype(self):
        return config_dtype(self.config)

    @property
    def context_length(self) -> int | None:
        n = getattr(self.args, "max_position_embeddings", None)
        return int(n) if n else None

    def tensor_bytes(self) -> dict:
        """Tensor name -> its stored bytes (from the headers)."""
        return {name: stored_bytes(ref) for name, ref in self.refs.items()}

    def build(self, with_refs: bool = True, refs: dict | None = None):
        """The model (parameters lazy), with the layers the checkpoint stores
        MLX-quantized swapped for quantized ones, and its sanitized refs
        (None when not asked for and not needed: an unquantized checkpoint's
        shapes come from the config alone). `refs`: stand-ins for the
        checkpoint's tensors (shardcache records what a rank reads)."""
        m = build_model(self.config)
        need = with_refs or self.quantization is not None  # quantized: its tensors say which layers are
        refs = m.sanitize(dict(self.refs if refs is None else refs)) if need else None
        if self.quantization is not None:
            quantize_model(m, self.quantization, refs)
        return m, refs

    def rank_reads(self, group: Group, pp: int, refs: dict) -> list:
        """(ref, axis, ranges) of every read this rank's load makes
        (`build_rank`, then `planned_reads`), against `refs`: stand-ins for
        the checkpoint's tensors (shardcache.rank_pieces records them)."""
        m, refs, full = build_rank(self, group, pp, self.dtype, refs=refs)
        return [(ref, axis, ranges) for _, ref, axis, ranges in planned_reads(m, refs, full)]


_OPENED: dict = {}  # MODEL argument -> (the files' stamp, Checkpoint)


def _stamp(model_dir: Path) -> tuple:
    """What a Checkpoint was read from: a file changed since means reading it again."""
    out = []
    for p in sorted([model_dir / "config.json", *model_dir.glob("*.safetensors"), *model_dir.glob("*.index.json")]):
        try:
            st = p.stat()
        except OSError:
            continue
        out.append((p.name, st.st_mtime_ns, st.st_size))
    return tuple(out)


def open_model(model) -> Checkpoint:
    """MODEL (a path, a Hub repo id, None for the embedded default, or a
    Checkpoint) as a Checkpoint, read once per process while its files stay
    as they were (a Hub id is resolved once)."""
    if isinstance(model, Checkpoint):
        return model
    arg = None if model is None or str(model) == "" else str(model)
    hit = _OPENED.get(arg)
    model_dir = hit[1].dir if hit is not None else resolve_model_dir(model)
    stamp = _stamp(model_dir)
    if hit is None or hit[0] != stamp:
        hit = _OPENED[arg] = (stamp, Checkpoint(model_dir, read_config(model_dir)))
    return hit[1]


def check_shardable(model, np_: int, weights=None, moe_split: str | None = None) -> None:
    """Raise UserError now if `np_` ranks (with these rank weights) cannot
    split this model's heads/MLP, so a bad rank count is one clear line
    instead of N failing ranks."""
    if np_ <= 1:
        return
    ck = open_model(model)
    if moe_split == "experts":
        m, _ = ck.build(with_refs=False)
        if not any(hasattr(x, "expert_range") for _, x in m.named_modules()):
            raise UserError(f"--moe-split experts: {ck.config.get('model_type')} has no stacked routed experts "
                            "that place whole experts per rank (the families on experts.SwitchGLU do: qwen3_moe, "
                            "glm4_moe, deepseek_v3, minimax_m2, llama4, step3p5, gemma4, qwen3_next, qwen3_5_moe); "
                            "use --moe-split intermediate")
    for r in range(np_):
        m, _ = ck.build(with_refs=False)
        m.shard(Group.planned(np_, r, weights, moe_split))  # on paper: parameters stay lazy


def check_stageable(model, pp: int, weights=None) -> None:
    """Before launch: the family runs in stages and has at least `pp` layers
    with a legal cut into `pp` stages (shared KV stays on one stage)."""
    from ..parallel.pipeline import check_family, plan_stages

    m, refs = open_model(model).build()
    check_family(m)
    plan_stages(m, refs, pp, weights)


def load_model(model, dtype: str | None = None, group: Group = SINGLE, progress=None, pp: int = 1,
               kv=None, adapter=None) -> Loaded:
    """`pp` > 1: `group` is a pipeline of `pp` stages of T = size / pp ranks
    each (pipeline.py): this rank builds and reads its stage only, sharded
    T ways inside the stage (`pipeline.stage_group`). `kv`: a
    `cache.KVOptions` (--max-kv-size, --kv-bits) the model's caches follow;
    `adapter`: a `lora.Adapter` (--adapter-path) put on the loaded layers."""
    ck = open_model(model)
    target = parse_dtype(dtype) or ck.dtype
    m, refs, full_shapes = build_rank(ck, group, pp, target)
    method = ck.foreign_quant
    hint = (
        f"config.json quantization_config has quant_method {method!r}, which mlxcel-dist does not read "
        f"(it reads MLX-quantized checkpoints, e.g. mlx-community or `mlxcel-dist convert --quantize`, and unquantized ones)"
        if method
        else None
    )
    from ..cluster import faults

    faults.at("load", group.rank())
    load_weights(m, refs, target, progress=progress, unexpected_hint=hint, full_shapes=full_shapes)
    m.eval()
    if adapter is not None:
        from ..nn.lora import apply_adapter

        apply_adapter(m, adapter)
    if kv:
        kv.apply(m)
    return Loaded(m, ck.config, ck.dir, target, group)


def build_rank(ck: Checkpoint, group: Group, pp: int, target, refs: dict | None = None):
    """This rank's model (built, quantized, cut to its stage, sharded; still
    lazy), the sanitized refs it reads and the unsharded shapes. `refs`: as
    in `Checkpoint.build` (a planned group and recording refs: the reads on
    paper, shardcache.rank_pieces)."""
    m, refs = ck.build(refs=refs)
    full_shapes = {name: tuple(p.shape) for name, p in tree_flatten(m.parameters())}  # before sharding
    if pp > 1:
        from ..parallel.pipeline import comm_stream, stage_group

        comm_stream(group)
        refs = cut_stage(m, refs, group, pp, target)
        tp = stage_group(group, pp)
        if not tp.single:
            tp.moe_split = group.moe_split  # the stage's ranks place experts as the job says
            m.shard(tp)
            m.stage.tp = tp
    elif not group.single:
        m.shard(group)
    m.ranks = group.size()
    return m, refs, full_shapes


def cut_stage(m, refs: dict, group: Group, pp: int, target) -> dict:
    """Cut `m` down to this rank's pipeline stage (pipeline.make_stage) and
    return the checkpoint refs of that stage: the other stages' tensors are
    set aside, so the strict check below covers exactly this stage's
    parameters (a tensor no stage has is still unexpected)."""
    from ..parallel import pipeline

    if group.size() % pp:
        raise UserError(f"--pp {pp} needs a multiple of {pp} ranks, this job has {group.size()}")
    pipeline.check_family(m)
    ranges = pipeline.plan_stages(m, refs, pp, group.weights)
    before = {name for name, _ in tree_flatten(m.parameters())}
    emb = m.model.embed_tokens
    ref = refs.get("model.embed_tokens." + ("scales" if "scales" in emb else "weight"))
    dtype = target or (_mlx_dtype(ref.dtype) if ref is not None else emb.weight.dtype)
    pipeline.make_stage(m, group, pp, ranges, dtype)
    others = before - {name for name, _ in tree_flatten(m.parameters())}
    return {name: r for name, r in refs.items() if name not in others}


def _mlx_dtype(safetensors_dtype: str):
    from .weights import _DTYPES

    return _DTYPES[safetensors_dtype][1]


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
    weights = []
    reads = list(planned_reads(model, refs, full_shapes))
    for i, (name, ref, axis, ranges) in enumerate(reads):
        w = ref.read(axis, ranges)
        if dtype is not None and mx.issubdtype(w.dtype, mx.floating):
            w = w.astype(dtype)
        weights.append((name, w))
        if progress is not None:
            progress(i + 1, len(reads))
    model.load_weights(weights, strict=True)
    mx.eval(model.parameters())


def planned_reads(model: nn.Module, refs: dict, full_shapes: dict | None = None):
    """(name, ref, axis, ranges) of every parameter, in name order: the read
    that fills it (this rank's slice), its shape checked against the ref's."""
    expected = dict(tree_flatten(model.parameters()))
    plan = collect_plan(model)
    for name in sorted(expected):
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
        yield name, ref, axis, ranges
