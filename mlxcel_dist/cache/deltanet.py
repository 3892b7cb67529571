"""A gated DeltaNet layer's state (`DeltaNetCache`: qwen3_next,
qwen3_5_moe): a `StateCache` (state.py) whose forms are every state's.
"""

from __future__ import annotations

from .state import StateCache


class DeltaNetCache(StateCache):
    """A gated DeltaNet layer's state across chunks and decode steps
    (deltanet.GatedDeltaNet: qwen3_next, qwen3_5_moe): `conv_state`
    [B, conv_kernel - 1, channels] holds the last inputs of the causal
    depthwise conv over the q/k/v channels (compute dtype; zeros before the
    first token, as the reference pads), `recurrent_state` [B, v_heads,
    k_head_dim, v_head_dim] the delta rule's state matrix per value head
    (float32, as the reference keeps it). Under TP both cover this rank's
    heads only. `fetch()` / `update(conv, state, n)`; `offset` counts the
    tokens seen. No keys, so no mask; decode steps and batch rows hold its
    state in static buffers (`static_state`). Snapshots as every
    state's (`StateCache`)."""

    @property
    def recurrent_state(self):
        return self.h

    @recurrent_state.setter
    def recurrent_state(self, x) -> None:
        self.h = x
