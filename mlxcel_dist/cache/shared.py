"""A layer that reads another layer's keys/values (gemma3n, gemma4's last
layers): it holds nothing in any form; each form reads the source layer's
(`reads_layer`) cache of the same form.
"""

from __future__ import annotations

import mlx.core as mx

from .base import LayerCache


class SharedKVCache(LayerCache):
    """The cache of a layer that reads another layer's keys/values (Gemma 3n
    and Gemma 4's last layers reuse the KV of the last earlier layer of their
    kind). It holds nothing: `fetch()` returns what the source layer's cache
    returned in this forward (the source runs first), `offset` is the source's
    offset before that update (this layer's queries sit at the same
    positions), and `mask(L)` is the source's (asked before any update, as
    every mask). A model without a cache must still make caches for a
    forward, since this is how the KV travels between the two layers.
    Decode steps build its static counterpart on the source's buffers
    (`reads_layer`)."""

    static_kv = True  # its static form reads the source's static buffers
    static_form = "shared"
    cacheable = True  # (nothing of its own to keep)

    def __init__(self, source: LayerCache, reads_layer: int):
        self.source, self.reads_layer = source, reads_layer

    @property
    def window(self):
        return self.source.window

    @property
    def offset(self):
        last = self.source.last
        return self.source.offset if last is None else last[2]

    def mask(self, L: int):
        return self.source.mask(L)

    def fetch(self) -> tuple[mx.array, mx.array]:
        if self.source.last is None:
            raise RuntimeError(f"layer {self.reads_layer}'s cache has not been updated in this forward")
        k, v, _ = self.source.last
        return k, v

    # Its other forms: the same reader over the source layer's (it holds nothing).
    def held(self) -> tuple[list, list]:
        return [], []

    def row_view(self, buffers: dict, index: int, views: list, rows=None, margin: int = 0):
        return SharedKVCache(views[self.reads_layer], self.reads_layer)

    def prefill_view(self, buffers: dict, index: int, ring: int, wraps: bool, views: list):
        return SharedKVCache(views[self.reads_layer], self.reads_layer)

    def can_trim(self, n: int) -> bool:
        return True  # its source trims

    def trim(self, n: int) -> None:
        pass

    def restore_kept(self, entry, n: int) -> None:
        pass

