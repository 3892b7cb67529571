"""A 4-bit MoE's first and second run on one GPU, ours against mlx-lm, each
in fresh processes with its own empty kernel caches (issue 42: "a first
run's time to first token no more than mlx-lm's, and a second run's under
5 s").

    python benchmarks/moe_first_run.py build /tmp/ckpt/qwen3moe-4bit     # once: the checkpoint
    python benchmarks/moe_first_run.py all /tmp/ckpt/qwen3moe-4bit [--runs 2] [--json out.jsonl]
    python benchmarks/moe_first_run.py all /tmp/ckpt/qwen3moe-4bit --prompt 4096 --impls ours,ours-gathered,mlx-lm
    python benchmarks/moe_first_run.py kernels /tmp/ckpt/qwen3moe-4bit --prompt 4096   # each form's own kernels

`build` writes issue 42's qwen3_moe shape (moe_decode.py's: hidden 2048, 16
layers, 128 experts top-8, moe_intermediate 768; random bf16 weights, the
same arrays both sides) as mlx-lm's model quantized to 4 bits, group 64
(what `mlx_lm.convert -q` writes: experts stacked as `switch_mlp`), so both
load one file. `all` runs, per implementation, `--runs` fresh processes one
after another, the first with empty caches (MLX's compiled kernels,
MLX_PTX_CACHE_DIR, and the CUDA driver's, CUDA_CACHE_PATH: a directory of
its own per implementation), the later ones reusing them. Each process
reports (JSON line): import_s, load_s (weights read and evaluated),
ttft_s (a `--prompt`-token prompt, 128 by default, submitted to its first
id read: prefill, first decode step and every kernel they compile) and
decode tok/s of the next 64, and the kernel files in its cache with the
seconds after the process started that each was written (the gaps are
compiles; ours' include those engine/warmup.py's helper published).
"ours-gathered" is ours with the quantized experts' prefill kept gathered
(no grouped form however long the prompt: what a long prompt's first run
costs for the grouped form's kernels).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

T_START = time.perf_counter()
HERE = Path(__file__).resolve().parent
PROMPT, GEN = 128, 64


def build(out: Path) -> None:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    sys.path.insert(0, str(HERE.parent))
    sys.path.insert(0, str(HERE))
    import gpu_compare as G
    import moe_decode as M

    a = argparse.Namespace(family="qwen3_moe", layers=16, hidden=2048, experts=128, top_k=8, moe_intermediate=768,
                           small=False)
    cfg = M.shape(a)
    ours, weights = G.build_ours(cfg)
    lm = G.build_mlx_lm(cfg, weights)
    del ours, weights
    nn.quantize(lm, group_size=64, bits=4)
    weights = dict(tree_flatten(lm.parameters()))
    mx.eval(weights)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3MoeForCausalLM"],
                                                 "quantization": {"group_size": 64, "bits": 4}}, indent=1))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(HERE.parent / "models" / "gemma3-tiny" / f, out / f)
    print(f"wrote {out}: {sum(v.nbytes for v in weights.values()) / 1e9:.2f} GB", file=sys.stderr)


def one(impl: str, path: Path, prompt: int = PROMPT) -> dict:
    """This process: import, load, first id of a `prompt`-token prompt, 64 more."""
    import mlx.core as mx
    import numpy as np

    ids = np.random.default_rng(0).integers(3, 4000, prompt).tolist()
    if impl.startswith("ours"):
        from mlxcel_dist.checkpoint.loader import load_model
        from mlxcel_dist.engine import warmup
        from mlxcel_dist.engine.generation import Generation
        from mlxcel_dist.nn import experts

        if impl == "ours-gathered":
            experts.QUANT_GROUP_PER_EXPERT = 1 << 30

        t_import = time.perf_counter()
        warmup.start(str(path))  # as the CLI's load does: the decode's kernels compiled beside it on a fresh machine
        model = load_model(str(path)).model
        mx.eval(model.parameters())
        t_load = time.perf_counter()
        stamps = []
        gen = Generation(model, ids, GEN + 1)
        for _ in gen:
            stamps.append(time.perf_counter())
        gen.finish()
    else:
        from mlx_lm.generate import generate_step
        from mlx_lm.utils import load_model as lm_load

        t_import = time.perf_counter()
        model = lm_load(path)[0]
        mx.eval(model.parameters())
        t_load = time.perf_counter()
        stamps = []
        for _ in generate_step(mx.array(ids), model, max_tokens=GEN + 1):
            stamps.append(time.perf_counter())
    return {"impl": impl, "prompt": prompt, "import_s": round(t_import - T_START, 2), "load_s": round(t_load - t_import, 2),
            "ttft_s": round(stamps[0] - t_load, 2),
            "decode_tok_s": round(GEN / (stamps[-1] - stamps[0]), 1) if len(stamps) > 1 else None}


def kernels(form: str, path: Path, prompt: int) -> dict:
    """This process (empty kernel caches): one MoE block of the model over
    `prompt` random tokens in expert form `form` (gathered, grouped), timed
    cold and warm; the kernel files MLX wrote (its PTX cache) listed."""
    import mlx.core as mx

    from mlxcel_dist.checkpoint.loader import load_model
    from mlxcel_dist.nn import experts

    experts.QUANT_GROUP_PER_EXPERT = 1 << 30 if form == "gathered" else 1
    model = load_model(str(path)).model
    mlp = model.model.layers[1].mlp
    x = (mx.random.normal((1, prompt, model.args.hidden_size)) * 0.1).astype(mx.bfloat16)
    mx.eval(x, mlp.parameters())
    cache = Path(os.environ["MLX_PTX_CACHE_DIR"])
    before = set(cache.rglob("*")) if cache.exists() else set()
    times = []
    for _ in range(2):
        t = time.perf_counter()
        mx.eval(mlp(x))
        times.append(round(time.perf_counter() - t, 2))
    new = sorted(str(p.relative_to(cache)) for p in set(cache.rglob("*")) - before if p.is_file())
    return {"form": form, "prompt": prompt, "cold_s": times[0], "warm_s": times[1], "kernels": new}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["build", "all", "kernels", "one-ours", "one-ours-gathered", "one-mlx-lm",
                                     "kernels-gathered", "kernels-grouped"])
    ap.add_argument("path", type=Path)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--prompt", type=int, default=PROMPT, help="prompt tokens")
    ap.add_argument("--impls", default="ours,mlx-lm", help="comma-separated: ours, ours-gathered, mlx-lm")
    a = ap.parse_args()
    if a.what == "build":
        return build(a.path)
    if a.what.startswith("kernels-"):
        print(json.dumps(kernels(a.what[8:], a.path, a.prompt)), flush=True)
        return
    if a.what.startswith("one-"):
        print(json.dumps(one(a.what[4:], a.path, a.prompt)), flush=True)
        return
    if a.what == "kernels":  # each form in a fresh process with its own empty caches
        for form in ("gathered", "grouped"):
            _fresh(a, f"kernels-{form}", {"form": form})
        return
    for impl in a.impls.split(","):
        for run in range(a.runs):  # the first with empty caches, the later ones reusing them
            _fresh(a, f"one-{impl}", {"impl": impl, "run": run}, keep=run > 0)


def _fresh(a, what: str, tags: dict, keep: bool = False) -> None:
    """`what` of this script in a new process with kernel caches of its own
    (emptied first unless `keep`); its JSON row (with `tags`) printed and
    appended to --json."""
    caches = Path(f"/tmp/first-run-{what.split('-', 1)[1]}")
    if not keep:
        shutil.rmtree(caches, ignore_errors=True)
    env = {**os.environ, "MLX_PTX_CACHE_DIR": str(caches / "ptx"), "CUDA_CACHE_PATH": str(caches / "nv"),
           "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    t0 = time.time()
    out = subprocess.run([sys.executable, __file__, what, str(a.path), "--prompt", str(a.prompt)],
                         env=env, text=True, capture_output=True)
    rows = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    row = {**rows[-1], **tags} if rows else {**tags, "error": out.stderr[-800:]}
    ptx = caches / "ptx"
    if ptx.exists() and what.startswith("one-"):  # the kernels MLX has compiled so far for this implementation
        # each file's name and when it was written, seconds after the process started: compiles are the gaps
        row["kernels"] = sorted((round(p.stat().st_mtime - t0, 1), p.name[:60]) for p in ptx.rglob("*.ptx"))
    print(json.dumps(row), flush=True)
    if a.json:
        with a.json.open("a") as f:
            f.write(json.dumps(row) + "\n")

if __name__ == "__main__":
    main()
