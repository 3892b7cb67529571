"""LoRA and DoRA adapters as `mlx_lm.lora` writes them (`--adapter-path DIR`).

DIR holds adapter_config.json (`fine_tune_type` lora | dora, `num_layers`,
`lora_parameters`: `rank`, `scale`, optional `keys`) and
adapters.safetensors: per adapted layer `<path>.lora_a` [in, r] and
`<path>.lora_b` [r, out] (DoRA adds `<path>.m` [out], the magnitudes), the
path being the layer's module path (mlx-lm's names are the checkpoint's, as
ours). Which layers are adapted is read from the tensors; `num_layers` and
`keys` only said which ones mlx-lm trained.

A layer's output becomes mlx-lm's (tuner/lora.py, tuner/dora.py):
  LoRA: y = x W^T + scale (x A) B + bias
  DoRA: y = m / |W + scale B^T A^T|_row * (x W^T + scale (x A) B) + bias
on the base layer as loaded (a quantized W stays quantized: its matmul is
the QuantizedLinear's). Under tensor parallelism A and B are cut with their
layer (`LoRALinear.attach`): an output-sliced layer (q/k/v, gate/up) keeps
B's columns of its rows (every KV slot it holds), an input-sliced one
(o_proj, down_proj) A's rows of its columns, so (x_r A_r) B is this rank's
part of the sum the layer's all_sum already makes: no collective is added
(the DoRA row norms of an input-sliced layer take one all_sum at load).
Under --pp a stage adapts its own layers only.

`fuse` writes W + scale B^T A^T (DoRA: times m / its row norms) into a float
checkpoint's weights (`convert --adapter-path`), as `mlx_lm.fuse --dequantize`.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import (AllToShardedLinear, QuantizedAllToShardedLinear, QuantizedShardedToAllLinear,
                                       ShardedToAllLinear)

from ..errors import UserError

CONFIG = "adapter_config.json"
WEIGHTS = "adapters.safetensors"
KINDS = ("lora", "dora")
_ROWS = (nn.Linear, nn.QuantizedLinear, AllToShardedLinear, QuantizedAllToShardedLinear)  # whole or output-sliced
_COLS = (ShardedToAllLinear, QuantizedShardedToAllLinear)  # input-sliced, then all_sum


class Adapter:
    """An adapter directory read and checked: `kind`, `rank`, `scale`, and
    `layers` {module path: {"lora_a", "lora_b"[, "m"]}: mx.array}."""

    def __init__(self, path):
        from ..checkpoint.shardcache import local_adapter

        self.path = local_adapter(path) or Path(path).expanduser()
        if not self.path.is_dir():
            raise UserError(f"--adapter-path {path}: no such directory")
        cfg_file, weights = self.path / CONFIG, self.path / WEIGHTS
        for f in (cfg_file, weights):
            if not f.is_file():
                raise UserError(f"--adapter-path {path}: no {f.name} (mlx_lm.lora writes {CONFIG} and {WEIGHTS})")
        try:
            cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"{cfg_file}: not a JSON file ({e})") from None
        if not isinstance(cfg, dict):
            raise UserError(f"{cfg_file}: not a JSON object")
        self.kind = cfg.get("fine_tune_type", "lora")
        if self.kind not in KINDS:
            raise UserError(f"{cfg_file}: fine_tune_type {self.kind!r} is not an adapter (lora or dora; a 'full' "
                            "fine-tune's weights are a checkpoint of their own)")
        p = cfg.get("lora_parameters")
        if not isinstance(p, dict) or not isinstance(p.get("rank"), int) or not isinstance(p.get("scale"), (int, float)):
            raise UserError(f"{cfg_file}: lora_parameters needs an integer rank and a number scale "
                            "(mlx-lm's names: scale, not alpha)")
        self.rank, self.scale = int(p["rank"]), float(p["scale"])
        try:
            tensors = mx.load(str(weights))
        except Exception as e:  # a truncated or foreign file: MLX's own message
            raise UserError(f"{weights}: cannot read it ({e})") from None
        self.layers: dict = {}
        for name, t in tensors.items():
            path, _, leaf = name.rpartition(".")
            if leaf not in ("lora_a", "lora_b", "m") or not path:
                raise UserError(f"{weights}: tensor {name!r} is not a LoRA/DoRA parameter (lora_a, lora_b, m)")
            self.layers.setdefault(path, {})[leaf] = t.astype(mx.float32) if leaf == "m" else t
        if not self.layers:
            raise UserError(f"{weights}: no adapter tensors")
        want = {"lora_a", "lora_b"} | ({"m"} if self.kind == "dora" else set())
        for path, parts in self.layers.items():
            if set(parts) != want:
                raise UserError(f"{weights}: {path} has {', '.join(sorted(parts))}; a {self.kind} layer has "
                                f"{', '.join(sorted(want))}")
            a, b = parts["lora_a"], parts["lora_b"]
            if a.ndim != 2 or b.ndim != 2 or a.shape[1] != self.rank or b.shape[0] != self.rank:
                raise UserError(f"{weights}: {path} has lora_a {list(a.shape)} and lora_b {list(b.shape)}, "
                                f"not [in, {self.rank}] and [{self.rank}, out] (rank {self.rank})")
            if "m" in parts and parts["m"].shape != (b.shape[1],):
                raise UserError(f"{weights}: {path}.m has shape {list(parts['m'].shape)}, expected [{b.shape[1]}]")

    def check(self, model) -> None:
        """Every adapted path is a linear layer of `model` (built, not yet
        loaded or sharded) of the adapter's shapes: before any rank starts."""
        modules = dict(model.named_modules())
        for path, parts in sorted(self.layers.items()):
            m = modules.get(path)
            if m is None:
                raise UserError(f"--adapter-path {self.path}: it adapts {path}, which this model does not have "
                                f"({_hint(path, modules)})")
            if not isinstance(m, (nn.Linear, nn.QuantizedLinear)):
                raise UserError(f"--adapter-path {self.path}: {path} is a {type(m).__name__}, not a linear layer "
                                "(adapters on embeddings or stacked experts are not supported)")
            out_dims, in_dims = _dims(m)
            a, b = parts["lora_a"], parts["lora_b"]
            if (a.shape[0], b.shape[1]) != (in_dims, out_dims):
                raise UserError(f"--adapter-path {self.path}: {path} is [{out_dims}, {in_dims}] but the adapter "
                                f"is for [{b.shape[1]}, {a.shape[0]}]")


def _hint(path: str, modules: dict) -> str:
    parts = path.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            n = sum(1 for k in modules if k.count(".") == i and k.startswith(".".join(parts[:i]) + ".")
                    and k.split(".")[i].isdigit())
            if int(p) >= n:
                return f"its layers are 0..{n - 1}"
    return "no module of that name"


def _dims(m) -> tuple[int, int]:
    """(out, in) of a linear layer as the model computes it (packed words unpacked)."""
    out_dims, in_dims = m.weight.shape
    if "scales" in m:
        in_dims = in_dims * 32 // m.bits
    return out_dims, in_dims


def _dequantized(m) -> mx.array:
    if "scales" in m:
        return mx.dequantize(m["weight"], m["scales"], m.get("biases"), group_size=m.group_size, bits=m.bits,
                             mode=m.mode)
    return m["weight"]


def _matmul(m, x):
    """x W^T of the base layer, without its bias or all_sum."""
    if "scales" in m:
        return mx.quantized_matmul(x, m["weight"], scales=m["scales"], biases=m.get("biases"), transpose=True,
                                   group_size=m.group_size, bits=m.bits, mode=m.mode)
    return x @ m["weight"].T


def _all_sum(m, x):
    tp = getattr(m, "tp", None)  # shard.SumShardedToAll: the job's Group (a pipeline stage's ChainGroup)
    return tp.all_sum(x) if tp is not None else mx.distributed.all_sum(x, group=m.group)


def _cut(x: mx.array, axis: int, ranges) -> mx.array:
    parts = [x[(slice(None),) * axis + (slice(a, b),)] for a, b in ranges]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=axis)


class LoRALinear(nn.Module):
    """A base linear layer (any of its TP forms) plus its adapter; the base
    stays a child (`base`), so its parameters and ShardSpec are untouched."""

    def __init__(self, base: nn.Module, a: mx.array, b: mx.array, scale: float, norm_scale: mx.array | None):
        super().__init__()
        self.base = base
        self.lora_a, self.lora_b = a, b  # [in, r], [r, out] (this rank's slices), the base's dtype
        self.scale = scale
        self.norm_scale = norm_scale  # DoRA: m / |W + scale B^T A^T|_row [out], else None
        self.reduce = isinstance(base, _COLS)

    @staticmethod
    def attach(base: nn.Module, parts: dict, scale: float, spec) -> "LoRALinear":
        """`spec`: the base weight's (axis, ranges) in stored units, or None
        (not sharded)."""
        a, b = parts["lora_a"], parts["lora_b"]
        if spec is not None:
            axis, ranges = spec
            if axis == 0:  # output rows: B's columns
                b = _cut(b, 1, ranges)
            else:  # input columns (packed words when quantized): A's rows
                if "scales" in base:
                    ranges = [(s * 32 // base.bits, e * 32 // base.bits) for s, e in ranges]
                a = _cut(a, 0, ranges)
        # A and B keep their stored dtype (float32 from mlx_lm.lora), as mlx-lm computes with them
        dtype = base["scales"].dtype if "scales" in base else base["weight"].dtype
        norm_scale = None
        if "m" in parts:
            w = _dequantized(base)
            adapted = w + (scale * b.T) @ a.T  # this rank's rows or columns of W + scale B^T A^T
            sq = (adapted.astype(mx.float32) ** 2).sum(axis=1)
            if isinstance(base, _COLS):
                sq = _all_sum(base, sq)  # each row's other columns are on the other ranks
            m = parts["m"] if spec is None or spec[0] != 0 else _cut(parts["m"], 0, spec[1])
            norm_scale = (m / mx.sqrt(sq)).astype(dtype)
        return LoRALinear(base, a, b, scale, norm_scale)

    def __call__(self, x: mx.array) -> mx.array:
        base = self.base
        y = _matmul(base, x) + (self.scale * ((x @ self.lora_a) @ self.lora_b)).astype(x.dtype)
        if self.norm_scale is not None:
            y = self.norm_scale * y  # linear, so an input-sliced layer may scale its part before the sum
        if self.reduce:
            y = _all_sum(base, y)
        return y + base["bias"] if "bias" in base else y


def apply_adapter(model, adapter: Adapter) -> int:
    """Wrap every adapted layer this rank holds (after sharding and loading);
    returns how many. A path another pipeline stage holds is not here."""
    from ..parallel.shard import collect_plan

    plan = collect_plan(model)
    modules = dict(model.named_modules())
    done = []
    for path, parts in sorted(adapter.layers.items()):
        base = modules.get(path)
        if base is None or not isinstance(base, _ROWS + _COLS):
            continue  # another stage's layer (checked before launch: every path exists in the model)
        done.append((path, LoRALinear.attach(base, parts, adapter.scale, plan.get(f"{path}.weight"))))
    if done:
        from mlx.utils import tree_unflatten

        model.update_modules(tree_unflatten(done))
        mx.eval(model.parameters())
    return len(done)


def fuse(weights: dict, adapter: Adapter) -> dict:
    """Checkpoint tensors {name: array} with the adapter merged into the
    adapted layers' float weights (`convert --adapter-path`)."""
    out = dict(weights)
    for path, parts in adapter.layers.items():
        name = f"{path}.weight"
        if name not in out:
            raise UserError(f"--adapter-path {adapter.path}: the checkpoint has no {name}")
        if f"{path}.scales" in out:
            raise UserError(f"--adapter-path {adapter.path}: {path} is quantized in this checkpoint; fuse into the "
                            "float checkpoint, then quantize (convert --adapter-path ... --quantize)")
        w = out[name]
        a, b = parts["lora_a"].astype(mx.float32), parts["lora_b"].astype(mx.float32)
        fused = w.astype(mx.float32) + (adapter.scale * b.T) @ a.T
        if "m" in parts:
            fused = (parts["m"] / mx.linalg.norm(fused, axis=1))[:, None] * fused
        out[name] = fused.astype(w.dtype)
    return out
