"""Baichuan-M1 (`baichuan_m1`, Baichuan-M1-14B): a Llama-style decoder whose
attention has a fused q/k/v projection and a short causal conv over k and v.

transformers has no implementation; the reference is the checkpoints' own
modeling_baichuan.py, ported to float64 for the fixtures
(scripts/baichuan_m1_reference.py, cross-checked against transformers'
Mistral and Llama where it degenerates to them). Its ONE full forward pass is
what every feeding mode here matches: the original's incremental path is
wrong for a multi-token chunk on a non-empty cache (it takes its single-token
decode branch for the whole chunk, so the conv is lost after the chunk's first
token), and is not followed.

Per layer (`sliding_window_layers` lists the sliding ones):
- heads: sliding layers use `num_swa_attention_heads` / `num_swa_key_value_heads`,
  full layers `num_attention_heads` / `num_key_value_heads`; head_dim = hidden /
  q heads, so the two kinds have different head_dims (absent swa counts: the
  full counts, as vLLM and mlx-lm read such configs);
- `W_pack` [(H + 2*KV) * D, hidden]: x [B, L, hidden] -> [B, L, H + 2*KV, D],
  q the first H heads, k the next KV, v the last KV (per-rank counts under TP:
  `shard.shard_packed_attention` keeps the three row ranges of this rank);
- `conv_k`, `conv_v` [1, 1, KV, 1, w] (w = conv_window): per KV head,
  k'[t] = sum_j K[h, j] * k[t - (w - 1) + j] along the sequence, zero before
  the first token; on k [B, L, KV, D] before RoPE. A chunk or decode step reads
  the previous w - 1 tokens' k/v from its `cache.ConvKVCache`;
- RoPE over the whole head (rotate-half, base rope_theta), scale D^-0.5,
  sliding layers see keys i - window < j <= i;
- RMSNorm, SwiGLU MLP, pre-norm blocks (`blocks.PreNormBlock`).
The head is a NormHead: each vocabulary row of `lm_head.weight` is divided by
its L2 norm; applied as logits * (1 / ||row||) per vocabulary entry, which
splits by rows under the vocabulary-split head.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from ..nn.attention import causal_attention
from ..nn.blocks import MLP, PreNormBlock
from ..cache import SLIDING, ConvKVCache, KVCache, RotatingKVCache
from ..errors import UserError
from ..nn.layers import RMSNorm, activation
from ..nn.rope import RoPE
from ..parallel.shard import shard_mlp, shard_packed_attention
from .base import FULL, BaseModelArgs, CausalLM, DecoderStack


@dataclass
class ModelArgs(BaseModelArgs):
    # Keys of the original's config.json; defaults are Baichuan-M1-14B's where known.
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rope_theta: float
    model_type: str = "baichuan_m1"
    num_swa_attention_heads: int | None = None
    num_swa_key_value_heads: int | None = None
    sliding_window: int | None = None
    sliding_window_layers: list = field(default_factory=list)
    conv_window: int = 2
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    rope_scaling: dict | None = None
    head_dim: int | None = None

    def __post_init__(self):
        if self.tie_word_embeddings:
            raise UserError("baichuan_m1 with tie_word_embeddings is not supported (the released checkpoints are untied)")
        if self.rope_scaling:
            # The original reads no rope scaling at all: refuse rather than guess.
            raise UserError(f"baichuan_m1 config rope_scaling {self.rope_scaling!r} is not supported")
        if self.conv_window < 1:
            raise UserError(f"baichuan_m1 config conv_window must be >= 1, got {self.conv_window}")
        bad = [i for i in self.sliding_window_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise UserError(f"baichuan_m1 config sliding_window_layers {bad} are not layers")
        if self.sliding_window_layers and not self.sliding_window:
            raise UserError("baichuan_m1 config has sliding_window_layers but no sliding_window")
        self.num_swa_attention_heads = self.num_swa_attention_heads or self.num_attention_heads
        self.num_swa_key_value_heads = self.num_swa_key_value_heads or self.num_key_value_heads
        for kind, (H, _, _) in (("full", self.heads(FULL)), ("sliding", self.heads(SLIDING))):
            if self.hidden_size % H:
                raise UserError(f"baichuan_m1: hidden_size {self.hidden_size} is not a multiple of the {kind} "
                                f"layers' {H} attention heads")
        if self.head_dim is not None and self.head_dim != self.heads(FULL)[2]:
            # The original ignores head_dim and uses hidden / heads.
            raise UserError(f"baichuan_m1 config head_dim {self.head_dim} != hidden_size / num_attention_heads")
        self.head_dim = self.heads(FULL)[2]  # the full layers'; sliding layers: hidden / num_swa_attention_heads
        swa = set(self.sliding_window_layers)
        self.layer_types = [SLIDING if i in swa else FULL for i in range(self.num_hidden_layers)]

    def heads(self, kind: str) -> tuple[int, int, int]:
        """(q heads, kv heads, head_dim) of a layer kind."""
        if kind == SLIDING:
            H, KV = self.num_swa_attention_heads, self.num_swa_key_value_heads
        else:
            H, KV = self.num_attention_heads, self.num_key_value_heads
        return H, KV, self.hidden_size // H


class Attention(nn.Module):
    """Fused W_pack projection, causal conv over k/v, RoPE, (windowed) GQA."""

    def __init__(self, args: ModelArgs, kind: str):
        super().__init__()
        H, KV, D = args.heads(kind)
        if KV < 1 or H % KV:
            raise UserError(f"baichuan_m1: {H} attention heads are not a multiple of {KV} KV heads")
        self.total_num_heads = self.num_heads = H
        self.total_num_kv_heads = self.num_kv_heads = KV
        self.head_dim = D
        self.scale = D**-0.5
        self.window = args.sliding_window if kind == SLIDING else None
        self.rope = RoPE(D, {"rope_type": "default", "rope_theta": args.rope_theta}, args.max_position_embeddings)
        self.W_pack = nn.Linear(args.hidden_size, (H + 2 * KV) * D, bias=False)
        self.o_proj = nn.Linear(H * D, args.hidden_size, bias=False)
        self.conv_k = mx.zeros((1, 1, KV, 1, args.conv_window))
        self.conv_v = mx.zeros((1, 1, KV, 1, args.conv_window))

    def conv(self, x, state, kernel):
        """Causal conv along L of x [B, L, KV, D] after `state` [B, w-1, KV, D];
        returns (conv output [B, L, KV, D], the new state)."""
        w = kernel.shape[-1]
        L = x.shape[1]
        ext = mx.concatenate([state, x], axis=1) if w > 1 else x  # [B, w-1+L, KV, D]
        taps = kernel.reshape(-1, w).astype(x.dtype)  # [KV, w]
        # The reference's products round to the compute dtype, its sum over the
        # taps accumulates in fp32 and rounds once (the same in fp32).
        out = (ext[:, 0:L] * taps[:, 0, None]).astype(mx.float32)
        for j in range(1, w):
            out = out + (ext[:, j : j + L] * taps[:, j, None]).astype(mx.float32)
        return out.astype(x.dtype), ext[:, ext.shape[1] - (w - 1) :]

    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        proj = self.W_pack(x).reshape(B, L, H + 2 * KV, D)  # [B, L, H + 2KV, D]
        q, k, v = proj[:, :, :H], proj[:, :, H : H + KV], proj[:, :, H + KV :]
        w = self.conv_k.shape[-1]
        if cache is not None:
            k_state, v_state = cache.fetch_conv(k)
        else:
            k_state = v_state = mx.zeros((B, w - 1, KV, D), k.dtype)
        k, k_state = self.conv(k, k_state, self.conv_k)
        v, v_state = self.conv(v, v_state, self.conv_v)
        # [B, L, heads, D] -> [B, heads, L, D]
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset), self.rope(k, offset)
        if cache is not None:
            cache.update_conv(k_state, v_state)
            k, v = cache.update_and_fetch(k, v)
        out = causal_attention(q, k, v, self.scale, self.window, mask=mask)
        # [B, heads, L, D] -> [B, L, heads * D]
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DecoderLayer(PreNormBlock):
    def __init__(self, args: ModelArgs, kind: str):
        mlp = MLP(args.hidden_size, args.intermediate_size, activation(args.hidden_act))
        super().__init__(Attention(args, kind), mlp, args.hidden_size, lambda d: RMSNorm(d, args.rms_norm_eps))


class BaichuanModel(DecoderStack):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.layers = [DecoderLayer(args, kind) for kind in args.layer_types]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Model(CausalLM):
    pipeline_stages = True  # its caches are per layer (ConvKVCache): runs in --pp stages (pipeline.py)

    def __init__(self, args: ModelArgs):
        super().__init__(args, BaichuanModel(args))

    def _head(self, h):
        # NormHead: logit v = h . W[v] / ||W[v]||, the same per row whether
        # the vocabulary is split or not (under --pp: on the last stage, before
        # the logits go to every rank).
        logits = super()._head(h)
        return logits * self.row_inv_norms().astype(logits.dtype)

    def row_inv_norms(self) -> mx.array:
        """1 / max(||W[v]||, 1e-12) per vocabulary row [V] (float32), computed
        once per head weight (a quantized head: of its dequantized rows)."""
        layer = self.lm_head
        src = layer.weight
        if self.get("_inv_norm_src") is not src:
            if isinstance(layer, nn.QuantizedLinear):
                w = mx.dequantize(layer.weight, layer.scales, layer.get("biases"), layer.group_size, layer.bits,
                                  mode=layer.mode)
            else:
                w = layer.weight
            norms = mx.sqrt(mx.sum(mx.square(w.astype(mx.float32)), axis=-1))
            self._inv_norm = 1.0 / mx.maximum(norms, 1e-12)
            self._inv_norm_src = src
        return self._inv_norm

    def make_cache(self):
        w = self.args.conv_window
        return [
            ConvKVCache(RotatingKVCache(self.args.sliding_window) if kind == SLIDING else KVCache(), w)
            for kind in self.model.stage_layer_types  # (this rank's layers: a pipeline stage's under --pp)
        ]

    def shard(self, group):
        for layer in self.layers:
            shard_packed_attention(layer.self_attn, group, per_kv_head=(("conv_k", 2), ("conv_v", 2)))
            shard_mlp(layer.mlp, group)
        self.shard_head(group)

    def describe_layers(self) -> list[str]:
        out = []
        for i, (kind, layer) in enumerate(zip(self.args.layer_types, self.layers)):
            a = layer.self_attn
            what = f"sliding (window {a.window})" if kind == SLIDING else "full"
            out.append(
                f"{i}: {what}, {a.total_num_heads} q / {a.total_num_kv_heads} kv heads of {a.head_dim}, "
                f"causal conv {self.args.conv_window} on k/v, rope {a.rope.describe()}"
            )
        return out
