"""One stream through two pipeline stages on one GPU, in MLX calls only (issue 41):
what MLX itself costs a pipelined decode token, with none of mlxcel-dist in it.

A stand-in decoder of `--layers` bf16 layers at a gemma3 4B's sizes (per layer: rms_norm,
the q/k/v and o projections, rms_norm, gate/up, gelu * up, down, two residual adds; no
attention over a context: the one-token step's matrix-vector work and most of its kernels),
an embedding and a [H, V] head. A token: the embedding row of the last id, the layers,
the head, argmax. Decode is pipelined as ours is: token t + 1 is built from token t's lazy
id and `async_eval`'d before the host reads id t (one host read a token).

    python benchmarks/pp_floor.py one                 # the whole model in one process
    python benchmarks/pp_floor.py one --stage 0       # stage 0's half alone (embedding + layers / 2)
    python benchmarks/pp_floor.py one --stage 1       # stage 1's half alone (layers / 2 + head)
    mlx.launch -n 2 --backend ring benchmarks/pp_floor.py pp --hand-back ids     # two stages, the id sent back
    mlx.launch -n 2 --backend ring benchmarks/pp_floor.py pp --hand-back logits  # the logits all_summed to both

Stage 0 sends h [1, H] to stage 1 (`mx.distributed.send`); stage 1 either sends the id back
(`--hand-back ids`) or both ranks all_sum the logits [1, V] (stage 0 adding zeros) and take the
argmax (`--hand-back logits`, what mlxcel-dist's stages do today). Each prints one JSON line
(rank 0): ms a token, median over `--rounds` of `--tokens` tokens after a warm-up round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
import mlx.nn as nn

H, QKV, O, F, V = 2560, 4096, 2048, 10240, 262144  # gemma3 4B: 8 q + 2 x 4 kv heads of 256


def weights(n: int, seed: int) -> list:
    mx.random.seed(seed)
    s = 0.02
    layers = []
    for _ in range(n):
        layers.append(dict(n1=mx.ones((H,), mx.bfloat16), qkv=(mx.random.normal((QKV, H)) * s).astype(mx.bfloat16),
                           o=(mx.random.normal((H, O)) * s).astype(mx.bfloat16), n2=mx.ones((H,), mx.bfloat16),
                           gu=(mx.random.normal((2 * F, H)) * s).astype(mx.bfloat16),
                           d=(mx.random.normal((H, F)) * s).astype(mx.bfloat16)))
    mx.eval(layers)
    return layers


def run_layers(h: mx.array, layers: list) -> mx.array:
    for w in layers:
        x = mx.fast.rms_norm(h, w["n1"], 1e-6)
        qkv = x @ w["qkv"].T
        h = h + qkv[..., :O] @ w["o"].T  # the attention's output projection on the q part (no context)
        x = mx.fast.rms_norm(h, w["n2"], 1e-6)
        g, u = mx.split(x @ w["gu"].T, 2, axis=-1)
        h = h + (nn.gelu_approx(g) * u) @ w["d"].T
    return h


def timed(step, first: mx.array, tokens: int, rounds: int) -> list:
    """ms a token per round: pipelined, one host read a token (round 0 a warm-up, not counted).
    A step returns the id [1], or a list whose last entry is the id (evaluated in list order)."""
    out = []

    def last(x):
        return x[-1] if isinstance(x, list) else x

    for r in range(rounds + 1):
        nxt = step(first)
        mx.async_eval(nxt)
        t = time.perf_counter()
        for _ in range(tokens):
            ids, nxt = nxt, step(last(nxt))
            mx.async_eval(nxt)
            last(ids).item()
        last(nxt).item()
        if r:
            out.append((time.perf_counter() - t) * 1e3 / tokens)
    return out


def one(a) -> dict:
    n = a.layers if a.stage is None else a.layers // 2
    layers = weights(n, 0)
    emb = (mx.random.normal((V, H)) * 0.02).astype(mx.bfloat16)
    head = (mx.random.normal((V, H)) * 0.02).astype(mx.bfloat16)
    mx.eval(emb, head)
    h0 = mx.zeros((1, H), mx.bfloat16)

    def step(ids):
        h = emb[ids] if a.stage in (None, 0) else h0 + ids.astype(mx.bfloat16)[:, None]  # [1, H]
        h = run_layers(h, layers)
        if a.stage == 0:  # its half hands h on: stand in with a scalar that depends on all of it
            return h[:, 0].astype(mx.int32)
        return mx.argmax(h @ head.T, axis=-1).astype(mx.int32)  # [1]

    ms = timed(step, mx.array([1], mx.int32), a.tokens, a.rounds)
    return dict(mode="one", stage=a.stage, layers=n, ms=statistics.median(ms), rounds=ms)


def pp(a) -> dict:
    g = mx.distributed.init(strict=True)
    assert g.size() == 2, g.size()
    r = g.rank()
    layers = weights(a.layers // 2, r)
    emb = (mx.random.normal((V, H)) * 0.02).astype(mx.bfloat16) if r == 0 else None
    head = (mx.random.normal((V, H)) * 0.02).astype(mx.bfloat16) if r == 1 else None
    mx.eval([x for x in (emb, head) if x is not None])

    def step(ids):
        if r == 0:
            h = run_layers(emb[ids], layers)
            sent = mx.distributed.send(h, 1, group=g)
            if a.hand_back == "ids":  # the send launched first: the receive has no input that orders it after
                mx.async_eval(sent)
                return [sent, mx.distributed.recv_like(ids, 1, group=g)]
            logits = mx.zeros((1, V), mx.bfloat16) + 0 * sent.sum()
            return mx.argmax(mx.distributed.all_sum(logits, group=g), axis=-1).astype(mx.int32)
        h = mx.distributed.recv((1, H), mx.bfloat16, 0, group=g)
        logits = run_layers(h, layers) @ head.T
        if a.hand_back == "ids":
            ids = mx.argmax(logits, axis=-1).astype(mx.int32)
            return mx.distributed.send(ids, 0, group=g)
        return mx.argmax(mx.distributed.all_sum(logits, group=g), axis=-1).astype(mx.int32)

    ms = timed(step, mx.array([1], mx.int32), a.tokens, a.rounds)
    return dict(mode="pp", back=a.hand_back, rank=r, layers=a.layers, ms=statistics.median(ms), rounds=ms)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["one", "pp"])
    ap.add_argument("--layers", type=int, default=34)
    ap.add_argument("--stage", type=int, choices=[0, 1], default=None)
    ap.add_argument("--hand-back", choices=["ids", "logits"], default="ids")
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    global V
    V = a.vocab
    res = one(a) if a.mode == "one" else pp(a)
    res.update(device=str(mx.default_device()), mlx=mx.__version__)
    if res.get("rank", 0) == 0:
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
