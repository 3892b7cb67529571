"""Ministral 3 (`ministral3`): the Mistral decoder with yarn RoPE and Llama-4
style per-position query scaling.

Hidden states [B, L, hidden]; q [B, n_heads, L, head_dim], k/v [B, n_kv_heads,
L, head_dim] (per-rank counts under tensor parallelism). After RoPE, queries
at absolute position p are multiplied by

    1 + llama_4_scaling_beta * log(1 + floor(p / original_max_position_embeddings))

(both keys from rope_parameters; computed in fp32, cast to the compute dtype),
so keys in the cache are unscaled. As in transformers 5.24 (Ministral3Model),
`sliding_window`, when set, windows EVERY layer and a `layer_types` key is
ignored (transformers warns and builds one mask). No biases.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..nn.blocks import Attention, MLP, PreNormBlock
from ..errors import UserError
from ..nn.layers import RMSNorm, activation
from ..nn.rope import RoPE
from .base import SLIDING, BaseModelArgs, CausalLM, DecoderStack, derive_layer_types

# Ministral3Config's rope_parameters when config.json has none.
DEFAULT_ROPE = {
    "type": "yarn",
    "rope_theta": 1000000.0,
    "factor": 16.0,
    "original_max_position_embeddings": 16384,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale_all_dim": 1.0,
    "mscale": 1.0,
    "llama_4_scaling_beta": 0.1,
}


@dataclass
class ModelArgs(BaseModelArgs):
    # Defaults are transformers' Ministral3Config defaults.
    model_type: str = "ministral3"
    vocab_size: int = 131072
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 34
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    head_dim: int | None = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 262144
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    original_max_position_embeddings: int | None = None
    sliding_window: int | None = None

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.layer_types = derive_layer_types(None, self.num_hidden_layers, self.sliding_window)
        self.rope = self.one_rope(default=DEFAULT_ROPE)
        # transformers reads both with .get() and fails on None: require them.
        for key in ("llama_4_scaling_beta", "original_max_position_embeddings"):
            if self.rope.get(key) is None:
                raise UserError(f"ministral3 config.json rope_parameters needs {key}")


class Ministral3Attention(Attention):
    """Attention whose queries are scaled per absolute position after RoPE."""

    def __init__(self, *args, beta: float, original_max: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.beta = float(beta)
        self.original_max = float(original_max)

    def position(self, q, k, offset: int):
        q, k = super().position(q, k, offset)
        # offset: an int, a scalar array (decode.py) or one per row [B] (batch.py)
        pos = (mx.array(offset).reshape(-1, 1) + mx.arange(q.shape[2])).astype(mx.float32)  # [1 or B, L]
        scale = 1.0 + self.beta * mx.log(1.0 + mx.floor(pos / self.original_max))
        # [1 or B, L] -> [1 or B, 1, L, 1]: one factor per query row of [B, heads, L, D].
        return q * scale[:, None, :, None].astype(q.dtype), k


class DecoderLayer(PreNormBlock):
    def __init__(self, args: ModelArgs, layer_idx: int):
        kind = args.layer_types[layer_idx]
        self_attn = Ministral3Attention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            scale=args.head_dim**-0.5,
            window=args.sliding_window if kind == SLIDING else None,
            rope=RoPE(args.head_dim, args.rope, args.max_position_embeddings),
            beta=args.rope["llama_4_scaling_beta"],
            original_max=args.rope["original_max_position_embeddings"],
        )
        mlp = MLP(args.hidden_size, args.intermediate_size, activation(args.hidden_act))
        super().__init__(self_attn, mlp, args.hidden_size, lambda d: RMSNorm(d, args.rms_norm_eps))


class Ministral3Model(DecoderStack):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Model(CausalLM):
    pipeline_stages = True  # plain DecoderStack: runs in --pp stages (pipeline.py)

    def __init__(self, args: ModelArgs):
        super().__init__(args, Ministral3Model(args))
