"""Where np 2's per-token time goes: decode, warm prefill and a per-step timeline.

    python benchmarks/tp_timeline.py --np 1                      # one GPU, no launcher
    python benchmarks/tp_timeline.py --np 2 --backend nccl       # two GPUs (ranks via the launcher)
    MLX_USE_CUDA_GRAPHS=0 python benchmarks/tp_timeline.py --np 2 --backend nccl --quick

A gemma3-12b-shaped bf16 model (gpu_compare.GEMMA3_12B, or --layers N of it)
with random weights is built in memory on every rank and sharded there (each
rank draws the same values for its shard's shape: timing only, the ranks
agree on every id). Each rank writes one JSON object to --out-dir/rankR.json:

- prefill_tok_s: warm prefills of --prompt tokens (generation.Generation, 1 token);
- decode_tok_s[ce]: Generation decode of --gen tokens with --check-every
  ce, ce = 1 and 0 alternated (--rounds each);
- steps (NOT PORTED: it timed decode.DecodeStep, removed with the one engine;
  "not ported" is written instead): a DecodeStep on a --prompt-token cache, --steps steps per mode:
  * build_ms: host time to build one step (Python, lazy),
  * encode_ms: host time in mx.async_eval (MLX encodes and launches the
    kernels and collectives of the step: CUDA graph build, NCCL capture),
  * wait_ms: then until the step's logits are ready (mx.eval),
  * t0/t_enc/t_done: wall-clock ns (time.time_ns: one clock for all ranks of
    one host) of each step's start, end of encode and end of wait: rank skew;
  * chained_ms: --steps steps built as one lazy chain (each fed the argmax of
    the last) and evaluated once: the device's time per step with no host
    sync between steps;
  * segments: the split step with a host sync (mx.eval) after every compiled
    segment and every attention call: per-piece wall time (launch + run +
    sync), medians over steps, and the same pieces' encode-only time;
- the same step modes with every collective replaced by a local stand-in
  (all_sum -> x, all_gather -> x repeated): "nocoll" (numbers wrong, shapes
  and every other kernel the same): the difference is what the collectives cost;
- and with the whole-graph (unsplit, masked) step: "whole".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


# gemma-3-27b's text shape (its query_pre_attn_scalar, 168, only scales q: timing is the same)
GEMMA3_27B = dict(
    hidden_size=5376, intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32,
    num_key_value_heads=16, head_dim=128, vocab_size=262208, sliding_window=1024,
)


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def build(cfg, group):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlxcel_dist.checkpoint.loader import build_model

    model = build_model(cfg)
    if not group.single:
        model.shard(group)
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(0), len(params))
    new = []
    for i, (name, p) in enumerate(params):
        new.append((name, (0.02 * mx.random.normal(p.shape, key=keys[i])).astype(mx.bfloat16)))
        if i % 16 == 0:
            mx.eval([x for _, x in new[-16:]])
    model.load_weights(new)
    mx.eval(model.parameters())
    model.eval()
    return model


def guard_cost(group, steps: int) -> dict:
    """The agreement check alone, as the decode loop runs it: its lazy all_sum
    on a ready id, async_eval (encode), then the host read (wait)."""
    import mlx.core as mx
    import numpy as np

    from mlxcel_dist.engine.guard import RankAgreement

    g = RankAgreement(group, 1)
    y = mx.array(5, mx.int32)
    mx.eval(y)
    e, w = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        rows = g.pending_rows(y)
        packed = mx.concatenate([y.reshape(1), rows.reshape(-1)])
        mx.async_eval(packed)
        t1 = time.perf_counter()
        got = np.array(packed)
        t2 = time.perf_counter()
        g.commit([5], got[1:].reshape(-1, 3))
        e.append(t1 - t0), w.append(t2 - t1)
    return {"encode_ms": 1e3 * _median(e), "wait_ms": 1e3 * _median(w)}


def guard_ab(model, prompt, gen, group, rounds, out):
    """Decode tok/s with the agreement check off (ce 0) and on (new), alternated
    (the pre-bc14032 variant, "old", is gone with the loop it patched)."""
    from mlxcel_dist.engine.guard import RankAgreement
    from mlxcel_dist.engine.generation import Generation

    res = {"ce0": [], "new": []}
    order = ["ce0", "new"]
    for r in range(rounds):
        for v in order[r % 2:] + order[: r % 2]:
            group.barrier()
            g = Generation(model, prompt, gen, group=group, check_every=0 if v == "ce0" else 1)
            list(g)
            res[v].append(round(g.finish().decode_tok_s, 2))
    out["guard_ab"] = res


def host_array_stall(reps: int = 5) -> dict:
    """Host time to make a tiny array from host data (and to async_eval an op
    on it) while the GPU is busy with ~50 ms of queued matmuls, against idle."""
    import mlx.core as mx

    n = 8192 if mx.default_device() == mx.gpu else 256  # the CPU smoke run: small
    w = (mx.random.normal((n, n)) / n**0.5).astype(mx.bfloat16)
    mx.eval(w)
    res = {}
    for busy in (False, True):
        mk, ev = [], []
        for _ in range(reps):
            if busy:
                x = w
                for _ in range(40):
                    x = x @ w
                mx.async_eval(x)
            t0 = time.perf_counter()
            a = mx.array([7, 8], mx.int64)
            t1 = time.perf_counter()
            mx.async_eval(a + 1)
            t2 = time.perf_counter()
            mx.synchronize()
            mk.append(t1 - t0), ev.append(t2 - t1)
        res["busy" if busy else "idle"] = {"make_ms": 1e3 * _median(mk), "async_eval_ms": 1e3 * _median(ev)}
    return res


def prefill_profile(model, prompt, group, reps: int = 3) -> dict:
    """A warm prefill of the prompt, one host sync after each layer's
    attention half (norm, q/k/v, attention, o_proj, all_sum, post-norm,
    residual) and each MLP half: which pieces halve at np 2 and which do not
    (medians over reps, summed per kind of layer); also one all_sum of the
    [1, L, hidden] activations alone (what each half's collective moves)."""
    import mlx.core as mx

    inner = model.model
    kinds = inner.args.layer_types
    L = len(prompt) - 1
    x = mx.array(prompt[:L])[None]
    runs = []
    for r in range(reps + 1):  # rep 0: kernels compile
        cache = model.make_cache()
        group.barrier()
        t0 = time.perf_counter()
        h = inner.embed(x)
        masks = inner.masks(L, cache)
        mx.eval(h, *[m for m in masks.values() if isinstance(m, mx.array)])
        t_embed = time.perf_counter() - t0
        att, mlp = [], []
        for layer, kind, c in zip(inner.layers, kinds, cache):
            t = time.perf_counter()
            a = layer.self_attn(layer.input_layernorm(h), masks[kind], c)
            if hasattr(layer, "post_attention_layernorm"):
                a = layer.post_attention_layernorm(a)
            h1 = h + a
            mx.eval(h1)
            t1 = time.perf_counter()
            pre = getattr(layer, "pre_feedforward_layernorm", None) or layer.post_attention_layernorm
            m = layer.mlp(pre(h1))
            post = getattr(layer, "post_feedforward_layernorm", None)
            h = h1 + (post(m) if post is not None else m)
            mx.eval(h)
            att.append(t1 - t), mlp.append(time.perf_counter() - t1)
        runs.append({"total": time.perf_counter() - t0, "embed": t_embed, "att": att, "mlp": mlp})
    runs = runs[1:]
    out = {"tokens": L, "total_ms": 1e3 * _median([r["total"] for r in runs]),
           "embed_ms": 1e3 * _median([r["embed"] for r in runs])}
    for kind in sorted(set(kinds)):
        idx = [i for i, k in enumerate(kinds) if k == kind]
        for part in ("att", "mlp"):
            out[f"{kind}_{part}_ms"] = 1e3 * _median([sum(r[part][i] for i in idx) for r in runs])
            out[f"{kind}_{part}_per_layer_ms"] = out[f"{kind}_{part}_ms"] / len(idx)
    if not group.single:
        y = mx.random.normal((1, L, inner.args.hidden_size)).astype(mx.bfloat16)
        mx.eval(y)
        ts = []
        for _ in range(8):
            group.barrier()
            t = time.perf_counter()
            mx.eval(group.all_sum(y))
            ts.append(time.perf_counter() - t)
        out["all_sum_ms"] = 1e3 * _median(ts[2:])
    return out


def decode_rounds(model, prompt, gen, group, rounds, out):
    import mlx.core as mx

    from mlxcel_dist.engine.generation import Generation

    dec = {"1": [], "0": []}
    checks = {}
    for r in range(rounds):
        for ce in (1, 0) if r % 2 == 0 else (0, 1):
            group.barrier()
            g = Generation(model, prompt, gen, group=group, check_every=ce)
            list(g)
            s = g.finish()
            dec[str(ce)].append(round(s.decode_tok_s, 2))
            checks[str(ce)] = s.checks
    out["decode_tok_s"] = dec
    out["checks"] = checks


def worker(a) -> None:
    import mlx.core as mx

    from gpu_compare import GEMMA3_12B, SMALL, config
    from mlxcel_dist.parallel.collectives import SINGLE
    from mlxcel_dist.parallel.distributed import init_from_env
    from mlxcel_dist.engine.generation import Generation

    group = init_from_env() if a.np > 1 else SINGLE
    shape = dict(SMALL if a.small else GEMMA3_27B if a.shape == "27b" else GEMMA3_12B)
    if a.layers:
        shape["num_hidden_layers"] = a.layers
    cfg = config(shape)
    t = time.perf_counter()
    model = build(cfg, group)
    out = {"np": group.size(), "rank": group.rank(), "layers": shape["num_hidden_layers"],
           "env": {k: v for k, v in os.environ.items() if k.startswith(("MLX_", "NCCL_"))},
           "mlx": mx.__version__, "build_s": round(time.perf_counter() - t, 1),
           "weights_gb": round(mx.get_active_memory() / 1e9, 2)}
    prompt = mx.random.randint(0, cfg["vocab_size"], (a.prompt,), key=mx.random.key(1)).tolist()
    t = time.perf_counter()
    g = Generation(model, prompt, 4, group=group)  # warm-up: kernels compile, traces
    list(g)
    g.finish()
    out["warmup_s"] = round(time.perf_counter() - t, 1)
    if a.guard_ab:
        out["stall"] = host_array_stall()
        guard_ab(model, prompt, a.gen, group, a.rounds, out)
        _write(a, group, out)
        return
    if a.prefill_profile:
        out["prefill_profile"] = prefill_profile(model, prompt, group)
        print(f"rank {group.rank()} prefill profile", json.dumps(out["prefill_profile"]), flush=True)
        if a.prefill_profile == "only":
            _write(a, group, out)
            return
    if not a.quick:
        pre = []
        for _ in range(a.rounds):
            group.barrier()
            g = Generation(model, prompt, 1, group=group)
            list(g)
            s = g.finish()
            pre.append(round(s.prefill_tok_s))
        out["prefill_tok_s"] = pre
    decode_rounds(model, prompt, a.gen, group, a.rounds, out)
    # the per-step timelines (split / whole / no collectives) timed decode.DecodeStep's pieces, removed
    # with the one engine (2026-12-02): not ported
    out["steps"] = "not ported"
    if group.size() > 1:
        group.barrier()
        out["guard"] = guard_cost(group, a.steps)
    _write(a, group, out)


def _write(a, group, out) -> None:
    import mlx.core as mx

    out["peak_gb"] = round(mx.get_peak_memory() / 1e9, 2)
    Path(a.out_dir).mkdir(parents=True, exist_ok=True)
    tag = a.tag or f"np{group.size()}"
    (Path(a.out_dir) / f"{tag}-rank{group.rank()}.json").write_text(json.dumps(out))
    if group.rank() == 0:
        brief = {k: v for k, v in out.items() if k not in ("split", "whole", "nocoll")}
        for m in ("split", "whole", "nocoll"):
            if m in out:
                o = out[m]
                brief[m] = {k: round(o[k], 3) for k in ("build_ms", "encode_ms", "wait_ms", "synced_ms", "chained_ms",
                                                       "chained_build_ms")}
                if "segments" in o:
                    brief[m]["seg"] = {md: {k: round(v, 3) for k, v in o["segments"][md].items() if k.endswith("_ms")
                                            and not isinstance(v, list)} for md in o["segments"]}
        print(tag, json.dumps(brief), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--backend", default="nccl")
    ap.add_argument("--layers", type=int, default=0, help="layers of the 12B shape (0: all 48)")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--small", action="store_true", help="gpu_compare.SMALL's shape (CPU smoke runs)")
    ap.add_argument("--shape", choices=("12b", "27b"), default="12b", help="gemma3 12B- or 27B-shaped")
    ap.add_argument("--prefill-profile", nargs="?", const="also", choices=("also", "only"), default=None,
                    help="per-layer synced prefill timing (attention half, MLP half); 'only': nothing else")
    ap.add_argument("--guard-ab", action="store_true", help="only: agreement check off / old / new, and the host-array stall")
    ap.add_argument("--quick", action="store_true", help="decode rounds and the split step only")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "/tmp/tp_timeline"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker or a.np == 1:
        worker(a)
        return 0
    from mlxcel_dist.cluster.launcher import launch

    args = ["--worker", "--np", str(a.np), "--backend", a.backend, "--layers", str(a.layers), "--prompt",
            str(a.prompt), "--gen", str(a.gen), "--rounds", str(a.rounds), "--steps", str(a.steps), "--tag", a.tag,
            "--out-dir", a.out_dir] + (["--quick"] if a.quick else []) + (["--small"] if a.small else []) + (["--guard-ab"] if a.guard_ab else [])
    args += ["--shape", a.shape] + (["--prefill-profile", a.prefill_profile] if a.prefill_profile else [])
    return launch(args, a.np, a.backend, script=__file__)


if __name__ == "__main__":
    sys.exit(main())
