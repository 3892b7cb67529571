"""Llama (`llama`): the plain pre-norm decoder, every layer full attention.

Hidden states [B, L, hidden]; q [B, n_heads, L, head_dim], k/v [B, n_kv_heads,
L, head_dim] (per-rank counts under tensor parallelism). Each layer:
h = x + attn(rms(x)); out = h + mlp(rms(h)), SwiGLU MLP, scores scaled by
head_dim ** -0.5, one RoPE for all layers (default, linear or llama3; yarn
too). Optional biases on q/k/v/o (attention_bias) and on the MLP (mlp_bias);
the output head may be tied to the embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass


from ..nn.blocks import Attention, MLP, PreNormBlock
from ..nn.layers import RMSNorm, activation
from ..nn.rope import RoPE
from .base import BaseModelArgs, CausalLM, DecoderStack, derive_layer_types


@dataclass
class ModelArgs(BaseModelArgs):
    # Defaults are transformers' LlamaConfig defaults.
    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    original_max_position_embeddings: int | None = None
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.layer_types = derive_layer_types(None, self.num_hidden_layers, None)
        self.rope = self.one_rope()


class DecoderLayer(PreNormBlock):
    def __init__(self, args: ModelArgs):
        self_attn = Attention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            scale=args.head_dim**-0.5,
            rope=RoPE(args.head_dim, args.rope, args.max_position_embeddings),
            bias=args.attention_bias,
        )
        mlp = MLP(args.hidden_size, args.intermediate_size, activation(args.hidden_act), bias=args.mlp_bias)
        super().__init__(self_attn, mlp, args.hidden_size, lambda d: RMSNorm(d, args.rms_norm_eps))


class LlamaModel(DecoderStack):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.layers = [DecoderLayer(args) for _ in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Model(CausalLM):
    pipeline_stages = True  # plain DecoderStack: runs in --pp stages (pipeline.py)
    split_decode = True  # the engine's one-row step (decode.SplitSegments) may run its layers' pre/attend/post split
    # Some older conversions saved `self_attn.rotary_emb.inv_freq`.
    drop_rotary_buffers = True

    def __init__(self, args: ModelArgs):
        super().__init__(args, LlamaModel(args))
