"""Where a constrained batch step's host time goes (issue 42): R rows under
serve_load.py's json_schema (a list of at least 40 objects: no row finishes
inside --steps) against the same rows unconstrained, on one BatchEngine.

Variants, interleaved over --reps passes (medians of each pass's median step):
  none                  no grammar
  json/<threads>/<when> the grammar; masks by llguidance's pool of that many
                        threads ("pool": llguidance's own default, 80% of the
                        CPUs; 1: one matcher after the other), computed
                        "ahead" (the engine's worker thread, from `finish`
                        until the next launch) or "inline" (in `finish`, on
                        the stepping thread: the engine before issue 42)
--host-ms X: X ms of pure-Python work between steps (the GIL held), standing
for the scheduler's per-step work (detokenizing, events) that masks computed
ahead can overlap.

Per step also the host time inside the engine's parts, timed by wrapping
them: `launch` (the forward built and started; on MLX's CPU device this
includes most of the forward), `collect` (the read; each matcher's
`advance`), `finish` (masks started, or computed inline), `_draw` (inside
launch: waits for the masks, builds the draw) and `masks` (the mask
computation itself, on whichever thread runs it). `finish` + `_draw` +
`advance` is the grammar's time on the stepping thread.

    python benchmarks/grammar_step.py [MODEL] --rows 16 --steps 32 --reps 5 [--host-ms 2] [--sampled] [--json]
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


def busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    x = 0
    while time.perf_counter() < end:
        x += 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--threads", default="1,pool", help="comma-separated: a number, or pool")
    ap.add_argument("--host-ms", type=float, default=0.0)
    ap.add_argument("--sampled", action="store_true", help="temperature 1 rows (each row's own draw)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import mlx.core as mx
    import numpy as np
    from concurrent.futures import Future

    import llguidance

    from mlxcel_dist.engine import grammar
    from mlxcel_dist.engine.batch import BatchEngine
    from mlxcel_dist.checkpoint.loader import default_model_dir, load_model
    from mlxcel_dist.engine.sampling import SamplingParams
    from mlxcel_dist.checkpoint.tokenizer import Tokenizer
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
    for name in ("launch", "collect", "finish", "_draw"):  # (the engine's steps, batch_step.Steps)
        timed(eng.steps, name, parts)
    timed(vocab, "masks", parts)
    timed(grammar.Matcher, "advance", parts)  # (the class: every row's matcher)
    ahead = vocab.masks_ahead
    executors = {t: llguidance.LLExecutor(None if t == "pool" else int(t)) for t in args.threads.split(",")}

    def inline(matchers, then=None):  # the masks on the stepping thread, as the engine computed them before
        f = Future()
        f.set_result(vocab.masks(matchers) if then is None else then(vocab.masks(matchers)))
        return f

    variants = ["none"] + [f"json/{t}/{w}" for t in executors for w in ("inline", "ahead")]
    results = defaultdict(list)
    warm = 4
    for rep in range(args.reps):
        for v in variants:
            if v != "none":
                _, t, when = v.split("/")
                vocab.threads, vocab._executor = (1 if t == "1" else 2), executors[t]
                vocab.masks_ahead = ahead if when == "ahead" else inline
            rng = np.random.default_rng(rep)
            reqs = [(i, rng.integers(3, n_vocab, size=args.prompt).tolist(), params[i], args.steps + 1,
                     None if v == "none" else schema) for i in range(args.rows)]
            eng.add_many(reqs)
            mx.synchronize()
            walls, per = [], defaultdict(list)
            for _ in range(args.steps):
                parts.clear()
                t0 = time.perf_counter()
                out = eng.step()
                busy(args.host_ms)
                walls.append(time.perf_counter() - t0)
                assert len(out) == args.rows
                for k, x in list(parts.items()):  # (the masks thread may add to it meanwhile)
                    per[k].append(x)
            for i in range(args.rows):
                eng.remove(i)
            while eng.step():
                pass
            rec = {"step_ms": 1e3 * float(np.median(walls[warm:]))}
            rec.update({k + "_ms": 1e3 * float(np.median(x[warm:])) for k, x in per.items()})
            results[v].append(rec)
    for v in variants:
        keys = sorted({k for r in results[v] for k in r}, key=lambda k: (k != "step_ms", k))
        rec = {"variant": v, "rows": args.rows, "sampled": args.sampled, "host_ms": args.host_ms,
               "reps": args.reps, **{k: round(float(np.median([r.get(k, 0.0) for r in results[v]])), 3)
                                     for k in keys}}
        rec["step_ms_reps"] = [round(r["step_ms"], 2) for r in results[v]]
        print(json.dumps(rec) if args.json else "  ".join(f"{k} {x}" for k, x in rec.items()), flush=True)


if __name__ == "__main__":
    main()
