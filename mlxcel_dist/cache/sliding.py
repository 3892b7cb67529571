"""Sliding-window attention's keys/values (`RotatingKVCache(window)`): the
eager kind; its static forms are full.py's (`KVKind`) with its window: a
ring of `window` slots (window + margin with drafts).

The sliding-window invariant (docs/architecture.md): before an update of n
tokens, `sliding_offset` (= min(offset, window - 1)) is the number of earlier
keys the update will return; `mask(n)` (asked once per forward, before any
update) is the windowed prefill mask over `sliding_offset + n` keys, and
`returned` after the update always agrees.

- A multi-token update returns the last `max_size - 1` earlier keys plus all
  new ones (a fresh prefill keeps all its keys), so every new token, the first
  included, sees a full window; the mask does the windowing.
- A single-token decode writes into a ring buffer of `max_size` slots and
  returns at most `max_size` keys: exactly the window, in ring order (order is
  irrelevant to a single query, RoPE was applied before caching).
- Trimming (`trim`): only while every position seen is still held.
"""

from __future__ import annotations

import mlx.core as mx

from ..nn.masks import CAUSAL, create_sliding_window_prefill_mask
from .base import Snapshot
from .full import KVKind


class RotatingKVCache(KVKind):
    """A sliding layer's keys/values, window `max_size` (the module docstring)."""

    step = 256

    def __init__(self, max_size: int):
        if max_size < 1:
            raise ValueError(f"RotatingKVCache needs max_size >= 1, got {max_size}")
        self.max_size = max_size
        self.keys = None
        self.values = None
        self.offset = 0  # tokens seen in total (the next token's position)
        self._idx = 0  # ring write position, or buffer length when in temporal order
        self.returned = 0

    @property
    def window(self) -> int:
        return self.max_size

    @property
    def sliding_offset(self) -> int:
        """Earlier keys the next update returns, for any update size."""
        return min(self.offset, self.max_size - 1)

    def mask(self, L: int):
        """A single token: none (the ring returns exactly the window). Keys
        that all lie within the window: plain causal. Else the windowed
        prefill mask over the `sliding_offset + L` keys the update returns."""
        if L == 1:
            return None
        if self.sliding_offset + L <= self.max_size:
            return CAUSAL
        return create_sliding_window_prefill_mask(L, self.sliding_offset, self.max_size)

    def _temporal_order(self, x: mx.array) -> mx.array:
        # Rearrange the ring buffer so the oldest key comes first.
        if self._idx == x.shape[2]:
            return x
        if self._idx < self.offset:  # wrapped
            return mx.concatenate([x[..., self._idx :, :], x[..., : self._idx, :]], axis=2)
        return x[..., : self._idx, :]

    def temporal(self) -> tuple[mx.array, mx.array]:
        """The keys and values held (up to the window, or a whole prefill),
        oldest first."""
        return self._temporal_order(self.keys), self._temporal_order(self.values)

    def _update_concat(self, keys, values):
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            keep = self.sliding_offset
            old_k = self._temporal_order(self.keys)
            old_v = self._temporal_order(self.values)
            old_k = old_k[..., old_k.shape[2] - keep :, :]
            old_v = old_v[..., old_v.shape[2] - keep :, :]
            self.keys = mx.concatenate([old_k, keys], axis=2)
            self.values = mx.concatenate([old_v, values], axis=2)
        self.offset += keys.shape[2]
        self._idx = self.keys.shape[2]
        return self.keys, self.values

    def _update_in_place(self, keys, values):
        prev = self.offset
        if self.keys is None or (prev >= self.keys.shape[2] and self.keys.shape[2] < self.max_size):
            # Grow towards max_size (buffer in temporal order, _idx == length).
            B, H, _, Dk = keys.shape
            Dv = values.shape[3]
            grow = min(self.step, self.max_size - prev)
            new_k = mx.zeros((B, H, grow, Dk), keys.dtype)
            new_v = mx.zeros((B, H, grow, Dv), values.dtype)
            if self.keys is not None:
                self.keys = mx.concatenate([self.keys, new_k], axis=2)
                self.values = mx.concatenate([self.values, new_v], axis=2)
            else:
                self.keys, self.values = new_k, new_v
            self._idx = prev
        excess = self.keys.shape[2] - self.max_size
        if excess > 0:
            # After a long multi-token update: keep the trailing window in order.
            self.keys = self._temporal_order(self.keys)[..., -self.max_size :, :]
            self.values = self._temporal_order(self.values)[..., -self.max_size :, :]
            self._idx = self.max_size
        if self._idx == self.max_size:
            self._idx = 0
        self.keys[..., self._idx : self._idx + 1, :] = keys
        self.values[..., self._idx : self._idx + 1, :] = values
        self.offset += 1
        self._idx += 1
        if self.offset < self.max_size:
            return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        return self.keys, self.values

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        expected = self.sliding_offset + keys.shape[2]
        prev = self.offset
        if keys.shape[2] == 1:
            k, v = self._update_in_place(keys, values)
        else:
            k, v = self._update_concat(keys, values)
        self.returned = k.shape[2]
        assert self.returned == expected, (self.returned, expected)
        self.last = (k, v, prev)
        return k, v

    def snapshot(self) -> Snapshot:
        """The ring as it is (its slots and write position), so a restored
        cache returns its keys in the same order, bit for bit."""
        if self.keys is None:
            return super().snapshot()
        return Snapshot((self.keys[:], self.values[:], self._idx, self.offset))

    def restore_snapshot(self, snap: Snapshot) -> None:
        if len(snap.state) == 1:
            return super().restore_snapshot(snap)
        k, v, self._idx, self.offset = snap.state
        self.keys, self.values = k[:], v[:]
        self.returned, self.last = 0, None

    def can_trim(self, n: int) -> bool:
        """While it holds every position seen (in temporal order, nothing
        dropped by a ring or a long chunk): the last n can go."""
        return 0 <= n <= self.offset and self.keys is not None and self._idx == self.offset

    def trim(self, n: int) -> None:
        if not self.can_trim(n):
            super().trim(n)
        self.offset -= n
        self._idx -= n
        self.returned, self.last = 0, None
