"""What a grammar mask computed on the host costs a pipelined decode step, in
MLX calls only (issue 42: json_schema steps of a 64-client GPU server took
about 11% longer than text steps, while the grammar's own Python took under 3%
of the stepping thread; the lead: a host array, `mx.array(numpy)`, lives in
MLX CUDA's managed memory, malloc(size) with no stream, which a kernel reads
by page migration every step).

A stand-in forward of a decode step (an embedding row per row, `--layers`
matmuls [R, H] x [H, H] in bf16, a head [H, V]) runs pipelined as the engine
runs it: step t + 1 is launched (async_eval) before the host reads step t's
ids. Variants, interleaved over --reps passes:

  plain      ids = argmax(logits): a text row's draw
  mask-dev   ids = argmax(where(bits unpacked, logits, -inf)) with masks made
             on the device once (the masking ops alone)
  mask-host  the same with each step's masks [R, V / 32] uint32 handed over
             from numpy (`mx.array`), as serve's constrained rows are
  mask-host-copy  mask-host, the uploaded array copied on the device first
             (`x + 0`: the copy's output is device memory; its input still
             migrates)
  mask-host-16  mask-host with only each row's first 16 words handed over
             (the rest disallowed, as sampling.allowed_from_bits reads a
             short mask): what trimming a mask's all-zero tail would buy

Each variant's wall ms a step (median of a pass's steps) and the host time a
step spends building and launching (perf_counter around the launch part).

    python benchmarks/mask_upload.py [--rows 30] [--vocab 262208] [--hidden 3840] [--layers 8] [--steps 200] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
import numpy as np

NEG_INF = float("-inf")


def unpack(bits: mx.array, index: tuple) -> mx.array:
    """bool [R, V] from uint32 words [R, ceil(V / 32)]: bit t % 32 of word t // 32
    (`index`: those words and shifts, made once, as sampling.allowed_from_bits's)."""
    word, shift = index
    return ((mx.take(bits, word, axis=-1) >> shift) & 1).astype(mx.bool_)


def run(variant: str, a, steps: int) -> dict:
    R, V = a.rows, a.vocab
    words = -(-V // 32)
    rng = np.random.default_rng(0)
    host_masks = [rng.integers(0, 2**32, size=(R, words), dtype=np.uint32) for _ in range(4)]
    dev_masks = [mx.array(m) for m in host_masks]
    t_ = mx.arange(V)
    index = (t_ // 32, (t_ % 32).astype(mx.uint32))
    short = (mx.minimum(t_ // 32, 15), (t_ % 32).astype(mx.uint32), t_ < 16 * 32)  # a 16-word mask's
    mx.eval(dev_masks, index, short)

    def draw(logits, t):
        if variant == "plain":
            return mx.argmax(logits, axis=-1).astype(mx.int32)
        if variant == "mask-dev":
            bits = dev_masks[t % 4]
        elif variant == "mask-host-16":
            bits = mx.array(np.ascontiguousarray(host_masks[t % 4][:, :16]))
            allowed = mx.logical_and(unpack(bits, short[:2]), short[2])
            return mx.argmax(mx.where(allowed, logits.astype(mx.float32), NEG_INF), axis=-1).astype(mx.int32)
        else:
            bits = mx.array(host_masks[t % 4])
            if variant == "mask-host-copy":
                bits = bits + mx.array(0, mx.uint32)
        return mx.argmax(mx.where(unpack(bits, index), logits.astype(mx.float32), NEG_INF), axis=-1).astype(mx.int32)

    def forward(ids):
        h = W["embed"][ids]  # [R, H]
        for w in W["layers"]:
            h = h + mx.tanh(h @ w) * 0.1
        return h @ W["head"]  # [R, V]

    ids = mx.zeros((R,), mx.int32)
    walls, hosts = [], []
    prev = None
    t0 = time.perf_counter()
    for t in range(steps):
        h0 = time.perf_counter()
        nxt = draw(forward(ids), t)
        mx.async_eval(nxt)
        hosts.append(time.perf_counter() - h0)
        if prev is not None:
            np.array(prev)  # the host reads the step before (pipelined one deep)
        prev, ids = nxt, nxt
        t1 = time.perf_counter()
        walls.append(t1 - t0)
        t0 = t1
    np.array(prev)
    skip = min(10, steps // 4)
    return {"variant": variant, "step_ms": round(1e3 * statistics.median(walls[skip:]), 3),
            "host_ms": round(1e3 * statistics.median(hosts[skip:]), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--vocab", type=int, default=262208)
    ap.add_argument("--hidden", type=int, default=3840)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", default="plain,mask-dev,mask-host,mask-host-copy,mask-host-16")
    ap.add_argument("--json", action="store_true", help="one JSON line a variant and pass")
    a = ap.parse_args()
    global W
    k = mx.random.key(0)
    H, V = a.hidden, a.vocab
    W = {"embed": (mx.random.normal((V, H), key=k) * 0.02).astype(mx.bfloat16),
         "layers": [(mx.random.normal((H, H), key=mx.random.split(k, a.layers + 1)[i]) * 0.02).astype(mx.bfloat16)
                    for i in range(a.layers)],
         "head": (mx.random.normal((H, V), key=mx.random.split(k, 2)[1]) * 0.02).astype(mx.bfloat16)}
    mx.eval(W)
    print(f"device {mx.default_device()}, rows {a.rows}, vocab {V}, hidden {H}, layers {a.layers}, "
          f"{a.steps} steps a pass", flush=True)
    variants = a.variants.split(",")
    for v in variants:  # a warm pass each: graphs and kernels first met
        run(v, a, 12)
    got = {v: [] for v in variants}
    for rep in range(a.reps):
        for v in variants:
            r = run(v, a, a.steps)
            got[v].append(r)
            print(json.dumps({"rep": rep, **r}) if a.json else
                  f"rep {rep}  {v:>15}  step {r['step_ms']:.3f} ms  host {r['host_ms']:.3f} ms", flush=True)
    base = statistics.median(r["step_ms"] for r in got[variants[0]])
    for v in variants:
        s = statistics.median(r["step_ms"] for r in got[v])
        h = statistics.median(r["host_ms"] for r in got[v])
        print(f"{v:>15}: step {s:.3f} ms ({s / base:.3f}x {variants[0]}), host {h:.3f} ms (medians of {a.reps})")


if __name__ == "__main__":
    main()
