"""The run-to-run spread of 4-bit MoE decode on a GPU, in MLX calls only
(nothing of mlxcel-dist or mlx-lm): issue 42's qwen3_moe shape (hidden
2048, 16 layers, 32 q / 4 KV heads of 128, 128 experts top-8,
moe_intermediate 768, vocabulary 151936), random weights quantized to 4
bits (group 64) by mx.quantize, experts stacked and run by mx.gather_qmm
(as mlx-lm's SwitchGLU), attention from mx.fast into preallocated
buffers. Each rep decodes --gen ids greedily from a --prompt-id prompt,
pipelined (step n + 1 built before step n is read), and prints its tok/s
and per-id gap median / p10 / p90; run the script several times (fresh
processes) for the spread between processes too.

    python benchmarks/moe_spread.py [--reps 6] [--gen 128] [--sorted]
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
import numpy as np

from mlx_only import attend

H, LAYERS, NQ, NKV, D, V = 2048, 16, 32, 4, 128, 151936
E, TOP, MI = 128, 8, 768
BITS, GROUP, EPS, THETA, S = 4, 64, 1e-6, 1000000.0, 1024


def q4(*shape):
    w = 0.02 * mx.random.normal(shape).astype(mx.bfloat16)
    out = mx.quantize(w, group_size=GROUP, bits=BITS)
    mx.eval(out)
    return out


def qmm(x, w):
    return mx.quantized_matmul(x, *w, transpose=True, group_size=GROUP, bits=BITS)


def gqmm(x, w, idx, sort):
    return mx.gather_qmm(x, *w, rhs_indices=idx, transpose=True, group_size=GROUP, bits=BITS, sorted_indices=sort)


class Model:
    def __init__(self, sort: bool):
        self.sort = sort
        one = mx.ones((H,), mx.bfloat16)
        self.layers = [dict(ln1=one, q=q4(NQ * D, H), k=q4(NKV * D, H), v=q4(NKV * D, H), o=q4(H, NQ * D),
                            qn=mx.ones((D,), mx.bfloat16), kn=mx.ones((D,), mx.bfloat16), ln2=one,
                            router=q4(E, H), gate=q4(E, MI, H), up=q4(E, MI, H), down=q4(E, H, MI))
                       for _ in range(LAYERS)]
        self.embed, self.head, self.norm = q4(V, H), q4(V, H), one
        self.k = [mx.zeros((1, NKV, S, D), mx.bfloat16) for _ in range(LAYERS)]
        self.v = [mx.zeros((1, NKV, S, D), mx.bfloat16) for _ in range(LAYERS)]
        mx.eval(self.k, self.v)

    def moe(self, x, L):
        logits = qmm(x, L["router"])  # [1, T, E]
        idx = mx.argpartition(-logits, TOP - 1, axis=-1)[..., :TOP]
        w = mx.softmax(mx.take_along_axis(logits, idx, axis=-1).astype(mx.float32), axis=-1)
        xe = mx.expand_dims(x, (-2, -3))  # [1, T, 1, 1, H]
        g, u = gqmm(xe, L["gate"], idx, self.sort), gqmm(xe, L["up"], idx, self.sort)
        y = gqmm(g * mx.sigmoid(g) * u, L["down"], idx, self.sort).squeeze(-2)  # [1, T, TOP, H]
        return (y * w[..., None].astype(y.dtype)).sum(axis=-2)

    def __call__(self, ids: mx.array, pos: int) -> mx.array:
        T = ids.shape[0]
        h = mx.dequantize(*[a[ids] for a in self.embed], group_size=GROUP, bits=BITS)[None]
        for i, L in enumerate(self.layers):
            x = mx.fast.rms_norm(h, L["ln1"], EPS)
            q = mx.fast.rms_norm(qmm(x, L["q"]).reshape(1, T, NQ, D), L["qn"], EPS).transpose(0, 2, 1, 3)
            k = mx.fast.rms_norm(qmm(x, L["k"]).reshape(1, T, NKV, D), L["kn"], EPS).transpose(0, 2, 1, 3)
            v = qmm(x, L["v"]).reshape(1, T, NKV, D).transpose(0, 2, 1, 3)
            h = h + qmm(attend(q, k, v, self.k[i], self.v[i], pos, THETA), L["o"])
            h = h + self.moe(mx.fast.rms_norm(h, L["ln2"], EPS), L)
        return qmm(mx.fast.rms_norm(h, self.norm, EPS), self.head)[0]


def decode(m: Model, prompt: mx.array, gen: int) -> tuple[float, list]:
    y = mx.argmax(m(prompt, 0)[-1:], axis=-1)
    mx.eval(y)
    pos, gaps = prompt.shape[0], []
    nxt = mx.argmax(m(y, pos)[-1:], axis=-1)
    mx.async_eval(nxt)
    t0 = last = time.perf_counter()
    for i in range(gen):
        pos += 1
        cur = nxt
        if i < gen - 1:
            nxt = mx.argmax(m(cur, pos)[-1:], axis=-1)
            mx.async_eval(nxt)
        cur.item()
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    return gen / (time.perf_counter() - t0), gaps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--sorted", action="store_true", help="gather_qmm's sorted_indices=True")
    ap.add_argument("--tiny", action="store_true", help="small widths (a CPU smoke run)")
    a = ap.parse_args()
    if a.tiny:
        global H, NQ, NKV, V, E, MI, LAYERS
        H, NQ, NKV, V, E, MI, LAYERS = 256, 4, 2, 1000, 16, 128, 4
    t = time.perf_counter()
    m = Model(a.sorted)
    print(json.dumps({"device": str(mx.default_device()), "mlx": mx.__version__,
                      "built_s": round(time.perf_counter() - t, 1)}), flush=True)
    prompt = mx.random.randint(0, V, (a.prompt,), key=mx.random.key(1)).astype(mx.int32)
    for rep in range(a.reps):
        tps, gaps = decode(m, prompt, a.gen)
        g = np.array(gaps[1:]) * 1e3
        print(json.dumps({"rep": rep, "tps": round(tps, 1), "gap_ms": [round(float(np.percentile(g, p)), 2)
                                                                       for p in (50, 10, 90)]}), flush=True)


if __name__ == "__main__":
    main()
