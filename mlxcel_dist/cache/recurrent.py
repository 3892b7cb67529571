"""RecurrentGemma's RG-LRU state (`RecurrentCache`): a `StateCache`
(state.py) whose forms are every state's.
"""

from __future__ import annotations

from .state import StateCache


class RecurrentCache(StateCache):
    """A recurrent layer's state across chunks and decode steps (RecurrentGemma's
    RG-LRU block): `conv_state` [B, conv1d_width - 1, channels] holds the last
    inputs of the causal depthwise conv1d (compute dtype), `lru_state`
    [B, channels] the linear recurrence's hidden state (float32, as the
    reference accumulates). The layer reads both with `fetch()` and writes them
    back with `update(conv_state, lru_state, n)`; `offset` counts the tokens
    seen (position 0 resets the recurrence). No keys, so no mask; decode
    steps and batch rows hold its state in static buffers (`StaticState`);
    snapshots as every state's (`StateCache`)."""

    @property
    def lru_state(self):
        return self.h

    @lru_state.setter
    def lru_state(self, x) -> None:
        self.h = x
