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
from ..errors import UserError
from .experts import SwitchGLU, softmax_top_k
from .layers import gated_fp32, joinable_params, joined_rows
from .rope import RoPE

# Fused projections: q/k/v of `Attention` and gate/up of `MLP` each run as one
# matmul on their row-concatenated weights, the output split by slices (on an
# H200, MLX CUDA decode is host-bound: a kernel per projection is the cost).
# Off: the separate projections (tests compare both).
FUSE_PROJECTIONS = True


def _fusable_types():
    from mlx.nn.layers.distributed import AllToShardedLinear, QuantizedAllToShardedLinear

    return (nn.Linear, nn.QuantizedLinear, AllToShardedLinear, QuantizedAllToShardedLinear)


def _fused_params(layers: list) -> tuple | None:
    """What one matmul over `layers` joins (`layers.joinable_params`): a Linear,
    a QuantizedLinear or their all-to-sharded TP forms, whose forward is the
    same matmul."""
    return joinable_params(layers, _fusable_types())


def fused_projection(module: nn.Module, names: tuple, key: str):
    """x -> [out of each of `names`] as ONE matmul on their row-concatenated
    weights (`layers.joined_rows`: built once, the HF-named parameters then
    row views of it, so memory does not double), or None when they do not
    fuse (`_fused_params`) or FUSE_PROJECTIONS is off."""
    if not FUSE_PROJECTIONS:
        return None
    layers = [module.get(n) for n in names]
    got = joined_rows(module, layers, key, _fused_params)
    return None if got is None else _projector(layers[0], *got)


def _projector(layer: nn.Module, fused: tuple, rows: tuple, params: tuple):
    p = dict(zip(params, fused))

    def project(x):
        if "scales" in p:  # QuantizedLinear's forward
            y = mx.quantized_matmul(x, p["weight"], scales=p["scales"], biases=p.get("biases"), transpose=True,
                                    group_size=layer.group_size, bits=layer.bits, mode=layer.mode)
            if "bias" in p:
                y = y + p["bias"]
        elif "bias" in p:  # nn.Linear's forward
            y = mx.addmm(p["bias"], x, p["weight"].T)
        else:
            y = x @ p["weight"].T
        outs, start = [], 0
        for r in rows:
            outs.append(y[..., start : start + r])
            start += r
        return outs

    return project


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
        fused = fused_projection(self, ("q_proj", "k_proj", "v_proj"), "_qkv_fused")
        q, k, v = fused(x) if fused is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        # [B, L, heads * D] -> [B, heads, L, D]
        q = q.reshape(B, L, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)
        k = k.reshape(B, L, self.num_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        v = v.reshape(B, L, self.num_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def position(self, q, k, offset: int):
        if self.rope is None:
            return q, k
        return self.rope(q, offset), self.rope(k, offset)

    # A forward is qkv -> attend -> out. Split decode (decode.SplitSegments)
    # runs qkv and out inside compiled segments and `attend` between them,
    # on the written prefix of the static buffers (no mask: the fused kernels).

    def qkv(self, x, cache=None):
        """q, and k/v after RoPE and the cache update (the whole cache)."""
        q, k, v = self.project(x)
        q, k = self.position(q, k, cache.offset if cache is not None else 0)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        return q, k, v

    def attend(self, q, k, v, mask=None):
        sinks = self.sinks if "sinks" in self else None
        return causal_attention(q, k, v, self.scale, self.window, softcap=self.softcap, sinks=sinks, mask=mask)

    def out(self, o):
        # [B, heads, L, D] -> [B, L, heads * D]
        B, _, L, _ = o.shape
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def __call__(self, x, mask=None, cache=None):
        q, k, v = self.qkv(x, cache)
        return self.out(self.attend(q, k, v, mask))


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
        fused = fused_projection(self, ("gate_proj", "up_proj"), "_gate_up_fused")
        g, u = fused(x) if fused is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(gated_fp32(self.act)(g, u))


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
        return self.finish(x, self.self_attn(self.input_layernorm(x), mask, cache))

    # split decode (decode.SplitSegments): pre -> self_attn.attend -> post, the pieces of __call__
    def pre(self, x, cache):
        return (x, *self.self_attn.qkv(self.input_layernorm(x), cache))

    def post(self, x, o):
        return self.finish(x, self.self_attn.out(o))

    def finish(self, x, a):
        """The layer after its attention output `a`: both residual adds and the MLP."""
        h = x + a
        return h + self.mlp(self.post_attention_layernorm(h))


class SandwichBlock(PreNormBlock):
    """Gemma's decoder layer: each sub-layer's output is normed before its
    residual add, h = x + post_attn_norm(attn(norm(x))); out = h +
    post_ff_norm(mlp(pre_ff_norm(h))) (HF's `pre_feedforward_layernorm`,
    `post_feedforward_layernorm` beside PreNormBlock's two)."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, norm: Callable[[int], nn.Module]):
        super().__init__(self_attn, mlp, hidden_size, norm)
        self.pre_feedforward_layernorm = norm(hidden_size)
        self.post_feedforward_layernorm = norm(hidden_size)

    def finish(self, x, a):
        h = x + self.post_attention_layernorm(a)
        return h + self.post_feedforward_layernorm(self.ffn(h))

    def ffn(self, h):
        """The feed-forward branch before its post-norm (Gemma 4 adds its experts here)."""
        return self.mlp(self.pre_feedforward_layernorm(h))


# --------------------------------------------------------------------------- Gemma 4 pieces
# (Gemma 4 and the models built on its backbone: attention with q/k/v norms,
# proportional partial RoPE, k == v, shared KV; its router and fused experts.)


class ProportionalRoPE:
    """transformers' "proportional" RoPE (Gemma 4's full layers): of the
    head_dim/2 rotate-half pairs (i, i + head_dim/2), the first
    int(partial_rotary_factor * head_dim / 2) rotate with inverse frequency
    theta^(-2i / head_dim) / factor (exponents over the WHOLE head_dim, not
    the rotated part); the rest do not rotate (inverse frequency 0, an
    infinite wavelength for mx.fast.rope: cos 1, sin 0, exactly x)."""

    def __init__(self, head_dim: int, params: dict):
        import numpy as np

        base = float(params.get("rope_theta", 10_000.0))
        factor = float(params.get("factor", 1.0) or 1.0)
        angles = int(float(params.get("partial_rotary_factor", 1.0)) * head_dim // 2)
        exps = np.arange(0, 2 * angles, 2).astype(np.float32) / np.float32(head_dim)
        # torch's float32 pow is correctly rounded: raise in float64, round once
        pw = (np.float64(np.float32(base)) ** exps.astype(np.float64)).astype(np.float32)
        inv = np.zeros(head_dim // 2, np.float32)
        inv[:angles] = np.float32(1.0) / pw
        inv = (inv / np.float32(factor)).astype(np.float32)
        with np.errstate(divide="ignore"):
            self._freqs = mx.array((1.0 / inv.astype(np.float64)).astype(np.float32))  # inf: no rotation
        self.dims, self.angles, self.params = head_dim, angles, dict(params)

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        return mx.fast.rope(x, self.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=self._freqs)

    def describe(self) -> str:
        p = self.params
        return f"proportional theta {p.get('rope_theta')}, {self.angles} of {self.dims // 2} pairs rotated"


class Gemma4Attention(nn.Module):
    """Gemma 4 attention: scale 1 (`scale`), q and k RMS-normed per head (w *
    x), v normed without a weight; `k_eq_v`: no v_proj, v is the raw k
    projection (before k_norm); `reads_kv`: no k/v projections at all, the
    keys/values are another layer's (its cache is a `cache.SharedKVCache`).
    Attribute contract of `shard.shard_attention` (which shards all three forms)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *, window=None,
                 rope=None, eps: float = 1e-6, bias: bool = False, k_eq_v: bool = False, reads_kv: bool = False,
                 scale: float = 1.0):  # fmt: skip
        super().__init__()
        from .layers import RMSNormFP32Scale

        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise UserError(f"{num_heads} attention heads are not a multiple of {num_kv_heads} KV heads")
        self.total_num_heads = self.num_heads = num_heads
        self.total_num_kv_heads = self.num_kv_heads = num_kv_heads
        self.head_dim, self.scale, self.window, self.rope, self.eps = head_dim, scale, window, rope, eps
        self.k_eq_v, self.reads_kv = k_eq_v, reads_kv
        self.per_head_params = ()
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.q_norm = RMSNormFP32Scale(head_dim, eps)
        if not reads_kv:
            self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
            if not k_eq_v:
                self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
            self.k_norm = RMSNormFP32Scale(head_dim, eps)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)

    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        offset = cache.offset if cache is not None else 0
        # [B, L, heads * D] -> [B, heads, L, D]
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.num_heads, self.head_dim)).transpose(0, 2, 1, 3)
        q = self.rope(q, offset)
        if self.reads_kv:
            k, v = cache.fetch()
        else:
            k = self.k_proj(x).reshape(B, L, self.num_kv_heads, self.head_dim)
            v = self.v_proj(x).reshape(B, L, self.num_kv_heads, self.head_dim) if "v_proj" in self else k
            k = self.rope(self.k_norm(k).transpose(0, 2, 1, 3), offset)
            v = mx.fast.rms_norm(v, None, self.eps).transpose(0, 2, 1, 3)  # weightless, fp32 inside
            if cache is not None:
                k, v = cache.update_and_fetch(k, v)
        out = causal_attention(q, k, v, self.scale, self.window, mask=mask)
        # [B, heads, L, D] -> [B, L, heads * D]
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def _scaled(x: mx.array, s: float) -> mx.array:
    # a tensor times a python float: torch multiplies in fp32 and rounds once
    return (x.astype(mx.float32) * s).astype(x.dtype)


class Gemma4Router(nn.Module):
    """Gemma 4's router over x [N, hidden]: weightless RMS norm, times `scale`
    [hidden] and hidden^-0.5, `proj` to E scores, softmax (fp32), top-k,
    renormalised over the k, times `per_expert_scale` [E] of the chosen.
    Returns (indices [N, k], weights [N, k] float32). Replicated under TP."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, eps: float = 1e-6):
        super().__init__()
        self.top_k, self.eps, self.root = top_k, eps, hidden_size**-0.5
        self.proj = nn.Linear(hidden_size, num_experts, bias=False)
        self.scale = mx.ones((hidden_size,))
        self.per_expert_scale = mx.ones((num_experts,))

    def __call__(self, x):
        h = _scaled(mx.fast.rms_norm(x, None, self.eps) * self.scale.astype(x.dtype), self.root)
        idx, w = softmax_top_k(self.proj(h), self.top_k, True)  # [N, k] each
        return idx, w * self.per_expert_scale[idx].astype(mx.float32)


class Gemma4Experts(SwitchGLU):
    """Gemma 4's routed experts: `experts.SwitchGLU` with transformers' fused
    `gate_up_proj` [E, 2I, hidden] (gate rows, then up rows; sanitize adds
    `.weight`, `gemma4_expert_name`) and `down_proj` [E, hidden, I]; each
    fp32-weighted output rounded, summed in routed order. The block sums its
    own partial output over `group` (one all_sum per block once sharded:
    Gemma 4 norms each branch before adding them)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act: Callable):
        from ..parallel.collectives import SINGLE

        super().__init__(hidden_size, intermediate_size, num_experts, gated_fp32(act), fused=True, combine="sum")
        self.group = SINGLE

    def __call__(self, x, indices, weights):
        # x [N, hidden]; indices [N, k]; weights [N, k] (float32)
        return self.group.all_sum(super().__call__(x, indices, weights))


class Gemma4Block(SandwichBlock):
    """Gemma 4's decoder layer (gemma4, diffusion_gemma): a SandwichBlock
    whose feed-forward branch may add routed experts beside the dense MLP
    (`moe` = (router, experts): each branch post-normed,
    `post_feedforward_layernorm_1` / `_2`, then the shared post-norm; the
    router reads the un-normed residual, the experts its
    `pre_feedforward_layernorm_2`), the layer's output times `layer_scalar`
    (or the caller's `scalar`: diffusion_gemma's encoder pass)."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, norm: Callable[[int], nn.Module],
                 moe: tuple | None = None):
        super().__init__(self_attn, mlp, hidden_size, norm)
        self.layer_scalar = mx.ones((1,))
        if moe is not None:
            self.router, self.experts = moe
            self.post_feedforward_layernorm_1 = norm(hidden_size)
            self.post_feedforward_layernorm_2 = norm(hidden_size)
            self.pre_feedforward_layernorm_2 = norm(hidden_size)

    def __call__(self, x, mask=None, cache=None, scalar=None):
        return self.scaled(self.finish(x, self.self_attn(self.input_layernorm(x), mask, cache)), scalar)

    def ffn(self, h):
        m = self.mlp(self.pre_feedforward_layernorm(h))
        if "experts" not in self:
            return m
        B, L, D = h.shape
        flat = h.reshape(B * L, D)  # [N, hidden]: the router reads the residual, not a normed copy
        idx, w = self.router(flat)
        e = self.experts(self.pre_feedforward_layernorm_2(flat), idx, w).reshape(B, L, D)
        return self.post_feedforward_layernorm_1(m) + self.post_feedforward_layernorm_2(e)

    def scaled(self, h, scalar=None):
        s = self.layer_scalar if scalar is None else scalar
        return h * s.astype(h.dtype)


def gemma4_expert_name(name: str) -> str:
    """A Gemma 4 checkpoint name in our layout: transformers' bare expert
    stacks (`experts.gate_up_proj`, `experts.down_proj`) are SwitchLinear
    weights (`.weight`); every other name as it is."""
    return name + ".weight" if name.endswith((".experts.gate_up_proj", ".experts.down_proj")) else name


def gemma4_rope_params(rope_parameters: dict | None, layer_types: list, family: str) -> dict:
    """{layer kind: RoPE params} of a Gemma 4 backbone (gemma4, diffusion_gemma):
    transformers' defaults (local theta 1e4; global "proportional", factor
    0.25, theta 1e6) when the config gives none; only "default" and
    "proportional" are supported (one UserError otherwise)."""
    rp = rope_parameters or {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    }
    out = {}
    for kind in set(layer_types):
        p = rp.get(kind)
        if not isinstance(p, dict):
            raise UserError(f"{family} config rope_parameters has no entry for {kind}")
        p = dict(p)
        p.setdefault("rope_type", "default")
        p.setdefault("rope_theta", 10_000.0)
        if p["rope_type"] not in ("default", "proportional"):
            raise UserError(f"{family} rope_type {p['rope_type']!r} is not supported (default, proportional)")
        out[kind] = p
    return out


def gemma4_rope(params: dict, head_dim: int):
    """The RoPE of one Gemma 4 layer kind (`gemma4_rope_params`)."""
    if params["rope_type"] == "proportional":
        return ProportionalRoPE(head_dim, params)
    # transformers' default RoPE for Gemma 4 ignores partial_rotary_factor
    return RoPE(head_dim, {"rope_type": "default", "rope_theta": params["rope_theta"]})
