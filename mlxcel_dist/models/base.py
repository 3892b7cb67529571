"""What every model file shares: the model contract, config parsing and
the per-layer kinds.

A model file defines `ModelArgs(BaseModelArgs)` whose fields are config.json
keys and a `Model(args)` that fulfils `LanguageModel` (below): `__call__`,
`make_cache`, `masks`, `sanitize`, `shard`, `collectives_per_token`, the
`engine` slot and its declared capabilities (`stage`, `own_loop`,
`split_decode`, `pipeline_stages`, `kv_bits_refused`, ...: read, never
probed with getattr). `CausalLM` fulfils it for the usual decoder, with
every capability's default.

The decoder-stack loop (`run_layers`) and the `Model` wrapper around it
(`CausalLM`: output head, `layers`, `make_cache`, `sanitize`, `shard`) are
shared here; what a family does differently stays explicit in its own file.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx
import mlx.nn as nn

from ..cache import FULL, SLIDING, SharedKVCache, make_layer_caches
from ..parallel.collectives import SINGLE, Group
from ..errors import UserError
from ..cache import layer_masks
from ..parallel.partition import split_ranges
from ..parallel.shard import plan_sharded_linears, shard_layers, vocab_parallel_logits

__all__ = ["FULL", "SLIDING", "LanguageModel", "Capabilities", "BaseModelArgs", "CausalLM", "DecoderStack"]


@runtime_checkable
class LanguageModel(Protocol):
    """What the engine, the loader, decode.py and bench ask of a model.

    - `args`: the ModelArgs (at least `vocab_size`; `layer_types`);
    - `__call__(inputs [B, L] int32, cache=None) -> logits [B, L, vocab]`;
    - `make_cache()`: one `cache.LayerCache` per layer (or None: no cache);
    - `masks(L, cache)`: one mask per attention kind for L new tokens;
    - `sanitize(weights)`: pure dict -> dict over checkpoint names;
    - `shard(group)`: tensor parallelism applied after construction;
    - `collectives_per_token()`: {op: (calls, payload bytes)} that one
      single-token forward issues on this rank (bench checks its counts
      against it);
    - `engine`: None until `generation.batch_engine` keeps the model's
      batch engine there (generate, bench, sequence_logits' decode: its
      compiled steps' traces reused).

    Capabilities, declared (as vLLM's `SupportsPP`), never probed;
    `Capabilities` (CausalLM's base) holds the defaults, a family sets what it has:
    - `stage`: this rank's `pipeline.Stage` under --pp, else None;
    - `own_loop`: `generate_ids(prompt_ids, max_tokens, sampling, eos_ids,
      group)` is its generation loop (generation.OneRowEngine: one request
      at a time, no logprobs);
    - `split_decode`: a one-row step may run its layers' pre / attend /
      post as segments (decode.SplitSegments), the last ending in
      `decode_logits(h)`;
    - `pipeline_stages`: it runs in --pp stages (pipeline.py), cut where
      `stage_cuts()` allows, sending `stage_send_width(stop)` values a token;
    - `kv_bits_refused`: why --kv-bits cannot serve it (None: it can);
    - `kv_options`: the `cache.KVOptions` applied to it (None: plain caches);
    - `describe_layers()`, `quant_override(path)`, `export_for_mlx_lm(weights,
      config)`, `mlx_lm_path(path, config)`: info's and convert's hooks.
    """

    args: Any
    engine: Any
    own_loop: bool
    split_decode: bool
    pipeline_stages: bool
    kv_bits_refused: str | None
    kv_options: Any

    @property
    def stage(self): ...

    def __call__(self, inputs: mx.array, cache=None) -> mx.array: ...

    def make_cache(self) -> list | None: ...

    def masks(self, L: int, cache) -> dict: ...

    def sanitize(self, weights: dict) -> dict: ...

    def shard(self, group: Group) -> None: ...

    def collectives_per_token(self) -> dict: ...

    def decode_logits(self, h: mx.array) -> mx.array: ...

    def stage_cuts(self) -> list | None: ...

    def stage_send_width(self, stop: int) -> int: ...

    def describe_layers(self) -> list[str]: ...

    def quant_override(self, path: str) -> dict | None: ...

    def export_for_mlx_lm(self, weights: dict, config: dict) -> tuple[dict, dict]: ...

    def mlx_lm_path(self, path: str, config: dict) -> str: ...


class Capabilities:
    """The declared capabilities' defaults (LanguageModel's list): CausalLM
    has them; a model of its own (a test's toy) inherits them too."""

    stage = None  # CausalLM: its stack's (pipeline.make_stage sets it)
    own_loop = False  # True: `generate_ids` is its generation loop (diffusion_gemma)
    split_decode = False  # True: its layers have pre/attend/post (blocks.PreNormBlock's), decode may split
    pipeline_stages = False  # True: runs in --pp stages (pipeline.py)
    kv_bits_refused = None  # why --kv-bits cannot serve it (a string), None: it can
    kv_options = None  # cache.KVOptions.apply: the --max-kv-size / --kv-bits it runs with
    ranks = 1  # the ranks its forward runs across (loader.build_rank): > 1, collectives in its forwards


@dataclasses.dataclass
class BaseModelArgs:
    @classmethod
    def from_dict(cls, params: dict):
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in params.items() if k in names})
        except TypeError as e:  # a required key is missing
            raise UserError(f"config.json for {cls.__module__.rsplit('.', 1)[-1]}: {e}") from None

    def one_rope(self, default: dict | None = None, theta: float | None = None) -> dict:
        """`single_rope_params` of this config's own keys (rope_parameters,
        rope_scaling, rope_theta or `theta`, max_position_embeddings,
        original_max_position_embeddings; those a family lacks are None)."""
        get = lambda key: getattr(self, key, None)  # noqa: E731
        return single_rope_params(get("rope_parameters"), get("rope_scaling"), get("rope_theta") if theta is None
                                  else theta, self.max_position_embeddings,
                                  get("original_max_position_embeddings"), default=default)


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
    """One line per layer for `mlxcel-dist info`: attention kind, window, RoPE
    (`CausalLM.describe_layers`' default; families add their own parts)."""
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


def run_layers(h, layers, layer_types: list, cache, masks: dict):
    """Run the decoder layers over h [B, L, hidden]: each layer gets its
    kind's mask (built once per forward, before any cache update) and its own
    cache entry (None without a cache)."""
    cache = cache if cache is not None else [None] * len(layers)
    for layer, kind, c in zip(layers, layer_types, cache):
        h = layer(h, masks[kind], c)
    return h


def kv_sharing_cuts(kv_source: list) -> list[int]:
    """The layers i a pipeline stage may start at when layer j reads the KV
    of layer kv_source[j] (None: its own): no reader on or after i whose
    source is before i, so each reader sits on its source's stage (the KV
    never travels: it would be the whole cache, every step)."""
    n = len(kv_source)
    return [i for i in range(1, n) if not any(s is not None and s < i <= j for j, s in enumerate(kv_source))]


def shared_kv_caches(layer_types: list, window, kv_source: list, start: int = 0) -> list:
    """One cache per layer of `layer_types` (a stage's layers, the first
    being layer `start`); a layer reading another's KV (kv_source, global
    indices) gets a SharedKVCache on its source's cache, whose `reads_layer`
    is the source's index in this list (decode.py re-points it there)."""
    caches = make_layer_caches(layer_types, window)
    for i, src in enumerate(kv_source):
        if src is not None:
            caches[i] = SharedKVCache(caches[src - start], src - start)
    return caches


def send_packed(stage, parts: list) -> mx.array:
    """Send [B, L, w_k] arrays to the next stage as one [B, L, sum w_k]
    message in the stage's dtype (hidden state plus what else a layer kind
    hands on): one send per hop, since MLX's recv takes no inputs and two
    receives in one graph have no order to match the sender's two sends."""
    parts = [x.astype(stage.dtype) for x in parts]
    return stage.send_tensor(parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1))


def receive_packed(stage, B: int, L: int, widths: list) -> list:
    """The previous stage's `send_packed` message, split back into [B, L, w_k] arrays."""
    x = stage.receive_tensor((B, L, sum(widths)), stage.dtype)
    bounds = [0]
    for w in widths:
        bounds.append(bounds[-1] + w)
    return [x[..., a:b] for a, b in zip(bounds, bounds[1:])]


class DecoderStack(nn.Module):
    """The decoder stack every family shares: `embed_tokens`, then `layers`
    (run by `run_layers` with the masks of `masks()`, built from the
    config's `sliding_window`), then the final `norm`. A family's `__init__` calls this one (which
    sets `args` and `embed_tokens`) and then builds its own `layers` and
    `norm`; `embed` is the hook for what it does to the embeddings.
    Under --pp the first stage alone holds `first_stage_parts`, the last
    alone `last_stage_parts` (pipeline.stage_parts)."""

    first_stage_parts = ("embed_tokens",)
    last_stage_parts = ("norm",)

    def __init__(self, args):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.stage = None  # pipeline.Stage under --pp (pipeline.make_stage): this rank's layers

    def embed(self, inputs):
        return self.embed_tokens(inputs)

    @property
    def stage_layers(self) -> list:
        """The layers this rank runs: all of them, or its pipeline stage's."""
        if self.stage is None:
            return self.layers
        return self.layers[self.stage.start : self.stage.stop]

    @property
    def stage_layer_types(self) -> list:
        """The kinds of `stage_layers` (what the caches and masks of this rank are for)."""
        if self.stage is None:
            return self.args.layer_types
        return self.args.layer_types[self.stage.start : self.stage.stop]

    def masks(self, L: int, cache) -> dict:
        """One mask per attention kind for L new tokens (`cache.layer_masks`)
        of this rank's layers (`cache`: their caches)."""
        return layer_masks(L, cache, self.stage_layer_types, getattr(self.args, "sliding_window", None))

    @property
    def stage_span(self) -> tuple[int, int]:
        """[start, stop) of the layers this rank runs."""
        return (0, len(self.layers)) if self.stage is None else (self.stage.start, self.stage.stop)

    def __call__(self, inputs, cache=None):
        stage = self.stage
        if stage is not None:
            stage.begin()
        if stage is None or stage.first:
            h = self.embed(inputs)
        else:  # the previous stage's hidden states
            h = stage.receive(*inputs.shape)
        h = run_layers(h, self.stage_layers, self.stage_layer_types, cache, self.masks(inputs.shape[1], cache))
        if stage is not None and not stage.last:
            return stage.pass_on(h)  # CausalLM.head turns it into zeros for the logits' all_sum
        return self.norm(h)


class CausalLM(nn.Module, Capabilities):
    """The `Model` wrapper every family shares: `self.model` (the decoder
    stack, with `embed_tokens` and `layers`) plus an output head that is
    `lm_head` or, with `tie_word_embeddings`, the embedding matrix.

    Attribute names are the checkpoint's weight names (`model.*`, `lm_head.*`).
    Families override `__call__` (softcaps, logit scales), `sanitize` (name
    maps, refusals) or `shard` (extra per-rank state) where they differ, and
    declare the capabilities they have (`Capabilities`: own_loop,
    split_decode, pipeline_stages, kv_bits_refused).
    """

    # Drop `*rotary_emb.inv_freq` buffers that some older conversions saved.
    drop_rotary_buffers = False

    def __init__(self, args, model: nn.Module):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = model
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.head_group = SINGLE  # shard_head: the group that splits the head's vocabulary
        self._head_rows = None  # shard_head: every rank's [start, stop) of the vocabulary
        self.engine = None  # generation.batch_engine keeps the model's BatchEngine here

    def masks(self, L: int, cache) -> dict:
        return self.model.masks(L, cache)

    @property
    def stage(self):
        """This rank's `pipeline.Stage` under --pp (the stack's, set by
        pipeline.make_stage), else None."""
        return self.model.stage

    def __call__(self, inputs, cache=None):
        return self.head(self.model(inputs, cache))

    def head(self, h):
        """Logits of the final hidden states h [B, L, hidden]. After
        `shard_head` each rank computes only its vocabulary slice from the
        (replicated) head weights and one all_gather joins the slices: the
        same logits on every rank for 1/N of the head's work."""
        stage = self.stage
        if stage is not None:  # pipeline: the last stage's logits on every rank (pipeline.Stage.logits)
            return stage.logits(self._head, h, self.args.vocab_size)
        return self._head(h)

    def _head(self, h):
        layer = self.head_layer
        if not self.head_group.single:
            return vocab_parallel_logits(layer, h, self.head_group, self._head_rows)
        return layer.as_linear(h) if self.args.tie_word_embeddings else layer(h)

    @property
    def head_layer(self) -> nn.Module:
        return self.model.embed_tokens if self.args.tie_word_embeddings else self.lm_head

    def decode_logits(self, h):
        """Logits of the final hidden state of a split decode step (as
        __call__ after its layers); a family with its own arithmetic after
        the head (softcaps) overrides it."""
        return self.head(self.model.norm(h))

    def shard_head(self, group: Group):
        """Split the output head's work by vocabulary rows (`head`), as
        `split_ranges` cuts them (uneven when the ranks do not divide V, or
        with rank weights); the weights stay whole on every rank (tied
        embeddings need every row for the input lookup)."""
        stage = self.stage
        if stage is not None and not stage.last:  # no head on this pipeline stage
            return
        if not group.single and self.args.vocab_size >= group.size():
            self._head_rows = split_ranges(self.args.vocab_size, group.size(), group.weights)
            self.head_group = group

    def collectives_per_token(self) -> dict:
        """{op: (calls, payload bytes)} of one single-token forward on this
        rank: an all_sum per sharded-to-all projection (`shard.
        plan_sharded_linears`) and the vocabulary-split head's all_gather
        ([rows, 1] in the head's dtype, rows the largest rank's share: the
        slices are padded to it). Families that add collectives extend it."""
        plan = {"all_sum": plan_sharded_linears(self), "all_gather": (0, 0)}
        stage = self.stage
        if stage is not None:  # a pipeline: the logits' all_sum ([1, 1, V] in the hidden dtype), every rank
            calls, nbytes = plan["all_sum"]
            plan["all_sum"] = (calls + 1, nbytes + self.args.vocab_size * stage.dtype.size)
        if not self.head_group.single:
            head = self.head_layer
            dt = (head.scales if "scales" in head else head.weight).dtype
            per = max(e - s for s, e in self._head_rows)
            plan["all_gather"] = (1, per * dt.size)
        handoff = stage.handoff if stage is not None else None
        if handoff is not None:  # --pp-handoff collective: an all_gather of [1, 1, width] per hop it takes part in
            calls, nbytes = plan["all_gather"]
            hops = sorted(handoff.hops)
            plan["all_gather"] = (calls + len(hops), nbytes + sum(handoff.widths[k] for k in hops) * stage.dtype.size)
        return plan

    @property
    def layers(self):
        """The layers this rank runs (under --pp: its stage's; `self.model.layers` keeps every name)."""
        return self.model.layers if self.stage is None else self.model.stage_layers

    def stage_cuts(self) -> list | None:
        """The layers a pipeline stage may start at (None: any): with KV
        sharing (`args.kv_source`, gemma3n / gemma4) a layer stays on the
        stage of the layer whose KV it reads (`kv_sharing_cuts`)."""
        kv_source = getattr(self.args, "kv_source", None)
        return None if kv_source is None else kv_sharing_cuts(kv_source)

    def stage_send_width(self, stop: int) -> int:
        """Values per token that a pipeline stage ending before layer `stop`
        sends on (plan's per-token sends): the hidden state; families that
        hand on more (gemma3n, gemma4) say so."""
        return self.args.hidden_size

    def make_cache(self):
        """One cache per layer this rank runs."""
        kinds = self.args.layer_types if self.stage is None else self.model.stage_layer_types
        return make_layer_caches(kinds, getattr(self.args, "sliding_window", None))

    def describe_layers(self) -> list[str]:
        """`mlxcel-dist info`'s line per layer (families with more to say override it)."""
        return describe_layers(self)

    def quant_override(self, path: str) -> dict | None:
        """convert's own {"group_size", "bits"} for the layer at `path` (mlx-lm's
        `quant_predicate`); None: the run's."""
        return None

    def export_for_mlx_lm(self, weights: dict, config: dict) -> tuple[dict, dict]:
        """The weights and config as mlx-lm's model reads them (convert): ours, unless a family differs."""
        return weights, config

    def mlx_lm_path(self, path: str, config: dict) -> str:
        """A module path of ours as mlx-lm names it (a `quant_override`'s key in config.json)."""
        return path

    def sanitize(self, weights: dict) -> dict:
        """Drop a stored copy of the tied output head (and, with
        `drop_rotary_buffers`, saved RoPE buffers)."""
        tied = self.args.tie_word_embeddings
        out = {}
        for name, w in weights.items():
            if self.drop_rotary_buffers and name.endswith("rotary_emb.inv_freq"):
                continue
            if tied and name == "lm_head.weight":
                continue
            out[name] = w
        return out

    def shard(self, group: Group):
        shard_layers(self.layers, group)
        self.shard_head(group)
