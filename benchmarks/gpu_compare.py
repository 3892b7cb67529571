"""Ours vs mlx-lm on one GPU, in one process, on the same weights.

A gemma3-12b-shaped bf16 model with random weights is built in memory (no
24 GB file to write); mlx-lm's gemma3_text model is given the very same
arrays, so both read identical weights. For each: prefill of P prompt tokens
(tok/s) and greedy decode of G tokens (tok/s), through each project's own
generation loop (ours: mlxcel_dist.engine.TokenGenerator; mlx-lm:
mlx_lm.generate.generate_step). Also the share of the HBM roofline decode
reaches (each token streams every weight once) and the NCCL backend at size 1.

    python benchmarks/gpu_compare.py [--prompt 2048] [--gen 128] [--small]

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
    from mlxcel_dist.loader import build_model

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
    from mlx_lm.models import gemma3_text

    args = gemma3_text.ModelArgs.from_dict(cfg)
    model = gemma3_text.Model(args)
    model.load_weights(list(model.sanitize(dict(weights)).items()))  # the same arrays: no copy
    model.eval()
    return model


def time_ours(model, prompt, gen, prefill_step=None, compiled=True):
    from mlxcel_dist.engine import TokenGenerator

    g = TokenGenerator(model, prompt, gen, prefill_step=prefill_step, compiled=compiled)
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
    a = ap.parse_args()
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
    from mlxcel_dist.engine import sequence_logits
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


if __name__ == "__main__":
    main()
