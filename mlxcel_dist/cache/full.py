"""Full attention's keys/values, in every form: the eager `KVCache`, the
static buffers the engine's compiled steps run on (`StaticCache`), a layer's
view of the batch rows (`RowCache`, one row being the one-row form) and of
prompts prefilled together (`PrefillCache`). The sliding and chunked kinds
(sliding.py, chunked.py) take the same static forms with their `window` /
`chunk` (`KVKind`, the KV kinds' shared answers).

Static layout: a layer's keys/values live in a buffer [B, kv_heads, S, D]
and the token's position `pos` is an int32 array, an input of the graph.
The new key goes to slot `pos` (full layers) or `pos % S` (sliding layers:
while S < window the buffer is in temporal order, so that is `pos` too; once
S == window it is a ring holding exactly the window); the mask is
`arange(S) <= pos` (unwritten slots hidden; a full ring all visible), built
once per step per attention kind by `cache.layer_masks` from
`StaticCache.mask`; RoPE takes `pos` as its offset. Chunked layers (llama4)
use the sliding layers' buffer (a ring of `chunk` slots once that long),
whose slots 0 .. pos % chunk hold exactly the current chunk. With a margin
(drafts) a ring is window + margin slots and masks go by each slot's
position (`position_mask`), so rolling back is moving `pos` back.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..nn.masks import CAUSAL, create_rows_mask
from .base import EveryKeyHeld, LayerCache, Snapshot


def ring_slots(start: int, n: int, size: int):
    """Slots of positions start .. start + n - 1 in a buffer of `size` slots
    (position p at p % size, `StaticCache.slot`'s rule), oldest first: a slice
    when they do not wrap (a view to read, one slice update to write, nothing
    sent to the device), else an index array (a gather / scatter)."""
    s0 = start % size
    if s0 + n <= size:
        return slice(s0, s0 + n)
    return mx.array(np.arange(start, start + n) % size)


class KVKind(LayerCache):
    """What the float KV kinds (full, sliding, chunked) answer alike: their
    static form is `RowCache` / `PrefillCache` with their window and chunk,
    their snapshot the keys/values held and the offset."""

    static_kv = True
    static_form = "kv"
    cacheable = True
    keys = values = None

    def held(self) -> tuple[list, list]:
        return list(self.temporal()), []

    def buffer_names(self, index: int) -> tuple[tuple, tuple]:
        return (f"k{index}", f"v{index}"), ()

    def row_view(self, buffers: dict, index: int, views: list, rows=None, margin: int = 0):
        return RowCache(buffers, index, self.window, rows, self.chunk, margin)

    def prefill_view(self, buffers: dict, index: int, ring: int, wraps: bool, views: list):
        return PrefillCache(buffers, index, self.window, ring, wraps, chunk=self.chunk)

    def snapshot(self) -> Snapshot:
        """(keys, values, offset); new handles ([:]): the cache's in-place
        writes never reach a snapshot, nor a restored cache's the snapshot."""
        return Snapshot((self.offset,) if self.keys is None else (*(x[:] for x in self.temporal()), self.offset))

    def restore_snapshot(self, snap: Snapshot) -> None:
        if len(snap.state) == 1:
            self.release()
            self.offset = self._idx = self.returned = 0
            return
        k, v, offset = snap.state
        self.restore(k[:], v[:], offset)

    def kept(self):
        return self.temporal()

    def restore_kept(self, entry, n: int) -> None:
        self.restore(entry[0][..., :n, :], entry[1][..., :n, :], n)

    def entry(self, held: list, states: list, offset: int):
        return tuple(held)

    def restore(self, keys: mx.array, values: mx.array, offset: int) -> None:
        self.keys, self.values, self.offset = keys, values, offset
        self._idx = keys.shape[2]  # in temporal order (RotatingKVCache's bookkeeping)
        self.returned = 0

    def release(self) -> None:
        self.keys = self.values = self.last = None

    @property
    def state(self):
        if self.keys is None:
            return []
        return [self.keys, self.values]


class KVCache(EveryKeyHeld, KVKind):
    """A full-attention layer's keys/values: every key returned (and trimmable)."""

    step = 256  # grow the buffer in steps so decode does not copy every token

    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0
        self.returned = 0

    @property
    def sliding_offset(self) -> int:
        return self.offset

    def mask(self, L: int):
        # Every cached key is earlier than every new token: plain causal.
        return None if L == 1 else CAUSAL

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        n = keys.shape[2]
        prev = self.offset
        if self.keys is None or prev + n > self.keys.shape[2]:
            B, H, _, Dk = keys.shape
            Dv = values.shape[3]
            grow = ((n + self.step - 1) // self.step) * self.step
            new_k = mx.zeros((B, H, grow, Dk), keys.dtype)
            new_v = mx.zeros((B, H, grow, Dv), values.dtype)
            if self.keys is not None:
                self.keys = mx.concatenate([self.keys[..., :prev, :], new_k], axis=2)
                self.values = mx.concatenate([self.values[..., :prev, :], new_v], axis=2)
            else:
                self.keys, self.values = new_k, new_v
        self.keys[..., prev : prev + n, :] = keys
        self.values[..., prev : prev + n, :] = values
        self.offset += n
        self.returned = self.offset
        k, v = self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        self.last = (k, v, prev)
        return k, v

    def temporal(self) -> tuple[mx.array, mx.array]:
        """The keys and values held, in position order (what the static
        buffers take)."""
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]


class StaticCache(LayerCache):
    """One layer's view of static buffers (a dict of arrays, "pos" among
    them, that a compiled step takes as inputs and outputs): the cache
    protocol the model's attention uses (`offset`, `mask`, `update_and_fetch`)
    with `pos` as an array."""

    def __init__(self, state: dict, index: int, window: int | None, chunk: int | None = None,
                 margin: int = 0):
        self.buffers, self.index, self.window, self.chunk = state, index, window, chunk
        self.margin = margin  # ring slots past the window: room for drafted tokens that may be rolled back

    @property
    def names(self) -> list:
        """This layer's arrays in the buffers."""
        return [f"k{self.index}", f"v{self.index}"]

    @property
    def state(self) -> list:
        return [self.buffers[n] for n in self.names]

    @property
    def offset(self) -> mx.array:
        return self.buffers["pos"]

    @property
    def size(self) -> int:
        return self.buffers[self.names[0]].shape[2]

    def mask(self, L: int) -> mx.array:
        """[1, S] bool: the slots this step's query may see (the written ones;
        a full ring is all visible; chunked: the current chunk's). With a
        margin: [L, S] by each slot's position (`position_mask`)."""
        if self.margin:
            return self.position_mask(self.buffers["pos"], L)
        assert L == 1, "static buffers without a margin take one token per step"
        return (mx.arange(self.size) <= self.last_slot(self.buffers["pos"]))[None]

    def position_mask(self, pos, L: int) -> mx.array:
        """[L, S] bool for queries at pos .. pos + L - 1 once they are
        written: slot j holds the latest position <= the last query that is j
        mod S (full layers: j itself); a slot is visible to query q when that
        position is >= 0, <= q and in q's window (or chunk). Slots holding
        rolled-back tokens or overwritten ones are then hidden, because a
        ring of window + margin slots (margin >= L - 1 and >= any rollback)
        never overwrites a key a later query sees (docs/architecture.md,
        "Speculative decoding")."""
        S = self.size
        last = pos + (L - 1)
        kp = last - mx.remainder(last - mx.arange(S), S)  # [S]
        q = (pos + mx.arange(L))[:, None]  # [L, 1]
        m = (kp >= 0) & (kp <= q)
        if self.chunk:
            return m & (kp // self.chunk == q // self.chunk)
        if self.window:
            m = m & (kp > q - self.window)
        return m

    def last_slot(self, pos):
        """The last visible slot for a query at `pos`: slots 0 .. it are those
        it sees (pos, or pos % chunk on a chunked layer; a full ring: all)."""
        return pos % self.chunk if self.chunk else pos

    def slot(self, pos):
        """The buffer slot of position `pos` (an int or an array): itself on a
        full layer, pos % S on a sliding one (a ring once at the window)."""
        return pos % self.size if self.window else pos

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        s, i = self.buffers, self.index
        pos = s["pos"]
        L = keys.shape[2]
        if L > 1 and self.window:  # a ring may wrap inside the block: a scatter to (pos + l) % S
            idx = self.slot(pos + mx.arange(L)).reshape(1, 1, L, 1)
            s[f"k{i}"] = mx.put_along_axis(s[f"k{i}"], mx.broadcast_to(idx, keys.shape), keys, axis=2)
            s[f"v{i}"] = mx.put_along_axis(s[f"v{i}"], mx.broadcast_to(idx, values.shape), values, axis=2)
        else:
            start = self.slot(pos).reshape(1)
            s[f"k{i}"] = mx.slice_update(s[f"k{i}"], keys, start, axes=(2,))
            s[f"v{i}"] = mx.slice_update(s[f"v{i}"], values, start, axes=(2,))
        self.last = (s[f"k{i}"], s[f"v{i}"], pos)  # what a SharedKVCache on this layer reads
        return s[f"k{i}"], s[f"v{i}"]


class RowCache(StaticCache):
    """One layer's view of the batch engine's row buffers: StaticCache with
    `pos` (`offset`) the per-row positions [C], so its mask and writes are
    per row. `rows` (a, b): the view of a micro-batch, rows [a, b) only."""

    def __init__(self, state, index: int, window: int | None, rows=None, chunk: int | None = None,
                 margin: int = 0):
        super().__init__(state, index, window, chunk, margin)
        self.rows = rows

    @property
    def offset(self) -> mx.array:
        pos = self.buffers["pos"]
        return pos if self.rows is None else pos[self.rows[0] : self.rows[1]]

    def mask(self, L: int) -> mx.array:
        """[rows, 1, 1, S]: row b sees the slots it has written (chunked: its chunk's).
        With a margin (drafts, batch_spec.py): [rows, 1, L, S] by each slot's position
        (`StaticCache.position_mask`'s rule per row), for blocks of L tokens a row."""
        if self.margin:
            pos, S = self.offset, self.size
            last = (pos + (L - 1)).reshape(-1, 1)
            kp = last - mx.remainder(last - mx.arange(S)[None], S)  # [rows, S]: the position slot j holds
            return create_rows_mask(L, pos, kp, None if self.chunk else self.window, self.chunk)
        assert L == 1, "batch rows take one token per step"
        last = self.last_slot(self.offset)
        return (mx.arange(self.size)[None, :] <= last[:, None])[:, None, None, :]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        k, v = self._write([keys, values])
        self.last = (k, v, self.offset)
        return k, v

    def _write(self, xs: list) -> list:
        """Each row's new token (xs: one array per buffer of `names`) into its
        slot; the buffers (this view's rows)."""
        b = self.buffers
        pos = b["pos"]
        C, L = pos.shape[0], xs[0].shape[2]
        slot = self.slot(pos.reshape(C, 1) + mx.arange(L)) if L > 1 else self.slot(pos)  # a block: L slots a row
        out = []
        for name, x in zip(self.names, xs):
            idx = mx.broadcast_to(slot.reshape(C, 1, L, 1), (C, x.shape[1], L, x.shape[3]))
            if self.rows is not None:
                # a micro-batch writes its rows; the others' slots get their own values back
                # (one gathered slot per row), so the write stays one in-place scatter
                a, e = self.rows
                old = mx.take_along_axis(b[name], idx, axis=2)
                x = mx.concatenate([old[:a], x, old[e:]])
            b[name] = mx.put_along_axis(b[name], idx, x, axis=2)
            out.append(b[name] if self.rows is None else b[name][self.rows[0] : self.rows[1]])
        return out


class PrefillCache(LayerCache):
    """One layer's keys/values of B prompts prefilled together: [B, H, R, D],
    row b's position p in slot p % R (R: the window plus a chunk on a sliding
    layer, so a chunk never overwrites a key its queries see; the longest
    prompt plus a chunk on a full layer, so slot = position). `offset` is the
    chunk's first position per row ([B], for RoPE); the mask comes from each
    slot's position after this chunk's writes (masks.create_rows_mask)."""

    static_kv = True
    names = StaticCache.names

    def __init__(self, buffers: dict, index: int, window: int | None, ring: int, wraps: bool, chunk=None):
        self.buffers, self.index, self.window, self.ring, self.wraps = buffers, index, window, ring, wraps
        self.chunk = chunk  # a chunked layer: its window is the chunk, the mask the chunk rule

    @property
    def offset(self) -> mx.array:
        return self.buffers["offsets"]

    def mask(self, L: int) -> mx.array:
        if not self.wraps and self.window is None and self.chunk is None and self.buffers["offsets"].shape[0] == 1:
            return CAUSAL  # one prompt, its keys up to the chunk's end: plain causal (a GPU's fused kernel)
        if not self.wraps:  # slot = position: the slots up to this chunk's last end
            pos = mx.arange(self.buffers["upto"])
        else:  # slot k: the latest position = k (mod R) before the row's chunk end (pads included); < 0: empty
            end = self.buffers["end"].reshape(-1, 1)
            pos = end - 1 - (end - 1 - mx.arange(self.ring)[None]) % self.ring
        if self.chunk:
            return create_rows_mask(L, self.buffers["offsets"], pos, chunk=self.chunk)
        return create_rows_mask(L, self.buffers["offsets"], pos, self.window)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        k, v = self._write([keys, values])
        self.last = (k, v, self.buffers["offsets"])
        return k, v

    def _write(self, xs: list) -> list:
        """The chunk's tokens (one array per buffer of `names`) into their
        slots; the buffers (without a ring: the slots written so far)."""
        b = self.buffers
        B, H, L = xs[0].shape[:3]
        slots = ((b["offsets"].reshape(B, 1) + mx.arange(L)) % self.ring).reshape(B, 1, L, 1)
        for name, x in zip(self.names, xs):
            b[name] = mx.put_along_axis(b[name], mx.broadcast_to(slots, (B, H, L, x.shape[3])), x, axis=2)
        # no ring: attention over the keys written so far, not the whole buffer
        return [b[n] if self.wraps else b[n][:, :, : b["upto"]] for n in self.names]
