"""`mlxcel-dist bench` of this checkout against another's, interleaved pairs.

    python benchmarks/bench_vs.py --vs ../old-checkout [--rounds 5] [--prompt 1024] [--gen 256]
    python benchmarks/bench_vs.py --vs ../old-checkout --shape cpu --prompt 128 --gen 48 --np 2   # the CPU's

On a random gemma3-shaped bf16 checkpoint (benchmarks/random_ckpt.py; 2.6B
by default: hidden 2560, 34 layers, vocabulary 65536), each round runs both
checkouts' `bench` in fresh processes, alternating which goes first; prints
each run's (decode tok/s, prefill tok/s, time to first token, split decode)
and the per-round ratios. Used for the one engine's one-row case against
aff0c91's TokenGenerator on the H200 (docs/benchmarks.md).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from random_ckpt import BENCH_200M, gemma3_checkpoint  # noqa: E402

SHAPE = dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
             num_key_value_heads=4, head_dim=256, vocab_size=65536, sliding_window=1024)


def bench(root: Path, model: str, prompt: int, gen: int, extra=()) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "mlxcel_dist.cli", "bench", model, "--prompt-tokens", str(prompt),
                          "--gen-tokens", str(gen), "--json", *extra], env=env, capture_output=True, text=True,
                         cwd=root)
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    if not lines:
        raise SystemExit(f"{root}: bench failed\n{out.stderr[-2000:]}")
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vs", required=True, help="the other checkout's root")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--np", type=int, default=1)
    ap.add_argument("--backend", help="bench --backend (np > 1)")
    ap.add_argument("--shape", choices=["gpu", "cpu"], default="gpu",
                    help="gpu: the 2.6B gemma3 above; cpu: random_ckpt's 203.5M one (docs' CPU decode runs)")
    a = ap.parse_args()
    shape = SHAPE if a.shape == "gpu" else BENCH_200M
    model = str(gemma3_checkpoint(Path(tempfile.gettempdir()) / f"mlxcel-bench-vs-{a.shape}", **shape))
    extra = ["--np", str(a.np)] + (["--backend", a.backend] if a.backend else []) if a.np > 1 else []
    roots = {"this": HERE.parent, "vs": Path(a.vs).resolve()}
    for r in range(a.rounds):
        got = {}
        for name in (["this", "vs"] if r % 2 == 0 else ["vs", "this"]):
            j = bench(roots[name], model, a.prompt, a.gen, extra)
            got[name] = (round(j["decode_tok_s"], 1), round(j["prefill_tok_s"]), round(j["ttft_s"], 3),
                         j.get("split_decode"))
        ratio = got["this"][0] / got["vs"][0], got["this"][1] / got["vs"][1]
        print(json.dumps({"round": r, **got, "decode_ratio": round(ratio[0], 3), "prefill_ratio": round(ratio[1], 3)}),
              flush=True)


if __name__ == "__main__":
    main()
