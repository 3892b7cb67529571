"""Cohere 2 / Command R7B (`cohere2`).

Hidden states [B, L, hidden]; q [B, n_heads, L, head_dim], k/v [B, n_kv_heads,
L, head_dim] (per-rank counts under tensor parallelism), head_dim = hidden /
n_heads as transformers forces. Each block is parallel: one weight-only
LayerNorm feeds both attention and the SwiGLU MLP, and both outputs join the
residual. Sliding-window layers use RoPE in the interleaved-pair layout
(cohere's rotate_half); full-attention layers have no positional encoding.
Logits are scaled by logit_scale; embeddings are tied by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.nn as nn

from ..nn.blocks import MLP, Attention
from ..errors import UserError
from ..nn.layers import LayerNorm, activation
from ..nn.rope import RoPE
from .base import SLIDING, BaseModelArgs, CausalLM, DecoderStack, derive_layer_types


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = "cohere2"
    vocab_size: int = 256000
    hidden_size: int = 8192
    intermediate_size: int = 22528
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    num_key_value_heads: int | None = None
    hidden_act: str = "silu"
    layer_norm_eps: float = 1e-5
    logit_scale: float = 0.0625
    sliding_window: int | None = 4096
    layer_types: list | None = None
    # transformers' Cohere2Config: without layer_types, every 4th layer is full
    # unless the (legacy) sliding_window_pattern says otherwise.
    sliding_window_pattern: int | None = 4
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.hidden_size % self.num_attention_heads:
            raise UserError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads {self.num_attention_heads}"
            )
        # Cohere2Config overwrites any head_dim with hidden / heads.
        self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_types is None and not isinstance(self.sliding_window_pattern, int):
            raise UserError(f"config sliding_window_pattern must be an integer, got {self.sliding_window_pattern!r}")
        self.layer_types = derive_layer_types(
            self.layer_types, self.num_hidden_layers, self.sliding_window, self.sliding_window_pattern
        )
        self.rope = self.one_rope()


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, rope: RoPE, layer_idx: int):
        super().__init__()
        sliding = args.layer_types[layer_idx] == SLIDING
        self.self_attn = Attention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            scale=args.head_dim**-0.5,
            window=args.sliding_window if sliding else None,
            # Global layers carry no positions at all (the reference skips RoPE there).
            rope=rope if sliding else None,
            bias=args.attention_bias,
        )
        self.mlp = MLP(args.hidden_size, args.intermediate_size, activation(args.hidden_act))
        self.input_layernorm = LayerNorm(args.hidden_size, args.layer_norm_eps)

    def __call__(self, x, mask=None, cache=None):
        h = self.input_layernorm(x)
        return x + self.self_attn(h, mask, cache) + self.mlp(h)


class Cohere2Model(DecoderStack):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        rope = RoPE(args.head_dim, args.rope, args.max_position_embeddings, traditional=True)
        self.layers = [DecoderLayer(args, rope, i) for i in range(args.num_hidden_layers)]
        self.norm = LayerNorm(args.hidden_size, args.layer_norm_eps)


class Model(CausalLM):
    pipeline_stages = True  # plain DecoderStack: runs in --pp stages (pipeline.py)

    def __init__(self, args: ModelArgs):
        super().__init__(args, Cohere2Model(args))

    def __call__(self, inputs, cache=None):
        return super().__call__(inputs, cache) * self.args.logit_scale
