"""Gemma 2 (`gemma2`).

Hidden states [B, L, hidden]; q [B, n_heads, L, head_dim], k/v [B, n_kv_heads,
L, head_dim] (per-rank counts under tensor parallelism). Layers alternate
sliding-window and full attention (sliding first), all with the same RoPE;
scores are scaled by query_pre_attn_scalar ** -0.5 and tanh soft-capped
(attn_logit_softcapping, as transformers' eager path does), the output logits
soft-capped by final_logit_softcapping. Attention and the GeGLU MLP are
wrapped in pre- and post-norms (GemmaRMSNorm, 1 + w). Embeddings are scaled by
sqrt(hidden) in the compute dtype and tied to the output head by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..nn.blocks import MLP, Attention, SandwichBlock
from ..errors import UserError
from ..nn.layers import GemmaRMSNorm, activation
from ..nn.rope import RoPE
from .base import SLIDING, BaseModelArgs, CausalLM, DecoderStack, derive_layer_types

# transformers' Gemma2Config: without layer_types, every 2nd layer is full
# ("sliding_attention" if (i + 1) % 2 else "full_attention").
LEGACY_PATTERN = 2


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = "gemma2"
    vocab_size: int = 256000
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    query_pre_attn_scalar: float = 256
    sliding_window: int | None = 4096
    layer_types: list | None = None
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    attn_logit_softcapping: float | None = 50.0
    final_logit_softcapping: float | None = 30.0
    hidden_activation: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    max_position_embeddings: int = 8192
    use_bidirectional_attention: bool | None = None

    def __post_init__(self):
        if self.use_bidirectional_attention:
            raise UserError("gemma2 with use_bidirectional_attention (an embedding model) is not supported")
        # Gemma2Config ignores any sliding_window_pattern key: only the legacy alternation.
        self.layer_types = derive_layer_types(
            self.layer_types, self.num_hidden_layers, self.sliding_window, LEGACY_PATTERN
        )
        self.rope = self.one_rope()


class DecoderLayer(SandwichBlock):
    def __init__(self, args: ModelArgs, rope: RoPE, layer_idx: int):
        eps = args.rms_norm_eps
        kind = args.layer_types[layer_idx]
        attn = Attention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            scale=args.query_pre_attn_scalar**-0.5,
            window=args.sliding_window if kind == SLIDING else None,
            rope=rope,
            bias=args.attention_bias,
            softcap=args.attn_logit_softcapping,
        )
        mlp = MLP(args.hidden_size, args.intermediate_size, activation(args.hidden_activation))
        super().__init__(attn, mlp, args.hidden_size, lambda d: GemmaRMSNorm(d, eps))


class Gemma2Model(DecoderStack):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        rope = RoPE(args.head_dim, args.rope, args.max_position_embeddings)
        self.layers = [DecoderLayer(args, rope, i) for i in range(args.num_hidden_layers)]
        self.norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)

    def embed(self, inputs):
        h = self.embed_tokens(inputs)
        # sqrt(hidden) rounded once to fp32, then to the compute dtype (as the reference).
        h = h * mx.array(self.args.hidden_size**0.5, mx.float32).astype(h.dtype)
        return h


class Model(CausalLM):
    pipeline_stages = True  # plain DecoderStack: runs in --pp stages (pipeline.py)

    def __init__(self, args: ModelArgs):
        super().__init__(args, Gemma2Model(args))

    split_decode = True  # the engine's one-row step (decode.SplitSegments) may run its layers' pre/attend/post split

    def __call__(self, inputs, cache=None):
        return self.softcap(super().__call__(inputs, cache))

    def decode_logits(self, h):
        """Logits of the final hidden state of a split decode step (as __call__ after its layers)."""
        return self.softcap(self.head(self.model.norm(h)))

    def softcap(self, logits):
        if self.args.final_logit_softcapping is not None:
            cap = self.args.final_logit_softcapping
            logits = mx.tanh(logits / cap) * cap
        return logits
