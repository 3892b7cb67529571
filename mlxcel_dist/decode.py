"""Compiled single-token decode: one `mx.compile`d graph per step.

A decode step of an eager model rebuilds the same graph every token (hundreds
of small ops per layer, each a Python call and, on a GPU, a kernel launch).
`DecodeStep` traces it once and replays it: elementwise ops fuse, and the
host builds nothing per token. Shapes must not change from step to step, so
the step runs on `StaticCache`s instead of the growing `cache.KVCache` /
`RotatingKVCache`:

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
  on k/v sits beside its static KV (`StaticConvKV`). Speculative blocks
  (`margin`) keep such models eager: a state cannot be rolled back.

Slots past the mask hold zeros and get zero weight, so a step's logits are
those of the eager decode path (tests/test_decode.py compares them, and the
reference modes of the harness decode through this path). When `pos` reaches
a buffer's end the buffers grow (by a quarter) outside the graph, and the
next call traces again for the new shapes (a trace per growth; mx.compile
keeps the traces, so later generations of the same lengths reuse them).
The fused kernels a trace needs are compiled once per machine (MLX caches
them on disk under its temp dir): the first decode step ever ran ~2.5 s
longer on the 2-core CPU for a 12-layer model and 23-29 s on the H200 for a
48-layer one; later processes pay only the trace. Collectives
of sharded layers (all_sum, all_gather) are part of the traced graph.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .cache import ConvKVCache, LayerCache, QuantizedKV, SharedKVCache

STEP = 256  # buffer granularity (see _size)


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
    """One layer's view of a `DecodeState`: the cache protocol the model's
    attention uses (`offset`, `mask`, `update_and_fetch`) with `pos` as an
    array."""

    def __init__(self, state: "DecodeState", index: int, window: int | None, chunk: int | None = None,
                 margin: int = 0):
        self.buffers, self.index, self.window, self.chunk = state, index, window, chunk
        self.margin = margin  # ring slots past the window: room for drafted tokens that may be rolled back

    @property
    def names(self) -> list:
        """This layer's arrays in the `DecodeState`."""
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
    arrays are buffers "s{i}.{j}" [B, ...] of a DecodeState (the batch
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


class DecodeState(dict):
    """The arrays a compiled step reads and replaces: "pos" (int32 scalar, the
    position of the token being fed), "k{i}"/"v{i}" per KV layer ("k{i}.0"
    .. "v{i}.2" quantized), "s{i}.{j}" per state array. A dict so that
    mx.compile can take it as the step's captured inputs and outputs."""


class DecodeStep:
    """Compiled single-token steps for one model. `start(cache)` takes over an
    eager cache after the prompt (its `offset` tokens) and returns the
    per-layer `StaticCache`s; each `__call__(y)` then feeds one token id y
    [1, 1] and returns the lazy logits [V] of it. The compiled function is
    made once per model and reused by later generations (a trace per buffer
    shape, as mx.compile caches them)."""

    def __init__(self, model):
        self.model = model
        self.state = DecodeState()
        self.views: list = []
        self.static = False
        self.quantized = False  # some layer's buffers are QuantizedStaticCache's
        self.compiled = True
        self.traces = 0  # graphs built by mx.compile (the Python step runs only while tracing)
        self.pos = 0  # host copy of state["pos"]
        self.margin = 0  # see start
        self._compiled = mx.compile(self._step, inputs=self.state, outputs=self.state)
        self._compiled_block = mx.compile(self._block, inputs=self.state, outputs=self.state)
        self.split = splittable(model)  # compiled segments around the attention kernels (see _split_step)
        self._segments = None

    def _step(self, y: mx.array) -> mx.array:
        self.traces += self.compiled
        logits = self.model(y, self.views)[0, -1]
        self.state["pos"] = self.state["pos"] + 1
        return logits

    def _block(self, y: mx.array) -> mx.array:
        self.traces += self.compiled
        logits = self.model(y, self.views)[0]
        self.state["pos"] = self.state["pos"] + y.shape[1]
        return logits

    def start(self, cache, pos: int, compiled: bool = True, margin: int = 0) -> list:
        """Move an eager cache holding `pos` tokens into static buffers sized
        for token `pos` (the eager cache is emptied: it is not used again);
        the steps run compiled, or eagerly on the same buffers. A cache with
        a layer `static_kind` cannot move (or none) is kept as it is and
        stepped eagerly.

        `margin` > 0 (speculative decoding, spec.py): rings hold window +
        margin slots and masks go by slot positions, so blocks of up to
        margin + 1 tokens (`block`) can be fed and up to margin of the
        latest tokens rolled back (`rewind`) exactly; steps run unsplit
        (state layers then step eagerly: no rollback of a state)."""
        self.state.clear()
        self.pos = pos
        self.compiled = compiled
        self.margin = margin
        kinds = [static_kind(c) for c in cache or []]
        if not kinds or None in kinds or (margin and {"state", "conv_kv"} & set(kinds)):
            self.views, self.static = cache, False
            return cache
        self.static = True
        self.quantized = False
        self.state["pos"] = mx.array(pos, mx.int32)
        self.views = []
        for i, (c, kind) in enumerate(zip(cache, kinds)):
            if kind == "shared":  # no buffers of its own: it reads its source's
                self.views.append(SharedKVCache(self.views[c.reads_layer], c.reads_layer))
                continue
            window = c.window
            if c.offset == 0:
                raise ValueError("DecodeStep.start needs a cache holding at least one token")
            size = _size(pos + 1, window, margin)
            held, states = held_arrays(c, kind)
            if states:  # fixed shapes: the arrays themselves
                conv = StaticState(self.state, i, len(states))
                self.state.update(zip(conv.names, states))
            if kind == "state":
                self.views.append(conv)
                continue
            if kind == "quantized":  # a full layer: slot = position
                view = QuantizedStaticCache(self.state, i, c.bits, c.group_size)
                for n, x in zip(view.names, held):
                    buf = mx.zeros((*x.shape[:2], size, x.shape[3]), x.dtype)
                    buf[..., : x.shape[2], :] = x
                    self.state[n] = buf
                self.views.append(view)
                self.quantized = True
                continue
            k, v = held
            n = min(k.shape[2], size)
            k, v = k[..., k.shape[2] - n :, :], v[..., v.shape[2] - n :, :]
            B, H, _, Dk = k.shape
            bk = mx.zeros((B, H, size, Dk), k.dtype)
            bv = mx.zeros((B, H, size, v.shape[3]), v.dtype)
            # position j goes to slot j % size (temporal order while size > pos)
            slots = ring_slots(pos - n, n, size)
            bk[..., slots, :] = k
            bv[..., slots, :] = v
            self.state[f"k{i}"], self.state[f"v{i}"] = bk, bv
            view = StaticCache(self.state, i, window, c.chunk, margin)
            self.views.append(view if kind == "kv" else StaticConvKV(view, conv))
        for c in cache:  # taken over: the eager buffers go once the static ones are built
            c.release()
        return self.views

    def release(self) -> None:
        """Drop the KV buffers (the model keeps this object between
        generations, e.g. in `serve`; an idle model should not hold the last
        request's cache)."""
        self.state.clear()
        self.views = []
        self.static = False

    def _reserve(self, last: int) -> None:
        # Grow every buffer that cannot hold slot `last` (the last position
        # fed now): full layers always need last < S; sliding ones until
        # they reach the window (+ margin).
        for view in self.views:
            if view.reads_layer is not None or isinstance(view, StaticState):
                continue  # a SharedKVCache (its source's buffers grow) or a state (fixed)
            s = self.state
            size = view.size
            if last < size or (view.window and size >= view.window + self.margin):
                continue  # slot last exists, or a full ring
            want = _size(last + 1, view.window, self.margin)
            if want > size:
                for name in view.names:
                    a = s[name]
                    pad = mx.zeros((*a.shape[:2], want - a.shape[2], a.shape[3]), a.dtype)
                    s[name] = mx.concatenate([a, pad], axis=2)

    def __call__(self, y: mx.array) -> mx.array:
        if not self.static:
            self.pos += 1
            return self.model(y, self.views)[0, -1]
        self._reserve(self.pos)  # room for slot self.pos, the token fed now
        self.pos += 1
        if self.compiled and self.split and not self.quantized and not self.margin:  # (float buffers, no margin)
            return self._split_step(y)
        return self._compiled(y) if self.compiled else self._step(y)

    def block(self, y: mx.array) -> mx.array:
        """Feed L tokens y [1, L] at positions pos .. pos + L - 1 (started
        with margin >= L - 1); the lazy logits [L, V] of each."""
        L = y.shape[1]
        if not self.static:
            self.pos += L
            return self.model(y, self.views)[0]
        assert L - 1 <= self.margin, (L, self.margin)
        self._reserve(self.pos + L - 1)
        self.pos += L
        return self._compiled_block(y) if self.compiled else self._block(y)

    def rewind(self, n: int) -> None:
        """Forget the last n tokens fed (n <= margin): later tokens overwrite
        their slots, the masks hide them meanwhile. Static buffers only (an
        eager cache's state is restored by its owner, spec.py)."""
        if n <= 0:
            return
        assert self.static and n <= self.margin, (n, self.margin)
        self.pos -= n
        self.state["pos"] = self.state["pos"] - n

    # ------------------------------------------------------------------ split steps
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

    def _split_step(self, y: mx.array) -> mx.array:
        if self._segments is None:
            self._segments = SplitSegments(self.model)
        logits = self._segments(y, self.state, self.views, self.pos - 1)  # (the position of the token fed now)
        self.traces += self._segments.traced  # one count per step that built new graphs
        return logits[0]


class SplitSegments:
    """A model's split step (see DecodeStep's notes above): `__call__(y, state,
    views, p)` feeds token y at host position p through the compiled segments,
    writes each layer's new K/V into `state`'s buffers, replaces state["pos"]
    and returns the lazy logits (of the last position, the rows kept). Used
    by DecodeStep and by the batch engine's one-row step."""

    def __init__(self, model):
        self.model = model
        self.traced = False  # set while a segment's Python body runs (mx.compile traces)
        layers = model.layers
        n = len(layers)
        logits_of = getattr(model, "decode_logits", None) or (lambda h: model.head(model.model.norm(h)))

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
    """A split segment's cache (`DecodeStep._split_step`): RoPE's offset is
    the position array; `update_and_fetch` keeps the new key/value, which the
    step writes to the static buffers outside the compiled segment."""

    def __init__(self, pos: mx.array):
        self.offset = pos
        self.kv = None

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.kv = (keys, values)
        return keys, values


def _size(n: int, window: int | None, margin: int = 0) -> int:
    """Buffer length for n tokens: n plus a quarter, rounded up to a multiple
    of STEP (at most the window + margin). Geometric growth keeps the retraces few on
    long generations (each costs a trace of the whole model: ~0.4 s, estimated, for 48
    layers on the H200) while the padding attention scans stays < n / 4 + STEP."""
    size = _round_up(n + n // 4, STEP)
    return min(size, window + margin) if window else size


def splittable(model) -> bool:
    """Whether decode steps may run split (`DecodeStep._split_step`): the
    model says so (`split_decode`) and every layer has `pre`/`post` and a
    `self_attn` with `attend` (blocks.PreNormBlock and the layers built like it)."""
    if not getattr(model, "split_decode", False):
        return False
    if getattr(getattr(model, "model", None), "stage", None) is not None:
        return False  # a pipeline stage: its first segment would embed (the whole-step graph runs instead)
    layers = getattr(model, "layers", None) or []
    return all(hasattr(l, "pre") and hasattr(l, "post") and hasattr(getattr(l, "self_attn", None), "attend")
               for l in layers)


def decode_step_for(model) -> DecodeStep:
    """The model's DecodeStep: made on first use and kept in the model's
    `decode_step` attribute (the model contract, models/base.py), so that
    its traces are reused by later generations."""
    if model.decode_step is None:
        model.decode_step = DecodeStep(model)
    return model.decode_step
