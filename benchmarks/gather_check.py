"""Is `mx.gather_mm` right on this device, sorted and unsorted, and is
gpt_oss's expert block? One run answers it.

MLX CUDA's `mx.gather_mm` multiplies unsorted (token, expert) rows one
matrix-vector product at a time (gpt_oss prefill on an H200 1.8k tok/s, 0.09x
mlx-lm's). mlx-lm sorts the rows by expert and passes sorted_indices=True
(a grouped GEMM). Measured on the H200 (MLX 0.32.4 CUDA, 2026-12): the
sorted forms are WRONG (max err 1.8 against the dense reference, in both
the row-major and mlx-lm's transposed-view call forms), the unsorted forms
right. So gpt_oss does not use sorted gather_mm: its prefill groups the rows
by expert and runs plain dense matmuls per expert (`gpt_oss.Experts._grouped`,
from `gpt_oss.GROUP_ROWS` rows), decode stays on unsorted gather_mm.

For each dtype and shape this prints, against a dense reference (per
expert, plain fp32 matmuls of the same operands), the max error of:

    rowmajor/unsorted   gather_mm(x[:, None, None], W [E, in, out] row-major, idx)
    rowmajor/sorted     the same rows sorted by expert, sorted_indices=True          (WRONG on MLX 0.32.4 CUDA)
    mlx-lm/unsorted     gather_mm(x[:, None, None], Wt.swapaxes(-1, -2), idx), Wt [E, out, in]   (gpt_oss decode)
    mlx-lm/sorted       sorted rows, Wt.swapaxes(-1, -2), sorted_indices=True        (mlx-lm's SwitchGLU; WRONG there)

and, when mlxcel_dist imports, the whole gpt_oss expert block (`Experts`,
relaid as the model loads it) gathered and grouped against a dense fp32
block, with the grouped block's time vs the gathered one's (--reps). "err"
is max |out - ref| / max |ref|; a bf16 result should be within a few 2^-8,
fp32 within ~1e-3 (the GPU may use TF32); "WRONG" marks > 0.05 (rows mixed
up, not rounding). Verdict lines at the end: GPT_OSS_GROUPED_BLOCK_OK tells
whether gpt_oss's prefill path is right on this device; the SORTED_* lines
whether a future MLX fixed sorted gather_mm.

    python benchmarks/gather_check.py                     # GPU: every shape; CPU: the small ones, fp32 only
    python benchmarks/gather_check.py --shapes small --dtypes float32

MLX's CPU gather_mm is fp32-only (0.32): half-precision rows say so there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import mlx.core as mx
import numpy as np

# (tokens, experts, top-k, in, out); gpt_oss-20b: 32 experts, top-4, hidden 2880, 2I = 5760
SHAPES = {
    "small": [(8, 4, 2, 64, 48), (64, 8, 4, 128, 96), (33, 8, 2, 72, 40)],
    "gpt_oss": [(8, 32, 4, 2880, 5760), (64, 32, 4, 2880, 5760), (64, 32, 4, 2880, 2880),
                (512, 32, 4, 2880, 5760), (2048, 32, 4, 2880, 2880)],
}
WRONG = 0.05


def route(T, E, k, key):
    """Top-k expert ids per token [T, k] uint32, as a router's argpartition gives them."""
    scores = mx.random.normal((T, E), key=key)
    return mx.argpartition(-scores, kth=k - 1, axis=-1)[:, :k]


def dense(x, w_rm, idx):
    """[T, k, out] fp32: for each expert, its rows times its matrix (plain matmuls)."""
    T, k = idx.shape
    flat = np.array(idx).reshape(-1)
    x32, w32 = x.astype(mx.float32), w_rm.astype(mx.float32)
    rows = np.repeat(np.arange(T), k)
    out = mx.zeros((T * k, w_rm.shape[-1]), mx.float32)
    for e in np.unique(flat):
        sel = np.nonzero(flat == e)[0]
        out[mx.array(sel)] = x32[mx.array(rows[sel])] @ w32[int(e)]
    return out.reshape(T, k, -1)


def sorted_rows(x, idx):
    T, k = idx.shape
    flat = idx.flatten()
    order = mx.argsort(flat)
    return x[order // k][:, None, :], flat[order], mx.argsort(order)


def forms(x, w_rm, w_view, idx):
    T, k = idx.shape
    xe = x[:, None, None, :]

    def unsorted(w):
        return mx.gather_mm(xe, w, rhs_indices=idx).squeeze(-2)  # [T, k, out]

    def sorted_(w):
        xs, ids, inv = sorted_rows(x, idx)
        out = mx.gather_mm(xs, w, rhs_indices=ids, sorted_indices=True)  # [T*k, 1, out]
        return out[inv].reshape(T, k, -1)

    return {
        "rowmajor/unsorted": lambda: unsorted(w_rm),
        "rowmajor/sorted": lambda: sorted_(w_rm),
        "mlx-lm/unsorted": lambda: unsorted(w_view),
        "mlx-lm/sorted": lambda: sorted_(w_view),
    }


def err(out, ref):
    o, r = np.array(out.astype(mx.float32)), np.array(ref)
    return float(np.abs(o - r).max() / max(np.abs(r).max(), 1e-30))


def timed(fn, reps):
    mx.eval(fn())
    t = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn())
    return (time.perf_counter() - t) / reps * 1e3


def check_raw(dtype, shape, reps, results):
    T, E, k, K, N = shape
    keys = mx.random.split(mx.random.key(T * 7 + E), 3)
    x = mx.random.normal((T, K), key=keys[0]).astype(dtype)
    w_rm = (mx.random.normal((E, K, N), key=keys[1]) * K**-0.5).astype(dtype)  # [E, in, out] row-major
    w_view = mx.contiguous(w_rm.swapaxes(-1, -2)).swapaxes(-1, -2)  # mlx-lm: [E, out, in] stored, passed transposed
    idx = route(T, E, k, keys[2])
    mx.eval(x, w_rm, w_view, idx)
    ref = dense(x, w_rm, idx)
    for name, fn in forms(x, w_rm, w_view, idx).items():
        row = {"form": name, "dtype": str(dtype).split(".")[-1], "T,E,k,in,out": list(shape)}
        try:
            out = fn()
            mx.eval(out)
            row["err"] = round(err(out, ref), 6)
            row["status"] = "WRONG" if row["err"] > WRONG else "ok"
            if reps:
                row["ms"] = round(timed(fn, reps), 3)
        except Exception as e:  # noqa: BLE001 - e.g. CPU gather_mm is fp32-only
            row["status"] = f"unsupported: {type(e).__name__}: {str(e)[:100]}"
        results.append(row)
        print(json.dumps(row), flush=True)


def check_block(dtype, shape, reps, results):
    """gpt_oss.Experts (relaid as the model loads it), gathered and grouped, vs a dense fp32 block."""
    try:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from mlxcel_dist.models import gpt_oss
    except Exception as e:  # noqa: BLE001 - the raw forms above are the point
        print(json.dumps({"block": "skipped", "why": f"{type(e).__name__}: {e}"[:200]}))
        return
    T, E, k, K, N = shape
    inter = N // 2 if N % 2 == 0 else N
    ex = gpt_oss.Experts(E, K, inter, 1.702, 7.0)
    keys = mx.random.split(mx.random.key(T + 3), 7)
    ex.update({"gate_up_proj": (mx.random.normal((E, K, 2 * inter), key=keys[0]) * K**-0.5).astype(dtype),
               "gate_up_proj_bias": (0.1 * mx.random.normal((E, 2 * inter), key=keys[1])).astype(dtype),
               "down_proj": (mx.random.normal((E, inter, K), key=keys[2]) * inter**-0.5).astype(dtype),
               "down_proj_bias": (0.1 * mx.random.normal((E, K), key=keys[3])).astype(dtype)})
    ex.relayout()
    x = mx.random.normal((T, K), key=keys[4]).astype(dtype)
    idx = route(T, E, k, keys[5])
    w = mx.softmax(mx.random.normal((T, k), key=keys[6]), axis=-1).astype(dtype)
    # dense fp32 reference of the block (transformers' GptOssExperts math)
    gu = dense(x, ex.gate_up_proj, idx) + ex.gate_up_proj_bias.astype(mx.float32)[idx]
    g, u = mx.minimum(gu[..., ::2], 7.0), mx.clip(gu[..., 1::2], -7.0, 7.0)
    h = (u + 1) * (g * mx.sigmoid(1.702 * g))  # [T, k, I]
    down = ex.down_proj.astype(mx.float32)
    flat = np.array(idx).reshape(-1)
    hd = mx.zeros((T * k, K), mx.float32)
    hf = h.reshape(T * k, -1)
    for e in np.unique(flat):
        sel = mx.array(np.nonzero(flat == e)[0])
        hd[sel] = hf[sel] @ down[int(e)]
    ref = ((hd.reshape(T, k, K) + ex.down_proj_bias.astype(mx.float32)[idx]) * w.astype(mx.float32)[..., None]).sum(1)
    outs = {}
    for label, grouped in (("gathered", False), ("grouped", True)):
        row = {"block": f"gpt_oss Experts, {label}", "dtype": str(dtype).split(".")[-1],
               "T,E,k,in,2I": [T, E, k, K, 2 * inter], "grouped": grouped,
               "model would group": gpt_oss.use_grouped(T * k, T)}
        try:
            outs[label] = ex(x, idx, w, grouped=grouped)
            mx.eval(outs[label])
            row["err"] = round(err(outs[label], ref), 6)
            row["status"] = "WRONG" if row["err"] > WRONG else "ok"
            if reps:
                row["ms"] = round(timed(lambda: ex(x, idx, w, grouped=grouped), reps), 3)
        except Exception as e:  # noqa: BLE001
            row["status"] = f"unsupported: {type(e).__name__}: {str(e)[:100]}"
        results.append(row)
        print(json.dumps(row), flush=True)
    if len(outs) == 2:
        d = err(outs["grouped"], np.array(outs["gathered"].astype(mx.float32)))
        print(json.dumps({"block": "grouped vs gathered", "dtype": str(dtype).split(".")[-1], "T": T,
                          "rel_diff": round(d, 6), "bit_identical": d == 0.0}), flush=True)


def main():
    ap = argparse.ArgumentParser(description="sorted vs unsorted gather_mm, gpt_oss's expert block, against dense references")
    on_gpu = mx.default_device() == mx.gpu
    ap.add_argument("--shapes", default="small,gpt_oss" if on_gpu else "small", help=",".join(SHAPES))
    ap.add_argument("--dtypes", default="bfloat16,float32" if on_gpu else "float32")
    ap.add_argument("--reps", type=int, default=5 if on_gpu else 0, help="timed calls per form (0: no timing)")
    ap.add_argument("--no-block", action="store_true", help="skip the gpt_oss Experts check")
    a = ap.parse_args()
    print(json.dumps({"device": str(mx.default_device()), "mlx": mx.__version__}), flush=True)
    results = []
    for dname in a.dtypes.split(","):
        dtype = getattr(mx, dname)
        for group in a.shapes.split(","):
            for shape in SHAPES[group]:
                check_raw(dtype, shape, a.reps, results)
                if not a.no_block and shape[0] * shape[2] >= 64:
                    check_block(dtype, shape, a.reps, results)
    ran = [r for r in results if "err" in r]
    verdicts = {"mlx-lm/sorted": "SORTED_MLX_LM_FORM_OK", "rowmajor/sorted": "SORTED_ROWMAJOR_FORM_OK",
                "mlx-lm/unsorted": "UNSORTED_MLX_LM_FORM_OK", "rowmajor/unsorted": "UNSORTED_ROWMAJOR_FORM_OK"}
    for form, label in verdicts.items():
        rs = [r for r in ran if r.get("form") == form]
        if rs:
            ok = all(r["status"] == "ok" for r in rs)
            print(f"{label}={ok} (max err {max(r['err'] for r in rs):.3g} over {len(rs)} cases)")
    for label, grouped in (("GPT_OSS_GATHERED_BLOCK_OK", False), ("GPT_OSS_GROUPED_BLOCK_OK", True)):
        blocks = [r for r in ran if str(r.get("block", "")).startswith("gpt_oss") and r.get("grouped") is grouped]
        if blocks:
            print(f"{label}={all(r['status'] == 'ok' for r in blocks)} "
                  f"(max err {max(r['err'] for r in blocks):.3g} over {len(blocks)} cases)")


if __name__ == "__main__":
    main()
