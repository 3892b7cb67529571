"""BatchEngine alone (no HTTP, no scheduler): decode throughput at R rows, and
what each new buffer shape (a retrace of the compiled step) costs.

For each row count R: R seeded random prompts admitted together
(`add_many`), then `--steps` pipelined steps, every row greedy. Per step the
wall time is recorded; a step during which the engine traced a new shape
(`BatchEngine.traces` went up) is counted apart, so "steady" is the step
rate once every shape is compiled and "first pass" what a cold server pays.
Each R runs twice on one engine per R (pass 1 cold, pass 2 warm: same shapes).

    python benchmarks/batch_engine.py MODEL --rows 1,4,16 --prompt 32 --steps 128
    python benchmarks/batch_engine.py MODEL --rows 16 --np 2 --backend nccl
    python benchmarks/batch_engine.py MODEL --count-admission 8   # primitives of one admission
    python benchmarks/batch_engine.py MODEL --rows 8 --pp 2 --micro 1,2   # stages, micro-batched or not
    python benchmarks/batch_engine.py MODEL --rows 8 --grammar none,json_schema   # constrained rows' cost

--grammar: each pass once per format, one after another on the same engine
(none: unconstrained; json_schema: every row under serve_load.py's schema, a
list of at least 40 objects, so no row finishes inside --steps); the
process's CPU seconds per token are printed beside the wall time.

At np > 1 it re-launches itself through mlxcel_dist's launcher; every rank
makes the same engine calls, rank 0 prints. One JSON line per (R, pass) with
--json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # step_primitives (--count-admission)


def run(args) -> None:
    import mlx.core as mx
    import numpy as np

    from mlxcel_dist.engine.batch import BatchEngine, slot_step
    from mlxcel_dist.parallel.distributed import init_from_env
    from mlxcel_dist.checkpoint.loader import load_model
    from mlxcel_dist.engine.sampling import SamplingParams

    group = init_from_env()
    t = time.perf_counter()
    loaded = load_model(args.model, dtype=args.dtype, group=group, pp=args.pp)
    model = loaded.model
    mx.eval(model.parameters())
    load_s = time.perf_counter() - t
    vocab = int(loaded.config.get("vocab_size") or loaded.config.get("text_config", {}).get("vocab_size"))
    say = print if group.is_root else (lambda *a, **k: None)
    say(f"{args.model}: loaded in {load_s:.1f} s on {group.size()} rank(s), {mx.default_device()}, "
        f"slot step {slot_step()}", file=sys.stderr, flush=True)
    greedy = SamplingParams(temp=0.0)
    grammars = {"none": None}
    if any(g != "none" for g in args.grammar):
        from mlxcel_dist.engine import grammar
        from mlxcel_dist.checkpoint.tokenizer import Tokenizer
        from serve_load import FORMATS

        tok = Tokenizer(loaded.model_dir, loaded.config)
        gvocab = grammar.Vocab(loaded.model_dir / "tokenizer.json", vocab, tok.eos_ids)
        grammars["json_schema"] = grammar.json_schema(FORMATS["json_schema"]["json_schema"]["schema"])
        grammars["json_object"] = grammar.json_object()
    for R, micro in [(R, m) for R in args.rows for m in (args.micro or [None])]:
        eng = BatchEngine(model, prefill_step=args.prefill_step, vocab=gvocab if len(grammars) > 1 else None)
        if micro is not None:
            eng.micro = micro
        for p, g in [(p, g) for p in (1, 2) for g in args.grammar]:
            rng = np.random.default_rng([R, p])
            reqs = [(i, rng.integers(3, vocab, size=args.prompt).tolist(), greedy, args.steps, grammars[g])
                    for i in range(R)]
            cpu0 = time.process_time()
            t0 = time.perf_counter()
            eng.add_many(reqs)
            mx.synchronize()
            prefill_s = time.perf_counter() - t0
            times, traced = [], []
            for _ in range(args.steps):
                before = eng.traces
                t1 = time.perf_counter()
                out = eng.step()
                times.append(time.perf_counter() - t1)
                traced.append(eng.traces > before)
                assert len(out) == R, (len(out), R)
            for i in range(R):
                eng.remove(i)
            while eng.step():  # drain the step in flight
                pass
            times, traced = np.array(times), np.array(traced)
            steady = times[~traced][1:]  # the first step also waits for the prefill's tail
            rec = {
                "rows": R, "pass": p, "grammar": g,
                "cpu_ms_per_token": round(1e3 * (time.process_time() - cpu0) / (R * args.steps), 3), "np": group.size(), "pp": args.pp, "micro": eng.micro, "prompt": args.prompt, "steps": args.steps,
                "slot_step": slot_step(), "prefill_s": round(prefill_s, 4),
                "total_s": round(float(times.sum()), 4), "tok_s": round(R * args.steps / float(times.sum()), 1),
                "retrace_steps": int(traced.sum()), "retrace_s": round(float(times[traced].sum()), 4),
                "steady_ms": round(1e3 * float(np.median(steady)), 2) if steady.size else None,
                "steady_tok_s": round(R / float(np.median(steady)), 1) if steady.size else None,
            }
            if args.json:
                say(json.dumps(rec), flush=True)
            else:
                say(f"R={R:3d} micro {eng.micro} pass {p} grammar {g}: {rec['tok_s']:8.1f} tok/s over {args.steps} steps "
                    f"(steady {rec['steady_ms']} ms/step = {rec['steady_tok_s']} tok/s; "
                    f"{rec['retrace_steps']} steps with a new shape took {rec['retrace_s']:.2f} s; "
                    f"prefill {prefill_s:.2f} s; CPU {rec['cpu_ms_per_token']} ms/token)", flush=True)


def count_admission(model_path: str, rows: int) -> dict:
    """Primitives of admitting `rows` prompts (10, 13, 16, ... tokens) into a
    batch that already runs one row: the lazy graph `add_many` leaves for the
    batch buffers (the prefill itself is evaluated inside add_many; this is
    the moving of each row's keys/values into its batch row, evaluated with
    the next step). On MLX CUDA each primitive costs host encode time."""
    import mlx.core as mx
    import numpy as np

    from step_primitives import VIEWS, count_graph  # the decode-step counter's graph reading
    from mlxcel_dist.engine.batch import BatchEngine
    from mlxcel_dist.checkpoint.loader import load_model
    from mlxcel_dist.engine.sampling import SamplingParams

    model = load_model(model_path).model
    greedy = SamplingParams(temp=0.0)
    rng = np.random.default_rng(0)
    vocab = model.args.vocab_size
    eng = BatchEngine(model)
    eng.add_many([(-1, rng.integers(3, vocab, 20).tolist(), greedy, 50)])
    for _ in range(3):
        eng.step()
    mx.eval(list(eng.buffers.values()))
    eng.add_many([(i, rng.integers(3, vocab, 10 + 3 * i).tolist(), greedy, 50) for i in range(rows)])
    c = count_graph(list(eng.buffers.values()), {})
    return {"rows": rows, "layers": len(model.layers), "primitives": sum(c.values()),
            "kernels": sum(v for k, v in c.items() if k not in VIEWS), "by_kind": dict(c.most_common())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--prefill-step", type=int, default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--np", type=int, default=1)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages (the job has max(--np, --pp) ranks)")
    ap.add_argument("--micro", default=None, help="comma-separated micro-batch counts to run (default: the engine's, P)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--grammar", default="none", help="comma-separated: none, json_schema, json_object")
    ap.add_argument("--count-admission", type=int, metavar="ROWS",
                    help="only count the primitives of admitting ROWS prompts into a running batch (CPU, seconds)")
    args = ap.parse_args()
    if args.count_admission:
        print(json.dumps(count_admission(args.model, args.count_admission)))
        return 0
    args.rows = [int(x) for x in args.rows.split(",")]
    args.grammar = args.grammar.split(",")
    args.micro = [int(x) for x in args.micro.split(",")] if args.micro else None
    args.np = max(args.np, args.pp)
    if args.np > 1 and not os.environ.get("MLXCEL_DIST_WORLD"):
        from mlxcel_dist.cluster.launcher import launch

        argv = [a for a in sys.argv[1:]]  # (--np is read again: the job size)
        return launch(argv, args.np, args.backend, script=__file__)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
