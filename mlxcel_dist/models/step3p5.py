"""Step-3.5 / Step-3.7 text decoder (`step3p5`; the text tower of the
multimodal `step3p7`), as transformers' step3p7 code runs it.

Hidden states [B, L, hidden]; q [B, n_heads, L, head_dim], k/v [B,
n_kv_heads, L, head_dim] (per-rank counts under tensor parallelism). Sliding
layers may have another query-head count than full layers (the KV heads and
head_dim are shared). Per layer:

- attention: q/k normalised per head by a (1 + w) RMSNorm, RoPE per layer kind
  (its own theta and partial_rotary_factor: only the first `dims` features of
  each head rotate, the rest pass through), scores scaled by
  query_pre_attn_scalar ** -0.5, and a per-head sigmoid output gate:
  g_proj [n_heads, hidden] gives g [B, L, n_heads]; out[:, h] *= sigmoid(g[..., h]);
- MLP, dense layers: SwiGLU clamped as silu(gate).clamp(max=l) * up.clamp(-l, l)
  with l the layer's `swiglu_limits_shared` entry (None or 0: no clamp);
- MLP, sparse layers (`moe`): a sigmoid router (gate [E, hidden], scores
  chosen with router_bias [E] added, weights = the chosen sigmoids divided by
  their sum, times moe_router_scaling_factor) over stacked experts
  moe.gate_proj / moe.up_proj [E, I, hidden], moe.down_proj [E, hidden, I]
  clamped by `swiglu_limits`, plus an always-on `share_expert` (a dense MLP
  clamped by `swiglu_limits_shared`).
Norms are Gemma-style (1 + w, fp32).

Weight names are the hub layout (`model.layers.N.moe.{gate,router_bias,
gate_proj,up_proj,down_proj}`, `share_expert.*`); `sanitize` maps what
transformers' text model saves (`mlp.gate.weight`, `mlp.gate.
e_score_correction_bias`, `mlp.experts.gate_up_proj` [E, 2I, hidden] = gate
rows then up rows, `mlp.experts.down_proj`, `mlp.shared_experts.*`) and the
multimodal prefixes (`model.language_model.*`; vision tower and projector
dropped) onto it.

Tensor parallelism: heads split (g_proj rows with them), dense MLPs split by
columns, every expert (routed and shared) split on its intermediate
dimension (--moe-split experts: each rank whole routed experts), the router replicated; a sparse layer's routed and shared partial
sums go through one all_sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..nn.attention import causal_attention
from ..nn.blocks import Attention
from ..parallel.collectives import SINGLE
from ..errors import UserError
from ..nn.experts import SwitchGLU, top_k
from ..nn.layers import GemmaRMSNorm
from ..nn.rope import RoPE
from ..parallel.shard import (
    rank_heads,
    shard_attention,
    shard_expert_mlps,
    shard_head_vector,
    shard_mlp,
    shard_switch_glu,
)
from ..checkpoint.weights import View
from .base import FULL, SLIDING, BaseModelArgs, CausalLM, DecoderStack, derive_layer_types, describe_layers

# transformers' Step3p7TextConfig aliases (attribute_map) -> field names
ALIASES = {
    "num_attention_groups": "num_key_value_heads",
    "moe_num_experts": "n_routed_experts",
    "num_local_experts": "n_routed_experts",
    "moe_top_k": "num_experts_per_tok",
    "share_expert_dims": "share_expert_dim",
    "num_mtp_layers": "num_nextn_predict_layers",
}
# transformers' text-model names -> the hub layout (gate_up_proj is split in sanitize)
RENAMES = (
    (".mlp.experts.down_proj", ".moe.down_proj.weight"),
    (".mlp.gate.weight", ".moe.gate.weight"),
    (".mlp.gate.e_score_correction_bias", ".moe.router_bias"),
    (".mlp.shared_experts.", ".share_expert."),
)
# Multimodal checkpoint parts that are not the text decoder.
NOT_TEXT = ("vision_model.", "vit_large_projector.", "model.vision_model.", "model.multi_modal_projector.")


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = "step3p5"
    vocab_size: int = 128815
    hidden_size: int = 4096
    intermediate_size: int = 11264
    num_hidden_layers: int = 45
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 128
    num_sliding_attention_heads: int | None = None
    attention_other_setting: dict | None = None
    per_layer_config: dict | None = None
    sliding_window: int | None = None
    layer_types: list | None = None
    mlp_layer_types: list | None = None
    moe_layers_enum: str | list | None = None
    num_nextn_predict_layers: int = 0
    n_routed_experts: int = 288
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 1280
    share_expert_dim: int = 1280
    moe_router_scaling_factor: float = 1.0
    swiglu_limits: list | None = None
    swiglu_limits_shared: list | None = None
    rope_theta: float | list | None = None
    partial_rotary_factors: list | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    query_pre_attn_scalar: float | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 128000
    attention_bias: bool = False
    mlp_bias: bool = False
    gating: bool | str = True
    use_bidirectional_attention: bool = False
    tie_word_embeddings: bool = False

    @classmethod
    def from_dict(cls, params: dict):
        # Multimodal (`step3p7`) checkpoints nest the text model under text_config.
        if isinstance(params.get("text_config"), dict):
            params = {**params["text_config"], "model_type": params.get("model_type", "step3p7")}
        params = dict(params)
        for alias, name in ALIASES.items():
            if alias in params and name not in params:
                params[name] = params[alias]
        return super().from_dict(params)

    def __post_init__(self):
        n = self.num_hidden_layers
        self._trim_mtp_padding()
        if self.attention_bias or self.mlp_bias:
            raise UserError("step3p5: attention_bias / mlp_bias are not supported")
        if self.use_bidirectional_attention:
            raise UserError("step3p5: use_bidirectional_attention is not supported")
        if not (self.gating is True or self.gating == "per-head"):
            raise UserError(f"step3p5: only the per-head attention gate is supported (gating {self.gating!r})")
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise UserError(
                f"step3p5: num_experts_per_tok {self.num_experts_per_tok} must be in 1..{self.n_routed_experts}"
            )
        if self.layer_types is None:
            self.layer_types = [FULL] * n
        self.layer_types = derive_layer_types(self.layer_types, n, self.sliding_window)
        self.mlp_layer_types = self._mlp_types()
        self.heads = self._heads()
        if self.query_pre_attn_scalar is None:
            self.query_pre_attn_scalar = self.head_dim
        self.limits = _limits(self.swiglu_limits, n, "swiglu_limits")
        self.limits_shared = _limits(self.swiglu_limits_shared, n, "swiglu_limits_shared")
        self.rope = self._rope()

    def _trim_mtp_padding(self):
        # Hub configs pad the per-layer lists with the trailing MTP layers
        # (num_nextn_predict_layers), which this decoder does not run.
        n, padded = self.num_hidden_layers, self.num_hidden_layers + (self.num_nextn_predict_layers or 0)
        for name in ("layer_types", "mlp_layer_types", "swiglu_limits", "swiglu_limits_shared", "rope_theta",
                     "partial_rotary_factors"):
            value = getattr(self, name)
            if isinstance(value, list) and padded != n and len(value) == padded:
                setattr(self, name, value[:n])

    def _mlp_types(self) -> list:
        n = self.num_hidden_layers
        types = self.mlp_layer_types
        if types is None:
            # transformers: the legacy `moe_layers_enum` (indices of MoE layers), else layers 3.. are MoE.
            enum = self.moe_layers_enum
            if enum is not None:
                items = enum.split(",") if isinstance(enum, str) else enum
                moe = {int(i) for i in items if str(i).strip()}
            else:
                moe = set(range(3, n))
            types = ["sparse" if i in moe else "dense" for i in range(n)]
        if len(types) != n or not set(types) <= {"sparse", "dense"}:
            raise UserError(f"step3p5: mlp_layer_types must be {n} entries of 'sparse'/'dense', got {types}")
        return list(types)

    def _heads(self) -> list:
        """Query heads per layer: full layers num_attention_heads, sliding
        layers num_sliding_attention_heads (legacy: attention_other_setting),
        or what a saved per_layer_config says."""
        other = self.attention_other_setting or {}
        for key, mine in (("num_attention_groups", self.num_key_value_heads), ("head_dim", self.head_dim)):
            if key in other and other[key] != mine:
                raise UserError(f"step3p5: attention_other_setting {key} {other[key]} != {mine} is not supported")
        sliding = self.num_sliding_attention_heads
        if sliding is None:
            sliding = other.get("num_attention_heads", self.num_attention_heads)
        heads = [sliding if t == SLIDING else self.num_attention_heads for t in self.layer_types]
        if self.per_layer_config is not None:
            heads = [self.num_attention_heads] * self.num_hidden_layers
            for idx, over in self.per_layer_config.items():
                if set(over) - {"num_attention_heads"}:
                    raise UserError(f"step3p5: per_layer_config overrides {sorted(over)}; only num_attention_heads")
                heads[int(idx)] = int(over.get("num_attention_heads", self.num_attention_heads))
        return heads

    def _rope(self) -> dict:
        """One RoPE params dict per layer kind, as transformers builds it:
        per-kind dicts of a saved config as they are; else each kind takes its
        first layer's rope_theta / partial_rotary_factors entry, and
        rope_scaling goes to the full layers."""
        kinds = set(self.layer_types)
        rp = self.rope_parameters or {}
        if all(isinstance(rp.get(k), dict) for k in kinds):
            return {k: dict(rp[k]) for k in kinds}
        theta = 10000.0 if self.rope_theta is None else self.rope_theta
        thetas = theta if isinstance(theta, list) else [theta] * self.num_hidden_layers
        factors = self.partial_rotary_factors
        for name, values in (("rope_theta", thetas), ("partial_rotary_factors", factors)):
            if values is None:
                continue
            if len(values) != self.num_hidden_layers:
                raise UserError(f"step3p5: {name} has {len(values)} entries for {self.num_hidden_layers} layers")
            for k in kinds:
                seen = {values[i] for i, t in enumerate(self.layer_types) if t == k}
                if len(seen) > 1:
                    # transformers keeps one value per kind (the first layer's).
                    raise UserError(f"step3p5: {name} differs between {k} layers ({sorted(seen)}); not supported")
        out = {}
        for k in kinds:
            i = self.layer_types.index(k)
            params = {"rope_type": "default", "rope_theta": thetas[i]}
            if factors:
                params["partial_rotary_factor"] = factors[i]
            out[k] = params
        if self.rope_scaling and FULL in out:
            out[FULL].update(self.rope_scaling)
        return out


def _limits(values, n: int, name: str) -> list:
    # None, 0 or an absent list: no clamp (transformers' `or inf`).
    if values is None:
        return [None] * n
    if len(values) != n:
        raise UserError(f"step3p5: {name} has {len(values)} entries for {n} layers")
    return [float(v) if v else None for v in values]


def clamped_swiglu(gate: mx.array, up: mx.array, limit: float | None) -> mx.array:
    """silu(gate).clamp(max=limit) * up.clamp(-limit, limit), rounded where
    transformers rounds: the activation runs in fp32 and rounds once to the
    input dtype, the clamps and the product are in that dtype (the clamp on
    gate follows the activation)."""
    g = nn.silu(gate.astype(mx.float32)).astype(gate.dtype)
    if limit is not None:
        g = mx.minimum(g, mx.array(limit, g.dtype))
        up = mx.clip(up, mx.array(-limit, up.dtype), mx.array(limit, up.dtype))
    return g * up


class ClampedMLP(nn.Module):
    """Dense SwiGLU with transformers' Step3p7MLP clamps (a dense layer's
    `mlp`, a sparse layer's `share_expert`)."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float | None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.limit = limit

    def __call__(self, x):
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class MoE(SwitchGLU):
    """Sigmoid-routed top-k experts (`experts.SwitchGLU`'s stacks, the hub's
    names `moe.{gate,up,down}_proj.weight`; each fp32-weighted output rounded,
    summed in routed order, then scaled) beside the shared expert
    (`share_expert`, a sibling of this module in the layer). Under TP every
    expert holds an intermediate slice, or this rank whole experts
    (`shard.shard_switch_glu`); the layer sums the routed and shared partial
    outputs in one all_sum (`group`)."""

    def __init__(self, args: ModelArgs, limit: float | None):
        E, H, I = args.n_routed_experts, args.hidden_size, args.moe_intermediate_size
        super().__init__(H, I, E, lambda g, u: clamped_swiglu(g, u, limit), combine="sum")
        self.top_k = args.num_experts_per_tok
        self.scale = args.moe_router_scaling_factor
        self.limit = limit
        self.gate = nn.Linear(H, E, bias=False)
        self.router_bias = mx.zeros((E,))

    def route(self, x):
        """x [N, hidden] -> (indices [N, k], weights [N, k] fp32)."""
        scores = mx.sigmoid(self.gate(x).astype(mx.float32))  # [N, E]
        choice = scores + self.router_bias.astype(mx.float32)
        k = self.top_k
        idx = top_k(choice, k)  # [N, k], order irrelevant
        w = mx.take_along_axis(scores, idx, axis=-1)
        return idx, w / w.sum(axis=-1, keepdims=True)

    def __call__(self, x):
        """x [N, hidden] -> this rank's partial routed output [N, hidden], scaled."""
        return super().__call__(x, *self.route(x)) * self.scale


class GatedAttention(Attention):
    """Attention with the per-head sigmoid output gate g_proj [n_heads, hidden]."""

    def __init__(self, hidden_size: int, num_heads: int, *args, **kwargs):
        super().__init__(hidden_size, num_heads, *args, **kwargs)
        self.g_proj = nn.Linear(hidden_size, num_heads, bias=False)

    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        q, k, v = self.project(x)
        q, k = self.position(q, k, cache.offset if cache is not None else 0)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = causal_attention(q, k, v, self.scale, self.window, mask=mask)
        gate = mx.sigmoid(self.g_proj(x)).transpose(0, 2, 1)[..., None]  # [B, L, heads] -> [B, heads, L, 1]
        out = out * gate.astype(out.dtype)
        # [B, heads, L, D] -> [B, L, heads * D]
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DecoderLayer(nn.Module):
    """Pre-norm block; sparse layers have `moe` + `share_expert`, dense ones `mlp`."""

    def __init__(self, args: ModelArgs, i: int):
        super().__init__()
        kind = args.layer_types[i]
        H, D = args.hidden_size, args.head_dim
        self.self_attn = GatedAttention(
            H,
            args.heads[i],
            args.num_key_value_heads,
            D,
            scale=float(args.query_pre_attn_scalar) ** -0.5,
            window=args.sliding_window if kind == SLIDING else None,
            rope=RoPE(D, args.rope[kind], args.max_position_embeddings),
            qk_norm=lambda d: GemmaRMSNorm(d, args.rms_norm_eps),
        )
        self.sparse = args.mlp_layer_types[i] == "sparse"
        if self.sparse:
            self.moe = MoE(args, args.limits[i])
            self.share_expert = ClampedMLP(H, args.share_expert_dim, args.limits_shared[i])
        else:
            self.mlp = ClampedMLP(H, args.intermediate_size, args.limits_shared[i])
        self.input_layernorm = GemmaRMSNorm(H, args.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(H, args.rms_norm_eps)
        self.group = SINGLE  # shard: the group that sums a sparse layer's partial outputs

    def ffn(self, x):
        if not self.sparse:
            return self.mlp(x)
        B, L, D = x.shape
        flat = x.reshape(B * L, D)  # [N, hidden]
        # Routed and shared partial sums (each rank's intermediate slices): one all_sum.
        y = self.group.all_sum(self.moe(flat) + self.share_expert(flat))
        return y.reshape(B, L, D)

    def __call__(self, x, mask=None, cache=None):
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.ffn(self.post_attention_layernorm(h))


class Step3p5TextModel(DecoderStack):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)


def _split_rows(ref, start: int, stop: int):
    """Rows [start, stop) of axis 1 of a stacked [E, 2I, hidden] tensor: a
    lazy checkpoint ref (read on demand), an array, or None (names only)."""
    if ref is None:
        return None
    if isinstance(ref, mx.array):
        return ref[:, start:stop]
    return _RowsRef(ref, start, stop)


class _RowsRef(View):
    """A checkpoint tensor's axis-1 range [start, stop), read like a TensorRef
    (shape, dtype, sliced_shape, read(axis, ranges)) so a rank still reads only
    its slice."""

    def __init__(self, ref, start: int, stop: int):
        self.ref, self.start, self.stop = ref, start, stop
        self.dtype = ref.dtype
        self.shape = (ref.shape[0], stop - start) + tuple(ref.shape[2:])

    def read(self, axis=None, ranges=None) -> mx.array:
        if axis == 1:
            return self.ref.read(1, [(self.start + s, self.start + e) for s, e in ranges])
        whole = self.ref.read(1, [(self.start, self.stop)])
        if axis is None:
            return whole
        idx = (slice(None),) * axis
        return mx.concatenate([whole[idx + (slice(s, e),)] for s, e in ranges], axis=axis)


class Model(CausalLM):
    pipeline_stages = True  # a DecoderStack of independent layers: runs in --pp stages (pipeline.py)

    def __init__(self, args: ModelArgs):
        super().__init__(args, Step3p5TextModel(args))

    def describe_layers(self) -> list[str]:
        a = self.args
        out = []
        for line, layer, heads in zip(describe_layers(self), self.layers, a.heads):
            dims = layer.self_attn.rope.dims
            rotary = f", rotary {dims}/{a.head_dim} dims" if dims != a.head_dim else ""
            ffn = (f"moe {a.n_routed_experts} experts top-{a.num_experts_per_tok} + shared expert"
                   if layer.sparse else "dense mlp")
            out.append(f"{line}{rotary}, {heads} heads, head gate, {ffn}")
        return out

    def sanitize(self, weights: dict) -> dict:
        """Hub layout from transformers' names: drop the vision tower, the
        projector and MTP layers, strip `language_model.`, rename the MoE
        tensors and split the stacked gate_up_proj [E, 2I, hidden] into gate
        (first I rows) and up."""
        out = {}
        for name, w in weights.items():
            if name.startswith(NOT_TEXT):
                continue
            name = name.replace("model.language_model.", "model.", 1)
            if self._mtp_layer(name):
                continue
            if ".mlp.experts.gate_up_proj" in name:
                base = name.replace(".mlp.experts.gate_up_proj", ".moe.")
                inter = self.args.moe_intermediate_size
                out[base + "gate_proj.weight"] = _split_rows(w, 0, inter)
                out[base + "up_proj.weight"] = _split_rows(w, inter, 2 * inter)
                continue
            for old, new in RENAMES:
                if old in name:
                    name = name.replace(old, new)
                    break
            out[name] = w
        return super().sanitize(out)

    def _mtp_layer(self, name: str) -> bool:
        # Hub checkpoints append num_nextn_predict_layers MTP layers (model.layers.N.*, N >= layers).
        parts = name.split(".")
        return (len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
                and int(parts[2]) >= self.args.num_hidden_layers)

    def shard(self, group):
        for layer in self.layers:
            attn = layer.self_attn
            shard_attention(attn, group)
            if not group.single:
                q0, q1, _ = rank_heads(attn, group)
                # the gate rows of this rank's heads (and their scales/biases when quantized)
                for p in ("weight", "scales", "biases"):
                    if attn.g_proj.get(p) is not None:
                        shard_head_vector(attn.g_proj, p, (q0, q1), 1)
            if layer.sparse:
                shard_switch_glu(layer.moe, group)
                shard_expert_mlps([layer.share_expert], group)
                if not group.single:
                    layer.group = group
            else:
                shard_mlp(layer.mlp, group)
        self.shard_head(group)

    def collectives_per_token(self) -> dict:
        """The usual ones plus one all_sum per sharded sparse layer (routed +
        shared partial sums, [1, hidden] in the hidden states' dtype)."""
        plan = super().collectives_per_token()
        calls, nbytes = plan["all_sum"]
        for layer in self.layers:
            if layer.sparse and not layer.group.single:
                calls += 1
                nbytes += self.args.hidden_size * layer.moe.down_proj.weight.dtype.size
        return {**plan, "all_sum": (calls, nbytes)}
