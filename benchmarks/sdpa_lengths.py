"""MLX CUDA's fused attention for a block of queries, by key length, in MLX
calls only: a draft round's verify (4 queries over a growing prefix of a
preallocated key buffer) through mx.fast.scaled_dot_product_attention, as
causal / unmasked blocks and as one query, against the same block with an
array mask over the whole buffer (the masked form, which takes no fused
kernel). Each call is evaluated alone; ms a call, averaged over 40 calls
whose key lengths are all the same, or each one new.

    python benchmarks/sdpa_lengths.py [--queries 4] [--slots 2048]

Why: on one H200 (MLX 0.32.4) a verify split as a decode step (causal SDPA
on the row's own prefix) made draft rounds 4x slower than plain decoding,
while a chain of verifies at one position was fast (docs/benchmarks.md,
issue 42's draft pair).
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queries", type=int, default=4)
    ap.add_argument("--slots", type=int, default=2048)
    a = ap.parse_args()
    T, S = a.queries, a.slots
    q = mx.random.normal((1, 32, T, 128)).astype(mx.bfloat16)
    k = mx.random.normal((1, 8, S, 128)).astype(mx.bfloat16)
    v = mx.random.normal((1, 8, S, 128)).astype(mx.bfloat16)
    mx.eval(q, k, v)
    slot = mx.arange(S)

    def call(n: int, how: str) -> mx.array:
        if how == "one query":
            return mx.fast.scaled_dot_product_attention(q[:, :, :1], k[..., :n, :], v[..., :n, :], scale=0.088)
        if how == "masked, whole buffer":  # slot j visible to query i when j <= n - T + i
            mask = slot[None] <= (n - T + mx.arange(T))[:, None]
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.088, mask=mask)
        mask = "causal" if how == "causal" else None
        return mx.fast.scaled_dot_product_attention(q, k[..., :n, :], v[..., :n, :], scale=0.088, mask=mask)

    print(json.dumps({"device": str(mx.default_device()), "mlx": mx.__version__}), flush=True)
    start = 300
    for how in ("causal", "unmasked", "one query", "masked, whole buffer"):
        for lengths in ("one length", "new lengths", "one length", "new lengths"):
            ns = [start] * 40 if lengths == "one length" else list(range(start + 1, start + 41))
            start += 41 if lengths == "new lengths" else 0
            mx.synchronize()
            t = time.perf_counter()
            for n in ns:
                mx.eval(call(n, how))
            ms = (time.perf_counter() - t) / len(ns) * 1e3
            print(json.dumps({"attention": how, "queries": 1 if how == "one query" else T, "keys": lengths,
                              "ms_a_call": round(ms, 3)}), flush=True)


if __name__ == "__main__":
    main()
