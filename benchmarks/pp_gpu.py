"""One stream through pipeline stages (issue 41): `mlxcel-dist bench` decode and
prefill at --np 1 and at --np 2 --pp 2 by each hand-off, rounds interleaved,
medians; then what one hop and the logits' all_sum cost between the same two
processes (benchmarks/pp_handoff.py at the model's hidden size and vocabulary).

    python benchmarks/pp_gpu.py --rounds 3                 # gemma3 4B shape, bf16
    python benchmarks/pp_gpu.py --shape 12b --configs np1 pp2-send

On one GPU both stage processes share it (ring on loopback); with several
GPUs visible, `--backend nccl` gives each rank its own (the collective
hand-off: NCCL has no send/recv).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from random_ckpt import gemma3_checkpoint  # noqa: E402

SHAPES = {
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=4096, sliding_window=64),  # a smoke run
    "4b": dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
               num_key_value_heads=4, head_dim=256, vocab_size=262144, sliding_window=1024),
    "12b": dict(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
                num_key_value_heads=8, head_dim=256, vocab_size=262144, sliding_window=1024),
}
CONFIGS = {
    "np1": [],
    "pp2-send": ["--np", "2", "--pp", "2", "--pp-handoff", "send"],
    "pp2-collective": ["--np", "2", "--pp", "2", "--pp-handoff", "collective"],
    "np2": ["--np", "2"],  # tensor parallel, for comparison
}


def bench(path: str, extra: list, a) -> dict | None:
    cmd = [sys.executable, "-m", "mlxcel_dist.cli", "bench", path, "--prompt-tokens", str(a.prompt_tokens),
           "--gen-tokens", str(a.gen_tokens), "--json", *extra]
    if extra and a.backend:
        cmd += ["--backend", a.backend]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
    line = [x for x in out.stdout.splitlines() if x.startswith("{")]
    if not line:
        print("FAILED", " ".join(extra), out.stdout[-600:], out.stderr[-1500:], flush=True)
        return None
    return json.loads(line[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="4b")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--backend", default="ring")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--ckpt", default=None, help="where the random checkpoint is written (reused)")
    ap.add_argument("--handoff-iters", type=int, default=100, help="0: skip the collective timings")
    a = ap.parse_args()
    cfg = SHAPES[a.shape]
    t = time.time()
    path = str(gemma3_checkpoint(a.ckpt, **cfg))
    print(f"checkpoint {path} ({time.time() - t:.0f} s)", flush=True)
    rows = {c: [] for c in a.configs}
    for r in range(a.rounds):
        order = a.configs if r % 2 == 0 else a.configs[::-1]
        for c in order:
            j = bench(path, CONFIGS[c], a)
            if j is not None:
                rows[c].append(j)
                alone = j.get("stage_ms_per_token")
                print(r, c, round(j["decode_tok_s"], 1), "tok/s decode,", round(j["prefill_tok_s"]), "prefill",
                      f"stages alone {[round(v, 2) for v in alone]} ms, idle {j['idle_share']:.0%}" if alone else "",
                      flush=True)
    base = [j["decode_tok_s"] for j in rows.get("np1", [])]
    print("| config | decode tok/s (median) | ms/token | x np1 | prefill tok/s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for c, js in rows.items():
        if not js:
            continue
        d = statistics.median(j["decode_tok_s"] for j in js)
        p = statistics.median(j["prefill_tok_s"] for j in js)
        ratio = f"{d / statistics.median(base):.2f}" if base else "-"
        print(f"| {c} | {d:.1f} | {1000 / d:.2f} | {ratio} | {p:.0f} |")
    if a.handoff_iters:
        here = os.path.dirname(os.path.abspath(__file__))
        for width, what in ((cfg["hidden_size"], "hand-off h"), (cfg["vocab_size"], "logits row")):
            print(f"== {what}: [1, 1, {width}] float32", flush=True)
            subprocess.run([sys.executable, os.path.join(here, "pp_handoff.py"), "--np", "2", "--backends",
                            a.backend, "--hidden", str(width), "--prefill", "1", "--iters", str(a.handoff_iters)],
                           timeout=a.timeout)


if __name__ == "__main__":
    main()
