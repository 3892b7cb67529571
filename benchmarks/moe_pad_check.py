"""Which quantized-matmul kernels MLX CUDA compiles for grouped expert blocks
of given sizes (issue 42: a block of 17-32 rows compiled MLX's 32-row tile,
30-40 s on a fresh machine; experts.block_rows pads such blocks to 33).

    MLX_PTX_CACHE_DIR=/tmp/pad-check python benchmarks/moe_pad_check.py [--sizes 20,40,24]

One 4-bit SwitchGLU of issue 42's expert shape (hidden 2048, intermediate
768, random weights), one grouped call whose experts get exactly `--sizes`
rows, timed cold and warm; prints the kernel files MLX wrote (run it with an
empty MLX_PTX_CACHE_DIR: the list is then this call's compiles).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="20,40,24", help="rows each expert gets (comma-separated)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    a = ap.parse_args()
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np

    from mlxcel_dist.nn import experts
    from mlxcel_dist.nn.layers import activation, gated_fp32

    sizes = [int(s) for s in a.sizes.split(",")]
    E = len(sizes)
    sw = experts.SwitchGLU(a.hidden, a.intermediate, E, gated_fp32(activation("silu")))
    for lin in (sw.gate_proj, sw.up_proj, sw.down_proj):
        lin.weight = (mx.random.normal(lin.weight.shape) * 0.02).astype(mx.bfloat16)
    nn.quantize(sw, group_size=64, bits=4)
    mx.eval(sw.parameters())
    idx = mx.array(np.repeat(np.arange(E), sizes)[:, None].astype(np.int32))  # [R, 1]: top-1, rows by expert
    x = (mx.random.normal((idx.shape[0], a.hidden)) * 0.1).astype(mx.bfloat16)
    w = mx.ones(idx.shape, mx.bfloat16)
    mx.eval(x, idx, w)
    cache = Path(os.environ.get("MLX_PTX_CACHE_DIR", "/nonexistent"))
    before = set(cache.rglob("*")) if cache.exists() else set()
    times = []
    for _ in range(2):
        t = time.perf_counter()
        mx.eval(sw._grouped(x, idx, None))
        times.append(round(time.perf_counter() - t, 2))
    new = sorted(p.name for p in set(cache.rglob("*")) - before if p.suffix == ".ptx")
    print(json.dumps({"sizes": sizes, "padded_to": [experts.block_rows(n, experts.on_cuda()) for n in sizes],
                      "cold_s": times[0], "warm_s": times[1], "kernels": new}))


if __name__ == "__main__":
    main()
