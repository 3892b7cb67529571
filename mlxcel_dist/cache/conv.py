"""Baichuan-M1's keys/values with a short causal conv over them
(`ConvKVCache`: a KV kind plus a conv state), in its forms: the static one
is the KV kind's beside a `StaticState` of the conv state (`StaticConvKV`).
"""

from __future__ import annotations

import mlx.core as mx

from .base import LayerCache, Snapshot
from .state import StaticState


class ConvKVCache(LayerCache):
    """A KV cache (`KVCache` or `RotatingKVCache`, `kv`) plus the state of a
    short causal conv over keys and values along the sequence (Baichuan-M1):
    `conv_state` = (keys, values) [B, conv_window - 1, kv_heads, head_dim], the
    last conv_window - 1 tokens' k/v BEFORE the conv (zeros before the first
    token, as the reference's zero padding), so a chunk or a decode step
    convolves exactly as the one pass does. The mask, offset, window and what
    attention sees are the wrapped cache's; kv_heads are per rank under TP.
    Its static form holds the conv state in buffers beside the static KV
    (`StaticConvKV`); not kept by the prompt cache, nor trimmed (a state)."""

    static_state = True

    def __init__(self, kv: LayerCache, conv_window: int):
        self.kv = kv
        self.conv_window = conv_window
        self.conv_state = None

    @property
    def offset(self):
        return self.kv.offset

    @property
    def window(self):
        return self.kv.window

    @property
    def sliding_offset(self) -> int:
        return self.kv.sliding_offset

    @property
    def returned(self) -> int:
        return self.kv.returned

    @property
    def last(self):
        return self.kv.last

    def mask(self, L: int):
        return self.kv.mask(L)

    def fetch_conv(self, like: mx.array) -> tuple[mx.array, mx.array]:
        """The conv state for new k/v shaped like `like` [B, n, kv_heads, D]."""
        if self.conv_state is None:
            B, _, H, D = like.shape
            z = mx.zeros((B, self.conv_window - 1, H, D), like.dtype)
            return z, z
        return self.conv_state

    def update_conv(self, keys: mx.array, values: mx.array) -> None:
        self.conv_state = (keys, values)

    def state_arrays(self) -> tuple:
        return self.conv_state or (None, None)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        return self.kv.update_and_fetch(keys, values)

    def temporal(self) -> tuple[mx.array, mx.array]:
        return self.kv.temporal()

    def release(self) -> None:
        self.kv.release()
        self.conv_state = None

    @property
    def state(self):
        return self.kv.state + ([] if self.conv_state is None else list(self.conv_state))

    @property
    def static_form(self) -> str | None:
        return "conv_kv" if self.kv.static_kv else None

    def held(self) -> tuple[list, list]:
        return list(self.kv.temporal()), list(self.state_arrays())

    def buffer_names(self, index: int) -> tuple[tuple, tuple]:
        return self.kv.buffer_names(index)[0], tuple(StaticState(None, index, 2).names)

    def row_view(self, buffers: dict, index: int, views: list, rows=None, margin: int = 0):
        return StaticConvKV(self.kv.row_view(buffers, index, views, rows, margin), StaticState(buffers, index, 2, rows))

    def snapshot(self) -> Snapshot:
        """The conv state (None, None before any token), then the KV's snapshot."""
        return Snapshot((*(self.conv_state or (None, None)), *self.kv.snapshot().state))

    def restore_snapshot(self, snap: Snapshot) -> None:
        ck, cv, *kv = snap.state
        self.conv_state = None if ck is None else (ck, cv)
        self.kv.restore_snapshot(Snapshot(tuple(kv)))


class StaticConvKV:
    """ConvKVCache's static form: a static KV view (`kv`) and its conv
    state as a `StaticState` of two arrays. Everything else (mask, offset,
    update_and_fetch, names, size ...) is the KV view's."""

    def __init__(self, kv: LayerCache, conv: StaticState):
        self.kv, self.conv = kv, conv

    def __getattr__(self, name):
        return getattr(self.__dict__["kv"], name)

    def fetch_conv(self, like) -> tuple:
        return self.conv.fetch()

    def update_conv(self, keys, values) -> None:
        self.conv.update(keys, values, 0)
