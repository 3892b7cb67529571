"""recurrent_gemma: what the per-family runners do not see.

The runners compare logits in every mode; here: the recurrent state a chunked
prefill and decode steps carry (RecurrentCache) equals the one-pass state,
config forms and refusals, and the tensor-parallel plan of the recurrent
block (heads split, conv/LRU state per rank, one all_sum per block)."""

import json

import mlx.core as mx
import numpy as np
import pytest

from mlxcel_dist.cache import RECURRENT, SLIDING, RecurrentCache, RotatingKVCache
from mlxcel_dist.parallel.collectives import Group
from mlxcel_dist.errors import UserError
from mlxcel_dist.checkpoint.loader import build_model, load_model
from mlxcel_dist.parallel.shard import collect_plan

from reference_cases import FIXTURES

MQA = FIXTURES / "recurrent_gemma" / "mqa_fp32"
GQA = FIXTURES / "recurrent_gemma" / "gqa_bias_fp32"


def _config(d=MQA, **changes):
    c = json.loads((d / "config.json").read_text())
    c.update(changes)
    return c


def _states(cache):
    return [(np.array(c.conv_state), np.array(c.lru_state)) for c in cache if isinstance(c, RecurrentCache)]


@pytest.mark.parametrize("step", [1, 2, 3, 5, 16, 21])
def test_chunked_prefill_carries_the_one_pass_state(step):
    # Chunks shorter than the conv width (1-3) must take the earlier inputs
    # from the conv state; the LRU state must carry across every boundary.
    model = load_model(MQA).model
    ids = np.load(MQA / "reference.npz")["ids"][:40]
    one = model.make_cache()
    model(mx.array(ids)[None], one)
    chunked = model.make_cache()
    for s in range(0, len(ids), step):
        model(mx.array(ids[s : s + step])[None], chunked)
    assert all(c.offset == len(ids) for c in chunked)
    for (conv1, lru1), (conv2, lru2) in zip(_states(one), _states(chunked)):
        assert conv1.shape == (1, 3, 64) and lru1.dtype == np.float32
        # the last 3 conv inputs (upstream matmuls of other shapes: equal to fp32 rounding)
        np.testing.assert_allclose(conv2, conv1, rtol=0, atol=1e-6 * np.abs(conv1).max())
        np.testing.assert_allclose(lru2, lru1, rtol=0, atol=1e-6 * np.abs(lru1).max())


def test_cache_kinds_and_masks():
    model = load_model(MQA).model
    assert model.args.layer_types == [RECURRENT, RECURRENT, SLIDING, RECURRENT, RECURRENT]
    cache = model.make_cache()
    assert [type(c) for c in cache] == [RecurrentCache] * 2 + [RotatingKVCache] + [RecurrentCache] * 2
    assert cache[2].window == 16 and not cache[0].static_kv and cache[0].state == []
    masks = model.masks(40, cache)
    assert masks[RECURRENT] is None and masks[SLIDING].shape == (40, 40)  # longer than the window
    lines = model.describe_layers()
    assert lines[0].startswith("0: recurrent") and lines[2].startswith("2: sliding (window 16)")


def test_transformers4_config_defaults():
    # Real checkpoints' form: top-level rope_theta, partial_rotary_factor
    # absent means 0.5 (RecurrentGemmaConfig's default), no head_dim, no lru_width.
    c = _config()
    for k in ("rope_parameters", "head_dim", "lru_width"):
        c.pop(k)
    c["rope_theta"] = 12345.0
    args = build_model(c).args
    assert args.rope == {"rope_type": "default", "rope_theta": 12345.0, "partial_rotary_factor": 0.5}
    assert args.head_dim == 16 and args.lru_width == 64 and args.sliding_window == 16
    # block_types repeats over the layers as transformers' (block_types * 100)[:n]
    assert build_model(_config(block_types=["attention", "recurrent"])).args.layer_types == [
        SLIDING, RECURRENT, SLIDING, RECURRENT, SLIDING]


@pytest.mark.parametrize("changes, message", [
    (dict(block_types=["recurrent", "mamba"]), "unsupported kinds"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "default RoPE"),
    (dict(lru_width=66), "lru_width"),
])
def test_unsupported_config_is_one_clear_error(changes, message):
    with pytest.raises(UserError, match=message):
        build_model(_config(**changes))


@pytest.mark.parametrize("n", [2, 4])
def test_tensor_parallel_plan(n):
    # gqa_bias_fp32: lru_width 32 in 4 heads of 8 channels; 4 q / 2 KV heads.
    for r in range(n):
        model = build_model(_config(GQA))
        model.shard(Group.planned(n, r))
        plan = collect_plan(model)
        per = 4 // n
        chans, heads = [(r * per * 8, (r + 1) * per * 8)], [(r * per, (r + 1) * per)]
        p = "model.layers.1.temporal_block."
        assert plan[p + "linear_x.weight"] == (0, chans) and plan[p + "linear_y.bias"] == (0, chans)
        assert plan[p + "linear_out.weight"] == (1, chans) and p + "linear_out.bias" not in plan  # added once
        assert plan[p + "conv_1d.weight"] == (0, chans) and plan[p + "rg_lru.recurrent_param"] == (0, chans)
        assert plan[p + "rg_lru.input_gate_weight"] == (0, heads) and plan[p + "rg_lru.recurrent_gate_bias"] == (0, heads)
        assert model.layers[1].temporal_block.rg_lru.num_heads == per
        # one all_sum per temporal block and per MLP
        assert model.collectives_per_token()["all_sum"][0] == 2 * model.args.num_hidden_layers


def test_heads_that_do_not_split_are_refused():
    model = build_model(_config(GQA))
    model.shard(Group.planned(3, 0))  # uneven: 4 heads as 2, 1, 1
    model = build_model(_config(GQA))
    with pytest.raises(UserError, match="cannot split"):
        model.shard(Group.planned(5, 0))
