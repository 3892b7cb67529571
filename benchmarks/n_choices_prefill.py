"""serve's n > 1: the admission of n copies of one prompt (prefilled once,
the other rows forked from its keys/values) against n different prompts of
the same length (what n rows each prefilling would cost), on one engine.

    python benchmarks/n_choices_prefill.py [MODEL] --n 8 --prompt 1024 --repeat 3
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from mlxcel_dist.engine.batch import BatchEngine  # noqa: E402
from mlxcel_dist.checkpoint.loader import default_model_dir, load_model  # noqa: E402
from mlxcel_dist.engine.sampling import SamplingParams  # noqa: E402


def admit(model, prompts) -> tuple[float, int]:
    """Seconds for add_many of `prompts` (buffers evaluated), prompt tokens prefilled."""
    eng = BatchEngine(model)
    t = time.perf_counter()
    eng.add_many([(i, p, SamplingParams(temp=0.8, seed=i)) for i, p in enumerate(prompts)])
    mx.eval(list(eng.buffers.values()))
    return time.perf_counter() - t, eng.prefilled


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=str(default_model_dir()))
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    model = load_model(a.model).model
    rng = np.random.default_rng(0)
    V = model.args.vocab_size
    admit(model, [rng.integers(3, V, 16)] * 2)  # first traces and allocations
    for _ in range(a.repeat):
        same = admit(model, [rng.integers(3, V, a.prompt)] * a.n)
        other = admit(model, [rng.integers(3, V, a.prompt) for _ in range(a.n)])
        print(f"n {a.n}, {a.prompt}-token prompt: copies {same[0] * 1000:.0f} ms ({same[1]} tokens prefilled), "
              f"{a.n} prompts {other[0] * 1000:.0f} ms ({other[1]} tokens), ratio {other[0] / same[0]:.1f}x")


if __name__ == "__main__":
    main()
