"""Attention masks shared by every model and every rank.

All masks are boolean arrays of shape [queries, keys] where True means "may
attend". Query row q is the token at absolute position `offset + q`; the key
axis covers the keys the cache returns, oldest first. A sliding window of size
W lets a query see W keys including itself, as in transformers:

    key k visible to query q  iff  q_pos - W < k_pos <= q_pos

Which builder applies:

- `create_causal_mask(size, offset)`: global layers, keys [0, offset + size).
- `create_causal_mask_with_window_full(size, offset, window)`: every key,
  windowed. Correct for any size; it is what a multi-token prefill past the
  window must use.
- `create_causal_mask_with_window(size, offset, window)`: the capped form, whose
  key axis is only the trailing `window` keys once size + offset > window. It is
  only correct while size <= window (a decode step, a short chunk): with a
  longer prefill the early query rows would see no key at all (all -inf, NaN).
- `create_sliding_window_prefill_mask(size, sliding_offset, window)`: the
  selector models call. `sliding_offset` is the number of earlier keys the
  cache returns with this update (`cache.sliding_offset`), so the mask's key
  axis always equals the keys attention receives.

- `create_chunked_mask(size, offset, chunk, num_keys)`: chunked attention
  (llama4): key k visible to query q iff k <= q and k // chunk == q // chunk
  (the query's own attention chunk), over the last `num_keys` keys.

No builder ever returns a row that is all False.

Rows at their own offsets (batch.py's prefill of several prompts together):
`create_rows_mask(size, offsets, key_positions, window)` is [B, 1, size, K]
for row b's queries at `offsets[b] + q` and the absolute position of each
key slot per row (a ring's slots hold positions out of order; -1: a slot
never written), with the same visibility rule (chunked with `chunk`); no row is all False as long
as each query's own key is among the slots (it is written before attention).

`cache.layer_masks` (what models call once per forward) asks each attention
kind's cache for its mask (the caches own which builder applies, so it lives
with them in the cache package; this module imports nothing of ours). The builders
return the string ``"causal"`` instead of an array whenever the mask would be
plain causal (a global layer, or a sliding layer whose keys all lie within
the window): the fused attention kernel then applies it without reading a
mask array, and without building one per forward.
"""

from __future__ import annotations

import mlx.core as mx

CAUSAL = "causal"  # plain causal, queries aligned to the last keys (mx.fast SDPA's mode)


def _positions(size: int, offset: int, num_keys: int):
    # Absolute positions: queries are the last `size` tokens, keys the last
    # `num_keys` tokens of the `offset + size` seen so far.
    end = offset + size
    q = mx.arange(offset, end)[:, None]
    k = mx.arange(end - num_keys, end)[None, :]
    return q, k


def _check(size: int, offset: int, window: int | None = None) -> None:
    if size < 1 or offset < 0:
        raise ValueError(f"mask needs size >= 1 and offset >= 0, got size={size} offset={offset}")
    if window is not None and window < 1:
        raise ValueError(f"sliding window must be >= 1, got {window}")


def create_causal_mask(size: int, offset: int = 0) -> mx.array:
    """[size, offset + size]: key k visible iff k <= q + offset."""
    _check(size, offset)
    q, k = _positions(size, offset, offset + size)
    return k <= q


def create_causal_mask_with_window_full(size: int, offset: int, window: int) -> mx.array:
    """[size, offset + size]: key k visible iff q + offset - window < k <= q + offset."""
    _check(size, offset, window)
    q, k = _positions(size, offset, offset + size)
    return (k <= q) & (k > q - window)


def create_causal_mask_with_window(size: int, offset: int, window: int) -> mx.array:
    """Capped windowed mask: [size, min(offset + size, window)].

    The key axis is the trailing `window` keys (what a cache capped at `window`
    holds). Only valid while size <= window; callers with a longer prefill must
    use `create_causal_mask_with_window_full` (see the module docstring).
    """
    _check(size, offset, window)
    if size > window and size + offset > window:
        raise ValueError(
            f"capped window mask cannot hold {size} queries in a window of {window}: "
            "use create_causal_mask_with_window_full"
        )
    q, k = _positions(size, offset, min(offset + size, window))
    return (k <= q) & (k > q - window)


def create_sliding_window_prefill_mask(size: int, sliding_offset: int, window: int) -> mx.array:
    """Mask for `size` new queries on a sliding layer whose cache returns
    `sliding_offset` earlier keys plus the `size` new ones.

    Three regimes, one invariant (key axis == sliding_offset + size):
    - within the window (sliding_offset + size <= window): equals the capped
      builder, which is then plain causal;
    - a fresh prefill longer than the window (sliding_offset == 0): the full
      windowed [size, size] mask;
    - a cache that has rolled over (sliding_offset > 0): the windowed mask over
      the kept keys followed by the new ones.
    """
    _check(size, sliding_offset, window)
    if sliding_offset + size <= window:
        return create_causal_mask_with_window(size, sliding_offset, window)
    return create_causal_mask_with_window_full(size, sliding_offset, window)


def create_chunked_mask(size: int, offset: int, chunk: int, num_keys: int | None = None) -> mx.array:
    """[size, num_keys] (default offset + size): queries at offset + q, keys
    the last `num_keys` of the offset + size positions; key k visible iff
    k <= q and k // chunk == q // chunk. The keys must reach back to the
    first query's chunk start (num_keys >= offset % chunk + size), so no row
    is all False."""
    _check(size, offset, chunk)
    num_keys = offset + size if num_keys is None else num_keys
    if not offset % chunk + size <= num_keys <= offset + size:
        raise ValueError(f"chunked mask over {num_keys} keys cannot serve {size} queries at {offset} (chunk {chunk})")
    q, k = _positions(size, offset, num_keys)
    return (k <= q) & (k // chunk == q // chunk)


def create_rows_mask(size: int, offsets: mx.array, key_positions: mx.array, window: int | None = None,
                     chunk: int | None = None) -> mx.array:  # fmt: skip
    """[B, 1, size, K]: row b's query q (position offsets[b] + q) sees key
    slot k iff its position p = key_positions[b, k] (or [k], shared by the
    rows) satisfies 0 <= p <= q_pos and, windowed, q_pos - window < p;
    chunked, p // chunk == q_pos // chunk.
    `offsets` int [B]; key positions int, -1 for a slot never written."""
    if size < 1:
        raise ValueError(f"mask needs size >= 1, got size={size}")
    if window is not None and window < 1:
        raise ValueError(f"sliding window must be >= 1, got {window}")
    q = (offsets.reshape(-1, 1) + mx.arange(size))[:, :, None]  # [B, size, 1]
    k = key_positions.reshape(-1, 1, key_positions.shape[-1])  # [B or 1, 1, K]
    m = (k >= 0) & (k <= q)
    if window is not None:
        m = m & (k > q - window)
    if chunk is not None:
        m = m & (k // chunk == q // chunk)
    return m[:, None]
