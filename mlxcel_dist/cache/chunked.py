"""Chunked attention's keys/values (llama4, `ChunkedKVCache(chunk)`): a
query sees the keys of its own attention chunk (positions chunk * (p //
chunk) .. p), so at most `chunk` keys (`window`), and `chunk` (not None) says
which. It keeps the last chunk - 1 keys as a RotatingKVCache's multi-token
path does and returns them with the new ones on every update (in position
order), the chunk mask (`masks.create_chunked_mask`) hiding those of earlier
chunks. Its static forms are full.py's with window = chunk: a ring of
`chunk` slots whose slots 0 .. pos % chunk are exactly the current chunk
(`StaticCache.last_slot`); prefill rings mask by the chunk rule.
"""

from __future__ import annotations

import mlx.core as mx

from ..nn.masks import CAUSAL, create_chunked_mask
from .sliding import RotatingKVCache


class ChunkedKVCache(RotatingKVCache):
    """A chunked-attention layer's cache (see the module docstring): every
    update returns the last min(offset, chunk - 1) earlier keys plus the new
    ones, oldest first (a decode step too: no ring, so the mask knows each
    key's position); its static form (full.py's) is a ring of `chunk`."""

    def __init__(self, chunk: int):
        super().__init__(chunk)

    @property
    def chunk(self) -> int:
        return self.max_size

    def mask(self, L: int):
        """None / CAUSAL when every returned key lies in the queries' chunk,
        else the chunk mask over the `sliding_offset + L` keys returned."""
        o, C = self.offset, self.max_size
        if (o - self.sliding_offset) // C == (o + L - 1) // C:
            return None if L == 1 else CAUSAL
        return create_chunked_mask(L, o, C, self.sliding_offset + L)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        expected = self.sliding_offset + keys.shape[2]
        prev = self.offset
        k, v = self._update_concat(keys, values)
        self.returned = k.shape[2]
        assert self.returned == expected, (self.returned, expected)
        self.last = (k, v, prev)
        return k, v
