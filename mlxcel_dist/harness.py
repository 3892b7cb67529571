"""The logit-match harness: the same tokens fed in every mode, single-process
and over N ranks, compared with each other and with a reference.

Tolerances: in float32, max |diff| <= 1e-4 of the logit scale (exact fp32
reaches ~1e-6). In bf16/fp16 the logits are themselves half precision (one
bf16 ulp is 2^-8 of the scale) and every matmul rounds: transformers' own bf16
run of the gqa_bf16 fixture is 1.54e-2 of the scale (~4 ulps) away from the
exact fp32 answer for the same weights, ours 1.36e-2 (np 1) and 1.42e-2 (np 4,
which also rounds each rank's partial sum). Two correct half-precision runs can
therefore differ by twice that: 8 ulps. The tests also check that our bf16 is
at least as close to the fp32 answer as transformers' bf16. Top-1 must agree
wherever the reference's top-2 margin exceeds twice the tolerance.
"""

from __future__ import annotations

import numpy as np

FP32_REL_TOL = 1e-4
HALF_REL_TOL = 8 * 2.0**-8


def rel_tol_for(dtype_name: str) -> float:
    return FP32_REL_TOL if dtype_name in ("float32", "mlx.core.float32") else HALF_REL_TOL


def modes(window: int, T: int) -> dict:
    """Feeding modes (kwargs of generation.sequence_logits) for a sequence of T
    tokens on a model whose sliding window is `window`."""
    below = max(2, window // 2 - 1)
    return {
        "one-pass": {},
        "decode-crossing-window": {"decode_from": max(1, min(T - 1, window // 2))},
        "chunked-below-window": {"prefill_step": below},
        "chunked-above-window": {"prefill_step": window + 3},
        "chunked-then-decode": {"prefill_step": below, "decode_from": max(1, min(T - 1, 2 * window + 3))},
    }


def short_length(window: int, T: int) -> int:
    """The tokens of a shorter run that still crosses the window twice in
    every mode (decode from window // 2 runs past window and 2 x window, so a
    ring buffer wraps): for runs where each decode step is dear (many ranks
    sharing few cores)."""
    return min(T, 2 * window + 8)


def model_window(model) -> int:
    """The span the modes must cross: --max-kv-size's N, else the sliding
    window, else a chunked-attention model's attention chunk (llama4), else 16."""
    bound = model.kv_options.max_size if model.kv_options is not None else None
    w = bound or getattr(model.args, "sliding_window", None) or getattr(model.args, "attention_chunk_size", None)
    return int(w) if w else 16


def default_tokens(vocab: int, window: int, seed: int = 0) -> np.ndarray:
    """A sequence that crosses the window several times."""
    T = 3 * window + 7
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, size=T).astype(np.int32)


def all_mode_logits(model, ids) -> dict:
    from .engine.generation import sequence_logits

    return {name: sequence_logits(model, ids, **kw) for name, kw in modes(model_window(model), len(ids)).items()}


def _log_softmax(x):
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare(logits: np.ndarray, ref: np.ndarray, rel_tol: float) -> dict:
    """max/mean |diff| (absolute and relative to the logit scale), top-1
    agreement, mean KL(ref || ours), and the verdict."""
    if logits.shape != ref.shape:
        return {"ok": False, "finite": True, "max": np.inf, "mean": np.inf, "rel": np.inf, "top1": 0.0,
                "kl": np.inf, "top1_decided_ok": False, "note": f"shape {logits.shape} != {ref.shape}"}
    finite = bool(np.isfinite(logits).all())
    scale = float(np.abs(ref).max()) or 1.0
    diff = np.abs(logits.astype(np.float64) - ref)
    top2 = np.sort(ref, axis=-1)[:, -2:]
    decided = (top2[:, 1] - top2[:, 0]) > 2 * rel_tol * scale
    agree = logits.argmax(-1) == ref.argmax(-1)
    if finite:
        lp, lq = _log_softmax(ref), _log_softmax(logits)
        kl = float((np.exp(lp) * (lp - lq)).sum(-1).mean())
    else:
        kl = float("nan")
    ok = finite and diff.max() <= rel_tol * scale and bool(agree[decided].all())
    return {
        "ok": bool(ok),
        "finite": finite,
        "max": float(diff.max()),
        "mean": float(diff.mean()),
        "rel": float(diff.max() / scale),
        "top1": float(agree.mean()),
        "top1_decided_ok": bool(agree[decided].all()),
        "kl": kl,
    }
