"""How close to the HBM roofline MLX's own matrix-vector kernels get: the
decode step's weight reads alone, with nothing else in the step.

Issue 19 asks decode at >= 70% of the H200's 4.8 TB/s. A decode step reads
every weight once; this chains, per layer of a FAMILIES shape
(gpu_compare.py), the step's matmuls on one token with the fused shapes ours
runs (q/k/v as one [q + 2 kv, hidden] matrix, o, gate/up as one, down; then
the output head), with only the elementwise glue a layer needs between them
(no norms, no attention), and times it eagerly and as one compiled graph.
What it reaches is a ceiling for the whole model's step with MLX's kernels:

    python benchmarks/gemv_ceiling.py [--families llama,mistral,qwen3] [--steps 50] [--small]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import mlx.core as mx

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpu_compare import FAMILIES, HBM_TB_S  # noqa: E402


def weights(cfg: dict, dtype=mx.bfloat16) -> tuple[list, mx.array]:
    H, I, D = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * D, cfg["num_key_value_heads"] * D
    layers = []
    for i in range(cfg["num_hidden_layers"]):
        ks = mx.random.split(mx.random.key(i + 1), 4)
        w = [(0.02 * mx.random.normal(s, key=k)).astype(dtype)
             for s, k in zip([(q + 2 * kv, H), (H, q), (2 * I, H), (H, I)], ks)]
        mx.eval(w)
        layers.append(w)
    head = (0.02 * mx.random.normal((cfg["vocab_size"], H), key=mx.random.key(10_000))).astype(dtype)
    mx.eval(head)
    return layers, head


def matmul(h, w):
    return h @ w.T


def step(x, layers, head, q: int, I: int, mm=matmul):
    """One token through the chain; `mm(h, w)` is h [1, K] @ w [N, K].T."""
    h = x
    for wqkv, wo, wgu, wd in layers:
        a = mm(h, wqkv)  # [1, q + 2kv]
        h = h + mm(a[:, :q], wo)
        gu = mm(h, wgu)  # [1, 2I]
        h = h + mm(mx.sigmoid(gu[:, :I]) * gu[:, :I] * gu[:, I:], wd)
    return mx.argmax(mm(h, head), axis=-1)


def time_step(fn, x, steps: int) -> float:
    """ms per call of fn(x), evaluated each time, after 3 warm calls."""
    for _ in range(3):
        mx.eval(fn(x))
    mx.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        mx.eval(fn(x))
    return (time.perf_counter() - t) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default="llama,mistral,qwen3")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--small", action="store_true")
    a = ap.parse_args()
    for fam in a.families.split(","):
        cfg = dict(FAMILIES[fam])
        if a.small:
            cfg.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2, vocab_size=1024,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64)
        layers, head = weights(cfg)
        nbytes = sum(w.nbytes for l in layers for w in l) + head.nbytes
        q, I = cfg["num_attention_heads"] * cfg["head_dim"], cfg["intermediate_size"]
        x = mx.random.normal((1, cfg["hidden_size"])).astype(mx.bfloat16)
        eager = lambda x: step(x, layers, head, q, I)  # noqa: E731
        compiled = mx.compile(eager)
        row = {"family": fam, "weights_gb": round(nbytes / 1e9, 2), "device": str(mx.default_device())}
        for name, fn in (("eager", eager), ("compiled", compiled), ("eager", eager), ("compiled", compiled)):
            ms = time_step(fn, x, a.steps)
            tbs = nbytes / (ms / 1e3) / 1e12
            row.setdefault(f"{name}_ms", []).append(round(ms, 3))
            row.setdefault(f"{name}_roofline", []).append(round(tbs / HBM_TB_S, 3))
        print(json.dumps(row), flush=True)
        layers = head = None
        mx.clear_cache()


if __name__ == "__main__":
    main()
