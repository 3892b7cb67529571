"""Qwen3 (`qwen3`): the Llama decoder plus per-head RMSNorm on q and k.

Hidden states [B, L, hidden]; q [B, n_heads, L, head_dim], k/v [B, n_kv_heads,
L, head_dim] (per-rank counts under tensor parallelism). q_norm / k_norm are
RMSNorms over head_dim applied to every head after the projection and BEFORE
RoPE. head_dim is its own config key (default 128, not hidden / heads).
Sliding windows only when `use_sliding_window`: then, without an explicit
`layer_types`, layers i >= max_window_layers slide (transformers 5.24's
Qwen3Config derivation), the rest are full.
"""

from __future__ import annotations

from dataclasses import dataclass


from ..nn.blocks import Attention, MLP, PreNormBlock
from ..errors import UserError
from ..nn.layers import RMSNorm, activation
from ..nn.rope import RoPE
from .base import FULL, SLIDING, BaseModelArgs, CausalLM, DecoderStack, derive_layer_types


@dataclass
class ModelArgs(BaseModelArgs):
    # Defaults are transformers' Qwen3Config defaults.
    model_type: str = "qwen3"
    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 32
    head_dim: int | None = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    original_max_position_embeddings: int | None = None
    attention_bias: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    layer_types: list | None = None

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            # transformers' Qwen3 cannot build this either (head_dim None in the projections).
            raise UserError("qwen3 config.json has head_dim null")
        # The window exists only with use_sliding_window (transformers drops it otherwise).
        self.sliding_window = self.sliding_window if self.use_sliding_window else None
        types = self.layer_types
        if types is not None and SLIDING in types and self.sliding_window is None:
            raise UserError("qwen3 config has sliding_attention layer_types but no window (use_sliding_window false)")
        if types is None:
            types = [
                SLIDING if self.sliding_window is not None and i >= self.max_window_layers else FULL
                for i in range(self.num_hidden_layers)
            ]
        self.layer_types = derive_layer_types(types, self.num_hidden_layers, self.sliding_window)
        self.rope = self.one_rope()


class DecoderLayer(PreNormBlock):
    def __init__(self, args: ModelArgs, layer_idx: int):
        eps = args.rms_norm_eps
        kind = args.layer_types[layer_idx]
        self_attn = Attention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            scale=args.head_dim**-0.5,
            window=args.sliding_window if kind == SLIDING else None,
            rope=RoPE(args.head_dim, args.rope, args.max_position_embeddings),
            bias=args.attention_bias,
            qk_norm=lambda d: RMSNorm(d, eps),
        )
        mlp = MLP(args.hidden_size, args.intermediate_size, activation(args.hidden_act))
        super().__init__(self_attn, mlp, args.hidden_size, lambda d: RMSNorm(d, eps))


class Qwen3Model(DecoderStack):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Model(CausalLM):
    pipeline_stages = True  # plain DecoderStack: runs in --pp stages (pipeline.py)
    split_decode = True  # the engine's one-row step (decode.SplitSegments) may run its layers' pre/attend/post split

    def __init__(self, args: ModelArgs):
        super().__init__(args, Qwen3Model(args))
