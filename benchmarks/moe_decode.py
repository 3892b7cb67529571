"""4-bit MoE on one GPU, ours against mlx-lm on the same weights, in one
process (issue 42): decode per token (median and spread), prefill by
expert-prefill form, split against whole-graph decode steps.

    python benchmarks/moe_decode.py [--family qwen3_moe|deepseek_v3] [--layers 16] [--experts 128] [--top-k 8]
                                    [--prompt 128] [--gen 128] [--reps 3] [--prefill-tokens 128,1024] [--small]

The model is issue 42's qwen3_moe shape by default (hidden 2048, 16 layers,
128 experts top-8, moe_intermediate 768, 32 q / 4 KV heads of 128, vocab
151936: 10.6B parameters), random bf16 weights (std 0.02, gpu_compare's
`build_ours`), both models `nn.quantize`d to 4 bits, group 64 (every
Linear, SwitchLinear and the embedding: what `mlx_lm.convert -q` does).
`--family deepseek_v3`: the same expert geometry (128 routed experts top-8,
moe_intermediate 768, 16 layers) as DeepSeek-V3's blocks: MLA attention (16
heads, q_lora 768, kv_lora 512, rope 64 + nope 128), sigmoid routing in 8
groups (top 4 groups), one shared expert, the first layer dense, vocab
129280 (9.9B parameters).
Rows (JSON lines):

- `logits`: ours vs mlx-lm on 64 tokens (max |diff| / max |ref|, argmax agreement);
- `prefill`: one forward of T tokens into a fresh cache, ms (median of 3
  after a warm one), ours per `experts.PREFILL` form for quantized experts
  (`--forms`: "sorted", "gather", "grouped", "by rows": the default) and mlx-lm's;
- `generate`: interleaved per rep: mlx-lm's `generate_step`, ours split
  decode steps, ours whole-graph steps (`BatchEngine.split` off: the path
  qwen3_moe took before it opted in): prefill tok/s, decode tok/s, and the
  per-token gaps (ms: median, p10, p90, max) seen by the consumer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import gpu_compare as G  # noqa: E402


def shape(a) -> dict:
    if a.family == "deepseek_v3":
        return dict(model_type="deepseek_v3", hidden_size=a.hidden, intermediate_size=8192 if not a.small else 512,
                    num_hidden_layers=a.layers, num_attention_heads=16 if not a.small else 4,
                    num_key_value_heads=16 if not a.small else 4, vocab_size=129280 if not a.small else 4096,
                    n_routed_experts=a.experts, num_experts_per_tok=a.top_k, moe_intermediate_size=a.moe_intermediate,
                    n_group=8, topk_group=4, n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True,
                    routed_scaling_factor=2.5, q_lora_rank=768 if not a.small else 64,
                    kv_lora_rank=512 if not a.small else 64, qk_nope_head_dim=128 if not a.small else 64,
                    qk_rope_head_dim=64 if not a.small else 32, v_head_dim=128 if not a.small else 64,
                    rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-6, max_position_embeddings=8192,
                    tie_word_embeddings=False, attention_bias=False, num_nextn_predict_layers=0,
                    hidden_act="silu", topk_method="noaux_tc", scoring_func="sigmoid")
    return dict(model_type="qwen3_moe", hidden_size=a.hidden, intermediate_size=6144, num_hidden_layers=a.layers,
                num_attention_heads=32 if not a.small else 4, num_key_value_heads=4 if not a.small else 2,
                head_dim=128, vocab_size=151936 if not a.small else 4096, num_experts=a.experts,
                num_experts_per_tok=a.top_k, moe_intermediate_size=a.moe_intermediate, norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                tie_word_embeddings=False, max_position_embeddings=40960, use_sliding_window=False,
                sliding_window=None)


def quantize(model):
    nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    return model


def gaps(stamps) -> dict:
    d = sorted((b - a) * 1e3 for a, b in zip(stamps, stamps[1:]))
    if not d:
        return {}
    q = lambda f: round(d[min(len(d) - 1, int(f * len(d)))], 3)  # noqa: E731
    return {"gap_ms_median": round(statistics.median(d), 3), "gap_ms_p10": q(0.1), "gap_ms_p90": q(0.9),
            "gap_ms_max": round(d[-1], 3)}


def run_mlx_lm(model, prompt, gen):
    from mlx_lm.generate import generate_step

    t0, stamps = time.perf_counter(), []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=gen, prefill_step_size=2048):
        stamps.append(time.perf_counter())
    return t0, stamps


STEPS = {}


def run_ours(model, prompt, gen, split: bool):
    from mlxcel_dist.engine.batch import BatchEngine
    from mlxcel_dist.engine.generation import Generation

    if split not in STEPS:  # one engine per step kind, kept: its traces are reused by later reps
        STEPS[split] = BatchEngine(model)
        if not split:
            STEPS[split].split = False  # the whole-graph one-row step
    t0, stamps = time.perf_counter(), []
    gen_ = Generation(model, prompt, gen, engine=STEPS[split])
    for _ in gen_:
        stamps.append(time.perf_counter())
    gen_.finish()
    return t0, stamps


def forward_ms(model, ids, make_cache, n=3):
    """(median ms of a forward of ids into a fresh cache, its last position's
    logits); n=0: the first forward's time alone (no warm-up)."""
    out = []

    def once():
        cache = make_cache()
        t = time.perf_counter()
        y = model(ids, cache)
        mx.eval(y)
        out[:] = [y[0, -1].astype(mx.float32)]
        return (time.perf_counter() - t) * 1e3

    first = once()
    return round(statistics.median(once() for _ in range(n)) if n else first, 2), out[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="qwen3_moe", choices=("qwen3_moe", "deepseek_v3"),
                    help="the blocks around the experts (the docstring gives both shapes)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--moe-intermediate", type=int, default=768)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prefill-tokens", default="128,1024")
    ap.add_argument("--forms", default="sorted,gather,grouped,by rows",
                    help="the experts.PREFILL forms timed for quantized experts per prefill length ('by rows': the default)")
    ap.add_argument("--fresh", type=int, default=0,
                    help="per prefill length and form, N forwards each on a new random prompt (new routing: "
                         "block sizes first met), ms each and kernels compiled (MLX_PTX_CACHE_DIR's new files)")
    ap.add_argument("--impls", default="mlx-lm,ours split,ours whole",
                    help="which generate rows, in this order ('ours gathered': ours split, quantized experts gathered)")
    ap.add_argument("--new-prompt", action="store_true", help="a new random prompt each generate rep after the first")
    ap.add_argument("--small", action="store_true", help="tiny heads and vocabulary (a CPU smoke run)")
    ap.add_argument("--out", default="", help="also append the rows to this file")
    a = ap.parse_args()

    def emit(row):
        print(json.dumps(row), flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")

    G._stub_transformers()
    from mlx_lm._version import __version__ as mlx_lm_version
    from mlx_lm.models.cache import make_prompt_cache

    import mlxcel_dist.nn.experts as experts
    from mlxcel_dist.engine.generation import sequence_logits

    cfg = shape(a)
    t = time.perf_counter()
    ours, weights = G.build_ours(cfg)
    n_params = sum(w.size for _, w in weights)
    theirs = G.build_mlx_lm(cfg, weights)
    del weights
    quantize(ours)
    quantize(theirs)
    mx.clear_cache()
    emit({"device": str(mx.default_device()), "mlx": mx.__version__, "mlx_lm": mlx_lm_version,
          "env": {k: v for k, v in os.environ.items() if k.startswith("MLX_")},
          "params_b": round(n_params / 1e9, 2), "build_s": round(time.perf_counter() - t, 1),
          "active_mem_gb": round(mx.get_active_memory() / 1e9, 2), "model_type": cfg["model_type"],
          "experts": a.experts, **{k: cfg[k] for k in (
              "hidden_size", "num_hidden_layers", "num_experts_per_tok", "moe_intermediate_size")}})

    prompt = mx.random.randint(0, cfg["vocab_size"], (max(a.prompt, 64),), key=mx.random.key(1)).tolist()
    import numpy as np

    lo = sequence_logits(ours, prompt[:64])
    lt = np.array(theirs(mx.array(prompt[:64])[None])[0].astype(mx.float32))
    emit({"row": "logits", "max_rel_diff": float(np.abs(lo - lt).max() / np.abs(lt).max()),
          "argmax_agree": float((lo.argmax(-1) == lt.argmax(-1)).mean())})

    was = dict(experts.PREFILL)
    for T in [int(x) for x in a.prefill_tokens.split(",") if x]:
        ids = mx.random.randint(0, cfg["vocab_size"], (1, T), key=mx.random.key(2))
        row = {"row": "prefill", "tokens": T}
        row["mlx_lm_ms"], ref = forward_ms(theirs, ids, lambda: make_prompt_cache(theirs))
        last = {}
        forms = a.forms.split(",")
        for mode in forms:
            experts.PREFILL[True] = mode
            row[f"ours_{mode.replace(' ', '_')}_ms"], last[mode] = forward_ms(ours, ids, ours.make_cache)
        base = last.get("gather", last[forms[0]])  # each form's last logits against the gathered form's
        scale = float(mx.abs(base).max())
        row.update({f"{m.replace(' ', '_')}_vs_gather": round(float(mx.abs(last[m] - base).max()) / scale, 5)
                    for m in forms if m != "gather"}, mlx_lm_vs_gather=round(float(mx.abs(ref - base).max()) / scale, 5))
        emit(row)
        for mode in forms if a.fresh else ():
            experts.PREFILL[True] = mode
            ms, kernels = [], []
            for i in range(a.fresh):
                new = mx.random.randint(0, cfg["vocab_size"], (1, T), key=mx.random.key(1000 * T + 10 * i + forms.index(mode)))
                files = G.ptx_files()
                ms.append(forward_ms(ours, new, ours.make_cache, n=0)[0])
                kernels.append(G.ptx_files() - files if files >= 0 else -1)
            emit({"row": "fresh prefill", "tokens": T, "form": mode, "ms": ms, "new_kernels": kernels})
    experts.PREFILL.update(was)

    def gathered(fn):  # ours with quantized experts gathered whatever the prefill's length (the old default)
        experts.PREFILL[True] = "gather"
        try:
            return fn()
        finally:
            experts.PREFILL.update(was)

    prompt = prompt[: a.prompt]
    for rep in range(a.reps):
        if a.new_prompt and rep:  # new routing each rep: no block sizes met before (see --fresh)
            prompt = mx.random.randint(0, cfg["vocab_size"], (a.prompt,), key=mx.random.key(100 + rep)).tolist()
        runs = {"mlx-lm": lambda: run_mlx_lm(theirs, prompt, a.gen),
                "ours split": lambda: run_ours(ours, prompt, a.gen, True),
                "ours gathered": lambda: gathered(lambda: run_ours(ours, prompt, a.gen, True)),
                "ours whole": lambda: run_ours(ours, prompt, a.gen, False)}
        for impl in a.impls.split(","):
            fn = runs[impl]
            mx.clear_cache()
            t0, stamps = fn()
            emit({"row": "generate", "rep": rep, "impl": impl, "prefill_tok_s": round(len(prompt) / (stamps[0] - t0), 1),
                  "decode_tok_s": round((len(stamps) - 1) / (stamps[-1] - stamps[0]), 2), **gaps(stamps)})
    emit({"row": "peak", "peak_mem_gb": round(mx.get_peak_memory() / 1e9, 2)})


if __name__ == "__main__":
    main()
