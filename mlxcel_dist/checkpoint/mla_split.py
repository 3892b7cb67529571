"""mlx-lm's layout of an MLA attention's kv_b_proj (deepseek_v3 and the
families registered as it): `mlx_lm.convert` stores it split per head as
`embed_q` [H, kv_lora, nope] (the k rows, transposed) and `unembed_out`
[H, v, kv_lora], quantized or not; these views read them back as the
Hugging Face kv_b_proj.weight [H * (nope + v), kv_lora], a rank reading only
the heads its rows need (a model's sanitize: checkpoint/weights.py's lazy
views)."""

from __future__ import annotations

import mlx.core as mx

from .weights import View


class KvbRef(View):
    """kv_b_proj.weight [H * (nope + v), kv_lora] rebuilt from mlx-lm's split
    of it (`embed_q` [H, kv_lora, nope], the k rows transposed; `unembed_out`
    [H, v, kv_lora]): a rearrangement, exact. Reads only the heads a row
    range needs."""

    def __init__(self, wk, wv):
        self.wk, self.wv = wk, wv
        self.dtype = wk.dtype
        H, R, nope = wk.shape
        self.width = nope + wv.shape[1]  # rows per head
        self.shape = (H * self.width, R)

    def read(self, axis=None, ranges=None) -> mx.array:
        if axis == 1:
            return mx.concatenate([self.read()[:, s:e] for s, e in ranges], axis=1)
        parts = []
        for s, e in ranges or [(0, self.shape[0])]:
            h0, h1 = s // self.width, -(-e // self.width)
            wk, wv = self.wk.read(0, [(h0, h1)]), self.wv.read(0, [(h0, h1)])
            rows = mx.concatenate([wk.swapaxes(1, 2), wv], axis=1).reshape(-1, self.shape[1])  # [heads * width, R]
            parts.append(rows[s - h0 * self.width : e - h0 * self.width])
        return parts[0] if len(parts) == 1 else mx.concatenate(parts)


class ArrayRef:
    """An mx.array read like a TensorRef (read(axis, ranges))."""

    def __init__(self, a):
        self.a, self.shape, self.dtype = a, tuple(a.shape), a.dtype

    def read(self, axis=None, ranges=None):
        if axis is None:
            return self.a
        return mx.concatenate([self.a[(slice(None),) * axis + (slice(s, e),)] for s, e in ranges], axis=axis)


class DequantizedRef:
    """A quantized stack [H, out, in] (mlx-lm's quantized `embed_q` /
    `unembed_out`: packed words, scales, biases) read as its dequantized
    values, head ranges only (axis 0): kv_b_proj is rebuilt from them in the
    float dtype, as no kv_b_proj is stored to quantize."""

    def __init__(self, w, scales, biases, in_dims: int):
        self.w, self.scales, self.biases = w, scales, biases
        self.group_size = in_dims // scales.shape[-1]
        self.bits = w.shape[-1] * 32 // in_dims
        self.dtype = scales.dtype
        self.shape = (*w.shape[:-1], in_dims)

    def read(self, axis=None, ranges=None) -> mx.array:
        assert axis in (None, 0), "read by heads only"
        w, scales, biases = ((a.read(0, ranges) if axis == 0 else a.read()) if a is not None else None
                             for a in (self.w, self.scales, self.biases))
        return mx.dequantize(w, scales, biases, group_size=self.group_size, bits=self.bits)


def kv_b_proj(wk, wv):
    """kv_b_proj.weight from mlx-lm's embed_q / unembed_out weights (None:
    names only; either may be a DequantizedRef)."""
    if wk is None:
        return None
    if isinstance(wk, mx.array) and isinstance(wv, mx.array):
        return KvbRef(ArrayRef(wk), ArrayRef(wv)).read()
    ref = (lambda a: ArrayRef(a) if isinstance(a, mx.array) else a)
    return KvbRef(ref(wk), ref(wv))
