"""`plan` for MoE against published figures and against `bench` (issue 41).

    python benchmarks/moe_plan.py published     # Qwen3-235B-A22B, two published setups
    python benchmarks/moe_plan.py bench [--rounds 3] [--base OTHER_TREE] [FIXTURE ...]

published: header-only checkpoints of Qwen3-235B-A22B (its real config:
tests/helpers/header_ckpt.py writes the header of every tensor our model
holds, bf16 and MLX 8-bit, and a hole for the data) planned for
  exo 1.0, 4 x M3 Ultra over Thunderbolt 5 RDMA (tensor parallel), 8-bit: 31.9 tok/s
      (Jeff Geerling, 2025-12, "1.5 TB of VRAM on Mac Studio - RDMA over Thunderbolt 5")
  mlx-lm pipeline, 2 x M3 Ultra, 8-bit: 17.8 tok/s (issue 41)
with the M3 Ultra's memory bandwidth (819 GB/s) and the tb5 link as inputs,
and the host time per layer, which this machine cannot measure for a Mac,
fitted on one setup and used to predict the other (both ways printed), and
with none (what the bytes alone predict); then with the host time a layer
an M3 Ultra shows in public single-Mac runs of small dense models
(M3_ULTRA_RUNS: host a layer = (1 / tok/s - bytes a token reads /
bandwidth) / (layers x plan.layer_kernel_ratio), one Qwen3-0.6B run at 819
GB/s; or bandwidth and host time both solved from the Qwen3-0.6B and
Qwen3-8B runs), scaled to a Qwen3-MoE layer by its kernel ratio, as plan
scales a measured layer; the other public runs predicted with it as a
check. Nothing in that column is fitted to the two published setups.

bench: for each MoE fixture, plan (bandwidth and host costs measured here,
--context the bench's prompt + half its generation) and `bench` (128-token
prompt, 48 tokens decoded) in turn, --rounds times each, each in a fresh
process; the medians and their ratio, and the ratio of the fastest runs
(the least disturbed by a loaded box).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "helpers"))

QWEN3_235B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "torch_dtype": "bfloat16",
    "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 94,
    "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu", "bos_token_id": 151643,
    "eos_token_id": 151645, "sliding_window": None, "use_sliding_window": False,
}
# (name, published tok/s, plan arguments)
SETUPS = [
    ("exo 4 x M3 Ultra, TB5 RDMA, tensor parallel", 31.9, dict(n=4, weights=(1, 1, 1, 1), link="tb5")),
    ("mlx-lm pipeline 2 x M3 Ultra", 17.8, dict(n=2, pp=2, link="tb5")),
]
M3_ULTRA_BW = 819e9
CONTEXT = 128  # a short prompt (the published runs' prompts were short)

QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "torch_dtype": "bfloat16", "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06, "tie_word_embeddings": True, "attention_bias": False, "hidden_act": "silu",
    "use_sliding_window": False, "sliding_window": None, "max_window_layers": 28,
}
QWEN3_8B = {**QWEN3_0_6B, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
            "num_attention_heads": 32, "tie_word_embeddings": False, "max_window_layers": 36}
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}
# Public single-Mac decode on one M3 Ultra (60-core GPU, 256 GB, 819 GB/s): Rapid-MLX's community bench
# (an MLX engine; greedy, a 512-token random prompt, 128 tokens, decode tok/s = tokens / (end - first token),
# median of 5 after 1 warm-up; mlx 0.31.2, macOS 26.5.1), mlx-community 4-bit (group 64) checkpoints:
# (name, config, tok/s, source). The first fits the host time; with the second, bandwidth and host time both.
RAPID = "https://github.com/raullenchai/Rapid-MLX/blob/main/community-benchmarks/"
M3_ULTRA_RUNS = [
    ("Qwen3-0.6B-4bit", QWEN3_0_6B, 387.64,
     RAPID + "submissions/20260617-apple-m3-ultra-qwen3-0-6b-4bit-eb0f689d7b51.json (PR #633, rapid-mlx 0.7.26)"),
    ("Qwen3-8B-4bit", QWEN3_8B, 112.89,
     RAPID + "submissions/20260617-apple-m3-ultra-qwen3-8b-4bit-e912922f4600.json (PR #636, rapid-mlx 0.7.26)"),
    ("Llama-3.1-8B-Instruct-4bit", LLAMA31_8B, 119.39,
     RAPID + "aggregated.json, submission acd2ae43768f (PR #586, rapid-mlx 0.7.9)"),
]
RUN_CONTEXT = 512 + 64  # the runs' prompt plus half their 128 tokens: the mean cached positions


def depth_ratio(config: dict, quant: dict, tmp) -> float:
    """plan.layer_kernel_ratio of `config` at its real depth, from copies of
    2 and 4 layers (the whole 94-layer MoE's graph does not fit this box's
    memory): the ratio is a + b / layers exactly where every layer is alike."""
    from header_ckpt import write_header_only

    from mlxcel_dist.checkpoint.loader import open_model
    from mlxcel_dist.plan import layer_kernel_ratio

    r = {n: layer_kernel_ratio(open_model(write_header_only(Path(tmp) / f"depth{n}", {**config, "num_hidden_layers": n},
                                                                quant))) for n in (2, 4)}
    b = 4 * (r[2] - r[4])
    return r[4] - b / 4 + b / config["num_hidden_layers"]


def m3_ultra_host(tmp) -> dict:
    """The host seconds a tiny-llama-equivalent layer (plan's unit: a model's
    layer is this x its layer_kernel_ratio) on an M3 Ultra, from
    M3_ULTRA_RUNS: "given" at 819 GB/s from the first run; "solved" with the
    bandwidth from the first two (t = reads / bw + layers x ratio x h, two
    runs, two unknowns). Prints every run's inputs and each variant's
    prediction of every run."""
    from header_ckpt import write_header_only

    from mlxcel_dist.checkpoint.loader import open_model
    from mlxcel_dist.plan import layer_kernel_ratio, make_plan

    rows = []
    for name, config, tok, _ in M3_ULTRA_RUNS:
        ck = open_model(write_header_only(Path(tmp) / name, config, {"group_size": 64, "bits": 4}))
        p = make_plan(ck, 1, bandwidth=M3_ULTRA_BW, memory=[512e9], host_token=0.0, host_layer=0.0,
                      context=RUN_CONTEXT)
        rows.append((name, p["token_s"] * M3_ULTRA_BW, config["num_hidden_layers"] * layer_kernel_ratio(ck), tok))
    (_, b0, u0, t0), (_, b1, u1, t1) = rows[0], rows[1]
    given = (1 / t0 - b0 / M3_ULTRA_BW) / u0
    inv_bw = (1 / t1 - 1 / t0 * u1 / u0) / (b1 - b0 * u1 / u0)  # eliminate h between the two runs
    solved = (1 / t0 - b0 * inv_bw) / u0
    fits = {"given": (M3_ULTRA_BW, given), "solved": (1 / inv_bw, solved)}
    for name, nbytes, units, tok in rows:
        pred = {k: 1 / (nbytes / bw + units * h) for k, (bw, h) in fits.items()}
        print(f"  {name}: reads {nbytes / 1e9:.3f} GB a token (--context {RUN_CONTEXT}), {units:.1f} llama-layer units; "
              f"published {tok} tok/s; predicted " + ", ".join(
                  f"{k} {v:.1f} ({100 * (v / tok - 1):+.0f}%)" for k, v in pred.items()))
    for k, (bw, h) in fits.items():
        print(f"  {k}: {bw / 1e9:.1f} GB/s, host {1e6 * h:.1f} us a tiny-llama layer "
              f"(a Qwen3-0.6B layer {1e6 * h * rows[0][2] / QWEN3_0_6B['num_hidden_layers']:.1f} us)")
    return fits


def published() -> None:
    from header_ckpt import write_header_only

    from mlxcel_dist.checkpoint.loader import open_model
    from mlxcel_dist.plan import make_plan

    with tempfile.TemporaryDirectory() as tmp:
        ck = open_model(write_header_only(Path(tmp) / "q8", QWEN3_235B, {"group_size": 64, "bits": 8}))
        bf16 = open_model(write_header_only(Path(tmp) / "bf16", QWEN3_235B))
        mem = [512e9] * 4
        held = sum(ck.tensor_bytes().values())
        print(f"Qwen3-235B-A22B 8-bit: {held / 1e9:.1f} GB held (bf16 {sum(bf16.tensor_bytes().values()) / 1e9:.1f} GB)")

        def plan(setup, host_layer, bandwidth=M3_ULTRA_BW):
            _, _, kw = setup
            kw = dict(kw)
            n = kw.pop("n")
            return make_plan(ck, n, bandwidth=bandwidth, memory=mem[:n], host_token=0.0, host_layer=host_layer,
                             context=CONTEXT, **kw)

        bare = [plan(s, 0.0) for s in SETUPS]
        for s, p in zip(SETUPS, bare):
            r = max(rp.reads for rp in p["ranks"])
            print(f"{s[0]}: reads {r / 1e9:.2f} GB a token on the busiest rank; bytes and links alone: "
                  f"{1e3 * p['token_s']:.2f} ms ({1 / p['token_s']:.1f} tok/s) vs published {s[1]} tok/s")
        layers = QWEN3_235B["num_hidden_layers"]
        for i, fit in enumerate(SETUPS):
            h = (1 / fit[1] - bare[i]["token_s"]) / layers  # the host seconds a layer that fit this one
            for j, other in enumerate(SETUPS):
                p = plan(other, h)
                tok = 1 / p["token_s"]
                print(f"  host {1e6 * h:.0f} us/layer (fitted on {fit[0]}): {other[0]}: {tok:.1f} tok/s, "
                      f"published {other[1]}: {100 * (tok / other[1] - 1):+.0f}%" + ("  (the fit)" if i == j else ""))
        print("host from public single-M3-Ultra runs (M3_ULTRA_RUNS):")
        for _, _, _, source in M3_ULTRA_RUNS:
            print(f"  source: {source}")
        fits = m3_ultra_host(tmp)
        ratio = depth_ratio(QWEN3_235B, {"group_size": 64, "bits": 8}, tmp)
        for k, (bw, h) in fits.items():
            layer = h * ratio
            print(f"  {k}: a Qwen3-MoE layer {ratio:.3f} tiny-llama layers: host {1e6 * layer:.1f} us/layer "
                  f"at {bw / 1e9:.1f} GB/s")
            for s in SETUPS:
                p = plan(s, layer, bw)
                tok = 1 / p["token_s"]
                print(f"    {s[0]}: {tok:.1f} tok/s, published {s[1]}: {100 * (tok / s[1] - 1):+.0f}%")


def _median_run(cmd, key, rounds, env=None, cwd=ROOT):
    out = []
    for _ in range(rounds):
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env)
        if p.returncode != 0:
            raise SystemExit(f"{cmd}: {p.stderr[-1000:]}")
        out.append(json.loads(p.stdout.strip().splitlines()[-1])[key])
    return statistics.median(out), out


PLAN_CODE = """
import json, sys
from mlxcel_dist.checkpoint.loader import open_model
from mlxcel_dist.plan import make_plan
p = make_plan(open_model(sys.argv[1]), 1, context=int(sys.argv[2]))
print(json.dumps({"ms": 1e3 * p["token_s"], "host": p["host"], "bw": p["bandwidth"]}))
"""


def bench(fixtures, rounds, base=None) -> None:
    """`base`: another tree's mlxcel_dist (a directory put first on
    PYTHONPATH) whose plan runs beside this one's in each round."""
    import os

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([base, os.environ.get("PYTHONPATH", "")])) if base else None
    print(f"{'fixture':28} {'plan ms':>8} {'bench ms':>8} {'ratio':>6} {'min/min':>7}"
          + (f" {'base':>6} {'ratio':>6}" if base else "")
          + "  plan runs / bench runs" + (" / base runs" if base else ""))
    for d in fixtures:
        plans, benches, bases = [], [], []
        for _ in range(rounds):  # interleaved: the box's load hits both alike
            plans.append(_median_run([sys.executable, "-c", PLAN_CODE, d, str(128 + 24)], "ms", 1)[0])
            if base:
                # run from `base`: `python -c` puts the working directory before PYTHONPATH
                bases.append(_median_run([sys.executable, "-c", PLAN_CODE, d, str(128 + 24)], "ms", 1, env, base)[0])
            benches.append(_median_run([sys.executable, "-m", "mlxcel_dist.cli", "bench", d, "--json"],
                                       "decode_ms_per_token", 1)[0])
        pm, bm = statistics.median(plans), statistics.median(benches)
        extra = f" {statistics.median(bases):6.2f} {statistics.median(bases) / bm:6.2f}" if base else ""
        print(f"{Path(d).parent.name + '/' + Path(d).name:28} {pm:8.2f} {bm:8.2f} {pm / bm:6.2f} "
              f"{min(plans) / min(benches):7.2f}{extra}  "
              f"{', '.join(f'{x:.2f}' for x in plans)} / {', '.join(f'{x:.2f}' for x in benches)}"
              + (f" / {', '.join(f'{x:.2f}' for x in bases)}" if base else ""), flush=True)


MOE_FIXTURES = ["qwen3_moe/gqa_fp32", "glm4_moe/gqa_fp32", "deepseek_v3/yarn_fp32", "deepseek_v32/yarn_fp32",
                "minimax_m2/gqa_fp32", "gpt_oss/gqa_fp32", "llama4/gqa_fp32", "step3p5/moe_fp32",
                "exaone_moe/gqa_fp32", "qwen3_next/hybrid_fp32", "qwen3_5_moe/text_fp32", "gemma4/moe_fp32"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["published", "bench"])
    ap.add_argument("fixtures", nargs="*")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--base", help="bench: also plan with this tree's mlxcel_dist (a directory for PYTHONPATH)")
    a = ap.parse_intermixed_args()
    if a.what == "published":
        published()
    else:
        bench([str(ROOT / "tests" / "fixtures" / f) for f in (a.fixtures or MOE_FIXTURES)], a.rounds, a.base)


if __name__ == "__main__":
    main()
