"""What K=3 drafts can buy on issue 42's pair, in MLX calls only (nothing of
mlxcel-dist or mlx-lm): the 7.24B llama target (hidden 4096, 32 layers,
32 q / 8 KV heads of 128, MLP 14336, vocabulary 32000, untied, random bf16
weights, norms at 1), its draft the first 4 layers with the same embedding,
norm and head (the same arrays, and the same KV buffers: layers 0-3 fed the
same ids write the same keys), layers 4..'s output projections scaled by
each of --alphas in turn (the smaller, the more the draft agrees: the
issue's pair accepted 68% of its drafts; one set of random weights).

The forward is the fewest kernels a plain MLX llama takes: q/k/v as one
matmul, gate/up as one, the SwiGLU product compiled into one kernel, RoPE
and attention from mx.fast, keys written into preallocated buffers.
Timed, each a chain of 64 launches with one read at the end (the host-bound
steady state): a target step (1 id), a 4-id verify, a draft step (4 layers),
a chain of trivial kernels (MLX's host time a kernel). Then greedy decoding,
plain (pipelined: step n + 1 built before step n is read) against K-draft
rounds (K draft steps and one K + 1 verify, one read a round), ids and
accepted drafts counted. The bound printed: a round yields E = 1 + a + a^2
+ ... + a^K ids (a: the per-draft acceptance) at K draft steps + a verify,
so drafts pay at most E x t_target / (K x t_draft + t_verify), E as
counted (`bound`).

    python benchmarks/draft_floor.py [--gen 256] [--k 3] [--reps 3] [--alphas 0.05,0.02] [--verify masked]
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx

from mlx_only import attend

H, LAYERS, NQ, NKV, D, I, V = 4096, 32, 32, 8, 128, 14336, 32000
DRAFT = 4
THETA, EPS = 500000.0, 1e-5
S = 2048  # key slots


def weights(seed: int = 0) -> dict:
    mx.random.seed(seed)

    def w(*shape):
        x = (0.02 * mx.random.normal(shape)).astype(mx.bfloat16)
        mx.eval(x)
        return x

    layers = [dict(ln1=mx.ones((H,), mx.bfloat16), qkv=w((NQ + 2 * NKV) * D, H), o=w(H, NQ * D),
                   ln2=mx.ones((H,), mx.bfloat16), gu=w(2 * I, H), down=w(H, I)) for _ in range(LAYERS)]
    return dict(embed=w(V, H), layers=layers, norm=mx.ones((H,), mx.bfloat16), head=w(V, H))


def scaled(p: dict, alpha: float) -> dict:
    """Layers DRAFT..'s output projections times alpha (the rest: the same arrays)."""
    layers = [L if i < DRAFT else dict(L, o=(L["o"] * alpha).astype(mx.bfloat16),
                                       down=(L["down"] * alpha).astype(mx.bfloat16))
              for i, L in enumerate(p["layers"])]
    mx.eval([(L["o"], L["down"]) for L in layers])
    return dict(p, layers=layers)


@mx.compile
def swiglu(gu):
    g, u = mx.split(gu, 2, axis=-1)
    return g * mx.sigmoid(g) * u


class Model:
    def __init__(self, p: dict):
        self.p = p
        self.k = [mx.zeros((1, NKV, S, D), mx.bfloat16) for _ in range(LAYERS)]
        self.v = [mx.zeros((1, NKV, S, D), mx.bfloat16) for _ in range(LAYERS)]
        mx.eval(self.k, self.v)

    masked = False  # a block's attention over the whole buffer with an array mask (--verify masked)

    def __call__(self, ids: mx.array, pos: int, layers: int = LAYERS) -> mx.array:
        """ids [T] at positions pos .. pos + T - 1 through the first `layers` layers: logits [T, V]."""
        T = ids.shape[0]
        h = self.p["embed"][ids][None]  # [1, T, H]
        for i, L in enumerate(self.p["layers"][:layers]):
            x = mx.fast.rms_norm(h, L["ln1"], EPS)
            qkv = x @ L["qkv"].T
            q, k, v = mx.split(qkv, [NQ * D, (NQ + NKV) * D], axis=-1)
            q = q.reshape(1, T, NQ, D).transpose(0, 2, 1, 3)  # [1, NQ, T, D]
            k = k.reshape(1, T, NKV, D).transpose(0, 2, 1, 3)
            v = v.reshape(1, T, NKV, D).transpose(0, 2, 1, 3)
            h = h + attend(q, k, v, self.k[i], self.v[i], pos, THETA, self.masked) @ L["o"].T
            x = mx.fast.rms_norm(h, L["ln2"], EPS)
            h = h + swiglu(x @ L["gu"].T) @ L["down"].T
        return (mx.fast.rms_norm(h, self.p["norm"], EPS) @ self.p["head"].T)[0]


def greedy(x: mx.array) -> mx.array:
    return mx.argmax(x, axis=-1).astype(mx.int32)


def chain_ms(fn, n: int = 64) -> float:
    """ms a launch of `fn` (returns arrays), n launches then one read."""
    mx.eval(fn())
    t = time.perf_counter()
    outs = [fn() for _ in range(n)]
    mx.eval(outs)
    return (time.perf_counter() - t) / n * 1e3


def plain(m: Model, prompt: mx.array, gen: int) -> tuple[list, float]:
    y = greedy(m(prompt, 0)[-1:])
    mx.eval(y)
    pos, out = prompt.shape[0], []
    t = time.perf_counter()
    nxt = greedy(m(y, pos)[-1:])
    mx.async_eval(nxt)
    for i in range(gen):
        pos += 1
        cur = nxt
        if i < gen - 1:
            nxt = greedy(m(cur, pos)[-1:])
            mx.async_eval(nxt)
        out.append(int(cur.item()))
    return out, gen / (time.perf_counter() - t)


def drafted(m: Model, prompt: mx.array, gen: int, K: int) -> tuple[list, float, float, float]:
    """(ids, ids a second, accepted / drafted, ids a round)."""
    y = greedy(m(prompt, 0)[-1:])
    mx.eval(y)
    pos, last, out, drafted_n, accepted_n, rounds = prompt.shape[0], int(y.item()), [], 0, 0, 0
    t = time.perf_counter()
    while len(out) < gen:
        rounds += 1
        x, ds = mx.array([last], mx.int32), []
        for j in range(K):  # the draft: the first 4 layers, each id fed lazily to the next step
            x = greedy(m(x, pos + j, DRAFT)[-1:])
            ds.append(x)
        d = mx.concatenate(ds)
        g = greedy(m(mx.concatenate([mx.array([last], mx.int32), d]), pos))  # [K + 1]
        mx.eval(d, g)
        d, g = d.tolist(), g.tolist()
        a = 0
        while a < K and d[a] == g[a]:
            a += 1
        new = d[:a] + [g[a]]
        drafted_n, accepted_n = drafted_n + K, accepted_n + a
        out += new
        pos += a + 1
        last = new[-1]
    return out[:gen], len(out) / (time.perf_counter() - t), accepted_n / drafted_n, len(out) / rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--alphas", default="0.05", help="comma-separated; each a pair of the same base weights")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--shift", type=int, default=0,
                    help="rep r's prompt is --prompt + r x shift ids long (key lengths no earlier rep saw)")
    ap.add_argument("--tiny", action="store_true", help="small widths (a CPU smoke run)")
    ap.add_argument("--verify", default="causal", choices=["causal", "masked"],
                    help="a verify block's attention: fused causal on the prefix (MLX CUDA: a cuDNN graph per "
                         "key length), or masked over the whole buffer")
    a = ap.parse_args()
    if a.tiny:
        global H, NQ, NKV, D, I, V
        H, NQ, NKV, D, I, V = 256, 4, 2, 64, 512, 1000
    t = time.perf_counter()
    base = weights()
    print(json.dumps({"device": str(mx.default_device()), "mlx": mx.__version__,
                      "built_s": round(time.perf_counter() - t, 1)}), flush=True)
    one, four = mx.array([5], mx.int32), mx.array([5, 6, 7, 8], mx.int32)
    tiny = mx.zeros((16,))

    def trivial():
        x = tiny
        for _ in range(100):
            x = x + 1
        return x

    prompts = mx.random.randint(0, V, (a.prompt + a.shift * a.reps,), key=mx.random.key(1)).astype(mx.int32)
    for alpha, rep in ((float(x), r) for x in a.alphas.split(",") for r in range(a.reps)):
        if rep == 0:
            m = None
            m = Model(scaled(base, alpha))
            m.masked = a.verify == "masked"
        prompt = prompts[: a.prompt + a.shift * rep]
        parts = {"target_ms": chain_ms(lambda: m(one, 600)), "verify_ms": chain_ms(lambda: m(four, 600)),
                 "draft_ms": chain_ms(lambda: m(one, 600, DRAFT)), "kernel_us": chain_ms(trivial) * 10}
        ids_p, tps_p = plain(m, prompt, a.gen)
        ids_d, tps_d, acc, E = drafted(m, prompt, a.gen, a.k)
        bound = E * parts["target_ms"] / (a.k * parts["draft_ms"] + parts["verify_ms"])
        same = next((i for i, (x, y) in enumerate(zip(ids_p, ids_d)) if x != y), len(ids_p))
        print(json.dumps({"alpha": alpha, "verify": a.verify, "rep": rep, **{k: round(v, 3) for k, v in parts.items()}, "plain_tps": round(tps_p, 1),
                          "drafted_tps": round(tps_d, 1), "ratio": round(tps_d / tps_p, 3),
                          "accepted": round(acc, 3), "ids_a_round": round(E, 3), "bound": round(bound, 3), "same_ids_first": same}), flush=True)


if __name__ == "__main__":
    main()
