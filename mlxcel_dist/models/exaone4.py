"""EXAONE 4.0 (`exaone4`).

Hidden states [B, L, hidden]; q [B, n_heads, L, head_dim], k/v [B, n_kv_heads,
L, head_dim] (per-rank counts under tensor parallelism). Post-norm blocks: no
input norm; the attention output and the SwiGLU MLP output are each
RMS-normalised before joining the residual. q and k are RMS-normalised per
head. Layer kinds follow the "LLLG" pattern (three sliding-window layers, one
global); when the config has a sliding window, global layers carry no RoPE
(without one every layer is global and all use RoPE), as the reference does.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.nn as nn

from ..nn.blocks import MLP, Attention
from ..errors import UserError
from ..nn.layers import RMSNorm, activation
from ..nn.rope import RoPE
from .base import FULL, SLIDING, BaseModelArgs, CausalLM, DecoderStack, derive_layer_types


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = "exaone4"
    vocab_size: int = 102400
    hidden_size: int = 4096
    intermediate_size: int = 16384
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    sliding_window: int | None = 4096
    sliding_window_pattern: str | int | None = 4
    layer_types: list | None = None
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.layer_types = derive_layer_types(
            self._pattern_layer_types(), self.num_hidden_layers, self.sliding_window
        )
        self.rope = self.one_rope()

    def _pattern_layer_types(self) -> list | None:
        """layer_types as given, else from sliding_window_pattern: an int P
        (every P-th layer global, transformers' Exaone4Config) or a string of
        L/G repeated over the layers (EXAONE's own "LLLG"; transformers cannot
        derive from a string and needs layer_types). No window: all global."""
        if self.layer_types is not None or self.sliding_window is None:
            return self.layer_types
        p = self.sliding_window_pattern
        n = self.num_hidden_layers
        if isinstance(p, str) and p and not set(p) - {"L", "G"}:
            return [SLIDING if p[i % len(p)] == "L" else FULL for i in range(n)]
        if isinstance(p, int) and not isinstance(p, bool) and p >= 1:
            return [SLIDING if (i + 1) % p else FULL for i in range(n)]
        raise UserError(
            f"config sliding_window_pattern {p!r} is neither a positive integer nor a string of L/G "
            "(and there is no layer_types)"
        )


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, rope: RoPE, layer_idx: int):
        super().__init__()
        eps = args.rms_norm_eps
        sliding = args.layer_types[layer_idx] == SLIDING
        self.self_attn = Attention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            scale=args.head_dim**-0.5,
            window=args.sliding_window if sliding else None,
            # The reference rotates iff the model has no window or the layer slides.
            rope=rope if args.sliding_window is None or sliding else None,
            qk_norm=lambda d: RMSNorm(d, eps),
        )
        self.mlp = MLP(args.hidden_size, args.intermediate_size, activation(args.hidden_act))
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(args.hidden_size, eps)

    def __call__(self, x, mask=None, cache=None):
        h = x + self.post_attention_layernorm(self.self_attn(x, mask, cache))
        return h + self.post_feedforward_layernorm(self.mlp(h))


class Exaone4Model(DecoderStack):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        rope = RoPE(args.head_dim, args.rope, args.max_position_embeddings)
        self.layers = [DecoderLayer(args, rope, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Model(CausalLM):
    pipeline_stages = True  # plain DecoderStack: runs in --pp stages (pipeline.py)

    def __init__(self, args: ModelArgs):
        super().__init__(args, Exaone4Model(args))
