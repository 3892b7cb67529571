"""deepseek_v32 (deepseek_v3.py with the lightning indexer): what the
per-family runners (every feeding mode against transformers at np 1, 2, 3, 4,
compiled decode steps, batched rows, pipeline stages) do not see.

- the indexer picks, row by row, the visible keys a direct float64
  computation of transformers' scores ranks first: min(index_topk, visible)
  of them, whatever the offset (prefill, a chunk after cached keys, a decode
  step);
- the selection decides the fixtures' logits (every key visible: far off);
- the cache holds the latent and [k_pe, index key] per token, whole on every
  rank, and the indexer stays whole on every rank (np 3 on paper);
- the transformers-4 config form (DeepSeek-V3.2-Exp's: rope_scaling, no
  mlp_layer_types) gives the same logits as config.json, bit for bit;
- mlx_lm.convert's 4-bit checkpoint gives mlx-lm's logits at np 1 (every
  mode) and np 2;
- `info`'s per-layer lines and the config refusals.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxcel_dist.parallel.collectives import Group
from mlxcel_dist.engine.generation import sequence_logits
from mlxcel_dist.errors import UserError
from mlxcel_dist.harness import FP32_REL_TOL, all_mode_logits, compare
from mlxcel_dist.checkpoint.loader import build_model, load_model
from testproc import run_cmd

FIX = Path(__file__).parent / "fixtures" / "deepseek_v32"
MLX_LM = Path(__file__).parent / "fixtures" / "mlx_lm" / "deepseek_v32_q4"
CASES = ["yarn_fp32", "rope_only_index_fp32"]


def _logits(d: Path, ids) -> np.ndarray:
    return np.array(sequence_logits(load_model(d).model, ids))


@pytest.mark.parametrize("case", CASES)
def test_transformers4_config_form_loads_alike(tmp_path, case):
    src = FIX / case
    shutil.copyfile(src / "config_t4.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors").symlink_to(src / "model.safetensors")
    t4 = json.loads((src / "config_t4.json").read_text())
    assert "rope_parameters" not in t4 and "mlp_layer_types" not in t4 and "rope_theta" in t4
    ids = np.load(src / "reference.npz")["ids"]
    assert np.array_equal(_logits(tmp_path, ids), _logits(src, ids))


def _direct_scores(ix, x, q_latent, keys) -> np.ndarray:
    """transformers' index scores in float64 from our projections' outputs:
    sum_h w_h relu(q_h . k) / sqrt(Di), w = weights_proj(x) / sqrt(Hi)."""
    B, L, _ = x.shape
    q = ix._rotate(ix.wq_b(q_latent).reshape(B, L, ix.n_heads, ix.head_dim).transpose(0, 2, 1, 3), OFFSET)
    q, k = np.array(q, np.float64), np.array(keys, np.float64)[:, 0]  # [B, Hi, L, Di], [B, S, Di]
    w = np.array(ix.weights_proj(x), np.float64) * ix.n_heads**-0.5  # [B, L, Hi]
    per_head = np.maximum(np.einsum("bhld,bsd->bhls", q, k) * ix.scale, 0)
    return np.einsum("blh,bhls->bls", w, per_head)


OFFSET = 30  # the chunk's first position: 30 cached keys before it


@pytest.mark.parametrize("L", [1, 6, 20], ids=["decode", "chunk", "prefill"])
def test_indexer_keeps_each_querys_best_visible_keys(L):
    """A chunk of L queries at positions 30.. over 30 + L keys (the layer's
    causal mask): each row keeps exactly min(topk, visible) keys, all
    visible, the best of a direct float64 ranking (its gaps checked to be
    far above fp32 rounding)."""
    from mlxcel_dist.nn.masks import create_causal_mask
    from mlxcel_dist.models.deepseek_v3 import chosen_mask

    model = load_model(FIX / "yarn_fp32").model
    ix = model.layers[1].self_attn.indexer
    ix.topk = 25 if L == 1 else 33  # the rows see 31.. keys: a chunk's first ones keep all, the later select
    rng = np.random.default_rng(L)
    S = OFFSET + L
    x = mx.array(rng.standard_normal((2, L, model.args.hidden_size)), mx.float32)
    q_latent = mx.array(rng.standard_normal((2, L, model.args.q_lora_rank)), mx.float32)
    keys = ix.keys(mx.array(rng.standard_normal((2, S, model.args.hidden_size)), mx.float32), 0)  # [2, 1, S, Di]
    visible = create_causal_mask(L, OFFSET) if L > 1 else None
    top = ix.select(x, q_latent, keys, visible, OFFSET)  # [2, 1, L, topk]
    assert top.shape == (2, 1, L, ix.topk)
    chosen = np.array(chosen_mask(top, visible, S))[:, 0]  # [2, L, S]
    direct = _direct_scores(ix, x, q_latent, keys)
    vis = np.broadcast_to(np.array(visible) if visible is not None else True, chosen.shape)
    assert not (chosen & ~vis).any()
    for b in range(2):
        for i in range(L):
            n = int(vis[b, i].sum())
            row = np.where(vis[b, i], direct[b, i], -np.inf)
            order = np.argsort(-row, kind="stable")
            want = set(order[: min(ix.topk, n)].tolist())
            assert set(np.flatnonzero(chosen[b, i]).tolist()) == want, (b, i)
            if n > ix.topk:
                gap = row[order[ix.topk - 1]] - row[order[ix.topk]]
                assert gap > 1e-4 * np.abs(row[vis[b, i]]).max()  # the ranking is not a rounding question
    # no row has more than topk keys: no selection at all (every key)
    assert ix.select(x[:, :1], q_latent[:, :1], keys[:, :, : ix.topk], None, OFFSET) is None


def test_the_selection_decides_the_logits():
    """With every key visible (index_topk past the prompt) the fixture's
    logits are far from transformers': the indexer's choice is tested."""
    d = FIX / "yarn_fp32"
    ref = np.load(d / "reference.npz")
    model = load_model(d).model
    for layer in model.layers:
        layer.self_attn.indexer.topk = 10**6
    r = compare(np.array(sequence_logits(model, ref["ids"])), ref["logits"], FP32_REL_TOL)
    assert not r["ok"] and r["rel"] > 0.1, r


def test_cache_holds_the_latent_and_the_index_keys(monkeypatch):
    """Per token and layer: kv_lora latent values ("keys") and k_pe + the
    index key ("values"), one "head", whatever deepseek_v3's LATENT_CACHE."""
    from mlxcel_dist.models import deepseek_v3

    monkeypatch.setattr(deepseek_v3, "LATENT_CACHE", False)  # deepseek_v3's option: v32 keeps the latent
    d = FIX / "yarn_fp32"
    ref = np.load(d / "reference.npz")
    model = load_model(d).model
    a = model.args
    cache = model.make_cache()
    model(mx.array(ref["ids"][:5])[None], cache)
    keys, values = cache[0].state
    assert keys.shape[1] == values.shape[1] == 1
    assert keys.shape[-1] == a.kv_lora_rank and values.shape[-1] == a.qk_rope_head_dim + a.index_head_dim
    r = compare(np.array(sequence_logits(model, ref["ids"], decode_from=8)), ref["logits"], FP32_REL_TOL)
    assert r["ok"], r


def test_ranks_replicate_the_indexer():
    """np 3 on paper: MLA heads 3/3/2, the indexer whole on every rank."""
    cfg = json.loads((FIX / "yarn_fp32" / "config.json").read_text())
    heads = []
    for r in range(3):
        m = build_model(cfg)
        m.shard(Group.planned(3, r))
        a = m.layers[1].self_attn
        heads.append(a.num_heads)
        ix = a.indexer
        assert ix.wq_b.weight.shape == (16 * 16, 24) and ix.wk.weight.shape == (16, 64)
        assert ix.weights_proj.weight.shape == (16, 64) and type(ix.wq_b).__name__ == "Linear"
    assert heads == [3, 3, 2]


def _v3_twin(cfg: dict) -> dict:
    return {**cfg, "model_type": "deepseek_v3"}


def test_collectives_are_deepseek_v3s():
    """The indexer adds no collective: the same counts as the model without it."""
    cfg = json.loads((FIX / "yarn_fp32" / "config.json").read_text())
    plans = []
    for c in (cfg, _v3_twin(cfg)):
        m = build_model(c)
        m.shard(Group.planned(2, 0))
        plans.append(m.collectives_per_token())
    assert plans[0] == plans[1]


def test_info_names_the_indexer():
    lines = load_model(FIX / "yarn_fp32").model.describe_layers()
    assert len(lines) == 3 and all("indexer top-8 keys (16 heads x 16)" in l for l in lines)
    assert "dense mlp" in lines[0] and "interleaved" in lines[0]


def _args(**over):
    cfg = json.loads((FIX / "rope_only_index_fp32" / "config.json").read_text())
    return build_model({**cfg, **over}).args


def test_mlp_layer_types_from_the_config_or_the_rule():
    assert _args().mlp_layer_types == ["dense", "sparse"]
    assert _args(mlp_layer_types=None, first_k_dense_replace=0).mlp_layer_types == ["sparse", "sparse"]
    assert _args(rope_interleave=False).rope_interleave  # always interleaved, as transformers


@pytest.mark.parametrize("over,message", [
    ({"q_lora_rank": None}, "q_lora_rank"),
    ({"index_head_dim": 4}, "index_head_dim"),
    ({"index_topk": 0}, "index_topk"),
    ({"mlp_layer_types": ["dense"]}, "mlp_layer_types"),
])
def test_config_refusals(over, message):
    with pytest.raises(UserError, match=message):
        _args(**over)


def test_mlx_lm_4bit_checkpoint_matches_mlx_lm_at_np1():
    """mlx_lm.convert's 4-bit checkpoint (the indexer's wk / weights_proj
    quantized, switch_mlp gate/up, embed_q / unembed_out) in every mode."""
    ref = np.load(MLX_LM / "mlx_lm_reference.npz")
    model = load_model(MLX_LM).model
    ix = model.layers[1].self_attn.indexer
    assert "scales" in ix.wk and "scales" in ix.weights_proj
    for mode, logits in all_mode_logits(model, ref["ids"]).items():
        r = compare(logits, ref["logits"], FP32_REL_TOL)
        assert r["ok"], (mode, r)


def test_mlx_lm_4bit_checkpoint_matches_mlx_lm_at_np2(tmp_path):
    p = run_cmd([sys.executable, "-m", "mlxcel_dist.cli", "logit-match", str(MLX_LM), "--np", "2", "--backend", "mpi",
                 "--reference", str(MLX_LM / "mlx_lm_reference.npz")], timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "np2 vs reference" in p.stdout and " NO" not in p.stdout
