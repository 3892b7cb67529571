"""mellum and exaone_moe: what the per-family runners cannot see.

Config validation (one UserError, no silent fallback), the pure renames /
drops of `sanitize`, and the tensor-parallel plan of the per-expert layout:
experts and the shared expert are sliced without collectives of their own,
so a sharded MoE block issues exactly ONE all_sum (counted in
`collectives_per_token`), and each rank holds its intermediate slice.
"""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.nn.layers.distributed import ShardedToAllLinear

from mlxcel_dist.parallel.collectives import Group
from mlxcel_dist.errors import UserError
from mlxcel_dist.checkpoint.loader import build_model, load_model
from mlxcel_dist.parallel.shard import collect_plan

FIXTURES = Path(__file__).parent / "fixtures"


def config(family, case):
    return json.loads((FIXTURES / family / case / "config.json").read_text())


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": 1e4}), "one entry per layer kind"),
        (lambda c: c.update(mlp_layer_types=["dense", "moe", "sparse", "sparse"]), "mlp_layer_types"),
        (lambda c: c["rope_parameters"]["sliding_attention"].update(partial_rotary_factor=0.5), "partial_rotary"),
        (lambda c: c.update(num_experts_per_tok=9), "num_experts_per_tok"),
    ],
)
def test_mellum_config_errors(edit, message):
    c = config("mellum", "gqa_fp32")
    edit(c)
    with pytest.raises(UserError, match=message):
        build_model(c)


def test_mellum_config_forms():
    c = config("mellum", "gqa_fp32")
    E = c.pop("num_local_experts")
    c["num_experts"] = E  # transformers' attribute_map alias
    assert len(build_model(c).layers[1].mlp.experts) == E
    for key in ("layer_types", "mlp_layer_types", "sliding_window"):
        c.pop(key)
    c.pop("rope_parameters")
    m = build_model(c)  # MellumConfig's defaults: all full, all sparse, thetas 500000 / 10000
    assert m.args.layer_types == ["full_attention"] * 4 and m.args.mlp_layer_types == ["sparse"] * 4
    assert m.layers[0].self_attn.rope.params["rope_theta"] == 500000.0


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: (c.pop("layer_types"), c.update(sliding_window_pattern="LLLG")), "sliding_window_pattern"),
        (lambda c: c.update(n_group=3), "n_group"),
        (lambda c: c.update(topk_group=5), "topk_group"),
        (lambda c: c.update(num_shared_experts=0), "num_shared_experts"),
        (lambda c: c.update(rope_parameters={"full_attention": {}, "sliding_attention": {}}), "per-layer-kind"),
    ],
)
def test_exaone_moe_config_errors(edit, message):
    c = config("exaone_moe", "gqa_fp32")
    edit(c)
    with pytest.raises(UserError, match=message):
        build_model(c)


def test_exaone_moe_layer_kinds_from_pattern_and_first_k_dense():
    c = config("exaone_moe", "gqa_fp32")
    for key in ("layer_types", "mlp_layer_types"):
        c.pop(key)
    c.update(sliding_window_pattern=2, first_k_dense_replace=2)
    m = build_model(c)
    assert m.args.layer_types == ["sliding_attention", "full_attention"] * 2
    assert m.args.mlp_layer_types == ["dense", "dense", "sparse", "sparse"]
    assert m.layers[1].self_attn.rope is None and m.layers[0].self_attn.rope is not None  # NoPE global layers
    c.update(sliding_window=None)
    m = build_model(c)  # no window: every layer global and rotated
    assert set(m.args.layer_types) == {"full_attention"}
    assert all(layer.self_attn.rope is not None for layer in m.layers)


def test_sanitize_drops_mtp_and_renames_the_correction_bias():
    w = {"model.norm.weight": 1, "mtp.layers.0.mlp.gate.weight": 2}
    assert build_model(config("mellum", "gqa_fp32")).sanitize(w) == {"model.norm.weight": 1}
    m = build_model(config("exaone_moe", "gqa_fp32"))
    w = {"model.layers.1.mlp.gate.e_score_correction_bias": 3, "mtp.x": 4, "model.norm.weight": 1}
    assert m.sanitize(w) == {"model.layers.1.mlp.e_score_correction_bias": 3, "model.norm.weight": 1}


@pytest.mark.parametrize("family, moe_layers", [("mellum", 3), ("exaone_moe", 3)])
@pytest.mark.parametrize("n", [2, 4])
def test_one_all_sum_per_moe_block(family, moe_layers, n):
    c = config(family, "gqa_fp32")
    m = build_model(c)
    m.shard(Group.planned(n, 1))
    moe = [layer.mlp for layer in m.layers if hasattr(layer.mlp, "experts")]
    assert len(moe) == moe_layers
    for block in moe:
        # no expert projection reduces on its own
        assert not any(isinstance(x, ShardedToAllLinear) for _, x in block.named_modules())
        assert block.group.size() == n
    sharded_to_all = sum(isinstance(x, ShardedToAllLinear) for _, x in m.named_modules())
    calls, nbytes = m.collectives_per_token()["all_sum"]
    assert sharded_to_all == c["num_hidden_layers"] + 1  # o_proj per layer + the one dense MLP's down_proj
    assert calls == sharded_to_all + moe_layers
    I = c["moe_intermediate_size"]
    plan = collect_plan(m)
    e0 = next(k for k in plan if k.endswith("experts.0.gate_proj.weight"))
    assert plan[e0] == (0, [(I // n, 2 * I // n)])  # rank 1's rows of the expert
    assert plan[e0.replace("gate_proj", "down_proj")] == (1, [(I // n, 2 * I // n)])


def test_exaone_moe_shared_expert_is_split_too():
    c = config("exaone_moe", "mqa_tied_fp32")  # 2 shared experts: I_shared = 2 * moe_intermediate_size
    m = build_model(c)
    m.shard(Group.planned(2, 0))
    shared = m.layers[1].mlp.shared_experts
    I = 2 * c["moe_intermediate_size"]
    assert shared.gate_proj.weight.shape == (I // 2, c["hidden_size"])
    assert shared.down_proj.weight.shape == (c["hidden_size"], I // 2)


def test_exaone_moe_correction_bias_only_chooses():
    # The loaded router: weights are the UNBIASED sigmoid scores of the chosen
    # experts, renormalised then scaled; a huge bias on one expert forces its choice.
    m = load_model(FIXTURES / "exaone_moe" / "gqa_fp32").model
    block = m.layers[1].mlp
    x = mx.random.normal((5, m.args.hidden_size), key=mx.random.key(0))
    bias = np.zeros(m.args.num_experts, np.float32)
    bias[6] = 100.0
    block.e_score_correction_bias = mx.array(bias)
    w = np.array(block.routing(x))
    scores = np.array(mx.sigmoid(block.gate(x.astype(mx.float32))))
    assert (w[:, 6] > 0).all() and ((w > 0).sum(-1) == m.args.num_experts_per_tok).all()
    chosen = w > 0
    expect = scores * chosen / (scores * chosen).sum(-1, keepdims=True) * m.args.routed_scaling_factor
    np.testing.assert_allclose(w, expect, rtol=1e-6)


def test_exaone_moe_reads_the_transformers4_rope_form():
    # ExaoneMoeConfig turns rope_theta + rope_scaling into rope_parameters (checked on 5.24).
    c = config("exaone_moe", "gqa_fp32")
    c.pop("rope_parameters")
    c.update(rope_theta=5e5, rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert build_model(c).args.rope == {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}
