"""mlx-lm (single process) vs mlxcel-dist at np 1 and np 2, on one checkpoint.

    python benchmarks/compare_mlx_lm.py                     # builds the ~200M bf16 gemma3 (cached)
    python benchmarks/compare_mlx_lm.py --model DIR --trials 3 --json out.json
    python benchmarks/compare_mlx_lm.py --backends mpi      # skip the ring

Without --model it writes a random-weight bf16 gemma3 of ~204M parameters
(hidden 1024, 12 layers in gemma3's 5 sliding : 1 full pattern, sliding
window 512, 8 q / 4 KV heads of 128, MLP 3584, vocab 32768, tied embeddings:
16.5% of the weights) with benchmarks/random_ckpt.py under
$MLXCEL_BENCH_CACHE or the system temp dir (reused; never committed).

Every run is a fresh process on the same prompt: the same seeded random
token ids (`mlxcel_dist.bench.prompt_ids`), `--prompt-tokens` of them (128),
then `--gen-tokens` (48) greedy tokens, EOS ignored; one short untimed
generation first, then the peak-memory counter is reset:

- mlx-lm: `mlx_lm.load` + `mlx_lm.generate.generate_step` (its default greedy
  sampler, prefill step = ours), in a subprocess of this script;
- ours: `mlxcel-dist bench MODEL --np N --backend B --json`.

Trials are interleaved (mlx-lm, np 1, np 2 mpi, np 2 ring, then again) so
that load from elsewhere on a shared machine hits all alike; the table shows
medians (with the range over trials), and ratios are taken within each trial
(runs back to back), then their median and range. "other load" is the CPU (in cores) that processes outside the run
used during it (from /proc/stat, minus the run's own CPU time): on a 2-core
machine anything above ~0.1 distorts the np 2 numbers most.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


def mlx_lm_worker(model: str, prompt_tokens: int, gen_tokens: int, seed: int, prefill_step: int) -> None:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    from mlxcel_dist.bench import prompt_ids

    t0 = time.perf_counter()
    m, _ = load(model)
    load_s = time.perf_counter() - t0
    weights = mx.get_active_memory() / 1e9
    text = getattr(m.args, "text_config", None)  # a multimodal wrapper's (llama4): its text model's vocabulary
    vocab = getattr(m.args, "vocab_size", None) or (text["vocab_size"] if isinstance(text, dict) else text.vocab_size)
    ids = prompt_ids(vocab, prompt_tokens, seed)
    for _ in generate_step(mx.array(ids[: min(prompt_tokens, 32)]), m, max_tokens=min(gen_tokens, 4),
                           prefill_step_size=prefill_step):
        pass
    mx.synchronize()
    mx.reset_peak_memory()
    toks = []
    t0 = time.perf_counter()
    for tok, _ in generate_step(mx.array(ids), m, max_tokens=gen_tokens, prefill_step_size=prefill_step):
        if not toks:
            t1 = time.perf_counter()
        toks.append(tok)
    t2 = time.perf_counter()
    mx.synchronize()
    n = len(toks)
    print(json.dumps({
        "np": 1, "backend": "none", "load_s": load_s, "prompt_tokens": prompt_tokens, "gen_tokens": n,
        "prefill_tok_s": prompt_tokens / (t1 - t0), "ttft_s": t1 - t0,
        "decode_tok_s": (n - 1) / (t2 - t1) if n > 1 else 0.0,
        "decode_ms_per_token": 1e3 * (t2 - t1) / (n - 1) if n > 1 else 0.0,
        "peak_mem_gb": mx.get_peak_memory() / 1e9, "weights_gb": weights,
        "all_sums_per_token": 0,
    }), flush=True)


def _busy_jiffies():
    try:
        f = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    v = [int(x) for x in f]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return sum(v[:8]) - idle


def _run(argv: list[str], timeout: float) -> dict:
    hz = os.sysconf("SC_CLK_TCK")
    b0 = _busy_jiffies()
    c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    b1 = _busy_jiffies()
    if p.returncode != 0:
        raise SystemExit(f"failed ({p.returncode}): {' '.join(argv)}\n{p.stdout}\n{p.stderr}")
    row = json.loads(p.stdout.strip().splitlines()[-1])
    own = (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime)
    row["other_load"] = max(0.0, ((b1 - b0) / hz - own) / wall) if b0 is not None else None
    row["wall_s"] = wall
    return row


def machine() -> dict:
    info = {"nproc": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        info["cpu"] = platform.processor()
    try:
        import mlx.core as mx

        info["mlx"] = mx.__version__
    except ImportError:
        pass
    try:
        from importlib.metadata import version

        info["mlx_lm"] = version("mlx-lm")
    except Exception:
        pass
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                                        text=True).stdout.strip()
    except OSError:
        pass
    info["date"] = time.strftime("%Y-%m-%d %H:%M %Z")
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint directory (default: build the ~200M random bf16 gemma3)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=48)
    ap.add_argument("--prefill-step", type=int, default=2048, help="both sides (mlx-lm's default and ours)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--backends", default="mpi,ring", help="np 2 backends (comma-separated)")
    ap.add_argument("--np", type=int, default=2, help="rank count of the TP runs")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", help="write every run and the summary here")
    ap.add_argument("--mlx-lm-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.mlx_lm_worker:
        mlx_lm_worker(args.model, args.prompt_tokens, args.gen_tokens, args.seed, args.prefill_step)
        return 0

    try:
        import mlx_lm  # noqa: F401
    except ImportError:
        print("mlx-lm is not installed: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    if args.model:
        model = Path(args.model)
    else:
        from random_ckpt import BENCH_200M, gemma3_checkpoint, gemma3_config, n_params

        model = gemma3_checkpoint(**BENCH_200M)
        total, emb = n_params(gemma3_config(**BENCH_200M))
        print(f"model: {model} ({total / 1e6:.1f}M parameters, embeddings {emb / total:.1%}, bf16)", file=sys.stderr)

    common = ["--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens),
              "--prefill-step", str(args.prefill_step), "--seed", str(args.seed)]
    cli = [sys.executable, "-m", "mlxcel_dist.cli", "bench", str(model), "--json", *common]
    configs = [("mlx-lm", [sys.executable, __file__, "--mlx-lm-worker", "--model", str(model), *common]),
               ("ours np1", [*cli, "--np", "1"])]
    for b in [b for b in args.backends.split(",") if b]:
        configs.append((f"ours np{args.np} {b}", [*cli, "--np", str(args.np), "--backend", b]))

    runs: dict[str, list[dict]] = {name: [] for name, _ in configs}
    for t in range(args.trials):
        for name, argv in configs:
            row = _run(argv, args.timeout)
            runs[name].append(row)
            print(f"  trial {t + 1}/{args.trials} {name:14} decode {row['decode_tok_s']:.2f} tok/s, "
                  f"ttft {row['ttft_s']:.2f} s, other load {row['other_load'] or 0:.2f}", file=sys.stderr)

    def med(name, key):
        vals = [r[key] for r in runs[name] if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    info = machine()
    print(f"\nmachine: {info.get('cpu')}, nproc {info['nproc']}; mlx {info.get('mlx')}, mlx-lm {info.get('mlx_lm')}; "
          f"commit {info.get('commit')}; {info['date']}")
    print(f"model: {model}; prompt {args.prompt_tokens} tokens, {args.gen_tokens} generated (greedy), "
          f"prefill step {args.prefill_step}; median of {args.trials} trial(s)\n")
    cols = ("prefill tok/s", "TTFT s", "decode tok/s", "ms/token", "peak GB", "all_sums/tok", "other load")
    keys = ("prefill_tok_s", "ttft_s", "decode_tok_s", "decode_ms_per_token", "peak_mem_gb", "all_sums_per_token",
            "other_load")
    fmts = (".1f", ".2f", ".2f", ".1f", ".3f", "g", ".2f")
    print("| run | " + " | ".join(cols) + " |")
    print("| --- |" + " ---: |" * len(cols))
    summary = {}
    for name, _ in configs:
        vals = {k: med(name, k) for k in keys}
        summary[name] = vals
        cells = []
        for k, f in zip(keys, fmts):
            if vals[k] is None:
                cells.append("-")
                continue
            cell = format(vals[k], f)
            if k in ("prefill_tok_s", "decode_tok_s") and args.trials > 1:
                xs = [r[k] for r in runs[name]]
                cell += f" ({format(min(xs), f)}-{format(max(xs), f)})"
            cells.append(cell)
        print(f"| {name} | " + " | ".join(cells) + " |")

    # Ratios within each trial (the runs of one trial ran back to back), then
    # their median and range over trials.
    def paired(a, b, key):
        xs = [ra[key] / rb[key] for ra, rb in zip(runs[a], runs[b])]
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}

    tp = [n for n, _ in configs if n.startswith(f"ours np{args.np}")]
    ratios = {"ours np1 / mlx-lm decode": paired("ours np1", "mlx-lm", "decode_tok_s"),
              "ours np1 / mlx-lm prefill": paired("ours np1", "mlx-lm", "prefill_tok_s"),
              "ours np1 / mlx-lm peak memory": paired("ours np1", "mlx-lm", "peak_mem_gb")}
    if tp:
        best = max(tp, key=lambda n: summary[n]["decode_tok_s"])
        for key, what in (("decode_tok_s", "decode"), ("prefill_tok_s", "prefill"), ("peak_mem_gb", "peak memory")):
            ratios[f"{best} / ours np1 {what}"] = paired(best, "ours np1", key)
    print(f"\nratios (per trial, median and range over {args.trials} trial(s)):")
    for k, v in ratios.items():
        print(f"{k}: {v['median']:.2f}x ({v['min']:.2f}-{v['max']:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "model": str(model), "args": vars(args),
                                               "runs": runs, "median": summary, "ratios": ratios}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
