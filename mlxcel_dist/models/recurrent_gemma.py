"""RecurrentGemma / Griffin (`recurrent_gemma`).

Hidden states [B, L, hidden]. Each residual block is `temporal_pre_norm` ->
temporal block -> residual, then `channel_pre_norm` -> GeGLU MLP (biases,
intermediate_size // 2) -> residual; norms are GemmaRMSNorm (1 + w). The
temporal block follows `block_types` repeated over the layers:

- "recurrent" (kind `cache.RECURRENT`): y = gelu(linear_y(x)); x = linear_x(x)
  [B, L, lru] channels last -> causal depthwise conv1d of width conv1d_width
  (`conv_1d.weight` [lru, 1, width] as stored) -> RG-LRU -> linear_out(x * y).
  The RG-LRU splits lru into num_attention_heads blocks of block_width
  channels with per-block gate matrices [H, bw, bw]; its recurrence
  h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (x_t * i_t) runs in float32 and resets at
  position 0. A `cache.RecurrentCache` carries the conv inputs and h across
  chunks and decode steps.
- "attention" (kind SLIDING): MQA/GQA with q [B, heads, L, head_dim], k/v
  [B, kv_heads, L, head_dim], head_dim = hidden // heads, RoPE on the first
  partial_rotary_factor of each head, o_proj with bias, the window
  attention_window_size (a RotatingKVCache, masks from masks.py).

Embeddings are scaled by sqrt(hidden) rounded to bfloat16 (transformers keeps
that buffer in bf16 whatever the model dtype), logits are tanh soft-capped by
logits_soft_cap; the head is tied to the embeddings by default.

Pipeline stages (--pp): only the hidden state crosses stages; each stage's
recurrent and sliding caches are its own layers'.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..nn.blocks import MLP, Attention
from ..cache import RECURRENT, SLIDING, RecurrentCache, RotatingKVCache
from ..errors import UserError
from ..nn.layers import GemmaRMSNorm, activation
from ..cache import layer_masks
from ..nn.rope import RoPE
from ..parallel.shard import shard_attention, shard_mlp, shard_recurrent_block
from .base import BaseModelArgs, CausalLM, DecoderStack, run_layers

BLOCK_KINDS = {"recurrent": RECURRENT, "attention": SLIDING}


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = "recurrent_gemma"
    vocab_size: int = 256000
    hidden_size: int = 2560
    intermediate_size: int = 3 * 2560
    num_hidden_layers: int = 26
    num_attention_heads: int = 10
    num_key_value_heads: int | None = None
    lru_width: int | None = None
    attention_window_size: int = 2048
    conv1d_width: int = 4
    logits_soft_cap: float = 30.0
    rms_norm_eps: float = 1e-6
    hidden_activation: str = "gelu_pytorch_tanh"
    block_types: list | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = True
    rope_parameters: dict | None = None
    rope_theta: float | None = None  # transformers-4 form
    partial_rotary_factor: float | None = None  # transformers-4 form

    def __post_init__(self):
        # As RecurrentGemmaConfig: lru_width defaults to hidden, head_dim is
        # always hidden // heads, KV heads default to the q heads.
        self.lru_width = self.lru_width or self.hidden_size
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.hidden_size // self.num_attention_heads
        if self.lru_width % self.num_attention_heads:
            raise UserError(f"lru_width {self.lru_width} is not a multiple of num_attention_heads")
        types = list(self.block_types or ("recurrent", "recurrent", "attention"))
        bad = sorted(set(types) - set(BLOCK_KINDS))
        if bad or not types:
            raise UserError(f"config block_types has unsupported kinds {bad} (supported: recurrent, attention)")
        # transformers: (block_types * 100)[:num_hidden_layers]
        self.layer_types = [BLOCK_KINDS[types[i % len(types)]] for i in range(self.num_hidden_layers)]
        self.sliding_window = self.attention_window_size
        self.rope = self._rope_params()

    def _rope_params(self) -> dict:
        # transformers 5 reads rope_parameters; a transformers-4 config has
        # top-level rope_theta / partial_rotary_factor (default 0.5).
        params = dict(self.rope_parameters or {})
        if params.get("rope_type", params.get("type", "default")) != "default":
            raise UserError(f"recurrent_gemma supports only the default RoPE, got {params.get('rope_type')!r}")
        params["rope_type"] = "default"
        params.setdefault("rope_theta", 10_000.0 if self.rope_theta is None else self.rope_theta)
        factor = self.partial_rotary_factor
        params.setdefault("partial_rotary_factor", 0.5 if factor is None else factor)
        return params


def _fp32(fn, x):
    # torch's half-precision kernels compute in fp32 and round once; MLX's
    # bf16 sigmoid/softplus round differently (up to 1 ulp on ~1/3 of the values).
    return fn(x.astype(mx.float32)).astype(x.dtype)


class Conv1d(nn.Module):
    """Causal depthwise conv1d over [B, L, C] with the checkpoint's layout:
    weight [C, 1, width], bias [C]. out[t] = bias + sum_k w[k] x[t - width + 1 + k],
    the earlier inputs coming from `state` [B, width - 1, C] (zeros at the start)."""

    def __init__(self, channels: int, width: int):
        super().__init__()
        self.weight = mx.zeros((channels, 1, width))
        self.bias = mx.zeros((channels,))

    def __call__(self, x, state=None):
        B, L, C = x.shape
        W = self.weight.shape[-1]
        if state is None:
            state = mx.zeros((B, W - 1, C), x.dtype)
        xp = mx.concatenate([state, x], axis=1)  # [B, W - 1 + L, C]
        # Accumulate in fp32 and round once, as torch's conv kernel does for half inputs.
        w = self.weight[:, 0, :].T.astype(mx.float32)  # [W, C]
        xf = xp.astype(mx.float32)
        out = self.bias.astype(mx.float32) + sum(xf[:, k : k + L, :] * w[k] for k in range(W))
        return out.astype(x.dtype), xp[:, L:, :]


def _at_start(offset, L: int):
    """[B or 1, L, 1] bool: the tokens at position 0, for an int offset or a
    per-row array (static decode, batch rows); None when there are none."""
    if isinstance(offset, int):
        return None if offset else (mx.arange(L) == 0)[None, :, None]
    return (offset.reshape(-1, 1) + mx.arange(L) == 0)[..., None]


class Rglru(nn.Module):
    """The Real-Gated Linear Recurrent Unit with transformers' names and
    dtypes: gates in the compute dtype, the recurrence accumulated in fp32."""

    def __init__(self, width: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads  # per rank once sharded
        self.block_width = width // num_heads
        bw = self.block_width
        self.recurrent_param = mx.zeros((width,))
        self.input_gate_weight = mx.zeros((num_heads, bw, bw))
        self.input_gate_bias = mx.zeros((num_heads, bw))
        self.recurrent_gate_weight = mx.zeros((num_heads, bw, bw))
        self.recurrent_gate_bias = mx.zeros((num_heads, bw))

    def _gate(self, xh, w, b, shape):
        # xh [H, B*L, bw] @ w [H, bw, bw] (x @ W, as torch.baddbmm) -> [B, L, C]
        # addmm: the bias joins the product before the one rounding (torch.baddbmm)
        res = mx.addmm(b[:, None, :], xh, w).transpose(1, 0, 2).reshape(shape)
        return _fp32(mx.sigmoid, res)

    def __call__(self, x, offset: int, state=None):
        B, L, C = x.shape
        xh = x.reshape(B * L, self.num_heads, self.block_width).transpose(1, 0, 2)  # [H, B*L, bw]
        input_gate = self._gate(xh, self.input_gate_weight, self.input_gate_bias, x.shape)
        recurrent_gate = self._gate(xh, self.recurrent_gate_weight, self.recurrent_gate_bias, x.shape)
        log_a = -8.0 * recurrent_gate * _fp32(nn.softplus, self.recurrent_param)
        a = mx.exp(log_a)
        a_square = mx.exp(2 * log_a)
        gated = x * input_gate
        multiplier = mx.sqrt(1 - a_square)
        first = _at_start(offset, L)
        if first is not None:
            # Position 0 resets: no decay from the (zero) state, no normalisation.
            multiplier = mx.where(first, mx.array(1, multiplier.dtype), multiplier)
            a = mx.where(first, mx.array(0, a.dtype), a)
        normalized = gated * multiplier.astype(x.dtype)
        h = mx.zeros((B, C), mx.float32) if state is None else state
        a32, n32 = a.astype(mx.float32), normalized.astype(mx.float32)
        outs = []
        for t in range(L):  # the reference's sequential scan, fp32
            h = a32[:, t] * h + n32[:, t]
            outs.append(h)
        return mx.stack(outs, axis=1).astype(x.dtype), h


class RecurrentBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        act = activation(args.hidden_activation)
        self.act = act
        self.linear_y = nn.Linear(args.hidden_size, args.lru_width)
        self.linear_x = nn.Linear(args.hidden_size, args.lru_width)
        self.linear_out = nn.Linear(args.lru_width, args.hidden_size)
        self.conv_1d = Conv1d(args.lru_width, args.conv1d_width)
        self.rg_lru = Rglru(args.lru_width, args.num_attention_heads)

    def __call__(self, x, mask=None, cache=None):
        conv_state, lru_state = cache.fetch() if cache is not None else (None, None)
        offset = cache.offset if cache is not None else 0
        y = self.linear_y(x)
        y = _fp32(self.act, y)
        xb, conv_state = self.conv_1d(self.linear_x(x), conv_state)
        xb, lru_state = self.rg_lru(xb, offset, lru_state)
        if cache is not None:
            cache.update(conv_state, lru_state, x.shape[1])
        return self.linear_out(xb * y)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, rope: RoPE, kind: str):
        super().__init__()
        eps = args.rms_norm_eps
        self.kind = kind
        self.temporal_pre_norm = GemmaRMSNorm(args.hidden_size, eps)
        if kind == RECURRENT:
            self.temporal_block = RecurrentBlock(args)
        else:
            self.temporal_block = Attention(
                args.hidden_size,
                args.num_attention_heads,
                args.num_key_value_heads,
                args.head_dim,
                scale=args.head_dim**-0.5,
                window=args.attention_window_size,
                rope=rope,
                bias=args.attention_bias,
                o_bias=True,
            )
        self.channel_pre_norm = GemmaRMSNorm(args.hidden_size, eps)
        self.mlp_block = MLP(args.hidden_size, args.intermediate_size // 2, activation(args.hidden_activation), bias=True)

    def __call__(self, x, mask=None, cache=None):
        h = x + self.temporal_block(self.temporal_pre_norm(x), mask, cache)
        return h + self.mlp_block(self.channel_pre_norm(h))


class RecurrentGemmaModel(DecoderStack):
    last_stage_parts = ("final_norm",)  # under --pp: held by the last stage only

    def __init__(self, args: ModelArgs):
        super().__init__(args)  # args, embed_tokens, stage
        rope = RoPE(args.head_dim, args.rope)
        self.layers = [DecoderLayer(args, rope, kind) for kind in args.layer_types]
        self.final_norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)

    def embed(self, inputs):
        h = self.embed_tokens(inputs)
        # transformers' normalizer buffer is bf16 in every model dtype.
        return h * mx.array(self.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)

    def masks(self, L: int, cache) -> dict:
        # A cache-less pass needs what fresh caches would ask for (this rank's layers).
        kinds = self.stage_layer_types
        cache = cache if cache is not None else make_cache(self.args, kinds)
        return layer_masks(L, cache, kinds, self.args.sliding_window)

    def __call__(self, inputs, cache=None):
        """DecoderStack's forward (under --pp: the hidden state from the
        previous stage, sent on after this stage's layers), with final_norm."""
        stage = self.stage
        if stage is not None:
            stage.begin()
        h = self.embed(inputs) if stage is None or stage.first else stage.receive(*inputs.shape)
        h = run_layers(h, self.stage_layers, self.stage_layer_types, cache, self.masks(inputs.shape[1], cache))
        if stage is not None and not stage.last:
            return stage.pass_on(h)
        return self.final_norm(h)


def make_cache(args: ModelArgs, kinds: list | None = None) -> list:
    """A RecurrentCache per recurrent layer, a RotatingKVCache(window) per
    attention layer (of `kinds`: a stage's layers; all by default)."""
    kinds = args.layer_types if kinds is None else kinds
    return [RecurrentCache() if k == RECURRENT else RotatingKVCache(args.attention_window_size) for k in kinds]


class Model(CausalLM):
    pipeline_stages = True  # layers are independent: only the hidden state crosses stages

    def __init__(self, args: ModelArgs):
        super().__init__(args, RecurrentGemmaModel(args))

    def __call__(self, inputs, cache=None):
        logits = super().__call__(inputs, cache)
        cap = self.args.logits_soft_cap
        return mx.tanh(logits / cap) * cap

    def make_cache(self):
        return make_cache(self.args, self.model.stage_layer_types)

    def shard(self, group):
        for layer in self.layers:
            if layer.kind == RECURRENT:
                shard_recurrent_block(layer.temporal_block, group)
            else:
                shard_attention(layer.temporal_block, group)
            shard_mlp(layer.mlp_block, group)
        self.shard_head(group)

    def describe_layers(self) -> list[str]:
        out = []
        for i, layer in enumerate(self.layers):
            block = layer.temporal_block
            if layer.kind == RECURRENT:
                out.append(f"{i}: recurrent (RG-LRU, {block.rg_lru.num_heads} heads, conv1d width "
                           f"{block.conv_1d.weight.shape[-1]})")
            else:
                out.append(f"{i}: sliding (window {block.window}), rope {block.rope.describe()}, "
                           f"partial {self.args.rope['partial_rotary_factor']}")
        return out
