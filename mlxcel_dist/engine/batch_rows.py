"""The batch engine's rows and the static buffers they live in (the engine's
`store`, a `RowBuffers`; batch.py's BatchEngine decides who has a row, the
step in batch_step.py reads and writes the buffers through `views`).

Layout. Every layer's keys/values live in static buffers [C, kv_heads, S, D]
shared by the batch: row b holds one sequence, `pos[b]` (int32 [C]) is the
position of the token row b feeds in this step. As in decode.py (whose
single-sequence steps this generalises), a full layer writes slot `pos[b]`
and a sliding layer slot `pos[b] % S` of a buffer that grows to exactly the
window and is then a ring; the mask of row b is `arange(S) <= pos[b]`
([C, 1, 1, S]), RoPE takes the per-row offsets `pos`. Rows are written with
one scatter per layer (`mx.put_along_axis`), so rows never see each other.
`C` (the buffer's row count) is a power of two that covers the active rows,
and a finished row is filled by moving the last one into it (`copy`), so
the active rows are always [0, n).

Every cache kind has its rows in the buffers (one `LayerRows` a layer,
learned at the first row; the layer's kind, cache/, names its buffers,
makes its views and its prompt-cache entries): a --kv-bits layer holds
decode.QuantizedStaticCache's six buffers [C, H, S, .], a state layer
(RG-LRU, conv, DeltaNet) its state arrays as [C, ...] buffers "s{i}.{j}"
(decode.StaticState; Baichuan-M1's conv state beside its KV,
decode.StaticConvKV). A row's state is its slice: admission writes the
prefilled state into the row (zeros when nothing was prefilled), removal
moves the last row's into it, a fork copies it, and the prompt cache gets a
DeltaNet layer's Snapshot (RG-LRU and conv state are not kept).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from .decode import _round_up, ring_slots
from .prefill import _read_row, _write_row
from .prompt_cache import PromptCache
from .sampling import Sampler

SHRINK = 2  # slots shrink once over this x the rows' need (each new slot count is a new compiled trace)


@dataclass(frozen=True)
class LayerRows:
    """How one layer's rows live in the batch buffers (learned from a
    prefilled cache, `RowBuffers.learn`)."""

    cache: object  # the layer's kind: its eager cache (released), which makes its views and entries
    window: int | None = None  # a sliding layer's window (a chunked one's: its chunk)
    kv: tuple = ()  # its keys/values buffers' names ([C, H, S, D] each: the slot axis 2)
    state: tuple = ()  # its state arrays' buffers' names ([C, ...] each)

    @property
    def kind(self) -> str:
        """Its static form's name (cache.LayerCache.static_form): "kv", "quantized", "state", ..."""
        return self.cache.static_form


@dataclass(eq=False)
class Row:
    """One sequence in the batch."""

    rid: object
    sampler: Sampler
    context: list  # prompt + generated ids (the repetition penalty's context)
    pos: int  # position of the token this row feeds next (counting steps launched, read or not)
    token: int  # the token it feeds next when no step in flight holds it (read ids, the prompt's last)
    eager_cache: list | None = None  # models that cannot batch: their own cache
    generated: list = field(default_factory=list)
    budget: int | None = None  # ids the caller will read at most (max_tokens): no step launched past it
    launched: int = 0  # steps launched for it
    grammar: object = None  # grammar.Matcher (None: unconstrained), advanced with each id read
    gave_up: str | None = None  # llguidance's reason once its grammar gave up (read here: the masks'
    # worker may hold the matcher later)
    drafts: bool = True  # the request lets drafts be verified for it (batch_spec.py; serve's "speculative")

    def took(self, ids: list) -> None:
        """The ids read for this row, in order (one a plain step; a draft round's accepted ones)."""
        self.context.extend(ids)
        self.generated.extend(ids)
        self.token = ids[-1]
        if self.grammar is not None:
            for t in ids:
                self.grammar.advance(t)
            self.gave_up = self.grammar.error


class RowBuffers:
    """The static buffers of a batch's rows: `buffers` (name -> array; one
    dict for the engine's life, the compiled steps' state), `layout`, and
    `views` (each layer's cache over the buffers, what the model is called
    with). `rows`: the engine's row list (row b is buffer row b); `view`
    (store, i, views, rows) -> layer i's cache and `grain()` (the slots a
    buffer grows by) are the row cache kinds' (batch.row_view, slot_step);
    `margin`: ring slots past each window for drafted tokens."""

    def __init__(self, rows: list, view, grain, margin: int = 0):
        self.rows, self.view_of, self.grain, self.margin = rows, view, grain, margin
        self.buffers: dict = {}
        self.views: list = []
        self.layout: list[LayerRows] = []  # per layer, learned at the first row
        self.shapes: dict = {}  # buffer name -> a row's shape (slots: the prefilled cache's)
        self.dtypes: dict = {}
        self.stateful = False  # some layer holds a state (prefilled alone: pads would enter it)
        self.cacheable = False  # the prompt cache can keep these layers (PromptCache.cacheable)
        self._cap = 0
        self._size = 0

    def capacity(self) -> int:
        return self._cap if self.buffers else 0

    def slots(self) -> int:
        """The nominal buffer length (full layers'; sliding ones stop at their window)."""
        return self._size if self.buffers else 0

    @property
    def kinds(self) -> list:
        return [lay.kind for lay in self.layout]

    @property
    def windows(self) -> list:
        return [lay.window for lay in self.layout]

    def learn(self, model, cache, probe) -> None:
        """Per-layer window, cache kind, buffer names and per-row shapes and
        dtypes, from a prefilled cache (or a one-token probe forward when the
        prompt had nothing to prefill)."""
        if cache is None:
            cache = model.make_cache()
            model(mx.array(probe)[None], cache)
        self.layout = []
        for i, c in enumerate(cache):  # each layer's kind names its buffers and hands over its arrays
            names, states = c.buffer_names(i)
            kv, st = c.held()
            self.layout.append(LayerRows(c, c.window, tuple(names), tuple(states)))
            for name, x in zip([*names, *states], [*kv, *st]):
                self.shapes[name], self.dtypes[name] = x.shape, x.dtype
        self.stateful = any(c.static_state for c in cache)
        self.cacheable = PromptCache.cacheable(cache)

    def reserve(self, n_rows: int, max_pos: int, fit: bool = False) -> None:
        """Buffers with at least `n_rows` rows (a power of two) and slot
        `max_pos` for every layer (full layers: pos < S; sliding: up to the
        window, then a ring). `fit` (rows left): the buffer rows shrink to
        the rows' power of two (its compiled step is kept: a trace per
        shape) and the slots to what they need once over SHRINK x it, since
        every step computes every buffer row and attends over every slot (a
        long prompt's row gone, the streams left would each read its length
        a step)."""
        C, S = self.capacity(), self.slots()
        rows = 1 << (n_rows - 1).bit_length()
        need = max_pos + 1
        want_c = max(C, rows)
        want_s = S if S >= need else _round_up(need + need // 4, self.grain())
        if fit and self.buffers:
            # every live row's positions are < need: its slots are [0, pos] in every layer, a
            # ring too (pos % S = pos), so a buffer cut to `fitted` slots keeps them in place
            fitted = _round_up(need + need // 4, self.grain())
            want_c = rows
            want_s = fitted if S > SHRINK * fitted else want_s
        if self.buffers and want_c == C and want_s == S:
            return
        self._size = want_s
        new = {}
        for lay in self.layout:
            s = min(want_s, lay.window + self.margin) if lay.window else want_s  # a margin: rolled-back drafts
            for name in lay.kv:
                old = self.buffers.get(name)
                shape = self.shapes[name] if old is None else old.shape
                buf = mx.zeros((want_c, shape[1], s, shape[3]), self.dtypes[name])
                if old is not None:
                    # A sliding buffer already at the window keeps its ring; a
                    # growing one is in temporal order: copy the slots held.
                    keep, c = min(old.shape[2], s), min(old.shape[0], want_c)
                    buf[:c, :, :keep, :] = old[:c, :, :keep, :]
                new[name] = buf
            for name in lay.state:  # a state: rows only
                old = self.buffers.get(name)
                buf = mx.zeros((want_c, *self.shapes[name][1:]), self.dtypes[name])
                if old is not None:
                    c = min(old.shape[0], want_c)
                    buf[:c] = old[:c]
                new[name] = buf
        self.buffers.clear()
        self.buffers.update(new)
        self._cap = want_c
        self.views = []
        for i in range(len(self.layout)):
            self.views.append(self.view(i, self.views))
        self.sync_pos()

    def view(self, i: int, views: list, rows=None):
        """Layer i's cache over the buffers (`views`: the layers before it;
        `rows` (a, e): a micro-batch's rows only)."""
        return self.view_of(self, i, views, rows)

    def sync_pos(self, pos: list | None = None) -> None:
        """The buffers' `pos` from the rows' positions (or `pos`, one a row), padding rows at 0."""
        pos = [r.pos for r in self.rows] if pos is None else list(pos)
        self.buffers["pos"] = mx.array(pos + [0] * (self.capacity() - len(pos)), mx.int32)

    def write(self, b: int, last: int, layers: list) -> None:
        """Row b's layers (per layer its keys/values in `names` order, [1, H, n, .]
        of positions up to `last`, oldest first, and its state arrays [1, ...];
        None: nothing held, a state starts at zeros) into buffer row b."""
        for lay, x in zip(self.layout, layers):
            held, states = x or ([], [None] * len(lay.state))
            if held:
                S = self.buffers[lay.kv[0]].shape[2]  # this layer's (a sliding one stops at its window)
                n = min(held[0].shape[2], S)
                slots = ring_slots(last - n, n, S)
                for name, a in zip(lay.kv, held):
                    _write_row(self.buffers[name], b, slots, a[..., a.shape[2] - n :, :])
            for name, a in zip(lay.state, states):
                buf = self.buffers[name]
                buf[b : b + 1] = mx.zeros_like(buf[:1]) if a is None else a

    def copy(self, src: int, dst: int) -> None:
        """Buffer row `dst` becomes a copy of row `src` (a fork; a removal's fill)."""
        for name in list(self.buffers):
            if name == "pos":
                continue
            buf = self.buffers[name]
            buf[dst : dst + 1] = buf[src : src + 1]
            self.buffers[name] = buf

    def held(self, b: int, fed: int) -> list:
        """Row b's layers as the prompt cache keeps them: per layer (keys/values
        of its `fed` tokens, oldest first; its state arrays; a shared one's are empty)."""
        layers = []
        for lay in self.layout:
            held = []
            if lay.kv:
                S = self.buffers[lay.kv[0]].shape[2]
                n = min(fed, S)
                slots = ring_slots(fed - n, n, S)
                held = [_read_row(self.buffers[name], b, slots) for name in lay.kv]
            layers.append((held, [self.buffers[x][b : b + 1] for x in lay.state]))
        return layers

    def entry(self, i: int, x, offset: int | None = None):
        """Layer i's prompt-cache entry from (keys/values, states) of `offset`
        tokens: (keys, values) (QuantizedKVs under --kv-bits), a state's
        Snapshot (its arrays, then the offset: DeltaNetCache.snapshot), or None."""
        if x is None:
            return None
        return self.layout[i].cache.entry(*x, offset)

    def release(self) -> None:
        """Drop the buffers (no rows left)."""
        self.buffers.clear()
        self.views = []
