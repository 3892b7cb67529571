"""Baichuan-M1 specifics the per-family runners do not see: the conv state
carried across chunks, the fused W_pack's three row ranges per rank, NormHead,
config validation. (Every mode at np 1/2/4 against the float64 port of the
original: tests/test_reference.py, test_tp.py, test_decode.py.)"""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxcel_dist.cache import ConvKVCache
from mlxcel_dist.parallel.collectives import Group
from mlxcel_dist.errors import UserError
from mlxcel_dist.harness import FP32_REL_TOL, compare
from mlxcel_dist.checkpoint.loader import load_model
from mlxcel_dist.models.baichuan_m1 import Model, ModelArgs
from mlxcel_dist.parallel.shard import collect_plan

FIX = Path(__file__).parent / "fixtures" / "baichuan_m1"


def _chunked(model, ids, step, drop_conv_state=False):
    cache = model.make_cache()
    out = []
    for s in range(0, len(ids), step):
        if drop_conv_state:
            for c in cache:
                c.conv_state = None
        out.append(np.array(model(mx.array(ids[s : s + step])[None], cache)[0]))
    return np.concatenate(out), cache


@pytest.mark.parametrize("case", ["gqa_fp32", "mqa_conv3_fp32"])
def test_conv_state_carries_the_previous_tokens_across_chunks(case):
    model = load_model(FIX / case).model
    ref = np.load(FIX / case / "reference.npz")
    ids, want = ref["ids"], ref["logits"]
    w = model.args.conv_window
    got, cache = _chunked(model, ids, 5)
    assert compare(got, want, FP32_REL_TOL)["ok"]
    for c, layer in zip(cache, model.layers):
        assert isinstance(c, ConvKVCache) and not c.static_kv
        a = layer.self_attn
        assert [s.shape for s in c.conv_state] == [(1, w - 1, a.num_kv_heads, a.head_dim)] * 2
    # The same chunks without the carried state (each chunk's conv starts from zeros,
    # as the original's cache path nearly does): far from the reference.
    wrong, _ = _chunked(model, ids, 5, drop_conv_state=True)
    assert not compare(wrong, want, FP32_REL_TOL)["ok"]
    assert np.abs(wrong - want).max() > 100 * FP32_REL_TOL * np.abs(want).max()


def _plan(case, n, r):
    cfg = json.loads((FIX / case / "config.json").read_text())
    m = Model(ModelArgs.from_dict(cfg))
    m.shard(Group.planned(n, r))
    return m, collect_plan(m)


def test_w_pack_is_split_per_segment_by_heads():
    # gqa_fp32: full layers 4 q / 2 kv of 16, sliding layers 8 q / 4 kv of 8 (hidden 64).
    m, plan = _plan("gqa_fp32", 2, 1)
    full, sliding = "model.layers.0.self_attn.", "model.layers.1.self_attn."
    # q heads 2-3 (rows 32-64), KV head 1 of k (64 + 16..32) and of v (96 + 16..32)
    assert plan[full + "W_pack.weight"] == (0, [(32, 64), (80, 96), (112, 128)])
    assert plan[full + "o_proj.weight"] == (1, [(32, 64)])
    assert plan[full + "conv_k"] == (2, [(1, 2)]) and plan[full + "conv_v"] == (2, [(1, 2)])
    # sliding: q heads 4-7 (rows 32-64), KV heads 2-3 of k (64 + 16..32), of v (96 + 16..32)
    assert plan[sliding + "W_pack.weight"] == (0, [(32, 64), (80, 96), (112, 128)])
    assert plan[sliding + "conv_k"] == (2, [(2, 4)])
    a = m.layers[1].self_attn
    assert (a.num_heads, a.num_kv_heads, a.W_pack.weight.shape) == (4, 2, (64, 64))
    # np 4, full layers: 1 q head per rank, the 2 KV heads replicated in pairs of ranks
    _, plan = _plan("gqa_fp32", 4, 3)
    assert plan[full + "W_pack.weight"] == (0, [(48, 64), (80, 96), (112, 128)])
    assert plan[full + "conv_k"] == (2, [(1, 2)])
    # mqa_conv3_fp32's full layer has 1 KV head: every rank keeps it
    _, plan = _plan("mqa_conv3_fp32", 4, 2)
    assert plan["model.layers.1.self_attn.W_pack.weight"] == (0, [(32, 48), (64, 80), (80, 96)])
    assert plan["model.layers.1.self_attn.conv_v"] == (2, [(0, 1)])


def test_norm_head_ignores_the_scale_of_each_row():
    model = load_model(FIX / "gqa_fp32").model
    ids = mx.array(np.load(FIX / "gqa_fp32" / "reference.npz")["ids"][:12])[None]
    before = np.array(model(ids))
    scale = mx.array(np.random.default_rng(0).uniform(0.1, 10.0, size=(model.args.vocab_size, 1)).astype(np.float32))
    model.lm_head.weight = model.lm_head.weight * scale
    after = np.array(model(ids))
    np.testing.assert_allclose(after, before, rtol=0, atol=1e-5 * np.abs(before).max())


BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, num_swa_attention_heads=8, num_swa_key_value_heads=4, rope_theta=1e6,
            sliding_window=8, sliding_window_layers=[1, 3], conv_window=2)


@pytest.mark.parametrize("change,words", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"sliding_window_layers": [1, 4]}, "are not layers"),
    ({"sliding_window": None}, "no sliding_window"),
    ({"num_swa_attention_heads": 6}, "not a multiple of the sliding layers' 6"),
    ({"num_swa_key_value_heads": 3}, "not a multiple of 3 KV heads"),
    ({"head_dim": 8}, "head_dim 8"),
    ({"conv_window": 0}, "conv_window"),
])
def test_config_errors(change, words):
    with pytest.raises(UserError, match=words):
        Model(ModelArgs.from_dict({**BASE, **change}))


def test_without_swa_head_counts_sliding_layers_use_the_full_ones():
    cfg = {k: v for k, v in BASE.items() if not k.startswith("num_swa")}
    m = Model(ModelArgs.from_dict(cfg))
    a = m.layers[1].self_attn
    assert (a.num_heads, a.num_kv_heads, a.head_dim, a.window) == (4, 2, 16, 8)
