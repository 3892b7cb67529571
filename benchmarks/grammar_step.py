"""Where a constrained batch step's host time goes (issue 42): R rows under
serve_load.py's json_schema (a list of at least 40 objects: no row finishes
inside --steps) against the same rows unconstrained, on one BatchEngine.

Per step: wall time, and the host time inside the engine's parts, timed by
wrapping them: `launch` (the next forward built and started), `collect` (the
one host read: it waits for the device, then advances each constrained
row's matcher: `advance` apart), `_finish` (the deferred rows' draw: their
masks from `Vocab.masks`, `masks` apart, then the masked argmax built and
started). Medians over the steps after the first few (every shape traced).

    python benchmarks/grammar_step.py [MODEL] --rows 16 --steps 64 [--sampled] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # serve_load's FORMATS


def timed(obj, name: str, into: dict):
    """Wrap obj.name so each call's seconds add to into[name]."""
    inner = getattr(obj, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            into[name] += time.perf_counter() - t

    setattr(obj, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--sampled", action="store_true", help="temperature 1 rows (each row's own draw)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import mlx.core as mx
    import numpy as np

    from mlxcel_dist import grammar
    from mlxcel_dist.batch import BatchEngine
    from mlxcel_dist.loader import default_model_dir, load_model
    from mlxcel_dist.sampling import SamplingParams
    from mlxcel_dist.tokenizer import Tokenizer
    from serve_load import FORMATS

    loaded = load_model(args.model or default_model_dir())
    model, n_vocab = loaded.model, loaded.model.args.vocab_size
    tok = Tokenizer(loaded.model_dir, loaded.config)
    vocab = grammar.Vocab(loaded.model_dir / "tokenizer.json", n_vocab, tok.eos_ids)
    schema = grammar.json_schema(FORMATS["json_schema"]["json_schema"]["schema"])
    params = [SamplingParams(temp=1.0, seed=i) if args.sampled else SamplingParams(temp=0.0)
              for i in range(args.rows)]
    parts = defaultdict(float)
    eng = BatchEngine(model, vocab=vocab)
    for name in ("launch", "collect", "_finish"):
        timed(eng, name, parts)
    timed(vocab, "masks", parts)
    timed(grammar.Matcher, "advance", parts)  # (the class: every row's matcher)
    warm = 4
    for g in ("none", "json_schema", "none", "json_schema"):
        rng = np.random.default_rng(0)
        reqs = [(i, rng.integers(3, n_vocab, size=args.prompt).tolist(), params[i], args.steps + 1,
                 schema if g != "none" else None) for i in range(args.rows)]
        eng.add_many(reqs)
        mx.synchronize()
        walls, per = [], defaultdict(list)
        for s in range(args.steps):
            parts.clear()
            t = time.perf_counter()
            out = eng.step()
            walls.append(time.perf_counter() - t)
            assert len(out) == args.rows
            for k, v in parts.items():
                per[k].append(v)
        for i in range(args.rows):
            eng.remove(i)
        while eng.step():
            pass
        ms = lambda xs: round(1e3 * float(np.median(xs[warm:])), 3) if len(xs) > warm else 0.0  # noqa: E731
        rec = {"grammar": g, "rows": args.rows, "sampled": args.sampled, "steps": args.steps,
               "step_ms": ms(walls), **{k + "_ms": ms(v) for k, v in sorted(per.items())}}
        if args.json:
            print(json.dumps(rec), flush=True)
        else:
            print("  ".join(f"{k} {v}" for k, v in rec.items()), flush=True)


if __name__ == "__main__":
    main()
