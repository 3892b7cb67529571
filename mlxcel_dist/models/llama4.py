"""Llama 4 text decoder (`llama4_text`: Llama4ForCausalLM; `llama4`: the text
model of Llama4ForConditionalGeneration, its config under `text_config`, its
weights under `language_model.`), as transformers 5.24 runs it.

Hidden states [B, L, hidden]; q [B, n_heads, L, head_dim], k/v [B,
n_kv_heads, L, head_dim] (per-rank counts under tensor parallelism).
Pre-norm blocks (llama RMSNorm). Two attention kinds (`layer_types`):

- "chunked_attention" (the RoPE layers, `no_rope_layers[i]` = 1, when
  `attention_chunk_size` is set): a token sees the earlier tokens of its own
  chunk of `attention_chunk_size` positions (masks.create_chunked_mask,
  cache.ChunkedKVCache); RoPE interleaved (complex pairs), llama3-scaled;
  then, with `use_qk_norm`, q and k L2-normalised per head (weightless
  RMS norm, fp32);
- "full_attention" (the NoPE layers): no RoPE, no q/k norm; with
  `attn_temperature_tuning` the queries are scaled by
  log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1 (fp32, per position).

Feed-forward per layer: MoE on `moe_layers` (default every
`interleave_moe_layer_step`-th), else a dense SwiGLU MLP
(`intermediate_size_mlp`). MoE: router `feed_forward.router` [E, hidden] in
the hidden dtype, top-k logits, weights = sigmoid of them (fp32, rounded to
the hidden dtype); each chosen expert runs on the token SCALED by its weight
(the reference scales the input, not the output); experts stacked in the bmm
layout (`experts.gate_up_proj` [E, hidden, 2I]: gate columns then up,
`experts.down_proj` [E, I, hidden]; here swapped into `experts.SwitchGLU`'s
fused SwitchLinear modules, so they quantize as mlx-lm writes them), only the
chosen experts run (mx.gather_mm / gather_qmm); plus `shared_expert`
(SwiGLU, I) on every token.

Tensor parallelism: heads split; dense MLPs by columns; routed and shared
experts by their intermediate dimension (`shard_switch_glu`, which also
places whole routed experts per rank under `--moe-split experts`;
`shard_expert_mlps`), the router replicated; a MoE block's
routed + shared partial sums go through one all_sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..nn.blocks import MLP, Attention
from ..cache import CHUNKED, make_layer_caches
from ..parallel.collectives import SINGLE
from ..errors import UserError
from ..nn.experts import SwitchGLU, top_k
from ..nn.layers import RMSNorm, activation, gated_fp32
from ..cache import layer_masks
from ..nn.rope import RoPE
from ..parallel.shard import shard_attention, shard_expert_mlps, shard_mlp, shard_switch_glu
from ..checkpoint.weights import join, swap_last_axes
from .base import FULL, BaseModelArgs, CausalLM, DecoderStack, single_rope_params

DEFAULT_THETA = 500_000.0  # Llama4TextConfig.default_theta
_NOT_TEXT = ("vision_model.", "multi_modal_projector.")


@dataclass
class ModelArgs(BaseModelArgs):
    # Defaults are transformers' Llama4TextConfig defaults.
    model_type: str = "llama4_text"
    vocab_size: int = 202048
    hidden_size: int = 5120
    intermediate_size: int = 8192
    intermediate_size_mlp: int = 16384
    num_hidden_layers: int = 48
    num_attention_heads: int = 40
    num_key_value_heads: int | None = 8
    head_dim: int | None = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096 * 32
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    num_experts_per_tok: int = 1
    num_local_experts: int = 16
    moe_layers: list | None = None
    interleave_moe_layer_step: int = 1
    use_qk_norm: bool = True
    rope_parameters: dict | None = None
    rope_theta: float | None = None
    rope_scaling: dict | None = None  # the transformers-4 form
    no_rope_layers: list | None = None
    no_rope_layer_interval: int = 4
    attention_chunk_size: int | None = 8192
    layer_types: list | None = None
    attn_temperature_tuning: bool = True
    floor_scale: int = 8192
    attn_scale: float = 0.1

    @classmethod
    def from_dict(cls, params: dict):
        # Llama4ForConditionalGeneration nests the text model under text_config.
        if isinstance(params.get("text_config"), dict):
            text = dict(params["text_config"])
            text["model_type"] = params.get("model_type", "llama4")
            if "tie_word_embeddings" in params and "tie_word_embeddings" not in text:
                text["tie_word_embeddings"] = params["tie_word_embeddings"]
            params = text
        return super().from_dict(params)

    def __post_init__(self):
        n = self.num_hidden_layers
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        # as Llama4TextConfig: an empty or absent list -> every interval-th layer NoPE (1 = uses RoPE)
        rope = self.no_rope_layers or [int((i + 1) % self.no_rope_layer_interval != 0) for i in range(n)]
        if len(rope) != n:
            raise UserError(f"llama4 config no_rope_layers has {len(rope)} entries for {n} layers")
        self.no_rope_layers = [int(bool(r)) for r in rope]
        if self.moe_layers is None:
            step = self.interleave_moe_layer_step
            self.moe_layers = list(range(step - 1, n, step)) if step >= 1 else []
        self.moe_layers = [int(i) for i in self.moe_layers]
        types = self.layer_types
        if types is None:
            types = [CHUNKED if r and self.attention_chunk_size is not None else FULL for r in self.no_rope_layers]
        if len(types) != n or set(types) - {CHUNKED, FULL}:
            raise UserError(f"llama4 config layer_types must be {n} entries of {CHUNKED}/{FULL}, got {types}")
        if CHUNKED in types and not self.attention_chunk_size:
            raise UserError("llama4 config has chunked_attention layers but no attention_chunk_size")
        self.layer_types = list(types)
        if self.moe_layers and not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise UserError(f"llama4: num_experts_per_tok must be in 1..{self.num_local_experts}")
        theta = DEFAULT_THETA if self.rope_theta is None else self.rope_theta
        self.rope = single_rope_params(self.rope_parameters, self.rope_scaling, theta, self.max_position_embeddings)


class Llama4Attention(Attention):
    """Attention with interleaved RoPE then a per-head L2 norm (RoPE layers),
    or neither and the NoPE layers' temperature tuning of the queries."""

    def __init__(self, args: ModelArgs, i: int):
        rope = args.no_rope_layers[i] == 1
        super().__init__(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            scale=args.head_dim**-0.5,
            rope=RoPE(args.head_dim, args.rope, args.max_position_embeddings, traditional=True) if rope else None,
            bias=args.attention_bias,
        )
        self.l2_norm = rope and args.use_qk_norm
        self.eps = args.rms_norm_eps
        # the reference tunes the temperature of NoPE layers only
        self.temperature = not rope and args.attn_temperature_tuning
        self.floor_scale, self.attn_scale = float(args.floor_scale), float(args.attn_scale)

    def position(self, q, k, offset):
        if self.rope is not None:
            # the reference rotates in fp32 (complex products of x.float()) and rounds once
            q = self.rope(q.astype(mx.float32), offset).astype(q.dtype)
            k = self.rope(k.astype(mx.float32), offset).astype(k.dtype)
        if self.l2_norm:
            q, k = mx.fast.rms_norm(q, None, self.eps), mx.fast.rms_norm(k, None, self.eps)  # fp32 inside
        if self.temperature:
            # positions [rows, L]: offset an int, a 0-d array (decode) or [B] (batch rows)
            L = q.shape[2]
            pos = (mx.array(offset).reshape(-1, 1) + mx.arange(L)).astype(mx.float32)
            s = mx.log1p(mx.floor((pos + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
            q = (q.astype(mx.float32) * s[:, None, :, None]).astype(q.dtype)  # [rows, 1, L, 1]
        return q, k


class MoE(nn.Module):
    """Sigmoid top-k router, scaled-input experts and the shared expert; one
    all_sum of the routed + shared partial sums once sharded (`group`)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        act = activation(args.hidden_act)
        self.top_k = args.num_experts_per_tok
        self.router = nn.Linear(args.hidden_size, args.num_local_experts, bias=False)
        # transformers' names (fused gate_up); the inputs scaled by the weights, outputs summed
        self.experts = SwitchGLU(args.hidden_size, args.intermediate_size, args.num_local_experts, gated_fp32(act),
                                 fused=True, combine="inputs")
        self.shared_expert = MLP(args.hidden_size, args.intermediate_size, act)
        self.group = SINGLE  # Model.shard: the group that sums the partial outputs

    def __call__(self, x):
        B, L, D = x.shape
        flat = x.reshape(B * L, D)  # [N, hidden]
        logits = self.router(flat)  # [N, E], the hidden dtype
        k = self.top_k
        idx = top_k(logits, k)  # [N, k], order irrelevant
        w = mx.sigmoid(mx.take_along_axis(logits, idx, axis=-1).astype(mx.float32)).astype(x.dtype)
        y = self.shared_expert(flat) + self.experts(flat, idx, w)
        return self.group.all_sum(y).reshape(B, L, D)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, i: int):
        super().__init__()
        self.self_attn = Llama4Attention(args, i)
        self.is_moe = i in args.moe_layers
        if self.is_moe:
            self.feed_forward = MoE(args)
        else:
            self.feed_forward = MLP(args.hidden_size, args.intermediate_size_mlp, activation(args.hidden_act))
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def __call__(self, x, mask=None, cache=None):
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.feed_forward(self.post_attention_layernorm(h))

    # split decode (decode.SplitSegments): pre -> self_attn.attend -> post
    def pre(self, x, cache):
        return (x, *self.self_attn.qkv(self.input_layernorm(x), cache))

    def post(self, x, o):
        h = x + self.self_attn.out(o)
        return h + self.feed_forward(self.post_attention_layernorm(h))


class Llama4TextModel(DecoderStack):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def masks(self, L: int, cache) -> dict:
        return layer_masks(L, cache, self.stage_layer_types, None, self.args.attention_chunk_size)


class Model(CausalLM):
    pipeline_stages = True  # a plain DecoderStack: runs in --pp stages (pipeline.py)
    split_decode = True  # the engine's one-row step (decode.SplitSegments) may run its layers' pre/attend/post split

    def __init__(self, args: ModelArgs):
        super().__init__(args, Llama4TextModel(args))

    def make_cache(self):
        """One cache per layer this rank runs (chunked layers: ChunkedKVCache)."""
        kinds = self.model.stage_layer_types
        return make_layer_caches(kinds, None, self.args.attention_chunk_size)

    def describe_layers(self) -> list[str]:
        a = self.args
        out = []
        for i, (kind, layer) in enumerate(zip(a.layer_types, self.layers)):
            attn = layer.self_attn
            what = f"chunked (chunk {a.attention_chunk_size})" if kind == CHUNKED else "full"
            if attn.rope is not None:
                pos = f"rope {attn.rope.describe()}" + (", q/k l2 norm" if attn.l2_norm else "")
            else:
                pos = "no rope (NoPE)" + (
                    f", temperature tuning (floor {a.floor_scale}, scale {a.attn_scale})" if attn.temperature else ""
                )
            ffn = (f"moe {a.num_local_experts} experts top-{a.num_experts_per_tok} (sigmoid) + shared expert"
                   if layer.is_moe else f"dense mlp ({a.intermediate_size_mlp})")
            out.append(f"{i}: {what}, {pos}, {ffn}")
        return out

    def sanitize(self, weights: dict) -> dict:
        """The multimodal wrapper's text weights (`language_model.model.*`,
        `language_model.lm_head.*`) as the text model's; vision tower and
        projector dropped. Experts in our Linear layout from transformers'
        bmm layout (`experts.gate_up_proj` [E, hidden, 2I], `down_proj`
        [E, I, hidden]: axes swapped by a lazy view, a rank reads its slices)
        and from mlx-lm's stacks (`experts.{gate,up}_proj.{weight,scales,
        biases}` [E, I, hidden], joined on the intermediate axis: rows are
        whole in the packed layout too; `experts.down_proj.*` as they are)."""
        out, stacks = {}, {}
        for name, w in weights.items():
            if name.startswith(_NOT_TEXT):
                continue
            name = name.removeprefix("language_model.")
            head, dot, rest = name.partition(".feed_forward.experts.")
            if not dot:
                out[name] = w
            elif rest in ("gate_up_proj", "down_proj"):  # transformers' bmm tensors
                out[f"{name}.weight"] = swap_last_axes(w)
            elif rest.startswith(("gate_proj.", "up_proj.")):
                stacks.setdefault(head, {})[rest] = w
            else:
                out[name] = w  # down_proj.{weight,scales,biases}: already our layout
        for head, parts in stacks.items():
            for suffix in sorted({k.split(".", 1)[1] for k in parts}):
                if (f"gate_proj.{suffix}" in parts) != (f"up_proj.{suffix}" in parts):
                    raise UserError(f"{head}: experts gate_proj / up_proj .{suffix} come in pairs")
                g, u = parts[f"gate_proj.{suffix}"], parts[f"up_proj.{suffix}"]
                out[f"{head}.feed_forward.experts.gate_up_proj.{suffix}"] = join([g, u], axis=1)
        return super().sanitize(out)

    def shard(self, group):
        for layer in self.layers:
            shard_attention(layer.self_attn, group)
            if layer.is_moe:
                ff = layer.feed_forward
                shard_switch_glu(ff.experts, group)
                shard_expert_mlps([ff.shared_expert], group)
                if not group.single:
                    ff.group = group
            else:
                shard_mlp(layer.feed_forward, group)
        self.shard_head(group)

    def collectives_per_token(self) -> dict:
        """The usual ones plus one all_sum per sharded MoE block (routed +
        shared partial sums, [1, hidden] in the hidden dtype)."""
        plan = super().collectives_per_token()
        calls, nbytes = plan["all_sum"]
        for layer in self.layers:
            if layer.is_moe and not layer.feed_forward.group.single:
                calls += 1
                d = layer.feed_forward.experts.down_proj
                nbytes += self.args.hidden_size * (d.scales if "scales" in d else d.weight).dtype.size
        return {**plan, "all_sum": (calls, nbytes)}
