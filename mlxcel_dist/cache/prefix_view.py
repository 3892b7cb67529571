"""DiffusionGemma's read-only view of a layer's cache (`PrefixViewCache`):
eager only (no static form, not kept, not trimmed).
"""

from __future__ import annotations

import mlx.core as mx

from .base import LayerCache


class PrefixViewCache(LayerCache):
    """A read-only view of a layer's cache for a block of queries placed right
    after what it holds, every key visible to every query (DiffusionGemma's
    canvas decoder: bidirectional within the block and over the prefix).
    `update_and_fetch(k, v)` returns the kept earlier keys/values (all of
    them, or the last `keep`: a sliding layer's window - 1, as transformers'
    DynamicCache keeps) followed by the block's, and stores nothing; `offset`
    is the source's (the block's first position); `mask(L)` is all True
    [L, kept + L]. Not a decode-step cache (`static_kv` False)."""

    def __init__(self, source: LayerCache, keep: int | None = None):
        self.source, self.keep = source, keep

    @property
    def offset(self):
        return self.source.offset

    @property
    def kept(self) -> int:
        n = self.source.offset
        return n if self.keep is None else min(n, self.keep)

    def mask(self, L: int):
        return mx.ones((L, self.kept + L), dtype=mx.bool_)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        n = self.kept
        if n == 0:
            return keys, values
        pk, pv = self.source.temporal()
        pk, pv = pk[..., pk.shape[2] - n :, :], pv[..., pv.shape[2] - n :, :]
        return mx.concatenate([pk, keys], axis=2), mx.concatenate([pv, values], axis=2)
