"""The engine's compiled steps: what they share (`STEP`, `_round_up`) and
the one-row split step (`SplitSegments`).

A decode step of an eager model rebuilds the same graph every token (hundreds
of small ops per layer, each a Python call and, on a GPU, a kernel launch).
The batch engine (batch.py: generate's one row, serve's many) traces it
once per buffer shape and replays it: elementwise ops fuse, and the host
builds nothing per token. Shapes must not change from step to step, so the
steps run on static buffers instead of the growing eager caches: each cache
kind's static form lives with the kind (the cache package: `static_form`
names it, `held()` is what moves, `row_view` the layer's cache over the
rows; cache/full.py describes the layout), which the engine asks for.

Slots past the mask hold zeros and get zero weight, so a step's logits are
those of the eager decode path (tests/test_decode.py compares them, and the
reference modes of the harness decode through the engine's rows). When `pos`
reaches a buffer's end the buffers grow (by a quarter) outside the graph,
and the next call traces again for the new shapes (mx.compile keeps the
traces). The fused kernels a trace needs are compiled once per machine (MLX
caches them on disk under its temp dir): the first decode step ever ran
~2.5 s longer on the 2-core CPU for a 12-layer model and 23-29 s on the H200
for a 48-layer one; later processes pay only the trace. Collectives of
sharded layers (all_sum, all_gather) are part of the traced graph.
"""

from __future__ import annotations

import mlx.core as mx

# (the kinds' static forms, where the engine imports them from)
from ..cache import (QuantizedStaticCache, StaticCache, StaticConvKV, StaticState,  # noqa: F401
                    quantize_kv, ring_slots)

STEP = 256  # buffer granularity on a GPU (batch.slot_step; at most batch.CPU_STEP on the CPU)


def _round_up(n: int, step: int) -> int:
    return ((n + step - 1) // step) * step


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
