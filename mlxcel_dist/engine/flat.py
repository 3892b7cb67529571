"""The mixed step as one forward: the decoding rows' tokens and a prefill
job's chunk flattened into one batch of single tokens (vLLM's flattened
batch), so a step beside a prompt costs one forward instead of two.

Why: a GPU step of few rows is host-bound (MLX CUDA: tens of us of host time
a kernel), and a chunk's own eager forward costs more host time than the
rows' compiled step whatever its size (20-55 ms beside a 15 ms step for a
12B gemma3 on an H200): streams stalled 8-28x while a long prompt came in.
Here the chunk's tokens ride in the rows' compiled graph: every linear
layer, norm and MLP runs once over C + B x m tokens ([N, 1, hidden]: each
token a batch row of one, RoPE at its own position), and only attention is
split: the rows attend their row buffers (batch_rows.py, `RowCache`), the
chunk its job's prefill buffers (prefill.Together, `PrefillCache`, [B, m]
queries, causal by position). The rows' logits, and each job row's last
token's in the chunk (a prompt's last token rides in its last chunk: its
row's first id, or its one answer, is drawn from them).

Layers run through their split-decode pieces (`pre` -> `self_attn.attend`
-> `post`, decode.SplitSegments'), so a layer's forward is still written
once; families whose layers have them and whose every layer keeps float
K/V (full, sliding ring, chunked) take it (`fusable`). One graph per
(rows' buffers, B, m, the job's buffer sizes), each traced once in a
server's life: m is a size run before where one is near the offer, else 2^k
or 3 x 2^(k-1) (`chunk_size`; prefill.Together._flat_size), a job's last
chunk the same m padded after its end (the pads' keys land where nothing a
query sees lives, as Together's) unless its pads alone would grow the
buffers, a job's rings window + a power of two up to prefill.FLAT_CHUNK and
its unwrapped buffers powers of two, whatever the prompt's length."""

from __future__ import annotations

import os

import mlx.core as mx

from .decode import _NewKV, splittable


def fusable(engine) -> bool:
    """Whether `engine`'s steps may carry a prefill chunk: static rows whose
    every layer keeps float K/V, a model with split-decode pieces, no drafts
    (their rounds feed blocks), no micro-batches (pipeline stages); on a GPU
    (a step's cost there is host time a kernel, which the chunk then shares),
    not on a CPU, where a step is compute-bound and a prompt token costs the
    same in either forward (the 2-core CPU measured no gain, and one process
    there runs the chunk on its second core instead: BatchEngine.side).
    MLXCEL_DIST_FLAT=1 takes it on a CPU too (the tests), =0 nowhere."""
    mode = os.environ.get("MLXCEL_DIST_FLAT")
    if mode == "0" or (mode != "1" and mx.default_device() == mx.cpu):
        return False
    return (bool(engine.static) and not engine.store.stateful and engine.spec is None and engine.micro == 1
            and all(k == "kv" for k in engine.store.kinds) and splittable(engine.model))


def chunk_size(n: int, cap: int) -> int:
    """The chunk a prompt takes of `n` tokens on offer: the largest of 1, 2, 4,
    then 2^k and 3 x 2^(k-1) (8, 12, 16, 24, 32, 48, ...) that is <= n and
    <= `cap` (its job's chunk, which sizes its rings): few sizes, so few
    traces, and at most a third of the offer left unused."""
    n = max(1, min(n, cap))
    m = 1 << (n.bit_length() - 1)
    return m * 3 // 2 if m >= 4 and m * 3 // 2 <= n else m


class FlatStep:
    """The engine's flattened mixed step: `__call__(x, job)` runs the rows'
    next tokens x [C] and `job`'s staged chunk (prefill.Together.stage) in
    one forward and returns the rows' lazy logits [C, V]; the job's buffers
    are updated in place of its own, and a prompt answered after this chunk
    gets its last token's logits (`Together.flat_done`)."""

    def __init__(self, engine):
        self.e = engine
        self.state: dict = {}  # the job's prefill buffers while a step runs (one dict: the compiled inputs)
        b = engine.store.buffers
        self._compiled = mx.compile(self._forward, inputs=[b, self.state], outputs=[b, self.state])

    def __call__(self, x: mx.array, job) -> mx.array:
        tokens = job.staged_tokens()  # [B, m]
        self.state.clear()
        self.state.update(job.flat_inputs())
        X = mx.concatenate([x, mx.array(tokens.reshape(-1), mx.int32)])
        logits = self._compiled(X) if self.e.compiled else self._forward(X)
        C = x.shape[0]
        job.flat_done(self.state, logits[C:])
        return logits[:C]

    def _forward(self, X: mx.array) -> mx.array:
        e, st = self.e, self.state
        e.steps.traces += e.compiled  # (the Python body runs per trace compiled, per step eager)
        store, model = e.store, e.model
        rows = store.buffers["pos"]  # [C]
        C, B = rows.shape[0], st["offsets"].shape[0]
        m = (X.shape[0] - C) // B
        positions = mx.concatenate([rows, (st["offsets"][:, None] + mx.arange(m)).reshape(-1)])  # [C + B*m]
        cviews = []
        for i, lay in enumerate(store.layout):
            cviews.append(lay.cache.prefill_view(st, i, st[f"k{i}"].shape[2], True, cviews))
        kinds = model.model.stage_layer_types
        rmask, cmask = {}, {}
        for i, kind in enumerate(kinds):  # one mask per attention kind, rows' and chunk's
            if kind not in rmask:
                rmask[kind], cmask[kind] = store.views[i].mask(1), cviews[i].mask(m)
        h = model.model.embed(X.reshape(-1, 1))  # [N, 1, hidden]: each token a row of one
        for i, layer in enumerate(model.layers):
            c = _NewKV(positions)
            x, q, _, _ = layer.pre(h, c)
            k, v = c.kv  # [N, kv_heads, 1, D]
            kr, vr = store.views[i].update_and_fetch(k[:C], v[:C])
            kc, vc = cviews[i].update_and_fetch(_block(k[C:], B), _block(v[C:], B))
            attn = layer.self_attn
            o_rows = attn.attend(q[:C], kr, vr, mask=rmask[kinds[i]])  # [C, heads, 1, D]
            o_chunk = attn.attend(_block(q[C:], B), kc, vc, mask=cmask[kinds[i]])  # [B, heads, m, D]
            h = layer.post(x, mx.concatenate([o_rows, _unblock(o_chunk)]))
        store.buffers["pos"] = rows + 1
        h = mx.concatenate([h[:C], h[C:][st["pick"]]])  # and each job row's last token (an answered prompt's)
        return model.decode_logits(h)[:, -1]


def _block(x: mx.array, B: int) -> mx.array:
    """[B*m, H, 1, D] -> [B, H, m, D]: a chunk's tokens as its rows' queries/keys."""
    _, H, _, D = x.shape
    return x.reshape(B, -1, H, D).transpose(0, 2, 1, 3)


def _unblock(x: mx.array) -> mx.array:
    """[B, H, m, D] -> [B*m, H, 1, D]."""
    B, H, m, D = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B * m, H, 1, D)
