"""Keys/values held MLX-quantized (--kv-bits), in every form: `QuantizedKV`
(what attention takes), the eager `QuantizedKVCache`, its static buffers
(`QuantizedStaticCache`: six a layer, the words, scales and biases of keys
and values), its rows (`QuantizedRowCache`) and prompts prefilled together
(`QuantizedPrefillCache`). Only full layers are quantized (as mlx-lm).
"""

from __future__ import annotations

import mlx.core as mx

from ..nn.masks import CAUSAL
from .base import EveryKeyHeld, Snapshot
from .full import PrefillCache, RowCache, StaticCache


class QuantizedKV:
    """Keys or values held MLX-quantized along head_dim (mx.quantize's affine
    form: packed uint32 `w` [B, H, S, D * bits / 32], `scales` and `biases`
    [B, H, S, D / group_size]); `shape` is the logical [B, H, S, D]
    (attention.causal_attention takes it as it takes an array)."""

    def __init__(self, w, scales, biases, bits: int, group_size: int):
        self.w, self.scales, self.biases, self.bits, self.group_size = w, scales, biases, bits, group_size

    @property
    def shape(self) -> tuple:
        return (*self.w.shape[:-1], self.w.shape[-1] * 32 // self.bits)

    @property
    def parts(self) -> tuple:
        return self.w, self.scales, self.biases

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.parts)

    def __getitem__(self, index) -> "QuantizedKV":
        """The same index on each part ([..., a:b, :]: positions a..b)."""
        return QuantizedKV(*(x[index] for x in self.parts), self.bits, self.group_size)

    @staticmethod
    def pair(parts, bits: int, group_size: int) -> tuple:
        """(keys, values) from six arrays: the keys' w, scales, biases, then the values'."""
        return QuantizedKV(*parts[:3], bits, group_size), QuantizedKV(*parts[3:], bits, group_size)

    def dequantize(self) -> mx.array:
        return mx.dequantize(*self.parts, group_size=self.group_size, bits=self.bits)


class QuantizedKVCache(EveryKeyHeld):
    """A full-attention layer's KV held quantized (mlx-lm's QuantizedKVCache:
    `--kv-bits`, `--kv-group-size`): each update quantizes the new keys and
    values and returns the whole cache as `QuantizedKV`s, which attention
    multiplies with `mx.quantized_matmul` (never dequantized as a whole).
    From the first token on (mlx-lm's generate waits for
    `--quantized-kv-start`, 5000 tokens by default). Not `static_kv` (its
    buffers are not float KV): its static forms are the quantized buffers
    below; the prompt cache keeps its quantized keys/values."""

    step = 256
    static_form = "quantized"
    cacheable = True

    def __init__(self, bits: int, group_size: int):
        self.bits, self.group_size = bits, group_size
        self.keys = self.values = None  # (w, scales, biases) each, room for `step` more tokens
        self.offset = 0

    def mask(self, L: int):
        return None if L == 1 else CAUSAL

    def _quantize(self, x: mx.array) -> tuple:
        D = x.shape[-1]
        if D % self.group_size:
            from ..errors import UserError

            raise UserError(f"--kv-group-size {self.group_size} does not divide this model's head_dim {D}")
        return mx.quantize(x, group_size=self.group_size, bits=self.bits)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        n, prev = keys.shape[2], self.offset
        qk, qv = self._quantize(keys), self._quantize(values)
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            grow = ((n + self.step - 1) // self.step) * self.step

            def extend(held, new):
                pad = [mx.zeros((*x.shape[:2], grow, x.shape[3]), x.dtype) for x in new]
                if held is None:
                    return pad
                return [mx.concatenate([h[..., :prev, :], p], axis=2) for h, p in zip(held, pad)]

            self.keys, self.values = extend(self.keys, qk), extend(self.values, qv)
        for held, new in ((self.keys, qk), (self.values, qv)):
            for h, x in zip(held, new):
                h[..., prev : prev + n, :] = x
        self.offset += n
        k, v = (QuantizedKV(*(h[..., : self.offset, :] for h in held), self.bits, self.group_size)
                for held in (self.keys, self.values))
        self.last = (k, v, prev)
        return k, v

    def temporal(self) -> tuple[QuantizedKV, QuantizedKV]:
        """The quantized keys and values held, position order."""
        return tuple(QuantizedKV(*held, self.bits, self.group_size)[..., : self.offset, :]
                     for held in (self.keys, self.values))

    def release(self) -> None:
        self.keys = self.values = self.last = None

    def restore(self, keys: QuantizedKV, values: QuantizedKV, offset: int) -> None:
        self.keys, self.values, self.offset = list(keys.parts), list(values.parts), offset

    @property
    def state(self):
        return [] if self.keys is None else [*self.keys, *self.values]

    # -- its other forms ------------------------------------------------------
    def held(self) -> tuple[list, list]:
        k, v = self.temporal()
        return [*k.parts, *v.parts], []

    def buffer_names(self, index: int) -> tuple[tuple, tuple]:
        return tuple(f"{x}{index}.{j}" for x in "kv" for j in range(3)), ()

    def row_view(self, buffers: dict, index: int, views: list, rows=None, margin: int = 0):
        return QuantizedRowCache(buffers, index, self.bits, self.group_size, rows, margin)

    def prefill_view(self, buffers: dict, index: int, ring: int, wraps: bool, views: list):
        return QuantizedPrefillCache(buffers, index, ring, wraps, self.bits, self.group_size)

    def snapshot(self) -> Snapshot:
        return Snapshot((self.offset,) if self.keys is None else (*self.held()[0], self.offset))

    def restore_snapshot(self, snap: Snapshot) -> None:
        if len(snap.state) == 1:
            self.release()
            self.offset = 0
            return
        self.restore(*self.entry([x[:] for x in snap.state[:6]], [], 0), snap.offset)

    def kept(self):
        return self.temporal()

    def restore_kept(self, entry, n: int) -> None:
        self.restore(entry[0][..., :n, :], entry[1][..., :n, :], n)

    def entry(self, held: list, states: list, offset: int):
        return QuantizedKV.pair(held, self.bits, self.group_size)


def quantize_kv(keys: mx.array, values: mx.array, bits: int, group_size: int) -> list:
    """The six arrays a token's keys and values take in quantized buffers."""
    return [*mx.quantize(keys, group_size=group_size, bits=bits), *mx.quantize(values, group_size=group_size, bits=bits)]


class QuantizedStaticCache(StaticCache):
    """A `QuantizedKVCache`'s static form (--kv-bits): keys and values
    each as (w, scales, biases) buffers [B, H, S, .] ("k{i}.0" ..), the new
    token quantized into slot `pos`; attention gets `QuantizedKV`s of the
    whole buffers and the mask hides the unwritten slots. A model with such
    layers never steps split (the split step attends float buffers)."""

    def __init__(self, state, index: int, bits: int, group_size: int):
        super().__init__(state, index, None)
        self.bits, self.group_size = bits, group_size

    @property
    def names(self) -> list:
        return [f"{x}{self.index}.{j}" for x in "kv" for j in range(3)]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        s, names = self.buffers, self.names
        pos = s["pos"]
        start = pos.reshape(1)
        for n, x in zip(names, quantize_kv(keys, values, self.bits, self.group_size)):
            s[n] = mx.slice_update(s[n], x, start, axes=(2,))
        k, v = QuantizedKV.pair([s[n] for n in names], self.bits, self.group_size)
        self.last = (k, v, pos)
        return k, v


class _QuantizedWrites:
    """The quantized rows' and prefill rows' update: the new tokens quantized
    into the six buffers (`_write`: the float form's slots)."""

    names = QuantizedStaticCache.names

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        k, v = QuantizedKV.pair(self._write(quantize_kv(keys, values, self.bits, self.group_size)),
                                self.bits, self.group_size)
        self.last = (k, v, self.offset)
        return k, v


class QuantizedRowCache(_QuantizedWrites, RowCache):
    """A --kv-bits layer's rows (QuantizedStaticCache's buffers, `pos`
    per row): each row's new token quantized into its slot; attention gets
    `QuantizedKV`s of the whole buffers under RowCache's per-row mask."""

    def __init__(self, state, index: int, bits: int, group_size: int, rows=None, margin: int = 0):
        super().__init__(state, index, None, rows, margin=margin)
        self.bits, self.group_size = bits, group_size


class QuantizedPrefillCache(_QuantizedWrites, PrefillCache):
    """PrefillCache for a --kv-bits layer: the chunk's keys/values quantized
    into the six buffers of QuantizedStaticCache's layout."""

    def __init__(self, buffers: dict, index: int, ring: int, wraps: bool, bits: int, group_size: int):
        super().__init__(buffers, index, None, ring, wraps)
        self.bits, self.group_size = bits, group_size
