"""Rotary position embeddings, with the inverse frequencies of transformers'
`ROPE_INIT_FUNCTIONS` (default, linear, llama3, yarn) computed the same way in
float32, so positions far into a sequence rotate exactly as the reference.

Input [B, heads, L, head_dim]; the first `dims` features are rotated in the
"rotate half" (non-interleaved) layout, or pairwise-interleaved with
`traditional=True`; the rest pass through.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from ..errors import UserError

SUPPORTED = ("default", "linear", "llama3", "yarn")


def _pow32(base: float, exps: np.ndarray) -> np.ndarray:
    # torch's float32 pow is correctly rounded; numpy's float32 pow can be 1 ulp
    # off, so raise in float64 and round once.
    return (np.float64(np.float32(base)) ** exps.astype(np.float64)).astype(np.float32)


def _default_inv_freq(base: float, dim: int) -> np.ndarray:
    exps = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (np.float32(1.0) / _pow32(base, exps)).astype(np.float32)


def inv_freq_for(params: dict, head_dim: int, max_position_embeddings: int | None = None):
    """(inv_freq [dims/2] float32, attention_scaling, dims) for one rope config
    in the transformers-5 form: {"rope_type", "rope_theta", "factor", ...}."""
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED:
        raise UserError(f"unsupported rope_type {rope_type!r} (supported: {', '.join(SUPPORTED)})")
    base = float(params.get("rope_theta", 10000.0))
    dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0) or 1.0))
    scaling = 1.0
    inv = _default_inv_freq(base, dim)
    if rope_type == "linear":
        inv = (inv / np.float32(params["factor"])).astype(np.float32)
    elif rope_type == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old = float(params["original_max_position_embeddings"])
        low_wl, high_wl = old / low, old / high
        wavelen = (np.float32(2 * math.pi) / inv).astype(np.float32)
        inv_l = np.where(wavelen > low_wl, inv / np.float32(factor), inv).astype(np.float32)
        smooth = ((old / wavelen - low) / (high - low)).astype(np.float32)
        smoothed = ((1 - smooth) * inv_l / np.float32(factor) + smooth * inv_l).astype(np.float32)
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        inv = np.where(medium, smoothed, inv_l).astype(np.float32)
    elif rope_type == "yarn":
        inv, scaling = _yarn(params, base, dim, max_position_embeddings)
    return inv, float(scaling), dim


def _yarn(params: dict, base: float, dim: int, max_pos: int | None):
    factor = params.get("factor")
    orig = params.get("original_max_position_embeddings")
    if orig is None:
        raise UserError("yarn rope needs original_max_position_embeddings")
    if factor is None:
        factor = max_pos / orig
    factor = float(factor)

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    att = params.get("attention_factor")
    if att is None:
        ms, msa = params.get("mscale"), params.get("mscale_all_dim")
        att = get_mscale(factor, ms) / get_mscale(factor, msa) if ms and msa else get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def corr_dim(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = _pow32(base, np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    extrap = (np.float32(1.0) / pos_freqs).astype(np.float32)
    interp = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrap_factor = (1 - ramp).astype(np.float32)
    inv = (interp * (1 - extrap_factor) + extrap * extrap_factor).astype(np.float32)
    return inv, float(att)


class RoPE:
    """Applies rotary embeddings; not an nn.Module so it holds no parameters."""

    def __init__(
        self, head_dim: int, params: dict, max_position_embeddings: int | None = None, *, traditional: bool = False
    ):
        inv, self.scaling, self.dims = inv_freq_for(params, head_dim, max_position_embeddings)
        # traditional: rotate interleaved pairs (x[2i], x[2i+1]) as cohere's
        # rotate_half does, instead of the two halves.
        self.traditional = traditional
        # mx.fast.rope takes wavelengths-over-2pi ("freqs") = 1 / inv_freq.
        self._freqs = mx.array((1.0 / inv.astype(np.float64)).astype(np.float32))
        self.params = dict(params)

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        if self.scaling != 1.0:
            # Yarn scales cos and sin; rotation is linear, so scale the input.
            x = x * self.scaling
        return mx.fast.rope(
            x, self.dims, traditional=self.traditional, base=None, scale=1.0, offset=offset, freqs=self._freqs
        )

    def describe(self) -> str:
        t = self.params.get("rope_type", "default")
        extra = f", factor {self.params['factor']}" if "factor" in self.params else ""
        inter = ", interleaved" if self.traditional else ""
        return f"{t} theta {self.params.get('rope_theta')}{extra}{inter}"
