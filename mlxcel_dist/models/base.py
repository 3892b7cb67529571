"""What every model file shares: config parsing and the per-layer kinds.

A model file defines `ModelArgs(BaseModelArgs)` whose fields are config.json
keys, `Model(args)` with `__call__(inputs [B, L] int32, cache=None) ->
logits [B, L, vocab]`, `make_cache()`, `sanitize(weights)` (pure dict -> dict
over weight names) and `shard(group)`.
"""

from __future__ import annotations

import dataclasses

from ..errors import UserError

SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclasses.dataclass
class BaseModelArgs:
    @classmethod
    def from_dict(cls, params: dict):
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in params.items() if k in names})
        except TypeError as e:  # a required key is missing
            raise UserError(f"config.json for {cls.__module__.rsplit('.', 1)[-1]}: {e}") from None


def derive_layer_types(
    layer_types: list | None,
    num_layers: int,
    sliding_window: int | None,
    sliding_window_pattern: int | None = None,
) -> list[str]:
    """The single source of sliding vs full per layer.

    `layer_types` (transformers 5, and newer 4.x configs) wins; else the legacy
    `sliding_window_pattern` P makes every P-th layer full; else every layer is
    sliding when a window is set (mistral) and full otherwise.
    """
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise UserError(f"config layer_types has {len(layer_types)} entries for {num_layers} layers")
        bad = sorted({t for t in layer_types if t not in (SLIDING, FULL)})
        if bad:
            raise UserError(f"config layer_types has unsupported kinds {bad} (supported: {SLIDING}, {FULL})")
        types = list(layer_types)
    elif sliding_window_pattern:
        p = int(sliding_window_pattern)
        types = [SLIDING if (i + 1) % p else FULL for i in range(num_layers)]
    else:
        types = [SLIDING if sliding_window else FULL] * num_layers
    if SLIDING in types and not sliding_window:
        raise UserError("config has sliding_attention layers but no sliding_window")
    return types


def describe_layers(model) -> list[str]:
    """One line per layer for `mlxcel-dist info`: attention kind, window, RoPE."""
    out = []
    for i, (kind, layer) in enumerate(zip(model.args.layer_types, model.layers)):
        attn = layer.self_attn
        what = f"sliding (window {attn.window})" if kind == SLIDING else "full"
        rope = f"rope {attn.rope.describe()}" if attn.rope is not None else "no rope"
        out.append(f"{i}: {what}, {rope}")
    return out


# RoPE types whose pretraining length transformers fills in when absent.
_NEEDS_ORIGINAL_MAX = ("llama3", "yarn", "longrope")


def single_rope_params(
    rope_parameters: dict | None,
    rope_scaling: dict | None,
    rope_theta: float | None,
    max_position_embeddings: int,
    original_max_position_embeddings: int | None = None,
    default: dict | None = None,
) -> dict:
    """One RoPE params dict (transformers-5 form) for a model whose layers all
    share one RoPE, read as transformers' `RotaryEmbeddingConfigMixin` does:

    - transformers 4 `rope_scaling` wins over 5's `rope_parameters` (then the
      family's `default`); its legacy "type" key names the rope_type;
    - `rope_theta` fills in only when the dict has none (10000 when absent);
    - llama3/yarn/longrope get `original_max_position_embeddings` from a
      top-level key of that name when the config has one (it overrides),
      else from max_position_embeddings.
    """
    params = rope_scaling or rope_parameters or default or {}
    if not isinstance(params, dict):
        raise UserError(f"config rope_parameters/rope_scaling must be an object, got {params!r}")
    if SLIDING in params or FULL in params:
        raise UserError("config has per-layer-kind rope_parameters, which this model does not support")
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", 10_000.0 if rope_theta is None else rope_theta)
    factor = params.get("partial_rotary_factor")
    if factor is not None and float(factor) != 1.0:
        # transformers' default RoPE for these families ignores it and the others break.
        raise UserError(f"config partial_rotary_factor {factor} is not supported for this model_type")
    if params["rope_type"] in _NEEDS_ORIGINAL_MAX:
        if original_max_position_embeddings is not None:
            params["original_max_position_embeddings"] = original_max_position_embeddings
        else:
            params.setdefault("original_max_position_embeddings", max_position_embeddings)
    return params
