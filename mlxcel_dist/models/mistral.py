"""Mistral (`mistral`): the Llama decoder where `sliding_window`, when set,
windows EVERY layer (transformers 5.24 MistralModel builds one sliding mask for
all layers; mlx-lm ignores the window altogether). A null window means full
attention everywhere. A config.json that also has a `layer_types` key is what
transformers' AutoConfig loads as `ministral` (Ministral-8B ships as model_type
mistral), so then `layer_types` decides per layer, as it does there. The same
file serves `ministral` (transformers 5.24 MinistralConfig: same defaults, same
decoder, `layer_types` per layer; it requires head_dim).

Hidden states [B, L, hidden]; q [B, n_heads, L, head_dim], k/v [B, n_kv_heads,
L, head_dim] (per-rank counts under tensor parallelism). No biases; head_dim
defaults to hidden / heads; one RoPE for all layers.
"""

from __future__ import annotations

from dataclasses import dataclass


from ..nn.blocks import Attention, MLP, PreNormBlock
from ..errors import UserError
from ..nn.layers import RMSNorm, activation
from ..nn.rope import RoPE
from .base import SLIDING, BaseModelArgs, CausalLM, DecoderStack, derive_layer_types


@dataclass
class ModelArgs(BaseModelArgs):
    # Defaults are transformers' MistralConfig defaults.
    model_type: str = "mistral"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096 * 32
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    original_max_position_embeddings: int | None = None
    sliding_window: int | None = 4096
    layer_types: list | None = None

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.model_type == "ministral":
                # MinistralConfig keeps head_dim None and transformers then fails to build the model.
                raise UserError("ministral config.json needs head_dim")
            self.head_dim = self.hidden_size // self.num_attention_heads
        # Without layer_types every layer slides when a window is set.
        self.layer_types = derive_layer_types(self.layer_types, self.num_hidden_layers, self.sliding_window)
        self.rope = self.one_rope()


class DecoderLayer(PreNormBlock):
    def __init__(self, args: ModelArgs, layer_idx: int):
        kind = args.layer_types[layer_idx]
        self_attn = Attention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            scale=args.head_dim**-0.5,
            window=args.sliding_window if kind == SLIDING else None,
            rope=RoPE(args.head_dim, args.rope, args.max_position_embeddings),
        )
        mlp = MLP(args.hidden_size, args.intermediate_size, activation(args.hidden_act))
        super().__init__(self_attn, mlp, args.hidden_size, lambda d: RMSNorm(d, args.rms_norm_eps))


class MistralModel(DecoderStack):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Model(CausalLM):
    pipeline_stages = True  # plain DecoderStack: runs in --pp stages (pipeline.py)
    split_decode = True  # the engine's one-row step (decode.SplitSegments) may run its layers' pre/attend/post split
    # Some older conversions saved `self_attn.rotary_emb.inv_freq`.
    drop_rotary_buffers = True

    def __init__(self, args: ModelArgs):
        super().__init__(args, MistralModel(args))
