"""A fixed-shape state instead of keys (recurrent.py's RG-LRU, deltanet.py's
DeltaNet; conv.py's conv state beside keys): `StateCache`, what the state
kinds answer alike, and `StaticState`, their static form (the batch rows'
buffers "s{i}.{j}" [C, ...], replaced by each step inside the graph; one
row is the one-row form). A state is snapshotted and restored whole; it
cannot be trimmed (the prompt cache reuses such an entry only whole, and
drafts are refused for such a target: spec.check_target).
"""

from __future__ import annotations

import mlx.core as mx

from .base import LayerCache, Snapshot


class StateCache(LayerCache):
    """Two state arrays (a conv's last inputs, then the recurrence's state)
    and the tokens seen: `fetch()` / `update(conv, h, n)`; no keys, so no
    mask. Snapshots hold (conv, h, offset)."""

    static_state = True
    static_form = "state"
    cacheable = True

    def __init__(self):
        self.conv_state = None
        self.h = None
        self.offset = 0

    def state_arrays(self) -> tuple:
        return self.conv_state, self.h

    def mask(self, L: int):
        return None  # a recurrence is causal by construction

    def fetch(self):
        return self.conv_state, self.h

    def update(self, conv_state: mx.array, h: mx.array, n: int) -> None:
        self.conv_state, self.h = conv_state, h
        self.offset += n

    def release(self) -> None:
        self.conv_state = self.h = None

    @property
    def state(self):
        return [] if self.conv_state is None else [self.conv_state, self.h]

    def held(self) -> tuple[list, list]:
        return [], list(self.state_arrays())

    def buffer_names(self, index: int) -> tuple[tuple, tuple]:
        return (), tuple(StaticState(None, index, 2).names)

    def row_view(self, buffers: dict, index: int, views: list, rows=None, margin: int = 0):
        return StaticState(buffers, index, 2, rows)

    def snapshot(self) -> Snapshot:
        return Snapshot((self.conv_state, self.h, self.offset))

    def restore_snapshot(self, snap: Snapshot) -> None:
        self.conv_state, self.h, self.offset = snap.state

    def entry(self, held: list, states: list, offset: int):
        return Snapshot((*states, offset))


class StaticState(LayerCache):
    """A state cache's static form (RG-LRU, DeltaNet, a conv's): its
    arrays are buffers "s{i}.{j}" [B, ...] of the static buffers (the batch
    engine's: B rows, `pos` per row), read by `fetch()` and replaced by
    `update()` inside the graph. `rows` (a, e): a micro-batch's rows only."""

    def __init__(self, state, index: int, count: int, rows=None):
        self.buffers, self.index, self.count, self.rows = state, index, count, rows

    @property
    def names(self) -> list:
        return [f"s{self.index}.{j}" for j in range(self.count)]

    @property
    def offset(self) -> mx.array:
        pos = self.buffers["pos"]
        return pos if self.rows is None else pos[self.rows[0] : self.rows[1]]

    def mask(self, L: int):
        return None

    def fetch(self) -> tuple:
        xs = [self.buffers[n] for n in self.names]
        return tuple(xs if self.rows is None else [x[self.rows[0] : self.rows[1]] for x in xs])

    def update(self, *args) -> None:
        """update(*arrays, n): the new state (n tokens: `pos` counts them)."""
        for name, x in zip(self.names, args[:-1]):
            if self.rows is not None:  # the other rows keep theirs
                old = self.buffers[name]
                x = mx.concatenate([old[: self.rows[0]], x, old[self.rows[1] :]])
            self.buffers[name] = x
