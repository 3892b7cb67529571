"""A model's caches from its layer kinds (`make_layer_caches`) and the masks
a forward asks them for, once per attention kind (`layer_masks`).
"""

from __future__ import annotations

from .base import CHUNKED, SLIDING
from .chunked import ChunkedKVCache
from .full import KVCache
from .sliding import RotatingKVCache


def make_layer_caches(layer_types: list, window: int | None, chunk: int | None = None) -> list:
    """A RotatingKVCache(window) per sliding layer, a ChunkedKVCache(chunk)
    per chunked one, a KVCache per full layer."""
    def one(kind):
        if kind == SLIDING:
            return RotatingKVCache(window)
        return ChunkedKVCache(chunk) if kind == CHUNKED else KVCache()

    return [one(kind) for kind in layer_types]


def layer_masks(L: int, cache, layer_types: list, window: int | None, chunk: int | None = None) -> dict:
    """One mask per attention kind for L new tokens, built once per forward
    (before any layer updates its cache): each kind's first cache says which
    (`cache.LayerCache.mask`). `cache` is the cache list of the layers this
    rank runs, `layer_types` their kinds, entry for entry (every layer, or a
    pipeline stage's: a kind's first layer may be on another stage, so the
    kinds are the stage's own, never the model's), or None for a cache-less
    pass, which needs what fresh caches would (`chunk`: the chunked layers'
    attention chunk)."""
    if cache is None:
        cache = make_layer_caches(layer_types, window, chunk)
    masks = {}
    for kind, c in zip(layer_types, cache):
        if kind not in masks:
            masks[kind] = c.mask(L)
    return masks
