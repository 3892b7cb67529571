"""Blocks that model files compose: grouped-query attention and the gated MLP,
with transformers' weight names (q_proj/k_proj/v_proj/o_proj, q_norm/k_norm,
gate_proj/up_proj/down_proj) so checkpoints load without key tables, and the
attribute contract `shard.shard_attention` / `shard.shard_mlp` rely on
(`total_num_heads`, `num_heads`, `total_num_kv_heads`, `num_kv_heads`,
`head_dim`, `per_head_params`).

Layouts: x [B, L, hidden]; q [B, num_heads, L, head_dim]; k, v [B,
num_kv_heads, L, head_dim] (per-rank counts once sharded).
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from .attention import causal_attention
from .errors import UserError
from .layers import gated_fp32


class Attention(nn.Module):
    """Causal GQA attention. Options cover the supported families:

    - `window`: sliding-window size for this layer (None: full attention);
    - `rope`: a `rope.RoPE`, or None for layers without positions (cohere2 and
      exaone4 global layers);
    - `qk_norm`: factory `head_dim -> Module` for per-head q/k norms;
    - `bias` on q/k/v (and o_proj unless `o_bias` says otherwise);
    - `softcap`: tanh soft-capping of scores; `sinks`: learned per-head logits.

    Subclasses change `project` (how q, k, v are made) or `position`.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        scale: float,
        window: int | None = None,
        rope=None,
        bias: bool = False,
        o_bias: bool | None = None,
        qk_norm: Callable[[int], nn.Module] | None = None,
        softcap: float | None = None,
        sinks: bool = False,
    ):
        super().__init__()
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise UserError(
                f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
            )
        self.total_num_heads = self.num_heads = num_heads
        self.total_num_kv_heads = self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.window = window
        self.rope = rope
        self.softcap = softcap
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias if o_bias is None else o_bias)
        if qk_norm is not None:
            self.q_norm = qk_norm(head_dim)
            self.k_norm = qk_norm(head_dim)
        self.per_head_params = ()
        if sinks:
            self.sinks = mx.zeros((num_heads,))
            self.per_head_params = ("sinks",)

    def project(self, x):
        B, L, _ = x.shape
        # [B, L, heads * D] -> [B, heads, L, D]
        q = self.q_proj(x).reshape(B, L, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, L, self.num_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.num_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def position(self, q, k, offset: int):
        if self.rope is None:
            return q, k
        return self.rope(q, offset), self.rope(k, offset)

    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        q, k, v = self.project(x)
        q, k = self.position(q, k, cache.offset if cache is not None else 0)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        sinks = self.sinks if "sinks" in self else None
        out = causal_attention(q, k, v, self.scale, self.window, softcap=self.softcap, sinks=sinks, mask=mask)
        # [B, heads, L, D] -> [B, L, heads * D]
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)); the activation runs in fp32 and rounds once,
    as torch's kernels do for half-precision inputs."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: Callable, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = act

    def __call__(self, x):
        return self.down_proj(gated_fp32(self.act)(self.gate_proj(x), self.up_proj(x)))


class PreNormBlock(nn.Module):
    """The llama-style decoder layer: h = x + attn(norm(x)); out = h + mlp(norm(h)),
    with HF's names (`input_layernorm`, `post_attention_layernorm`). `norm` is a
    factory `dims -> Module` (the family's RMSNorm variant)."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, norm: Callable[[int], nn.Module]):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = norm(hidden_size)
        self.post_attention_layernorm = norm(hidden_size)

    def __call__(self, x, mask=None, cache=None):
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))
