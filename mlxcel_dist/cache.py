"""Per-layer caches and the protocol they follow (`LayerCache`).

Every cache kind answers, for its layer: which mask L new tokens need
(`mask(L)`, built once per forward, before any layer updates its cache: a
layer's cache state before the update decides its mask), what it holds
(`offset` tokens seen; `temporal()`, its keys/values oldest first), the keys
a query may see (`window`, None for all) and whether the engine's rows may
move it into static buffers (`static_kv`). `cache.layer_masks` asks the first
cache of each attention kind; `decode.py` asks `static_kv` and `window`.
The layer kinds (`SLIDING`, `FULL`) are named here, once.

Keys and values are [B, kv_heads, S, head_dim] (kv_heads per rank under TP).
`update_and_fetch(k, v)` appends n new tokens and returns the keys/values that
attention must use for them. Before an update, `sliding_offset` says how many
earlier keys that update will return, so a model builds its mask (key axis
`sliding_offset + n`) once per forward, before any layer runs; after it,
`returned` says how many keys were handed out, and the two always agree.

- `KVCache`: global layers; returns every key.
- `RotatingKVCache(max_size)`: sliding layers with window `max_size`.
  * A multi-token update returns the last `max_size - 1` earlier keys plus all
    new ones (a fresh prefill keeps all its keys), so every new token, the first
    included, sees a full window; the mask does the windowing.
  * A single-token decode writes into a ring buffer of `max_size` slots and
    returns at most `max_size` keys: exactly the window, in ring order (order is
    irrelevant to a single query, RoPE was applied before caching).
- `ChunkedKVCache(chunk)`: chunked-attention layers (llama4): a query sees the
  keys of its own attention chunk (positions chunk * (p // chunk) .. p), so
  at most `chunk` keys (`window`) and `chunk` (not None) says which. It keeps
  the last chunk - 1 keys as a RotatingKVCache's multi-token path does and
  returns them with the new ones on every update (in position order), the
  chunk mask (`masks.create_chunked_mask`) hiding those of earlier chunks.
"""

from __future__ import annotations

import mlx.core as mx

from .masks import CAUSAL, create_chunked_mask, create_sliding_window_prefill_mask

SLIDING = "sliding_attention"
FULL = "full_attention"
CHUNKED = "chunked_attention"  # llama4: attention within fixed chunks of positions
RECURRENT = "recurrent"  # a recurrent layer's kind (recurrent_gemma): state, no keys
LINEAR = "linear_attention"  # a gated DeltaNet layer's kind (qwen3_next, qwen3_5_moe): state, no keys
LAYER_KINDS = (SLIDING, FULL)


class LayerCache:
    """The protocol: what every layer's cache says about itself.

    - `offset`: tokens seen so far (the next token's position);
    - `window`: how many keys a query may see (None: every key);
    - `chunk`: None, or the attention chunk of a chunked layer (its keys
      are those of the query's chunk, not the trailing `window`);
    - `static_kv`: True when `temporal()` hands over keys/values that
      the engine's rows (decode.py's static forms) can move into static buffers;
    - `static_state`: True when its state (`state_arrays()`: recurrent,
      conv or DeltaNet state, fixed shapes) can move into static buffers
      (`decode.StaticState`, one row of the batch engine's too);
    - `mask(L)`: the mask L new tokens need on this layer: None (a single
      token sees exactly what the cache returns), `masks.CAUSAL`, or a bool
      array [L, keys returned]. Called before the update.
    - `update_and_fetch(keys, values)`, `state` (arrays to evaluate).
    """

    window: int | None = None
    chunk: int | None = None
    static_kv = False
    static_state = False
    offset = 0
    reads_layer: int | None = None  # a SharedKVCache: the layer whose KV it reads
    last = None  # (keys, values, offset before) of the latest update_and_fetch

    def mask(self, L: int):
        raise NotImplementedError

    def temporal(self) -> tuple[mx.array, mx.array]:
        raise NotImplementedError

    def release(self) -> None:
        """Drop what it holds (decode.py has taken it over)."""

    def restore(self, keys: mx.array, values: mx.array, offset: int) -> None:
        """Hold `keys`/`values` (oldest first), the last ones of `offset`
        tokens seen (prompt_cache.py reuses a prefix this way)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be restored")

    @property
    def state(self) -> list:
        return []


class KVCache(LayerCache):
    step = 256
    static_kv = True  # grow the buffer in steps so decode does not copy every token

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
        """The keys and values held, in position order (what decode.py moves
        into its static buffers)."""
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def release(self) -> None:
        self.keys = self.values = self.last = None

    def restore(self, keys: mx.array, values: mx.array, offset: int) -> None:
        self.keys, self.values, self.offset = keys, values, offset
        self._idx = keys.shape[2]  # in temporal order (RotatingKVCache's bookkeeping)
        self.returned = 0

    @property
    def state(self):
        if self.keys is None:
            return []
        return [self.keys, self.values]


class RotatingKVCache(LayerCache):
    step = 256
    static_kv = True

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

    def release(self) -> None:
        self.keys = self.values = self.last = None

    def restore(self, keys: mx.array, values: mx.array, offset: int) -> None:
        self.keys, self.values, self.offset = keys, values, offset
        self._idx = keys.shape[2]  # in temporal order (RotatingKVCache's bookkeeping)
        self.returned = 0

    @property
    def state(self):
        if self.keys is None:
            return []
        return [self.keys, self.values]


class SharedKVCache(LayerCache):
    """The cache of a layer that reads another layer's keys/values (Gemma 3n
    and Gemma 4's last layers reuse the KV of the last earlier layer of their
    kind). It holds nothing: `fetch()` returns what the source layer's cache
    returned in this forward (the source runs first), `offset` is the source's
    offset before that update (this layer's queries sit at the same
    positions), and `mask(L)` is the source's (asked before any update, as
    every mask). A model without a cache must still make caches for a
    forward, since this is how the KV travels between the two layers.
    Decode steps build its static counterpart on the source's buffers
    (`reads_layer`)."""

    static_kv = True  # decode.py re-points it at the source's static buffers

    def __init__(self, source: LayerCache, reads_layer: int):
        self.source, self.reads_layer = source, reads_layer

    @property
    def window(self):
        return self.source.window

    @property
    def offset(self):
        last = self.source.last
        return self.source.offset if last is None else last[2]

    def mask(self, L: int):
        return self.source.mask(L)

    def fetch(self) -> tuple[mx.array, mx.array]:
        if self.source.last is None:
            raise RuntimeError(f"layer {self.reads_layer}'s cache has not been updated in this forward")
        k, v, _ = self.source.last
        return k, v


class ChunkedKVCache(RotatingKVCache):
    """A chunked-attention layer's cache (see the module docstring): every
    update returns the last min(offset, chunk - 1) earlier keys plus the new
    ones, oldest first (a decode step too: no ring, so the mask knows each
    key's position); decode.py's static buffers make it a ring of `chunk`."""

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


class RecurrentCache(LayerCache):
    """A recurrent layer's state across chunks and decode steps (RecurrentGemma's
    RG-LRU block): `conv_state` [B, conv1d_width - 1, channels] holds the last
    inputs of the causal depthwise conv1d (compute dtype), `lru_state`
    [B, channels] the linear recurrence's hidden state (float32, as the
    reference accumulates). The layer reads both with `fetch()` and writes them
    back with `update(conv_state, lru_state, n)`; `offset` counts the tokens
    seen (position 0 resets the recurrence). No keys, so no mask; decode
    steps and batch rows hold its state in static buffers (`static_state`);
    `snapshot()` / `restore_snapshot()` as DeltaNetCache's (the prompt cache)."""

    static_state = True

    def __init__(self):
        self.conv_state = None
        self.lru_state = None
        self.offset = 0

    def state_arrays(self) -> tuple:
        return self.conv_state, self.lru_state

    def mask(self, L: int):
        return None  # recurrent layers take no mask

    def fetch(self):
        return self.conv_state, self.lru_state

    def update(self, conv_state: mx.array, lru_state: mx.array, n: int) -> None:
        self.conv_state, self.lru_state = conv_state, lru_state
        self.offset += n

    def snapshot(self) -> tuple:
        return (self.conv_state, self.lru_state, self.offset)

    def restore_snapshot(self, snap: tuple) -> None:
        self.conv_state, self.lru_state, self.offset = snap

    def release(self) -> None:
        self.conv_state = self.lru_state = None

    @property
    def state(self):
        return [] if self.conv_state is None else [self.conv_state, self.lru_state]


class DeltaNetCache(LayerCache):
    """A gated DeltaNet layer's state across chunks and decode steps
    (deltanet.GatedDeltaNet: qwen3_next, qwen3_5_moe): `conv_state`
    [B, conv_kernel - 1, channels] holds the last inputs of the causal
    depthwise conv over the q/k/v channels (compute dtype; zeros before the
    first token, as the reference pads), `recurrent_state` [B, v_heads,
    k_head_dim, v_head_dim] the delta rule's state matrix per value head
    (float32, as the reference keeps it). Under TP both cover this rank's
    heads only. `fetch()` / `update(conv, state, n)`; `offset` counts the
    tokens seen. No keys, so no mask; decode steps and batch rows hold its
    state in static buffers (`static_state`). `snapshot()` (the state
    arrays, then the offset) / `restore_snapshot()` copy the state out and
    back (prompt_cache.py keeps a prefix this way: a state cannot be cut back)."""

    static_state = True

    def __init__(self):
        self.conv_state = None
        self.recurrent_state = None
        self.offset = 0

    def state_arrays(self) -> tuple:
        return self.conv_state, self.recurrent_state

    def mask(self, L: int):
        return None  # the delta rule is causal by construction

    def fetch(self):
        return self.conv_state, self.recurrent_state

    def update(self, conv_state: mx.array, recurrent_state: mx.array, n: int) -> None:
        self.conv_state, self.recurrent_state = conv_state, recurrent_state
        self.offset += n

    def release(self) -> None:
        self.conv_state = self.recurrent_state = None

    def snapshot(self) -> tuple:
        return (self.conv_state, self.recurrent_state, self.offset)

    def restore_snapshot(self, snap: tuple) -> None:
        self.conv_state, self.recurrent_state, self.offset = snap

    @property
    def state(self):
        return [] if self.conv_state is None else [self.conv_state, self.recurrent_state]


class ConvKVCache(LayerCache):
    """A KV cache (`KVCache` or `RotatingKVCache`, `kv`) plus the state of a
    short causal conv over keys and values along the sequence (Baichuan-M1):
    `conv_state` = (keys, values) [B, conv_window - 1, kv_heads, head_dim], the
    last conv_window - 1 tokens' k/v BEFORE the conv (zeros before the first
    token, as the reference's zero padding), so a chunk or a decode step
    convolves exactly as the one pass does. The mask, offset, window and what
    attention sees are the wrapped cache's; kv_heads are per rank under TP.
    Decode steps and batch rows hold the conv state in static buffers beside
    the static KV (`static_state`, decode.StaticConvKV)."""

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


class PrefixViewCache(LayerCache):
    """A read-only view of a layer's cache for a block of queries placed right
    after what it holds, every key visible to every query (DiffusionGemma's
    canvas decoder: bidirectional within the block and over the prefix).
    `update_and_fetch(k, v)` returns the kept earlier keys/values (all of
    them, or the last `keep`: a sliding layer's window - 1, as transformers'
    DynamicCache keeps) followed by the block's, and stores nothing; `offset`
    is the source's (the block's first position); `mask(L)` is all True
    [L, kept + L]. Not a decode-step cache (`static_kv` False)."""

    def __init__(self, source: LayerCache, keep: int | None = None):
        self.source, self.keep = source, keep

    @property
    def offset(self):
        return self.source.offset

    @property
    def kept(self) -> int:
        n = self.source.offset
        return n if self.keep is None else min(n, self.keep)

    def mask(self, L: int):
        return mx.ones((L, self.kept + L), dtype=mx.bool_)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        n = self.kept
        if n == 0:
            return keys, values
        pk, pv = self.source.temporal()
        pk, pv = pk[..., pk.shape[2] - n :, :], pv[..., pv.shape[2] - n :, :]
        return mx.concatenate([pk, keys], axis=2), mx.concatenate([pv, values], axis=2)


# Bounded and quantized KV (--max-kv-size, --kv-bits) ----------------------------

KV_BITS = (2, 3, 4, 5, 6, 8)  # MLX's affine quantization
KV_GROUP_SIZES = (32, 64, 128)


class QuantizedKV:
    """Keys or values held MLX-quantized along head_dim (mx.quantize's affine
    form: packed uint32 `w` [B, H, S, D * bits / 32], `scales` and `biases`
    [B, H, S, D / group_size]); `shape` is the logical [B, H, S, D]
    (attention.causal_attention takes it as it takes an array)."""

    def __init__(self, w, scales, biases, bits: int, group_size: int):
        self.w, self.scales, self.biases, self.bits, self.group_size = w, scales, biases, bits, group_size

    @property
    def shape(self) -> tuple:
        return (*self.w.shape[:-1], self.w.shape[-1] * 32 // self.bits)

    @property
    def parts(self) -> tuple:
        return self.w, self.scales, self.biases

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.parts)

    def __getitem__(self, index) -> "QuantizedKV":
        """The same index on each part ([..., a:b, :]: positions a..b)."""
        return QuantizedKV(*(x[index] for x in self.parts), self.bits, self.group_size)

    @staticmethod
    def pair(parts, bits: int, group_size: int) -> tuple:
        """(keys, values) from six arrays: the keys' w, scales, biases, then the values'."""
        return QuantizedKV(*parts[:3], bits, group_size), QuantizedKV(*parts[3:], bits, group_size)

    def dequantize(self) -> mx.array:
        return mx.dequantize(*self.parts, group_size=self.group_size, bits=self.bits)


class QuantizedKVCache(LayerCache):
    """A full-attention layer's KV held quantized (mlx-lm's QuantizedKVCache:
    `--kv-bits`, `--kv-group-size`): each update quantizes the new keys and
    values and returns the whole cache as `QuantizedKV`s, which attention
    multiplies with `mx.quantized_matmul` (never dequantized as a whole).
    From the first token on (mlx-lm's generate waits for
    `--quantized-kv-start`, 5000 tokens by default). Not `static_kv` (its
    buffers are not float KV): decode.py and the batch engine move it into
    quantized static buffers (`static_quantized`); the prompt cache keeps
    its quantized keys/values."""

    step = 256
    static_quantized = True

    def __init__(self, bits: int, group_size: int):
        self.bits, self.group_size = bits, group_size
        self.keys = self.values = None  # (w, scales, biases) each, room for `step` more tokens
        self.offset = 0

    def mask(self, L: int):
        return None if L == 1 else CAUSAL

    def _quantize(self, x: mx.array) -> tuple:
        D = x.shape[-1]
        if D % self.group_size:
            from .errors import UserError

            raise UserError(f"--kv-group-size {self.group_size} does not divide this model's head_dim {D}")
        return mx.quantize(x, group_size=self.group_size, bits=self.bits)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        n, prev = keys.shape[2], self.offset
        qk, qv = self._quantize(keys), self._quantize(values)
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            grow = ((n + self.step - 1) // self.step) * self.step

            def extend(held, new):
                pad = [mx.zeros((*x.shape[:2], grow, x.shape[3]), x.dtype) for x in new]
                if held is None:
                    return pad
                return [mx.concatenate([h[..., :prev, :], p], axis=2) for h, p in zip(held, pad)]

            self.keys, self.values = extend(self.keys, qk), extend(self.values, qv)
        for held, new in ((self.keys, qk), (self.values, qv)):
            for h, x in zip(held, new):
                h[..., prev : prev + n, :] = x
        self.offset += n
        k, v = (QuantizedKV(*(h[..., : self.offset, :] for h in held), self.bits, self.group_size)
                for held in (self.keys, self.values))
        self.last = (k, v, prev)
        return k, v

    def temporal(self) -> tuple[QuantizedKV, QuantizedKV]:
        """The quantized keys and values held, position order."""
        return tuple(QuantizedKV(*held, self.bits, self.group_size)[..., : self.offset, :]
                     for held in (self.keys, self.values))

    def release(self) -> None:
        self.keys = self.values = self.last = None

    def restore(self, keys: QuantizedKV, values: QuantizedKV, offset: int) -> None:
        self.keys, self.values, self.offset = list(keys.parts), list(values.parts), offset

    @property
    def state(self):
        return [] if self.keys is None else [*self.keys, *self.values]


def check_kv_options(max_size: int | None, bits: int | None, group_size: int, head_dim: int | None = None) -> None:
    """--max-kv-size / --kv-bits / --kv-group-size, before any rank starts
    (`head_dim`: the config's, when it has one)."""
    from .errors import UserError

    if max_size is not None and max_size < 1:
        raise UserError(f"--max-kv-size must be >= 1, got {max_size}")
    if group_size not in KV_GROUP_SIZES:
        raise UserError(f"--kv-group-size must be one of {', '.join(map(str, KV_GROUP_SIZES))}, got {group_size}")
    if bits is None:
        return
    if bits not in KV_BITS:
        raise UserError(f"--kv-bits must be one of {', '.join(map(str, KV_BITS))}, got {bits}")
    if max_size is not None:
        raise UserError("--kv-bits quantizes full-attention caches, which --max-kv-size makes rotating ones: "
                        "give one of them (mlx-lm cannot quantize a rotating cache either)")
    if head_dim and head_dim % group_size:
        fits = [str(g) for g in KV_GROUP_SIZES if head_dim % g == 0]
        hint = f": use --kv-group-size {' or '.join(fits)}" if fits else " (MLX quantizes in groups of 32, 64 or 128)"
        raise UserError(f"--kv-group-size {group_size} does not divide the model's head_dim {head_dim}{hint}")


def kv_caches(caches: list | None, max_size: int | None = None, bits: int | None = None,
              group_size: int = 64) -> list | None:
    """A model's fresh caches with --max-kv-size / --kv-bits applied.

    `max_size` N: every full-attention layer keeps the last N positions (a
    `RotatingKVCache(N)`: a sliding window of N, mlx-lm's rotating cache with
    keep=0), a sliding layer the last min(window, N); chunked layers (at most
    their chunk) and recurrent state are left as they are. `bits`: each
    full-attention `KVCache` becomes a `QuantizedKVCache`; sliding, chunked,
    shared and conv caches stay in the compute dtype (as mlx-lm, which
    quantizes only its plain KVCache). Layers reading another layer's KV are
    re-pointed at its new cache."""
    if caches is None or (max_size is None and bits is None):
        return caches

    def one(c):
        kind = type(c)
        if kind is KVCache:
            return RotatingKVCache(max_size) if max_size else QuantizedKVCache(bits, group_size)
        if kind is RotatingKVCache and max_size and c.max_size > max_size:
            return RotatingKVCache(max_size)
        if kind is ConvKVCache and max_size:
            c.kv = one(c.kv)
        return c

    new, out = {}, []
    for c in caches:
        if isinstance(c, SharedKVCache):
            out.append(SharedKVCache(new.get(id(c.source), c.source), c.reads_layer))
            continue
        n = one(c)
        new[id(c)] = n
        out.append(n)
    return out


class KVOptions:
    """--max-kv-size / --kv-bits / --kv-group-size as one value (`kv_caches`)."""

    def __init__(self, max_size: int | None = None, bits: int | None = None, group_size: int = 64):
        self.max_size, self.bits, self.group_size = max_size, bits, group_size

    def __bool__(self) -> bool:
        return self.max_size is not None or self.bits is not None

    def check(self, head_dim: int | None = None) -> "KVOptions":
        check_kv_options(self.max_size, self.bits, self.group_size, head_dim)
        return self

    def apply(self, model) -> None:
        """Make the model's `make_cache` (every caller's: generation, logits,
        the batch engine, the prompt cache, a pipeline stage's) return these caches."""
        if not self:
            return
        refused = model.kv_bits_refused
        if self.bits is not None and refused:
            from .errors import UserError

            raise UserError(f"--kv-bits: {model.args.model_type} cannot take a quantized cache ({refused})")
        make = model.make_cache
        model.make_cache = lambda: kv_caches(make(), self.max_size, self.bits, self.group_size)
        model.kv_options = self  # (harness.model_window: the modes cross N)
