"""4-bit MoE decode and prefill per family: mlx-lm 0.32 vs mlxcel-dist at np 1
and np 2 (both --moe-split placements), on the same mlx_lm.convert -q file.

usage: python benchmarks/moe_families.py [--families qwen3_moe,glm4_moe,minimax_m2,llama4,deepseek_v3]
                                          [--trials 2] [--prompt-tokens 128] [--gen-tokens 32] [--json out.json]

Per family a random checkpoint (never committed) under $MLXCEL_BENCH_CACHE or
/tmp/mlxcel-bench: transformers 5 builds the model from a transformers-4
config (CONFIGS; 40-70M parameters, bf16, its own random init: MLX's CPU
quantized kernels make larger ones minutes a run on a shared 2-core box), saves it,
the config is the transformers-4 form mlx-lm reads (llama4 as the multimodal
wrapper, weights under `language_model.`, as mlx-lm wants it), and
`mlx_lm.convert(quantize=True, q_bits=4, q_group_size=64)` writes the file
both sides load. Then, per trial and in this order, each a fresh process on
the same seeded prompt (compare_mlx_lm.py's runs): mlx-lm, ours np 1, ours
np 2 (MPI) --moe-split intermediate, ours np 2 --moe-split experts. Ratios
are taken within a trial (back-to-back runs), then their median and range;
the load average is printed at each trial's start (a shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from compare_mlx_lm import _run, machine  # noqa: E402
from random_ckpt import ROOT, cache_dir  # noqa: E402

_COMMON = dict(vocab_size=8192, hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
               rms_norm_eps=1e-6, max_position_embeddings=8192, tie_word_embeddings=False, hidden_act="silu",
               bos_token_id=2, eos_token_id=1, pad_token_id=0, torch_dtype="bfloat16", rope_scaling=None)
CONFIGS = {  # transformers-4 forms (what mlx-lm reads); 32 experts top-4 unless said
    "qwen3_moe": dict(_COMMON, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_hidden_layers=4,
                      intermediate_size=1024, moe_intermediate_size=256, num_experts=32, num_experts_per_tok=4,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1_000_000.0,
                      use_sliding_window=False, sliding_window=None),
    "glm4_moe": dict(_COMMON, architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", num_hidden_layers=4,
                     intermediate_size=1024, moe_intermediate_size=256, n_routed_experts=32, num_experts_per_tok=4,
                     n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True,
                     routed_scaling_factor=2.5, partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True,
                     rope_theta=1_000_000.0, num_nextn_predict_layers=0),
    "minimax_m2": dict(_COMMON, architectures=["MiniMaxM2ForCausalLM"], model_type="minimax_m2", num_hidden_layers=4,
                       intermediate_size=256, num_local_experts=32, num_experts_per_tok=4, rotary_dim=32,
                       rope_theta=5_000_000.0, shared_intermediate_size=0),
    "llama4": dict(_COMMON, architectures=["Llama4ForCausalLM"], model_type="llama4_text", num_hidden_layers=4,
                   intermediate_size=512, intermediate_size_mlp=1024, num_local_experts=16, num_experts_per_tok=1,
                   interleave_moe_layer_step=2, attention_chunk_size=8192, no_rope_layer_interval=4,
                   no_rope_layers=[], use_qk_norm=True, attn_temperature_tuning=True, floor_scale=8192,
                   attn_scale=0.1, rope_theta=500_000.0, rms_norm_eps=1e-5, attention_bias=False),  # 16 experts top-1 (Scout's)
    # kv_lora_rank 96, not a multiple of 64: mlx_lm.convert then leaves embed_q / unembed_out (kv_b_proj's
    # split) unquantized; our loader does not read them quantized yet (an mlx-community DeepSeek 4-bit has them so)
    "deepseek_v3": dict(_COMMON, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
                        num_hidden_layers=4, num_key_value_heads=8, intermediate_size=1024,
                        moe_intermediate_size=256, n_routed_experts=32, num_experts_per_tok=4, n_group=4,
                        topk_group=2, n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True,
                        routed_scaling_factor=2.5, q_lora_rank=256, kv_lora_rank=96, qk_nope_head_dim=32,
                        qk_rope_head_dim=32, v_head_dim=32, rope_theta=10_000.0, rope_interleave=True, attention_bias=False,
                        num_nextn_predict_layers=0),
}
# a DeepSeek-V3-shaped model big enough for a GPU's step to be more than host time (~2.3B parameters, 1.3 GB
# at 4 bits): kv_lora 512 as the real one (whole groups: mlx_lm.convert quantizes embed_q / unembed_out)
CONFIGS["deepseek_v3_h200"] = dict(
    CONFIGS["deepseek_v3"], vocab_size=32768, hidden_size=2048, num_hidden_layers=8, num_attention_heads=16,
    num_key_value_heads=16, intermediate_size=4096, moe_intermediate_size=768, n_routed_experts=64,
    num_experts_per_tok=8, n_group=8, topk_group=4, q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128)
CPU_FAMILIES = ("qwen3_moe", "glm4_moe", "minimax_m2", "llama4", "deepseek_v3")


def checkpoint(family: str) -> Path:
    """The family's mlx_lm.convert -q checkpoint (built once, reused while CONFIGS[family] is unchanged)."""
    cfg = CONFIGS[family]
    out = cache_dir() / f"moe4-{family}"
    stamp = out / "source_config.json"
    if stamp.exists() and json.loads(stamp.read_text()) == cfg:
        return out
    import mlx.core as mx
    import torch
    from mlx_lm.convert import convert
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = cache_dir() / f"moe4-{family}-hf"
    shutil.rmtree(hf, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    torch.manual_seed(0)
    kw = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg["model_type"], **kw), dtype=torch.bfloat16)
    model.save_pretrained(hf, safe_serialization=True)
    del model
    hub = dict(cfg)
    if cfg["model_type"] == "llama4_text":  # mlx-lm's llama4 is the multimodal wrapper (its llama4_text has no MoE)
        hub = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "text_config": cfg,
               "vision_config": {}, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
        for f in hf.glob("*.safetensors"):
            w = mx.load(str(f))
            mx.save_safetensors(str(f), {f"language_model.{k}": v for k, v in w.items()}, metadata={"format": "pt"})
        idx = hf / "model.safetensors.index.json"
        if idx.exists():
            j = json.loads(idx.read_text())
            j["weight_map"] = {f"language_model.{k}": v for k, v in j["weight_map"].items()}
            idx.write_text(json.dumps(j))
    (hf / "config.json").write_text(json.dumps(hub, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "models" / "gemma3-tiny" / f, hf / f)
    convert(str(hf), str(out), quantize=True, q_bits=4, q_group_size=64)
    shutil.rmtree(hf)
    stamp.write_text(json.dumps(cfg))
    return out


def size_mb(d: Path) -> float:
    return sum(p.stat().st_size for p in d.glob("*.safetensors")) / 1e6


def bench_family(family: str, a) -> dict:
    model = checkpoint(family)
    common = ["--prompt-tokens", str(a.prompt_tokens), "--gen-tokens", str(a.gen_tokens), "--seed", "0"]
    cli = [sys.executable, "-m", "mlxcel_dist.cli", "bench", str(model), "--json", *common]
    configs = [("mlx-lm", [sys.executable, str(HERE / "compare_mlx_lm.py"), "--mlx-lm-worker", "--model", str(model),
                           *common, "--prefill-step", "2048"]),
               ("ours np1", [*cli, "--np", "1"]),
               ("ours np2 intermediate", [*cli, "--np", "2", "--backend", "mpi", "--moe-split", "intermediate"]),
               ("ours np2 experts", [*cli, "--np", "2", "--backend", "mpi", "--moe-split", "experts"])]
    if a.np1_only:  # one GPU: two ranks would share it
        configs = configs[:2]
    runs = {name: [] for name, _ in configs}
    loads = []
    for t in range(a.trials):
        loads.append(os.getloadavg()[0])
        for name, argv in configs:
            row = _run(argv, a.timeout)
            runs[name].append(row)
            print(f"  {family} trial {t + 1}/{a.trials} {name:22} decode {row['decode_tok_s']:.2f} tok/s, prefill "
                  f"{row['prefill_tok_s']:.1f} tok/s, other load {row['other_load'] or 0:.2f}", file=sys.stderr)

    def paired(x, y, key):
        rs = [rx[key] / ry[key] for rx, ry in zip(runs[x], runs[y])]
        return statistics.median(rs), min(rs), max(rs)

    med = {n: {k: statistics.median(r[k] for r in rows) for k in ("decode_tok_s", "prefill_tok_s", "peak_mem_gb")}
           for n, rows in runs.items()}
    per_rank = {n: rows[-1].get("peak_mem_gb_per_rank") for n, rows in runs.items()}
    ratios = {
        "np1 / mlx-lm decode": paired("ours np1", "mlx-lm", "decode_tok_s"),
        "np1 / mlx-lm prefill": paired("ours np1", "mlx-lm", "prefill_tok_s"),
    } if a.np1_only else {
        "np1 / mlx-lm decode": paired("ours np1", "mlx-lm", "decode_tok_s"),
        "np1 / mlx-lm prefill": paired("ours np1", "mlx-lm", "prefill_tok_s"),
        "np2 intermediate / mlx-lm decode": paired("ours np2 intermediate", "mlx-lm", "decode_tok_s"),
        "np2 experts / mlx-lm decode": paired("ours np2 experts", "mlx-lm", "decode_tok_s"),
        "np2 experts / intermediate decode": paired("ours np2 experts", "ours np2 intermediate", "decode_tok_s"),
        "np2 experts / intermediate prefill": paired("ours np2 experts", "ours np2 intermediate", "prefill_tok_s"),
    }
    print(f"\n### {family}: {size_mb(model):.0f} MB 4-bit ({model.name}); load average at trial starts "
          f"{', '.join(f'{x:.1f}' for x in loads)}\n")
    print("| run | decode tok/s | prefill tok/s | peak GB (per rank) |")
    print("| --- | ---: | ---: | --- |")
    for n, m in med.items():
        pr = per_rank[n]
        mem = f"{m['peak_mem_gb']:.3f}" + (f" ({', '.join(f'{v:.3f}' for v in pr)})" if pr else "")
        print(f"| {n} | {m['decode_tok_s']:.2f} | {m['prefill_tok_s']:.1f} | {mem} |")
    print("\n" + "; ".join(f"{k} {v[0]:.2f}x ({v[1]:.2f}-{v[2]:.2f})" for k, v in ratios.items()), flush=True)
    return {"model": str(model), "mb": size_mb(model), "loads": loads, "runs": runs, "median": med, "ratios": ratios}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=",".join(CPU_FAMILIES), help=f"of {', '.join(CONFIGS)}")
    ap.add_argument("--np1-only", action="store_true", help="mlx-lm and ours at np 1 only (one GPU)")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--build-only", action="store_true", help="write the checkpoints and stop")
    ap.add_argument("--json", help="write every run and the summary here")
    a = ap.parse_args()
    fams = [f for f in a.families.split(",") if f]
    if a.build_only:
        for f in fams:
            print(checkpoint(f), f"{size_mb(checkpoint(f)):.0f} MB")
        return 0
    info = machine()
    print(f"machine: {info.get('cpu')}, nproc {info['nproc']}; mlx {info.get('mlx')}, mlx-lm {info.get('mlx_lm')}; "
          f"commit {info.get('commit')}; {info['date']}; prompt {a.prompt_tokens}, {a.gen_tokens} generated, "
          f"{a.trials} trial(s)")
    res, failed = {}, []
    for f in fams:
        try:
            res[f] = bench_family(f, a)
        except SystemExit as e:  # one run failed (compare_mlx_lm._run): report it, go on with the next family
            failed.append(f)
            print(f"\n### {f}: a run failed\n\n{e}", flush=True)
        if a.json:  # after every family: a later failure keeps what was measured
            Path(a.json).write_text(json.dumps({"machine": info, "args": vars(a), "families": res}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
