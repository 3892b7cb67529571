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

import mlx.nn as nn

from ..blocks import MLP, Attention
from ..cache import make_layer_caches
from ..layers import RMSNorm, activation
from ..masks import layer_masks
from ..rope import RoPE
from ..shard import shard_layers
from .base import BaseModelArgs, derive_layer_types, single_rope_params


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
        self.rope = single_rope_params(
            self.rope_parameters,
            self.rope_scaling,
            self.rope_theta,
            self.max_position_embeddings,
            self.original_max_position_embeddings,
        )


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            scale=args.head_dim**-0.5,
            rope=RoPE(args.head_dim, args.rope, args.max_position_embeddings),
            bias=args.attention_bias,
        )
        self.mlp = MLP(args.hidden_size, args.intermediate_size, activation(args.hidden_act), bias=args.mlp_bias)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def __call__(self, x, mask=None, cache=None):
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args) for _ in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def __call__(self, inputs, cache=None):
        h = self.embed_tokens(inputs)
        masks = layer_masks(inputs.shape[1], cache, self.args.layer_types, None)
        cache = cache if cache is not None else [None] * len(self.layers)
        for layer, kind, c in zip(self.layers, self.args.layer_types, cache):
            h = layer(h, masks[kind], c)
        return self.norm(h)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = LlamaModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs, cache=None):
        h = self.model(inputs, cache)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    @property
    def layers(self):
        return self.model.layers

    def make_cache(self):
        return make_layer_caches(self.args.layer_types, None)

    def sanitize(self, weights: dict) -> dict:
        """Drop a stored copy of the tied output head, and the RoPE buffers
        (`self_attn.rotary_emb.inv_freq`) that some older conversions saved."""
        out = {}
        for name, w in weights.items():
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.args.tie_word_embeddings:
                continue
            out[name] = w
        return out

    def shard(self, group):
        shard_layers(self.layers, group)
