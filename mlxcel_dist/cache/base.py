"""The protocol every cache kind follows (`LayerCache`), the layer kinds'
names, and a kind's snapshot (`Snapshot`).

A kind answers, for its layer, in three forms:

- eager (the growing cache a prompt is fed through): `mask(L)` (built once
  per forward, before any layer updates its cache), `update_and_fetch`,
  `offset`, `window` / `chunk`, `temporal()` (its keys/values oldest first);
- static (the engine's compiled steps, one row or many: `static_form` names
  it, `held()` is what moves into the buffers, `buffer_names(i)` what they
  are called, `row_view(...)` the layer's cache over the rows' buffers,
  `prefill_view(...)` over prompts prefilled together);
- kept (the prompt cache, a draft's rollback): `snapshot()` /
  `restore_snapshot()` (a copy of what it holds, exactly), `can_trim(n)` /
  `trim(n)` (its last n tokens dropped, where it can: keys, not a state),
  `kept()` / `restore_kept(entry, n)` / `entry(...)` (the prompt cache's
  entry of a layer, from the eager cache or from a row's arrays).
"""

from __future__ import annotations

import mlx.core as mx

SLIDING = "sliding_attention"
FULL = "full_attention"
CHUNKED = "chunked_attention"  # llama4: attention within fixed chunks of positions
RECURRENT = "recurrent"  # a recurrent layer's kind (recurrent_gemma): state, no keys
LINEAR = "linear_attention"  # a gated DeltaNet layer's kind (qwen3_next, qwen3_5_moe): state, no keys
LAYER_KINDS = (SLIDING, FULL)


class Snapshot:
    """What a cache held at one moment: its arrays, then its offset (`state`;
    a state kind's is the prompt cache's entry as it is)."""

    def __init__(self, state: tuple):
        self.state = state

    @property
    def arrays(self) -> list:
        return [x for x in self.state if isinstance(x, mx.array)]

    @property
    def offset(self) -> int:
        return self.state[-1]


class LayerCache:
    """The protocol: what every layer's cache says about itself (the module
    docstring lists the three forms).

    - `offset`: tokens seen so far (the next token's position);
    - `window`: how many keys a query may see (None: every key);
    - `chunk`: None, or the attention chunk of a chunked layer (its keys
      are those of the query's chunk, not the trailing `window`);
    - `static_kv`: True when `temporal()` hands over float keys/values;
    - `static_state`: True when it holds a fixed-shape state (`state_arrays()`);
    - `static_form`: the name of its static form (batch.LayerRows.kind:
      "kv", "quantized", "state", "conv_kv", "shared"), None when it has
      none (the model steps eagerly);
    - `cacheable`: the prompt cache can keep it;
    - `mask(L)`: the mask L new tokens need on this layer: None (a single
      token sees exactly what the cache returns), `masks.CAUSAL`, or a bool
      array [L, keys returned]. Called before the update.
    - `update_and_fetch(keys, values)`, `state` (arrays to evaluate).
    """

    window: int | None = None
    chunk: int | None = None
    static_kv = False
    static_state = False
    static_form: str | None = None
    cacheable = False
    offset = 0
    reads_layer: int | None = None  # a SharedKVCache: the layer whose KV it reads
    last = None  # (keys, values, offset before) of the latest update_and_fetch

    def mask(self, L: int):
        raise NotImplementedError

    def temporal(self) -> tuple[mx.array, mx.array]:
        raise NotImplementedError

    def release(self) -> None:
        """Drop what it holds (its static form has taken it over)."""

    def restore(self, keys: mx.array, values: mx.array, offset: int) -> None:
        """Hold `keys`/`values` (oldest first), the last ones of `offset`
        tokens seen (prompt_cache.py reuses a prefix this way)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be restored")

    @property
    def state(self) -> list:
        return []

    # -- the static form ------------------------------------------------------
    def held(self) -> tuple[list, list]:
        """What its static buffers take: (keys/values oldest first, in
        `buffer_names` order; state arrays, None where nothing was fed yet)."""
        raise NotImplementedError(f"{type(self).__name__} has no static form")

    def buffer_names(self, index: int) -> tuple[tuple, tuple]:
        """Layer `index`'s buffers: (slot-axis ones [C, H, S, .], row-only ones [C, ...])."""
        return (), ()

    def row_view(self, buffers: dict, index: int, views: list, rows=None, margin: int = 0):
        """Layer `index`'s cache over the engine's row buffers (`views`: the
        layers before it; `rows` (a, e): a micro-batch's; `margin`: ring slots
        for drafts rolled back). One row is the one-row static form."""
        raise NotImplementedError(f"{type(self).__name__} has no static form")

    def prefill_view(self, buffers: dict, index: int, ring: int, wraps: bool, views: list):
        """Layer `index`'s cache over prompts prefilled together (rings of `ring` slots)."""
        raise NotImplementedError(f"{type(self).__name__} prefills alone")

    # -- kept: snapshots, trims, the prompt cache ---------------------------------
    def snapshot(self) -> Snapshot | None:
        """A copy of what it holds (None: nothing of its own)."""
        return None

    def restore_snapshot(self, snap: Snapshot | None) -> None:
        """Hold what `snapshot()` gave, exactly."""

    def can_trim(self, n: int) -> bool:
        """Whether its last n tokens can be dropped (`trim`)."""
        return False

    def trim(self, n: int) -> None:
        """Drop its last n tokens (the next update writes at offset - n)."""
        raise ValueError(f"{type(self).__name__} cannot drop its last {n} tokens (a state is not cut back)")

    def kept(self):
        """Its prompt-cache entry for the tokens it has seen (`cacheable` ones)."""
        return self.snapshot()

    def restore_kept(self, entry, n: int) -> None:
        """Hold the first `n` tokens of a prompt-cache entry (a state's: all of it)."""
        self.restore_snapshot(entry)

    def entry(self, held: list, states: list, offset: int):
        """Its prompt-cache entry from a row's arrays (`held()`'s form) of `offset` tokens."""
        return None


class EveryKeyHeld(LayerCache):
    """A kind that holds every position it has seen (full keys, quantized or
    not): its last n tokens drop by moving `offset` back (the next update
    writes over them)."""

    def can_trim(self, n: int) -> bool:
        return 0 <= n <= self.offset

    def trim(self, n: int) -> None:
        if not self.can_trim(n):
            super().trim(n)
        self.offset -= n
        self.returned, self.last = self.offset, None
