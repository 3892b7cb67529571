"""Scaled dot-product attention with causal / sliding-window semantics.

Layouts: q [B, n_heads, L, D], k and v [B, n_kv_heads, S, D] with S >= L; the L
queries are the last L of the S key positions. GQA/MQA is handled by the kernel
(k/v are not tiled). Output [B, n_heads, L, Dv].
"""

from __future__ import annotations

import mlx.core as mx

from ..cache import QuantizedKV
from .masks import CAUSAL, create_causal_mask, create_causal_mask_with_window_full


def causal_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: mx.array | None = None,
    mask: mx.array | None = None,
) -> mx.array:
    """Causal attention, windowed when `window` is set (0 or None: plain causal).

    `mask` (boolean [L, S], True = attend, or "causal" for plain causal with
    the queries aligned to the last keys) is normally built once per forward
    by the model; without it the mask is derived here from L and S:
    - one query past the window: attend the trailing `window` keys only;
    - several queries: the full-width (windowed) mask over all S keys. K/V are
      never sliced for a multi-token query: a capped mask would leave the early
      rows with no visible key (all -inf, NaN).
    `softcap` applies tanh soft-capping to the scores (gemma2); `sinks` are
    per-head logits [n_heads] that join the softmax denominator (gpt-oss).
    k and v may be `cache.QuantizedKV` (--kv-bits): `_attention_quantized`.
    """
    L, S = q.shape[2], k.shape[2]
    if isinstance(k, QuantizedKV):  # --kv-bits: a full layer's cache (no window)
        return _attention_quantized(q, k, v, scale, softcap, mask, sinks)
    if mask is None:
        if L == 1:
            if window and S > window:
                k, v = k[..., -window:, :], v[..., -window:, :]
        elif window:
            mask = create_causal_mask_with_window_full(L, S - L, window)
        else:
            mask = create_causal_mask(L, S - L)
    elif isinstance(mask, str):
        if mask != CAUSAL:
            raise ValueError(f"unknown mask mode {mask!r}")
        if L == 1:
            mask = None  # one query sees every key it is given
        elif softcap is not None:
            mask = create_causal_mask(L, S - L)  # the explicit path needs the array
    elif mask.shape[-1] != S:
        raise ValueError(f"mask covers {mask.shape[-1]} keys but attention got {S}")

    if softcap is None:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)
    return _attention_softcap(q, k, v, scale, softcap, mask, sinks)


def _grouped_probs(scores, mask, sinks):
    """Softmax in fp32 of grouped scores [B, Hkv, rep, L, S] where ``mask``
    (boolean, or None) allows, with the heads' sinks as an extra logit."""
    _, Hkv, rep = scores.shape[:3]
    scores = scores.astype(mx.float32)
    if mask is not None:
        if mask.ndim == 4:  # per-row [B, 1, L, S] (batch.py): add the rep axis of the grouped scores
            mask = mask[:, :, None]
        scores = mx.where(mask, scores, mx.array(-mx.inf, mx.float32))
    if sinks is None:
        return mx.softmax(scores, axis=-1)
    s = sinks.astype(mx.float32).reshape(1, Hkv, rep, 1, 1)
    s = mx.broadcast_to(s, scores.shape[:-1] + (1,))
    return mx.softmax(mx.concatenate([s, scores], axis=-1), axis=-1)[..., 1:]


def _attention_softcap(q, k, v, scale, softcap, mask, sinks):
    # The fused kernel has no soft-capping: the explicit form, softmax in fp32
    # (as the reference does), GQA by grouping query heads per KV head.
    B, H, L, D = q.shape
    Hkv = k.shape[1]
    rep = H // Hkv
    q = q.reshape(B, Hkv, rep, L, D)  # [B, Hkv, rep, L, D]
    scores = (q @ mx.expand_dims(k, 2).swapaxes(-1, -2)) * scale  # [B, Hkv, rep, L, S]
    scores = mx.tanh(scores / softcap) * softcap
    probs = _grouped_probs(scores, mask, sinks)
    out = probs.astype(v.dtype) @ mx.expand_dims(v, 2)  # [B, Hkv, rep, L, Dv]
    return out.reshape(B, H, L, -1)


def _attention_quantized(q, k, v, scale, softcap, mask, sinks):
    # mlx-lm's quantized attention: scores and output by mx.quantized_matmul on
    # the packed cache (never dequantized whole), softmax in fp32 as above.
    B, H, L, D = q.shape
    Hkv = k.shape[1]
    rep = H // Hkv
    q = (q * scale).reshape(B, Hkv, rep, L, D)  # [B, Hkv, rep, L, D]
    kp = [mx.expand_dims(x, 2) for x in k.parts]  # [B, Hkv, 1, S, .]
    vp = [mx.expand_dims(x, 2) for x in v.parts]
    scores = mx.quantized_matmul(q, *kp, transpose=True, group_size=k.group_size, bits=k.bits)  # [B, Hkv, rep, L, S]
    if softcap is not None:
        scores = mx.tanh(scores / softcap) * softcap
    if isinstance(mask, str) or (mask is None and L > 1):
        mask = create_causal_mask(L, scores.shape[-1] - L)
    probs = _grouped_probs(scores, mask, sinks)
    out = mx.quantized_matmul(probs.astype(q.dtype), *vp, transpose=False, group_size=v.group_size, bits=v.bits)
    return out.reshape(B, H, L, -1)
