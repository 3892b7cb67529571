"""Ours vs mlx-lm on one GPU, in one process, on the same weights.

A gemma3-12b-shaped bf16 model with random weights is built in memory (no
24 GB file to write); mlx-lm's gemma3_text model is given the very same
arrays, so both read identical weights. For each: prefill of P prompt tokens
(tok/s) and greedy decode of G tokens (tok/s), through each project's own
generation loop (ours: mlxcel_dist.engine.generation.Generation; mlx-lm:
mlx_lm.generate.generate_step). Also the share of the HBM roofline decode
reaches (each token streams every weight once) and the NCCL backend at size 1.

    python benchmarks/gpu_compare.py [--prompt 2048] [--gen 128] [--small]
    python benchmarks/gpu_compare.py --families llama,qwen3,mistral,gemma3,gpt_oss [--out results.jsonl]

--families runs the per-family comparison in one process (8-12B shapes,
FAMILIES below), one family after the other (its weights freed before the
next); besides mlx-lm and ours it times "ours, whole-graph step" (the decode
step as one compiled graph with masked attention, as before the split step)
and measures the host time to build one decode step; for gpt_oss also
"ours, gathered experts" (prefill's experts through gather_mm, the path
before `gpt_oss.GROUP_ROWS`; --gpt-oss-group-rows N sets it, 0: off).

On a machine without transformers (the GPU box has no package registry) a
stub stands in for the one import mlx-lm's generate module makes of it; the
benchmark never tokenizes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import types

import mlx.core as mx
from mlx.utils import tree_flatten

GEMMA3_12B = dict(
    hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
    num_key_value_heads=8, head_dim=256, vocab_size=262208, sliding_window=1024,
)
SMALL = dict(
    hidden_size=512, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=8,
    num_key_value_heads=4, head_dim=64, vocab_size=32768, sliding_window=128,
)
HBM_TB_S = 4.8  # H200 peak

# 8-12B shapes per family (config.json keys; random weights)
FAMILIES = {
    "llama": dict(  # 11.3B: llama-2-13b's widths, 40 layers
        model_type="llama", hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
        num_attention_heads=40, num_key_value_heads=8, head_dim=128, vocab_size=32000, rope_theta=10000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=4096),
    "qwen3": dict(  # qwen3-8b
        model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=40960),
    "mistral": dict(  # mistral-nemo-12b
        model_type="mistral", hidden_size=5120, intermediate_size=14336, num_hidden_layers=40,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=131072, rope_theta=1000000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=131072, sliding_window=None),
    "gemma3": None,  # config(GEMMA3_12B)
    "gpt_oss": dict(  # gpt-oss-20b's layers, 12 of its 24 (10.8B total, 1.9B active per token)
        model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=12,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088, num_local_experts=32,
        num_experts_per_tok=4, experts_per_token=4, sliding_window=128, rope_theta=150000.0, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                      "truncate": False, "original_max_position_embeddings": 4096},
        layer_types=["sliding_attention", "full_attention"] * 6, attention_bias=True, swiglu_limit=7.0,
        tie_word_embeddings=False, max_position_embeddings=131072),
}


def ptx_files() -> int:
    """Kernels MLX CUDA has compiled into MLX_PTX_CACHE_DIR so far (-1: not set)."""
    d = os.environ.get("MLX_PTX_CACHE_DIR")
    return sum(len(f) for _, _, f in os.walk(d)) if d and os.path.isdir(d) else -1


def config(shape: dict) -> dict:
    return {
        "model_type": "gemma3_text", **shape,
        "rms_norm_eps": 1e-6, "query_pre_attn_scalar": shape["head_dim"], "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window_pattern": 6, "max_position_embeddings": 131072, "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None, "attn_logit_softcapping": None, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    }


def _stub_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        stub = types.ModuleType("transformers")
        for name in ("PreTrainedTokenizer", "PreTrainedTokenizerFast", "AutoTokenizer"):
            setattr(stub, name, type(name, (), {"register": staticmethod(lambda *a, **k: None)}))
        tub = types.ModuleType("transformers.tokenization_utils_base")
        tub.PreTrainedTokenizerBase = type("PreTrainedTokenizerBase", (), {})
        sys.modules["transformers"] = stub
        sys.modules["transformers.tokenization_utils_base"] = tub


def build_ours(cfg: dict):
    from mlxcel_dist.checkpoint.loader import build_model

    model = build_model(cfg)
    # random weights, std 0.02 (norm weights too: gemma's 1 + w stays near 1)
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(0), len(params))
    new = []
    for i, (name, p) in enumerate(params):
        w = (0.02 * mx.random.normal(p.shape, key=keys[i])).astype(mx.bfloat16)
        new.append((name, w))
        if i % 16 == 0:
            mx.eval([x for _, x in new[-16:]])
    model.load_weights(new)
    mx.eval(model.parameters())
    model.eval()
    return model, new


def build_mlx_lm(cfg: dict, weights):
    _stub_transformers()
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    w = dict(weights)
    if cfg["model_type"] == "gpt_oss":  # ours: x @ W experts ([E, in, out]); mlx-lm's: [E, out, in]
        w = {(k + ".weight" if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else k):
             (v.swapaxes(-1, -2) if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else v)
             for k, v in w.items()}
    model.load_weights(list(model.sanitize(w).items()))  # the same arrays: no copy (gpt_oss experts: our
    # [E, in, out] parameters are views of [E, out, in] arrays (Experts.relayout), mlx-lm's gate/up split copies)
    model.eval()
    return model


def active_params(cfg: dict, n_params: int) -> int:
    """Parameters one decoded token reads (MoE: only the top-k experts' share)."""
    if cfg.get("num_local_experts"):
        E, k = cfg["num_local_experts"], cfg["num_experts_per_tok"]
        per_expert = 3 * cfg["hidden_size"] * cfg["intermediate_size"]
        return n_params - cfg["num_hidden_layers"] * (E - k) * per_expert
    return n_params


def host_build_ms(model, prompt, split: bool, steps: int = 16) -> dict:
    """The wall time per one-row step, each evaluated before the next is
    built (BatchEngine.scores unread), on a 2048-token cache; split or the
    whole-graph step. (The host's build time alone is not separated: the
    engine builds and starts a step in one call.)"""
    from mlxcel_dist.engine.batch import BatchEngine

    e = BatchEngine(model)
    if not split:
        e.split = False

    def timed(n):
        cache = model.make_cache()
        model(mx.array(prompt[:-1])[None], cache)
        mx.eval([c.state for c in cache])
        t = time.perf_counter()
        e.scores(cache, [prompt[-1]] * n, read=False)
        return time.perf_counter() - t

    timed(2)  # trace
    synced = (timed(steps + 1) - timed(1)) / steps
    return {"host_build_ms": None, "step_ms_synced": round(synced * 1e3, 3)}


def time_ours(model, prompt, gen, prefill_step=None, compiled=True, step=None):
    from mlxcel_dist.engine.generation import Generation

    # step: the engine to run on (e.g. one whose one-row steps are whole-graph, not split)
    g = Generation(model, prompt, gen, prefill_step=prefill_step, compiled=compiled, engine=step)
    out = list(g)
    s = g.finish()
    return s.prefill_tok_s, s.decode_tok_s, out


def time_mlx_lm(model, prompt, gen):
    from mlx_lm.generate import generate_step

    t0 = time.perf_counter()
    toks = []
    t_first = None
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=gen, prefill_step_size=2048):
        if t_first is None:
            t_first = time.perf_counter()
        toks.append(int(tok))
    t1 = time.perf_counter()
    return len(prompt) / (t_first - t0), (len(toks) - 1) / (t1 - t_first), toks


def nccl_size1() -> str:
    if not mx.distributed.is_available("nccl"):
        return "nccl backend not in this mlx build"
    os.environ.update(MLX_RANK="0", MLX_WORLD_SIZE="1", NCCL_HOST_IP="127.0.0.1", NCCL_PORT="12355")
    try:
        g = mx.distributed.init(strict=True, backend="nccl")
        s = mx.distributed.all_sum(mx.arange(4, dtype=mx.float32), group=g)
        mx.eval(s)
        return f"nccl size {g.size()} all_sum ok: {s.tolist()}"
    except Exception as e:  # noqa: BLE001 - report, don't die
        return f"nccl failed: {type(e).__name__}: {e}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--nccl", action="store_true")
    ap.add_argument("--cross", action="store_true")
    ap.add_argument("--our-prefill-step", type=int, default=0, help="also time ours with this prefill chunk")
    ap.add_argument("--eager", action="store_true", help="also time ours with eager (uncompiled) decode steps")
    ap.add_argument("--families", default="", help="comma-separated: " + ",".join(FAMILIES))
    ap.add_argument("--out", default="", help="append every row (JSON lines) to this file")
    ap.add_argument("--gpt-oss-group-rows", dest="gpt_oss_group_rows", type=int, default=None,
                    help="set gpt_oss.GROUP_ROWS for this run: prefill's experts grouped by expert (dense matmuls per "
                         "expert) from N (token, expert) rows; 0: never (gather_mm, the path before); default: as "
                         "committed")
    a = ap.parse_args()
    if a.gpt_oss_group_rows is not None:
        from mlxcel_dist.models import gpt_oss

        gpt_oss.GROUP_ROWS = a.gpt_oss_group_rows or None
    if a.families:
        return families_main(a)
    info = {"device": str(mx.default_device()), "mlx": mx.__version__, "python": platform.python_version()}
    _stub_transformers()
    try:
        import mlx_lm

        from mlx_lm._version import __version__ as mlx_lm_version

        info["mlx_lm"] = mlx_lm_version
    except Exception as e:  # noqa: BLE001
        info["mlx_lm"] = f"import failed: {e}"
    if a.nccl:
        info["nccl"] = nccl_size1()
    cfg = config(SMALL if a.small else GEMMA3_12B)
    t = time.perf_counter()
    ours, weights = build_ours(cfg)
    n_params = sum(w.size for _, w in weights)
    info["params_b"] = round(n_params / 1e9, 3)
    info["build_s"] = round(time.perf_counter() - t, 1)
    theirs = build_mlx_lm(cfg, weights)
    prompt = mx.random.randint(0, cfg["vocab_size"], (a.prompt,), key=mx.random.key(1)).tolist()

    # same logits on the same weights (bf16: expect ~1e-2 of the scale)
    from mlxcel_dist.engine.generation import sequence_logits
    import numpy as np

    short = prompt[:64]
    lo = sequence_logits(ours, short)
    lt = np.array(theirs(mx.array(short)[None])[0].astype(mx.float32))
    info["logits_max_rel_diff_vs_mlx_lm"] = float(np.abs(lo - lt).max() / np.abs(lt).max())

    rows = []
    for rep in range(a.repeat):
        runs = [("mlx-lm", time_mlx_lm, theirs), ("ours", time_ours, ours)]
        if a.our_prefill_step:
            runs.append((f"ours, prefill step {a.our_prefill_step}",
                         lambda m, p, g: time_ours(m, p, g, a.our_prefill_step), ours))
        if a.eager:
            runs.append(("ours, eager steps", lambda m, p, g: time_ours(m, p, g, compiled=False), ours))
        if a.cross:  # which half makes a difference: the model or the generation loop
            runs += [("our model, mlx-lm loop", time_mlx_lm, ours), ("mlx-lm model, our loop", time_ours, theirs)]
        for name, fn, m in runs:
            mx.clear_cache()
            pf, dc, toks = fn(m, prompt, a.gen)
            rows.append({"rep": rep, "impl": name, "prefill_tok_s": round(pf, 1), "decode_tok_s": round(dc, 2),
                         "roofline_share": round(dc * n_params * 2 / (HBM_TB_S * 1e12), 3),
                         "first_tokens": toks[:6]})
            print(json.dumps(rows[-1]), flush=True)
    info["peak_mem_gb"] = round(mx.get_peak_memory() / 1e9, 1)
    last = {r["impl"]: r for r in rows if r["rep"] == a.repeat - 1}
    info["ratio_decode"] = round(last["ours"]["decode_tok_s"] / last["mlx-lm"]["decode_tok_s"], 3)
    info["ratio_prefill"] = round(last["ours"]["prefill_tok_s"] / last["mlx-lm"]["prefill_tok_s"], 3)
    print(json.dumps(info), flush=True)


def families_main(a) -> None:
    import gc

    from mlxcel_dist.engine.batch import BatchEngine

    def emit(row):
        print(json.dumps(row), flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")

    _stub_transformers()
    from mlx_lm._version import __version__ as mlx_lm_version

    from mlxcel_dist.models import gpt_oss

    emit({"device": str(mx.default_device()), "mlx": mx.__version__, "mlx_lm": mlx_lm_version,
          "prompt": a.prompt, "gen": a.gen, "repeat": a.repeat, "gpt_oss_group_rows": gpt_oss.GROUP_ROWS})
    for fam in a.families.split(","):
        t0 = time.perf_counter()
        try:
            cfg = config(SMALL if a.small else GEMMA3_12B) if fam == "gemma3" else dict(FAMILIES[fam])
            if a.small and fam != "gemma3":
                cfg.update(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, vocab_size=4096,
                           num_attention_heads=8, num_key_value_heads=4, head_dim=64)
                if "layer_types" in cfg:
                    cfg["layer_types"] = cfg["layer_types"][:4]
            ours, weights = build_ours(cfg)
            n_params = sum(w.size for _, w in weights)
            active = active_params(cfg, n_params)
            try:
                theirs = build_mlx_lm(cfg, weights)
            except Exception as e:  # noqa: BLE001 - time ours anyway
                theirs = None
                emit({"family": fam, "mlx_lm_build_failed": f"{type(e).__name__}: {e}"[:300]})
            prompt = mx.random.randint(0, cfg["vocab_size"], (a.prompt,), key=mx.random.key(1)).tolist()
            info = {"family": fam, "params_b": round(n_params / 1e9, 3), "active_b": round(active / 1e9, 3),
                    "build_s": round(time.perf_counter() - t0, 1)}
            if theirs is not None:
                from mlxcel_dist.engine.generation import sequence_logits
                import numpy as np

                try:
                    short = prompt[:64]
                    lo = sequence_logits(ours, short)
                    lt = np.array(theirs(mx.array(short)[None])[0].astype(mx.float32))
                    info["logits_max_rel_diff_vs_mlx_lm"] = round(float(np.abs(lo - lt).max() / np.abs(lt).max()), 5)
                    info["argmax_agree"] = float((lo.argmax(-1) == lt.argmax(-1)).mean())
                except Exception as e:  # noqa: BLE001 (CPU gather_mm: fp32 only)
                    info["logits_check_failed"] = f"{type(e).__name__}: {e}"[:200]
            split_step, whole_step = BatchEngine(ours), BatchEngine(ours)
            whole_step.split = False
            from mlxcel_dist.engine.decode import splittable

            info["split_available"] = splittable(ours)
            emit(info)
            runs = [("ours", lambda m, p, g: time_ours(m, p, g, step=split_step), ours),
                    ("ours, whole-graph step", lambda m, p, g: time_ours(m, p, g, step=whole_step), ours)]
            if theirs is not None:
                runs.insert(0, ("mlx-lm", time_mlx_lm, theirs))
            if fam == "gpt_oss" and gpt_oss.GROUP_ROWS is not None:
                def gathered(m, p, g):  # the prefill path before grouping: gather_mm for every row count
                    saved, gpt_oss.GROUP_ROWS = gpt_oss.GROUP_ROWS, None
                    try:
                        return time_ours(m, p, g, step=split_step)
                    finally:
                        gpt_oss.GROUP_ROWS = saved

                runs.append(("ours, gathered experts", gathered, ours))
            rows = []
            for rep in range(a.repeat):
                for name, fn, m in runs:
                    mx.clear_cache()
                    pf, dc, toks = fn(m, prompt, a.gen)
                    row = {"family": fam, "rep": rep, "impl": name, "prefill_tok_s": round(pf, 1),
                           "decode_tok_s": round(dc, 2), "ms_per_token": round(1e3 / dc, 3) if dc else None,
                           "roofline_share": round(dc * active * 2 / (HBM_TB_S * 1e12), 3),
                           "first_tokens": toks[:6]}
                    rows.append(row)
                    emit(row)
            for split in (True, False):
                emit({"family": fam, "split": split, **host_build_ms(ours, prompt, split)})
            summ = {"family": fam, "peak_mem_gb": round(mx.get_peak_memory() / 1e9, 1),
                    "wall_s": round(time.perf_counter() - t0, 1)}
            for rep in range(1, a.repeat):  # rep 0 is the warm-up (kernel compiles)
                r = {x["impl"]: x for x in rows if x["rep"] == rep}
                for name in r:
                    if name != "ours":
                        summ[f"rep{rep} ours/{name} decode"] = round(r["ours"]["decode_tok_s"] / r[name]["decode_tok_s"], 3)
                        summ[f"rep{rep} ours/{name} prefill"] = round(r["ours"]["prefill_tok_s"] / r[name]["prefill_tok_s"], 3)
            emit(summ)
        except Exception as e:  # noqa: BLE001 - the next family still runs
            import traceback

            emit({"family": fam, "failed": traceback.format_exc()[-1500:]})
        ours = theirs = weights = split_step = whole_step = None
        gc.collect()
        mx.clear_cache()
        mx.reset_peak_memory()


if __name__ == "__main__":
    main()
