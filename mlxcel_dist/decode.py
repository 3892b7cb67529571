"""Static forms of the cache kinds, which the engine's compiled steps run on.

A decode step of an eager model rebuilds the same graph every token (hundreds
of small ops per layer, each a Python call and, on a GPU, a kernel launch).
The batch engine (batch.py: generate's one row, serve's many) traces it
once per buffer shape and replays it: elementwise ops fuse, and the host
builds nothing per token. Shapes must not change from step to step, so the
steps run on static buffers instead of the growing `cache.KVCache` /
`RotatingKVCache`; this module holds each kind's static form (the engine's
rows are their per-row views, batch.RowCache):

- every layer's keys/values live in a fixed buffer [B, kv_heads, S, D] with
  S a multiple of `STEP` with room for a quarter more tokens (capped at the
  window on sliding layers) and the token's position `pos` is an int32
  array, an input of the graph;
- the new key goes to slot `pos` (full layers) or `pos % S` (sliding layers:
  while S < window the buffer is in temporal order, so that is `pos` too;
  once S == window it is a ring holding exactly the window);
- the mask is `arange(S) <= pos` for both kinds (unwritten slots are hidden;
  a full ring is all visible), built once per step per attention kind by
  `cache.layer_masks` from `StaticCache.mask`; RoPE takes `pos` as its offset.
- chunked layers (llama4, `chunk`: a query sees its attention chunk) use the
  sliding layers' buffer (a ring of `chunk` slots once that long), whose
  slots 0 .. pos % chunk hold exactly the current chunk: the mask is
  `arange(S) <= pos % chunk` (while S < chunk, pos < S and that is pos).

- a `--kv-bits` layer (cache.QuantizedKVCache) keeps its keys and values
  quantized: `QuantizedStaticCache`, six buffers (words, scales, biases of
  each), the new token quantized into slot `pos` inside the graph; such a
  model's steps are never split (the split step attends float buffers).
- a state layer (`static_state`: cache.RecurrentCache, DeltaNetCache) keeps
  its state arrays as buffers of the same state (`StaticState`: fixed
  shapes, replaced by each step inside the graph); Baichuan-M1's conv state
  on k/v sits beside its static KV (`StaticConvKV`).

`static_kind` says which form a cache takes, `held_arrays` what moves.
`SplitSegments` is the one-row split step (below). Slots past the mask hold
zeros and get zero weight, so a step's logits are those of the eager decode
path (tests/test_decode.py compares them, and the reference modes of the
harness decode through the engine's rows). When `pos` reaches a buffer's end
the buffers grow (by a quarter) outside the graph, and the next call traces
again for the new shapes (mx.compile keeps the traces). The fused kernels a
trace needs are compiled once per machine (MLX caches them on disk under its
temp dir): the first decode step ever ran ~2.5 s longer on the 2-core CPU for
a 12-layer model and 23-29 s on the H200 for a 48-layer one; later processes
pay only the trace. Collectives of sharded layers (all_sum, all_gather) are
part of the traced graph.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .cache import ConvKVCache, LayerCache, QuantizedKV

STEP = 256  # buffer granularity on a GPU (batch.slot_step; at most batch.CPU_STEP on the CPU)


def _round_up(n: int, step: int) -> int:
    return ((n + step - 1) // step) * step


def ring_slots(start: int, n: int, size: int):
    """Slots of positions start .. start + n - 1 in a buffer of `size` slots
    (position p at p % size, `StaticCache.slot`'s rule), oldest first: a slice
    when they do not wrap (a view to read, one slice update to write, nothing
    sent to the device), else an index array (a gather / scatter)."""
    s0 = start % size
    if s0 + n <= size:
        return slice(s0, s0 + n)
    return mx.array(np.arange(start, start + n) % size)


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


def static_kind(c) -> str | None:
    """How a cache moves into static buffers: "shared" (reads another
    layer's), "kv", "quantized", "state", "conv_kv" (KV plus a conv state),
    or None (it cannot: the model steps eagerly)."""
    if c.reads_layer is not None:
        return "shared"
    if isinstance(c, ConvKVCache):
        return "conv_kv" if c.kv.static_kv else None
    if getattr(c, "static_quantized", False):
        return "quantized"
    if c.static_kv:
        return "kv"
    return "state" if c.static_state else None


def held_arrays(c, kind: str) -> tuple[list, list]:
    """What an eager cache of `kind` holds, as its static buffers take it:
    (keys/values oldest first, in `names` order: [k, v] or the six quantized
    parts; state arrays, None where nothing was fed yet)."""
    kv = []
    if kind in ("kv", "conv_kv"):
        kv = list(c.temporal())
    elif kind == "quantized":
        k, v = c.temporal()
        kv = [*k.parts, *v.parts]
    return kv, list(c.state_arrays()) if kind in ("state", "conv_kv") else []


def quantize_kv(keys: mx.array, values: mx.array, bits: int, group_size: int) -> list:
    """The six arrays a token's keys and values take in quantized buffers."""
    return [*mx.quantize(keys, group_size=group_size, bits=bits), *mx.quantize(values, group_size=group_size, bits=bits)]


class StaticState(LayerCache):
    """A state cache's static form (`static_state`: RG-LRU, DeltaNet): its
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


class StaticConvKV:
    """cache.ConvKVCache's static form: a static KV view (`kv`) and its conv
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


class QuantizedStaticCache(StaticCache):
    """A `cache.QuantizedKVCache`'s static form (--kv-bits): keys and values
    each as (w, scales, biases) buffers [B, H, S, .] ("k{i}.0" ..), the new
    token quantized into slot `pos`; attention gets `QuantizedKV`s of the
    whole buffers and the mask hides the unwritten slots."""

    def __init__(self, state, index: int, bits: int, group_size: int):
        super().__init__(state, index, None)
        self.bits, self.group_size = bits, group_size

    @property
    def names(self) -> list:
        return [f"{x}{self.index}.{j}" for x in "kv" for j in range(3)]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        s, names = self.buffers, self.names
        pos = s["pos"]
        start = pos.reshape(1)
        for n, x in zip(names, quantize_kv(keys, values, self.bits, self.group_size)):
            s[n] = mx.slice_update(s[n], x, start, axes=(2,))
        k, v = QuantizedKV.pair([s[n] for n in names], self.bits, self.group_size)
        self.last = (k, v, pos)
        return k, v


# ---------------------------------------------------------------------- split steps
# One compiled graph per step puts attention inside the graph, where the
# static buffers need a mask (arange(S) <= pos) and MLX's GPU backends then
# leave their fused decode-attention kernels for the unfused matmul /
# softmax form (MLX 0.32 CUDA: an array mask disables both the vector
# kernel and cuDNN). The split step keeps everything else compiled, in
# segments between the attention calls:
#   segment 0:   embed, layer 0's pre (norm, q/k/v, RoPE)
#   segment i:   layer i-1's post (o_proj, MLP, norms, collectives), layer i's pre
#   segment N:   layer N-1's post, final norm, head -> logits
# Between them, eagerly: the new key/value go to their slot of the layer's
# buffers (a slice update at the host's position: MLX's static
# SliceUpdate, one copy kernel in place, where the compiled step's
# position-as-array DynamicSliceUpdate costs MLX CUDA a second kernel to
# compute the offset), then the layer's attention on the written prefix
# k[..., :n, :] with n = min(pos + 1, S) (views, no copy), with no mask:
# what the fused kernels take (and what mlx-lm's decode feeds them).
# The same numbers as the masked form (the hidden slots have weight 0).

class SplitSegments:
    """A model's split step (the notes above): `__call__(y, state, views, p)`
    feeds token y [1, 1] at host position p through the compiled segments,
    writes each layer's new K/V into `state`'s buffers, replaces state["pos"]
    and returns the lazy logits [1, V]: the batch engine's one-row step."""

    def __init__(self, model):
        self.model = model
        self.traced = False  # set while a segment's Python body runs (mx.compile traces)
        layers = model.layers
        n = len(layers)
        logits_of = model.decode_logits

        def make(i):
            def seg(*args):
                self.traced = True  # the Python body runs only while mx.compile traces
                if i == 0:
                    y, pos = args
                    h = model.model.embed(y)
                else:
                    x, o, pos = args
                    h = layers[i - 1].post(x, o)
                    if i == n:
                        return logits_of(h)[:, -1], pos + 1
                c = _NewKV(pos)
                x, q, _, _ = layers[i].pre(h, c)
                return x, q, *c.kv

            return mx.compile(seg)

        self.segments = [make(i) for i in range(n + 1)]

    def __call__(self, y: mx.array, s: dict, views: list, p: int) -> mx.array:
        segs = self.segments
        pos = s["pos"]
        self.traced = False
        carry = (y,)
        for i, layer in enumerate(self.model.layers):
            x, q, k_new, v_new = segs[i](*carry, pos)
            # the state's arrays: an indexed assignment makes each the update of itself
            # (the previous buffer is donated to it: written in place)
            k, v = s[f"k{i}"], s[f"v{i}"]
            slot = views[i].slot(p)
            k[..., slot : slot + 1, :] = k_new
            v[..., slot : slot + 1, :] = v_new
            m = min(views[i].last_slot(p) + 1, k.shape[2])
            carry = (x, layer.self_attn.attend(q, k[..., :m, :], v[..., :m, :]))
        logits, s["pos"] = segs[-1](*carry, pos)
        return logits


class _NewKV:
    """A split segment's cache (`SplitSegments`): RoPE's offset is
    the position array; `update_and_fetch` keeps the new key/value, which the
    step writes to the static buffers outside the compiled segment."""

    def __init__(self, pos: mx.array):
        self.offset = pos
        self.kv = None

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.kv = (keys, values)
        return keys, values


def splittable(model) -> bool:
    """Whether one-row steps may run split (`SplitSegments`): the
    model says so (`split_decode`) and every layer has `pre`/`post` and a
    `self_attn` with `attend` (blocks.PreNormBlock and the layers built like it)."""
    if not model.split_decode or model.stage is not None:
        return False  # (a pipeline stage: its first segment would embed; the whole-step graph runs instead)
    return all(hasattr(l, "pre") and hasattr(l, "post") and hasattr(getattr(l, "self_attn", None), "attend")
               for l in model.layers)
