"""Fused projections (blocks.FUSE_PROJECTIONS): q/k/v of blocks.Attention and
gate/up of blocks.MLP as one matmul each give the logits of the separate
projections, bit for bit on the CPU (fp32, half and quantized; one-pass
prefill, split compiled decode steps and eager steps); parameters keep their
names and shapes as views of the fused buffer; a second load or shard() after
a forward rebuilds the fused weights from the new (per-rank) arrays."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxcel_dist.nn import blocks
from mlxcel_dist.parallel import shard
from mlxcel_dist.parallel.collectives import Group
from mlxcel_dist.engine.generation import sequence_logits
from mlxcel_dist.checkpoint.loader import load_model

from reference_cases import FIXTURES

CASES = ["llama/gqa_fp32", "qwen3/sliding_fp32", "mistral/gqa_fp32", "gemma3/gqa_fp32", "gemma3/gqa_bf16",
         "mlx_lm/llama_q4"]


def _ids(d):
    return np.load(d / ("reference.npz" if (d / "reference.npz").exists() else "mlx_lm_reference.npz"))["ids"]


def _load(d, fuse, monkeypatch):
    monkeypatch.setattr(blocks, "FUSE_PROJECTIONS", fuse)
    return load_model(d).model


def _logits(model, ids):
    # one-pass prefill; split compiled decode steps (the engine's one row); eager decode steps
    return {"prefill": sequence_logits(model, ids),
            "decode split": sequence_logits(model, ids, decode_from=5, compiled=True),
            "decode eager": sequence_logits(model, ids, decode_from=5, compiled=False)}


@pytest.mark.parametrize("case", CASES)
def test_fused_logits_are_the_unfused_logits(case, monkeypatch):
    d = FIXTURES / case
    ids = _ids(d)
    plain = _load(d, False, monkeypatch)
    want = _logits(plain, ids)
    names = {k: v.shape for k, v in tree_flatten(plain.parameters())}
    assert not any(l.self_attn.get("_qkv_fused") for l in plain.layers)

    fused = _load(d, True, monkeypatch)
    got = _logits(fused, ids)
    assert fused.engine.split, "the split decode path is the one under test"
    for mode in want:
        np.testing.assert_array_equal(got[mode], want[mode], err_msg=f"{case} {mode}")
    for layer in fused.layers:
        a, m = layer.self_attn, layer.mlp
        assert a["_qkv_fused"] is not None and m["_gate_up_fused"] is not None
        quantized = isinstance(a.q_proj, nn.QuantizedLinear)
        assert type(a.q_proj) is (nn.QuantizedLinear if quantized else nn.Linear)
    # the same parameters (names, shapes), nothing fused among them
    assert {k: v.shape for k, v in tree_flatten(fused.parameters())} == names


def test_parameters_are_views_of_the_fused_weight(monkeypatch):
    model = _load(FIXTURES / "llama/gqa_fp32", True, monkeypatch)
    model(mx.array([[1, 2, 3]]))
    a = model.layers[0].self_attn
    w = a["_qkv_fused"][1][0]
    rows = [a[n].weight.shape[0] for n in ("q_proj", "k_proj", "v_proj")]
    assert w.shape[0] == sum(rows)
    np.testing.assert_array_equal(np.array(a.k_proj.weight), np.array(w[rows[0]:rows[0] + rows[1]]))
    # a change to the parameters (a second load) rebuilds the fused weight
    x = mx.random.normal((1, 4, w.shape[1]))
    a.project(x)
    prefix = next(k for k, _ in tree_flatten(model.parameters()) if k.endswith("self_attn.q_proj.weight"))[:-len("q_proj.weight")]
    model.load_weights([(f"{prefix}{n}.weight", a[n].weight * 2) for n in ("q_proj", "k_proj", "v_proj")], strict=False)
    assert a.q_proj.weight is not a["_qkv_fused"][0][0][0]
    # the separate layers on the new arrays (before the rebuild replaces them by views)
    want = [np.array(a[n](x)) for n in ("q_proj", "k_proj", "v_proj")]
    got = [np.array(t.transpose(0, 2, 1, 3).reshape(1, 4, -1)) for t in a.project(x)]
    assert a["_qkv_fused"][1][0] is not w  # rebuilt from the new arrays
    for g, wnt in zip(got, want):
        np.testing.assert_array_equal(g, wnt)


@pytest.mark.parametrize("case", ["llama/gqa_fp32", "mlx_lm/llama_q4"])
@pytest.mark.parametrize("rank", [0, 1])
def test_shard_after_a_forward_rebuilds_per_rank(case, rank, monkeypatch):
    model = _load(FIXTURES / case, True, monkeypatch)
    a, m = model.layers[0].self_attn, model.layers[0].mlp
    hidden = model.args.hidden_size
    x = mx.random.normal((1, 3, hidden), key=mx.random.key(0))
    q, k, v = (np.array(t) for t in a.project(x))  # builds the full-width fused weights
    gate, up = np.array(m.gate_proj(x)), np.array(m.up_proj(x))
    m(x)
    assert a["_qkv_fused"] is not None and m["_gate_up_fused"] is not None

    group = Group.planned(2, rank)
    shard.shard_layers(model.layers, group)
    (q0, q1), (kv0, kv1) = shard.head_ranges(a.total_num_heads, a.total_num_kv_heads, 2, rank)
    qs, ks, vs = (np.array(t) for t in a.project(x))
    built = a["_qkv_fused"]
    assert all(type(l).__name__.endswith("AllToShardedLinear") for l in built[4])
    assert built[1][0].shape[0] == sum(a[n].weight.shape[0] for n in ("q_proj", "k_proj", "v_proj"))
    np.testing.assert_array_equal(qs, q[:, q0:q1])
    np.testing.assert_array_equal(ks, k[:, kv0:kv1])
    np.testing.assert_array_equal(vs, v[:, kv0:kv1])
    inter = gate.shape[-1] // 2
    g, u = blocks.fused_projection(m, ("gate_proj", "up_proj"), "_gate_up_fused")(x)
    np.testing.assert_array_equal(np.array(g), gate[..., rank * inter:(rank + 1) * inter])
    np.testing.assert_array_equal(np.array(u), up[..., rank * inter:(rank + 1) * inter])


def test_unfusable_layers_keep_separate_projections(monkeypatch):
    monkeypatch.setattr(blocks, "FUSE_PROJECTIONS", True)
    a = blocks.Attention(32, 4, 2, 8, scale=8**-0.5)
    a.k_proj = nn.Linear(32, 16, bias=True)  # bias on k only
    a(mx.zeros((1, 2, 32)))
    assert a.get("_qkv_fused") is None
    mlp = blocks.MLP(32, 64, nn.silu)
    mlp.up_proj = mlp.up_proj.to_quantized(group_size=32, bits=4)  # types differ
    mlp(mx.zeros((1, 2, 32)))
    assert mlp.get("_gate_up_fused") is None
