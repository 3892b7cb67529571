"""Primitives of the flat step (engine/flat.py: C decoding rows and a
prompt's m-token chunk in one forward) per layer, against the rows' plain
step alone. CPU, tiny shapes, seconds.

    python benchmarks/flat_primitives.py [--family gemma3] [--rows 4] [--chunk 64] [--layers 2]

Why: on the H200 a flat step of 512 tokens costs the rows' step + ~10 ms
beyond its tokens' compute (docs/benchmarks.md, Session 22), and MLX CUDA
spends host time a primitive; the flat step's extra primitives are that
part's first suspect. Counted as step_primitives.py counts (its GPU-form
stand-ins for mx.fast, `mx.export_to_dot` of the compiled graph, per layer
= (count at 2L layers - count at L) / L); the chunk's attention has an
array mask, so it keeps SDPA's real fallback, as on CUDA.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import mlx.core as mx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpu_compare as G  # noqa: E402
import step_primitives as S  # noqa: E402


def count(cfg, rows: int, m: int, flat: bool, P: int = 40) -> collections.Counter:
    from mlxcel_dist.engine.batch import BatchEngine
    from mlxcel_dist.engine.prefill import Admission, Together

    model, _ = S.build(cfg, mx.bfloat16)
    a = model.args
    e = BatchEngine(model)
    ids = np.ones(P + 1, np.int32)
    e._decide(ids[:1])
    for r in range(rows):
        cache = model.make_cache()
        for c in cache:
            c.update_and_fetch(*S._zeros_kv(a.num_key_value_heads, P, a.head_dim, mx.bfloat16))
        e.place_prefilled(Admission(("row", r), ids, P, None, 0, None, 2), cache)
    mx.eval(list(e.buffers.values()))
    job = Together(e, [Admission("prompt", np.ones(4 * m + 1, np.int32), 4 * m, None, 0, None, 2)], m)
    job.stage(m)
    with S.FastStandIns().active() as fs:
        if flat:
            e.flat_job = job
        logits = e.steps.forward_rows(mx.ones((rows,), mx.int32))[0]
        extra = [x for name in job.kv for x in [job.bufs[name]]] if flat else []
        return S.count_graph([logits, *e.buffers.values(), *extra], fs.tally)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="gemma3")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    a = ap.parse_args()
    os.environ["MLXCEL_DIST_FLAT"] = "1"
    mx.set_default_device(mx.cpu)
    G._stub_transformers()
    cols = {}
    for name, flat in (("rows' step", False), (f"flat step (+{a.chunk} tokens)", True)):
        cols[name] = S.per_layer(lambda cfg, flat=flat: count(cfg, a.rows, a.chunk, flat), a.family, a.layers)
    print(S.table(f"{a.family}, {a.rows} rows", cols))


if __name__ == "__main__":
    main()
