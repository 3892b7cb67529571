"""Prompt lookup in the batch engine (serve --prompt-lookup) against plain
steps, before and after issue 42 (a step where no row drafts taking the
plain pipelined step; each row's k adapting; lookup rows that keep failing
resting), on one BatchEngine model, greedy rows.

Variants, one engine each (traced once), interleaved over --reps passes (medians over the passes of: tok/s,
R rows x --gen ids over the wall time of their steps; cpu_ms, the process's
CPU time per id, which other processes' load on a shared host moves less):
  plain       BatchEngine without drafts
  before      batch_spec.py as of aff0c91's successor 0cb588c (every step a verify round; read from git)
  fixed-k     this BatchDrafts, adaptive=False
  adaptive    this BatchDrafts (the default)
Workloads:
  miss        lookups that find nothing: the lookup asks for a repeated
              --miss-ngram-gram (default 4) that this output does not hold
              (the counts of verify steps say whether it did)
  hits        the default lookup (1..3-grams) on the tiny model's output,
              which repeats itself: drafts accepted and rejected

    python benchmarks/batch_lookup.py [MODEL] --rows 1,16 --gen 64 --reps 5 [--json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
BEFORE = "0cb588c"


def old_batch_spec():
    """batch_spec.py as of BEFORE, imported beside the current one (same engine)."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{BEFORE}:mlxcel_dist/batch_spec.py"],
                         check=True, capture_output=True, text=True).stdout
    spec = importlib.util.spec_from_loader("mlxcel_dist._batch_spec_before", loader=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "mlxcel_dist.engine"
    exec(compile(src, "batch_spec_before.py", "exec"), mod.__dict__)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--miss-ngram", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import mlx.core as mx
    import numpy as np

    from mlxcel_dist.engine.batch import BatchEngine
    from mlxcel_dist.engine.batch_spec import BatchDrafts
    from mlxcel_dist.checkpoint.loader import default_model_dir, load_model
    from mlxcel_dist.engine.sampling import SamplingParams
    from mlxcel_dist.engine.spec import PromptLookup

    model = load_model(args.model or default_model_dir()).model
    n_vocab = model.args.vocab_size
    before = old_batch_spec()
    greedy = SamplingParams(temp=0.0)

    def make(variant: str, workload: str):
        if variant == "plain":
            return BatchEngine(model), None
        adaptive = variant == "adaptive"
        spec = before.BatchDrafts(args.k) if variant == "before" else BatchDrafts(args.k, adaptive=adaptive)
        if workload == "miss":
            spec.lookup = PromptLookup(args.k, args.miss_ngram, args.miss_ngram)
        return BatchEngine(model, spec=spec), spec

    results = defaultdict(list)
    variants = ["plain", "before", "fixed-k", "adaptive"]
    for R in [int(x) for x in args.rows.split(",")]:
        for workload in ("miss", "hits"):
            ids, engines = {}, {v: make(v, workload) for v in variants}  # one engine a variant: traced once
            for rep in range(args.reps + 1):  # pass 0 traces the shapes it meets: not counted
                rng = np.random.default_rng(rep)
                reqs = [(i, rng.integers(3, n_vocab, size=args.prompt).tolist(), greedy, args.gen)
                        for i in range(R)]
                for v in variants:
                    eng, spec = engines[v]
                    before_counts = (dict(getattr(spec, "steps", {})), list(spec.total)) if spec else None
                    eng.add_many(reqs)
                    mx.synchronize()
                    out = {i: [] for i in range(R)}
                    t, c = time.perf_counter(), time.process_time()
                    while eng.rows:
                        for rid, got in eng.step().items():
                            out[rid] += got if isinstance(got, list) else [got]
                            if len(out[rid]) >= args.gen:
                                eng.remove(rid)
                    wall, cpu = time.perf_counter() - t, time.process_time() - c
                    got = {rid: x[: args.gen] for rid, x in out.items()}
                    assert ids.setdefault(rep, got) == got, f"{v}: ids differ from plain"
                    if rep:
                        rec = {"tok_s": R * args.gen / wall, "cpu_ms": 1e3 * cpu / (R * args.gen)}
                        if spec is not None:  # this pass's counts
                            steps0, total0 = before_counts
                            rec.update(steps={k: n - steps0[k] for k, n in getattr(spec, "steps", {}).items()},
                                       drafted=spec.total[1] - total0[1], accepted=spec.total[2] - total0[2])
                        results[(R, workload, v)].append(rec)
    for (R, workload, v), recs in results.items():
        tok_s = [r["tok_s"] for r in recs]
        base = [r["tok_s"] for r in results[(R, workload, "plain")]]
        cpu = [r["cpu_ms"] for r in recs]
        cbase = [r["cpu_ms"] for r in results[(R, workload, "plain")]]
        rec = {"rows": R, "workload": workload, "variant": v, "tok_s": round(float(np.median(tok_s)), 1),
               "vs_plain": round(float(np.median([a / b for a, b in zip(tok_s, base)])), 3),
               "cpu_ms": round(float(np.median(cpu)), 3),
               "cpu_vs_plain": round(float(np.median([a / b for a, b in zip(cpu, cbase)])), 3),
               "tok_s_reps": [round(x, 1) for x in tok_s]}
        if "drafted" in recs[-1]:
            rec.update(drafted=recs[-1]["drafted"], accepted=recs[-1]["accepted"], steps=recs[-1]["steps"])
        print(json.dumps(rec) if args.json else "  ".join(f"{k} {x}" for k, x in rec.items()), flush=True)


if __name__ == "__main__":
    main()
