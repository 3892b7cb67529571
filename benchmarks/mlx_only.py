"""What the MLX-calls-only reproducers (draft_floor.py, moe_spread.py) share:
nothing of mlxcel-dist or mlx-lm, MLX calls only."""

from __future__ import annotations

import mlx.core as mx


def attend(q, k, v, kbuf: mx.array, vbuf: mx.array, pos: int, theta: float, masked: bool = False) -> mx.array:
    """q [1, Hq, T, D], k / v [1, Hkv, T, D] at positions pos .. pos + T - 1:
    RoPE on q and k, k and v written into the preallocated buffers [1, Hkv, S, D]
    (in place), attention over the written prefix (causal for T > 1; `masked`:
    over the whole buffer with an array mask, MLX CUDA's unfused form, whose
    shapes do not change with pos); [1, T, Hq * D]."""
    _, H, T, D = q.shape
    q = mx.fast.rope(q, D, traditional=False, base=theta, scale=1.0, offset=pos)
    k = mx.fast.rope(k, D, traditional=False, base=theta, scale=1.0, offset=pos)
    kbuf[..., pos:pos + T, :] = k
    vbuf[..., pos:pos + T, :] = v
    if masked and T > 1:
        mask = mx.arange(kbuf.shape[2])[None] <= (pos + mx.arange(T))[:, None]
        o = mx.fast.scaled_dot_product_attention(q, kbuf, vbuf, scale=D ** -0.5, mask=mask)
        return o.transpose(0, 2, 1, 3).reshape(1, T, H * D)
    o = mx.fast.scaled_dot_product_attention(q, kbuf[..., :pos + T, :], vbuf[..., :pos + T, :], scale=D ** -0.5,
                                             mask=None if T == 1 else "causal")
    return o.transpose(0, 2, 1, 3).reshape(1, T, H * D)
