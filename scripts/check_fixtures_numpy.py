#!/usr/bin/env python
"""Independent float64 NumPy re-implementation of the Gemma3 text forward pass,
checked against the fixtures written by ``scripts/make_fixtures.py``.

    /work/venv/bin/python scripts/check_fixtures_numpy.py

It reads only ``config.json``, ``model.safetensors`` and ``reference.npz`` (no
transformers), so it doubles as a compact executable spec of the semantics the
fixtures encode:

* embeddings scaled by sqrt(hidden_size); lm_head tied to the embeddings;
* RMSNorm computes x / sqrt(mean(x^2) + eps) * (1 + w);
* q_norm / k_norm (per head) before RoPE; RoPE is the non-interleaved
  "rotate_half" form; per-layer-type theta; "linear" scaling divides the
  inverse frequencies by ``factor``;
* scores scaled by query_pre_attn_scalar ** -0.5;
* sliding layers: query i sees keys j with i - sliding_window < j <= i;
* post-attention / post-feedforward norms before the residual adds; GeGLU MLP
  with tanh-approximated GELU;
* final_logit_softcapping (CausalLM only): cap * tanh(logits / cap);
* attn_logit_softcapping is NOT applied (transformers ignores it for Gemma3);
  ``logits_attn_softcap`` is checked with it applied before the mask.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "gemma3"


def load_weights(path: Path) -> dict[str, np.ndarray]:
    """Minimal safetensors reader (F32 / BF16) -> float64 arrays (numpy has no bfloat16)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    out = {}
    for k, meta in header.items():
        if k == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        chunk = raw[8 + n + a : 8 + n + b]
        if meta["dtype"] == "F32":
            arr = np.frombuffer(chunk, dtype="<f4")
        elif meta["dtype"] == "BF16":
            arr = (np.frombuffer(chunk, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            raise ValueError(f"{k}: unsupported dtype {meta['dtype']}")
        out[k] = arr.reshape(meta["shape"]).astype(np.float64)
    return out


def forward(cfg_json: dict, w: dict[str, np.ndarray], ids: np.ndarray, attn_softcap: float | None = None):
    multimodal = "text_config" in cfg_json
    cfg = cfg_json["text_config"] if multimodal else cfg_json
    pre = "language_model.model." if multimodal else "model."
    T = len(ids)
    H, nh, nkv, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]

    def rms(x, weight):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + weight)

    def gelu_tanh(x):
        return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))

    def rope(x, params):
        inv = 1.0 / (params["rope_theta"] ** (np.arange(0, hd, 2) / hd))
        if params.get("rope_type", "default") == "linear":
            inv = inv / params["factor"]
        else:
            assert params.get("rope_type", "default") == "default", params
        ang = np.arange(T)[:, None] * inv[None]
        ang = np.concatenate([ang, ang], -1)
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * np.cos(ang) + np.concatenate([-x2, x1], -1) * np.sin(ang)

    x = w[pre + "embed_tokens.weight"][ids] * np.sqrt(H)
    qi, kj = np.arange(T)[:, None], np.arange(T)[None]
    for i, lt in enumerate(cfg["layer_types"]):
        p = f"{pre}layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(T, nh, hd).transpose(1, 0, 2)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(T, nkv, hd).transpose(1, 0, 2)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(T, nkv, hd).transpose(1, 0, 2)
        q, k = rms(q, w[p + "self_attn.q_norm.weight"]), rms(k, w[p + "self_attn.k_norm.weight"])
        rp = cfg["rope_parameters"][lt]
        q, k = rope(q, rp), rope(k, rp)
        k, v = np.repeat(k, nh // nkv, 0), np.repeat(v, nh // nkv, 0)  # q head h uses kv head h // (nh/nkv)
        s = q @ k.transpose(0, 2, 1) * cfg["query_pre_attn_scalar"] ** -0.5
        if attn_softcap:
            s = attn_softcap * np.tanh(s / attn_softcap)
        mask = kj <= qi
        if lt == "sliding_attention":
            mask &= kj > qi - cfg["sliding_window"]
        s = np.where(mask, s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        o = (a @ v).transpose(1, 0, 2).reshape(T, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        x = x + rms(o, w[p + "post_attention_layernorm.weight"])
        h = rms(x, w[p + "pre_feedforward_layernorm.weight"])
        f = gelu_tanh(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
        x = x + rms(f @ w[p + "mlp.down_proj.weight"].T, w[p + "post_feedforward_layernorm.weight"])
    logits = rms(x, w[pre + "norm.weight"]) @ w[pre + "embed_tokens.weight"].T
    cap = cfg.get("final_logit_softcapping")
    if cap and not multimodal:  # Gemma3ForConditionalGeneration does not apply it
        logits = cap * np.tanh(logits / cap)
    return logits


def main() -> int:
    ok = True
    for case in sorted(p for p in FIXTURES.iterdir() if (p / "reference.npz").exists()):
        cfg = json.loads((case / "config.json").read_text())
        w = load_weights(case / "model.safetensors")
        ref = np.load(case / "reference.npz")
        checks = [("logits_fp32" if "logits_fp32" in ref else "logits", None)]
        if "logits_attn_softcap" in ref:
            checks.append(("logits_attn_softcap", (cfg.get("text_config") or cfg)["attn_logit_softcapping"]))
        for key, cap in checks:
            lg = forward(cfg, w, ref["ids"], attn_softcap=cap)
            err = float(np.abs(lg - ref[key]).max())
            top1 = float((lg.argmax(-1) == ref[key].argmax(-1)).mean())
            good = err < 1e-3 and top1 == 1.0
            ok &= good
            print(f"{case.name:16s} {key:20s} max|numpy - HF| = {err:.2e}  top-1 agreement {top1:.3f}  {'OK' if good else 'FAIL'}")
        if "logits_fp32" in ref:
            err = float(np.abs(ref["logits"] - ref["logits_fp32"]).max())
            print(f"{case.name:16s} {'(bf16 vs fp32 HF)':20s} max|d| = {err:.2e}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
