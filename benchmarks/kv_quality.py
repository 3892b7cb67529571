"""How far a quantized KV cache (--kv-bits, --kv-group-size) moves the logits
from the unquantized cache, per family and bits.

For each case: the same token ids through `engine.sequence_logits` twice, once
with the plain caches and once with `cache.KVOptions(bits, group_size)` (the
full-attention layers' KV quantized from the first token; sliding layers stay
in the compute dtype), as one pass and as a short prefill followed by decode
steps. Reported: max |diff| relative to the logit scale, mean KL(plain ||
quantized) in nats, top-1 agreement, and the bytes a full layer's cache takes
a token against the compute dtype's.

Cases: the embedded default model (trained; an English text), every
committed fixture whose head_dim MLX can quantize (groups of 32, 64 or 128
must divide it), and, since most fixtures have head_dim 8-16 (which no group
size divides), each family's first fp32 fixture config with its head dims
set to 32 and MLX's own random initialisation (`--families`; random ids).
Fixtures and random models have none of a trained model's outlier channels in
their KV, so their numbers say the path works per family more than what a
real checkpoint loses; the trained default model is the one real data point.

Run: python benchmarks/kv_quality.py [--families] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from mlxcel_dist.cache import KV_GROUP_SIZES, KVOptions
from mlxcel_dist.engine.generation import sequence_logits
from mlxcel_dist.harness import _log_softmax
from mlxcel_dist.checkpoint.loader import default_model_dir, load_model, open_model
from mlxcel_dist.checkpoint.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
TEXT = ("The sea is calm today. The sky is clear and the sun is warm. There is a light wind from the west. "
        "It is a good day to go out in a boat. Three and three make six. Four and four make eight.")


def head_dim(d) -> int:
    a = open_model(d).args
    return getattr(a, "head_dim", None) or a.hidden_size // a.num_attention_heads


def cases():
    yield "default model (gemma3, trained)", default_model_dir(), None
    for cfg in sorted((ROOT / "tests" / "fixtures").glob("*/*/config.json")):
        d = cfg.parent
        if (d / "reference.npz").exists() and head_dim(d) % 32 == 0:
            yield f"{d.parent.name}/{d.name}", d, np.load(d / "reference.npz")["ids"]


def family_configs():
    """(family, config) per registered family: its first fp32 fixture's config
    with every *head_dim at 32 (qk_rope_head_dim 16) or, where head_dim is
    derived, a hidden_size of 32 per head."""
    from mlxcel_dist.models import supported

    seen = set()
    for cfg in sorted((ROOT / "tests" / "fixtures").glob("*/*fp32/config.json")):
        fam = cfg.parent.parent.name
        if fam not in supported() or fam in seen:
            continue
        seen.add(fam)
        c = json.loads(cfg.read_text())

        def edit(c):
            found = False
            for k, v in c.items():
                if isinstance(v, dict):
                    found |= edit(v)
                elif k.endswith("head_dim") and isinstance(v, int):
                    c[k], found = 16 if k == "qk_rope_head_dim" else 32, True
            return found

        if not edit(c) or fam == "cohere2":  # (cohere2 derives head_dim from these)
            t = c.get("text_config", c)
            t["hidden_size"] = 32 * t["num_attention_heads"]
        yield fam, c


def random_model(config, kv=None):
    import mlx.core as mx

    from mlxcel_dist.checkpoint.loader import build_model

    mx.random.seed(0)
    m = build_model(config)
    mx.eval(m.parameters())
    m.eval()
    if kv:
        kv.apply(m)
    return m


def distance(x, ref) -> dict:
    lp, lq = _log_softmax(ref), _log_softmax(x)
    return {"rel": float(np.abs(x - ref).max() / np.abs(ref).max()),
            "kl": float((np.exp(lp) * (lp - lq)).sum(-1).mean()),
            "top1": float((x.argmax(-1) == ref.argmax(-1)).mean())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--families", action="store_true", help="also every family at head_dim 32, random weights")
    args = ap.parse_args()
    rows = []
    todo = [(name, (lambda kv, d=d: load_model(d, kv=kv).model), ids, head_dim(d), 2 if "bf16" in name else 4)
            for name, d, ids in cases()]
    if args.families:
        from mlxcel_dist.cache import QuantizedKVCache, kv_caches

        for fam, c in family_configs():
            m = random_model(c)
            a = m.args
            n = sum(isinstance(x, QuantizedKVCache) for x in kv_caches(m.make_cache(), bits=8, group_size=32) or [])
            ids = np.random.default_rng(0).integers(3, a.vocab_size, 48)
            todo.append((f"{fam} (random, {n}/{len(m.layers)} layers full)",
                         (lambda kv, c=c: random_model(c, kv)), ids, 32, 4))
    for name, load, ids, D, dt in todo:
        if ids is None:
            ids = np.array(Tokenizer(default_model_dir()).encode(TEXT))
        feed = {"one pass": {}, "decode": {"decode_from": len(ids) // 4}}
        plain = {m: sequence_logits(load(None), ids, **kw) for m, kw in feed.items()}
        for bits in (8, 4):
            for g in (g for g in KV_GROUP_SIZES if D % g == 0):
                try:
                    m = load(KVOptions(bits=bits, group_size=g))
                    r = {mode: distance(sequence_logits(m, ids, **kw), plain[mode]) for mode, kw in feed.items()}
                except Exception as e:  # a family whose attention cannot take it: said, not hidden
                    r = {"error": f"{type(e).__name__}: {e}"}
                # bytes per token and head: packed D * bits / 8 plus a scale and a bias per group, in the
                # compute dtype (dt bytes) as mx.quantize keeps them
                ratio = (D * bits / 8 + 2 * dt * D / g) / (D * dt)
                rows.append({"case": name, "T": int(len(ids)), "head_dim": D, "bits": bits, "group": g,
                             "bytes_ratio": ratio, **r})
                print(json.dumps(rows[-1]), flush=True)
    print()
    print("| case | T | head_dim | bits | group | KV bytes | one pass: rel / KL / top-1 | decode: rel / KL / top-1 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "error" in r:
            cells = [r["error"], ""]
        else:
            cells = [f"{r[m]['rel']:.1e} / {r[m]['kl']:.1e} / {r[m]['top1']:.3f}" for m in ("one pass", "decode")]
        print(f"| {r['case']} | {r['T']} | {r['head_dim']} | {r['bits']} | {r['group']} | "
              f"{r['bytes_ratio']:.2f}x | {cells[0]} | {cells[1]} |")
    if args.json:
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
