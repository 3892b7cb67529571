"""MLX-quantized checkpoints, as mlx-lm writes them (the mlx-community format).

config.json holds `quantization` (mlx-lm writes the same object again as
`quantization_config`)::

    {"group_size": 64, "bits": 4, "mode": "affine",
     "model.layers.0.mlp.down_proj": {"group_size": 64, "bits": 8},   # per-layer override
     "lm_head": false}                                                # not quantized

A quantized Linear or Embedding stores `<path>.weight` (uint32, each row's
`in` values packed `32 / bits` to a word: [out, in * bits / 32]),
`<path>.scales` [out, in / group_size] and, in affine mode, `<path>.biases`
[out, in / group_size] (the other modes, mxfp4/nvfp4/mxfp8, keep uint8 scales
and no biases).

Which modules are quantized follows mlx-lm's `load_model`: a module named in
the per-layer overrides gets those parameters (`false`: left unquantized);
otherwise a Linear or Embedding is quantized exactly when the checkpoint has
`<path>.scales`, with group size and bits read off the stored shapes (so a
mixed-precision checkpoint loads even where the top-level default is wrong).
Quantization swaps modules before any weight is read (parameters stay lazy),
so the loader's strict check then expects `.scales`/`.biases` like any other
tensor and the sharding helpers see `QuantizedLinear` layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..errors import UserError

MODES = ("affine", "mxfp4", "nvfp4", "mxfp8")
AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUP_SIZES = (32, 64, 128)
# The modes other than affine allow one (bits, group_size) each; their scales are uint8.
_FIXED_MODES = {(4, 16): "nvfp4", (4, 32): "mxfp4", (8, 32): "mxfp8"}


@dataclass(frozen=True)
class QuantParams:
    group_size: int
    bits: int
    mode: str = "affine"

    def kwargs(self) -> dict:
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}

    def describe(self) -> str:
        return f"{self.bits}-bit {self.mode} (group size {self.group_size})"


@dataclass
class Quantization:
    """A checkpoint's quantization: the default and the per-module overrides
    (module path in the checkpoint's naming -> QuantParams, or None for
    "not quantized")."""

    default: QuantParams
    overrides: dict

    def to_config(self) -> dict:
        out = self.default.kwargs()
        for path, p in self.overrides.items():
            out[path] = False if p is None else p.kwargs()
        return out


def _params(obj, where: str, default: QuantParams | None = None) -> QuantParams:
    if not isinstance(obj, dict):
        raise UserError(f"config.json {where}: expected an object with group_size and bits, got {obj!r}")
    mode = obj.get("mode", default.mode if default else "affine")
    gs = obj.get("group_size", default.group_size if default else None)
    bits = obj.get("bits", default.bits if default else None)
    if mode not in MODES:
        raise UserError(f"config.json {where}: unknown quantization mode {mode!r} (known: {', '.join(MODES)})")
    for key, v in (("group_size", gs), ("bits", bits)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise UserError(f"config.json {where}: {key} must be a positive integer, got {v!r}")
    return QuantParams(gs, bits, mode)


def _quantization_config(config: dict):
    for src in (config, config.get("text_config")):
        if isinstance(src, dict) and src.get("quantization_config") is not None:
            where = "quantization_config" if src is config else "text_config.quantization_config"
            return src["quantization_config"], where
    return None, None


def foreign_quant_method(config: dict) -> str | None:
    """The `quant_method` of a non-MLX quantization_config (AWQ, GPTQ,
    bitsandbytes, fp8, gpt-oss MXFP4 blocks, ...), or None."""
    if config.get("quantization") is not None:
        return None
    q, _ = _quantization_config(config)
    return str(q["quant_method"]) if isinstance(q, dict) and "quant_method" in q else None


def read_quantization(config: dict) -> Quantization | None:
    """The checkpoint's MLX quantization from config.json, or None.

    `quantization` wins; else an MLX-style `quantization_config` (top level,
    or under text_config as multimodal conversions keep it). A
    `quantization_config` with a `quant_method` is another format and is not
    MLX quantization (None): such a checkpoint either holds plain weights
    (a dequantized upload) or fails strict loading, with a hint
    (`foreign_quant_method`)."""
    q, where = config.get("quantization"), "quantization"
    if q is None:
        q, where = _quantization_config(config)
        if q is None or (isinstance(q, dict) and "quant_method" in q):
            return None
    if not isinstance(q, dict):
        raise UserError(f"config.json {where}: expected an object, got {q!r}")
    default = _params(q, where)
    overrides = {}
    for key, v in q.items():
        if key in ("group_size", "bits", "mode"):
            continue
        if v is False:
            overrides[key] = None
        elif isinstance(v, dict):
            overrides[key] = _params(v, f"{where}[{key!r}]", default)
        # anything else (e.g. tool-specific scalar keys) is not a module path: ignored, as mlx-lm does
    return Quantization(default, overrides)


def _renamed_overrides(overrides: dict, sanitize) -> dict:
    """Override keys are module paths in the checkpoint's naming; the model's
    `sanitize` (a pure rename over tensor names) maps them to ours."""
    out = {}
    for path, p in overrides.items():
        for name in sanitize({f"{path}.weight": None}):
            if name.endswith(".weight"):
                out[name[: -len(".weight")]] = p
    return out


def infer_params(path: str, module: nn.Module, refs: dict) -> QuantParams:
    """Group size, bits and mode of `path` read off its stored tensors (the
    module is still unquantized, so its weight has the logical shape)."""
    if f"{path}.weight" not in refs:
        raise UserError(f"checkpoint has {path}.scales but no {path}.weight")
    w, s = refs[f"{path}.weight"], refs[f"{path}.scales"]
    shape = tuple(module.weight.shape)  # [out, in], or [E, out, in] for stacked experts (experts.SwitchLinear)
    in_dims = shape[-1]
    ok = (
        w.dtype == "U32"
        and len(w.shape) == len(shape) == len(s.shape)
        and tuple(w.shape[:-1]) == shape[:-1] == tuple(s.shape[:-1])
        and s.shape[-1] > 0
        and in_dims % s.shape[-1] == 0
        and (w.shape[-1] * 32) % in_dims == 0
    )
    if not ok:
        raise UserError(
            f"tensors {path}.weight ({w.dtype} {list(w.shape)}) and {path}.scales ({list(s.shape)}) "
            f"are not a quantized {list(shape)} matrix"
        )
    gs, bits = in_dims // s.shape[-1], (w.shape[-1] * 32) // in_dims
    if s.dtype != "U8":
        return QuantParams(gs, bits, "affine")
    if (bits, gs) in _FIXED_MODES:
        return QuantParams(gs, bits, _FIXED_MODES[(bits, gs)])
    raise UserError(f"{path}: cannot tell the quantization mode of {bits} bits with group size {gs} and uint8 scales")


def quantize_model(model: nn.Module, quant: Quantization, refs: dict) -> list[str]:
    """Swap in QuantizedLinear / QuantizedEmbedding wherever the checkpoint
    (and its overrides) say so. `refs` are the sanitized checkpoint tensors.
    Returns the quantized module paths."""
    overrides = _renamed_overrides(quant.overrides, model.sanitize)
    done = []

    def predicate(path, module):
        quantizable = hasattr(module, "to_quantized")
        if path in overrides:
            p = overrides[path]
            if p is None:
                return False
            if not quantizable:
                raise UserError(f"config.json quantizes {path}, a {type(module).__name__} (not a Linear or Embedding)")
        elif f"{path}.scales" not in refs:
            return False
        elif not quantizable:
            raise UserError(
                f"checkpoint has quantized tensors for {path}, a {type(module).__name__}, "
                f"which mlxcel-dist does not run quantized"
            )
        else:
            p = infer_params(path, module, refs)
        done.append(path)
        return p.kwargs()

    try:
        nn.quantize(model, class_predicate=predicate)
    except ValueError as e:  # mx.quantize refusing the bits / group size / shape
        where = f" ({done[-1]})" if done else ""
        raise UserError(f"cannot quantize the model as config.json says{where}: {e}") from None
    return done


def quantize_for_export(model: nn.Module, group_size: int, bits: int, mode: str = "affine") -> tuple[list, dict]:
    """Quantize every Linear and Embedding whose input dimension is a whole
    number of groups (as mlx-lm's convert does); weights must be loaded. A
    model's `quant_override(path)` (mlx-lm's `quant_predicate`) may give a
    layer its own {"group_size", "bits"}; returns the quantized paths and
    those overrides (config.json's `quantization` carries them)."""
    if mode != "affine":
        raise UserError(f"only affine quantization is written (got mode {mode!r})")
    if bits not in AFFINE_BITS:
        raise UserError(f"--bits must be one of {', '.join(map(str, AFFINE_BITS))}, got {bits}")
    if group_size not in AFFINE_GROUP_SIZES:
        raise UserError(f"--group-size must be one of {', '.join(map(str, AFFINE_GROUP_SIZES))}, got {group_size}")
    done, overrides = [], {}
    def predicate(path, module):
        own = model.quant_override(path) if hasattr(module, "to_quantized") else None
        if own is not None and module.weight.shape[-1] % own["group_size"] == 0:
            overrides[path] = own
            done.append(path)
            return own
        if not hasattr(module, "to_quantized") or module.weight.shape[-1] % group_size:
            return False
        done.append(path)
        return True

    nn.quantize(model, group_size, bits, mode=mode, class_predicate=predicate)
    mx.eval(model.parameters())
    return done, overrides


def quantized_col_ranges(ranges, group_size: int, bits: int, what: str = "layer"):
    """A sharded-to-all layer's input-column ranges in stored units:
    (packed uint32 ranges, scale/bias group ranges).

    Column range [start, stop) of the logical [out, in] matrix is words
    [start*bits/32, stop*bits/32) of the packed weight and groups
    [start/group_size, stop/group_size) of scales and biases. It has to cut
    whole quantization groups; otherwise UserError."""
    for s, e in ranges:
        if s % group_size or e % group_size or (s * bits) % 32 or (e * bits) % 32:
            raise UserError(
                f"{what}: each rank's input slice [{s}, {e}) ({e - s} columns) must be whole quantization groups "
                f"of {group_size}; use a rank count that gives whole groups, or a checkpoint quantized with a "
                f"smaller group size"
            )
    packed = [(s * bits // 32, e * bits // 32) for s, e in ranges]
    groups = [(s // group_size, e // group_size) for s, e in ranges]
    return packed, groups

