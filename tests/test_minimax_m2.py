"""MiniMax-M2 beyond the per-family runners: the whole-projection q/k norm
under TP (who counts each KV head; launches at np 2 and 3), the three weight
layouts (transformers', the hub's per-expert w1/w3/w2, mlx-lm's switch_mlp)
read as the same tensors and by slices, and mlx-lm's own logits."""

import sys

import numpy as np
import pytest

from mlxcel_dist.parallel.collectives import Group
from mlxcel_dist.harness import all_mode_logits
from mlxcel_dist.checkpoint.loader import load_model
from mlxcel_dist.checkpoint.weights import join, open_checkpoint

from reference_cases import FIXTURES, FP32_REL_TOL, compare
from testproc import run_cmd

CASES = FIXTURES / "minimax_m2"
MLX_LM = FIXTURES / "mlx_lm" / "minimax_m2_q4"


@pytest.mark.parametrize("heads,kv", [(8, 2), (12, 4), (4, 1), (6, 6)])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_whole_norm_counts_every_kv_feature_once(heads, kv, n):
    # The k statistic sums every KV head's features once over all ranks:
    # replicated heads (even split) scale the count, uneven splits mask out
    # all but the owner's first slot.
    from mlxcel_dist.models.minimax_m2 import MiniMaxM2Attention, Model, ModelArgs

    args = ModelArgs(hidden_size=32, num_attention_heads=heads, num_key_value_heads=kv, head_dim=4,
                     num_local_experts=2, num_experts_per_tok=1, num_hidden_layers=1)  # fmt: skip
    counted, replicas = 0.0, set()
    for r in range(n):
        attn = MiniMaxM2Attention(args)
        Model._shard_whole_norm(attn, Group.planned(n, r))
        held = attn.k_norm.weight.shape[0]  # this rank's KV slots * head_dim
        counted += held if attn._kv_owned is None else float(attn._kv_owned.sum())
        replicas.add(attn.kv_replicas)
    assert len(replicas) == 1
    assert counted == kv * args.head_dim * replicas.pop()


@pytest.mark.parametrize("n", [2, 3])
def test_whole_norm_under_tp_matches_transformers(n, tmp_path):
    # 8 q / 2 kv heads: at np 2 each rank holds one KV head, at np 3 the
    # middle rank holds both (one twice), so the k statistic's ownership mask
    # decides; every mode must match the reference and np 1.
    d = CASES / "gqa_fp32"
    p = run_cmd([sys.executable, "-m", "mlxcel_dist.cli", "logit-match", str(d), "--np", str(n), "--backend", "mpi",
                 "--reference", str(d / "reference.npz")], timeout=300, cwd=tmp_path)  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"np{n} vs reference" in p.stdout and " NO" not in p.stdout


def _transformers_layout(d):
    return {k: r.read() for k, r in open_checkpoint(d).items()}


def test_hub_and_switch_mlp_layouts_are_transformers_tensors():
    from mlxcel_dist.checkpoint.loader import build_model, read_config

    d = CASES / "gqa_fp32"
    w = _transformers_layout(d)
    model = build_model(read_config(d))
    want = model.sanitize(dict(w))
    hub, switch = {}, {}
    for name, x in w.items():
        moe = name.replace(".mlp.", ".block_sparse_moe.")
        if name.endswith("experts.gate_up_proj"):
            I = x.shape[1] // 2
            for e in range(x.shape[0]):
                hub[moe.replace("gate_up_proj", f"{e}.w1.weight")] = x[e, :I]
                hub[moe.replace("gate_up_proj", f"{e}.w3.weight")] = x[e, I:]
            switch[moe.replace("experts.gate_up_proj", "switch_mlp.gate_proj.weight")] = x[:, :I]
            switch[moe.replace("experts.gate_up_proj", "switch_mlp.up_proj.weight")] = x[:, I:]
        elif name.endswith("experts.down_proj"):
            for e in range(x.shape[0]):
                hub[moe.replace("down_proj", f"{e}.w2.weight")] = x[e]
            switch[moe.replace("experts.down_proj", "switch_mlp.down_proj.weight")] = x
        else:
            hub[moe] = switch[moe] = x
    for layout in (hub, switch):
        got = model.sanitize(layout)
        assert got.keys() == want.keys()
        for k in want:
            assert np.array_equal(np.array(got[k]), np.array(want[k])), k


def test_lazy_joins_read_only_the_slices_asked():
    # A rank's read of a joined tensor (hub experts, as the loader asks for
    # shard_switch_glu' halves) equals the slice of the whole.
    refs = open_checkpoint(CASES / "hub_layout_fp32")
    name = "model.layers.0.block_sparse_moe.experts.{}.{}.weight"
    E = 6
    gate_up = join([join([refs[name.format(e, "w1")], refs[name.format(e, "w3")]]) for e in range(E)], stack=True)
    whole = np.array(gate_up.read())
    assert whole.shape == gate_up.shape == (E, 32, 64)
    for axis, ranges in [(1, [(2, 5), (16 + 2, 16 + 5)]), (1, [(0, 16), (16, 32)]), (2, [(8, 24)]), (0, [(1, 4)])]:
        sl = np.concatenate([np.take(whole, np.arange(s, e), axis=axis) for s, e in ranges], axis=axis)
        assert gate_up.sliced_shape(axis, ranges) == sl.shape
        np.testing.assert_array_equal(np.array(gate_up.read(axis, ranges)), sl)


def test_mlx_lm_switch_mlp_checkpoint_matches_mlx_lm_at_np1():
    # mlx-lm's own conversion (switch_mlp stacks) and its logits
    # (tests/fixtures/mlx_lm, scripts/make_mlx_lm_fixtures.py), every mode.
    z = np.load(MLX_LM / "mlx_lm_reference.npz")
    for mode, logits in all_mode_logits(load_model(MLX_LM).model, z["ids"]).items():
        r = compare(logits, z["logits"], FP32_REL_TOL)
        assert r["ok"], (mode, r)


def test_mlx_lm_switch_mlp_checkpoint_matches_mlx_lm_at_np2(tmp_path):
    p = run_cmd([sys.executable, "-m", "mlxcel_dist.cli", "logit-match", str(MLX_LM), "--np", "2", "--backend", "mpi",
                 "--reference", str(MLX_LM / "mlx_lm_reference.npz")], timeout=300, cwd=tmp_path)  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    assert "np2 vs reference" in p.stdout and " NO" not in p.stdout


def test_refusals():
    from mlxcel_dist.errors import UserError
    from mlxcel_dist.models.minimax_m2 import ModelArgs

    with pytest.raises(UserError, match="use_qk_norm"):
        ModelArgs(use_qk_norm=False)
    with pytest.raises(UserError, match="num_experts_per_tok"):
        ModelArgs(num_local_experts=4, num_experts_per_tok=5)
    a = ModelArgs(head_dim=128, rotary_dim=64, rope_theta=1e6)  # the hub form
    assert a.rope["partial_rotary_factor"] == 0.5 and a.rope["rope_theta"] == 1e6
    assert ModelArgs(rope_parameters={"rope_type": "default", "rope_theta": 5.0, "partial_rotary_factor": 0.25}
                     ).rope["partial_rotary_factor"] == 0.25  # fmt: skip


def test_info_names_each_layer():
    m = load_model(CASES / "hub_layout_fp32").model
    lines = m.describe_layers()
    assert len(lines) == 2 and all("q/k norm over the whole projection" in x and "moe 6 experts top-3" in x
                                   and "rotary 4/8 dims" in x for x in lines)  # fmt: skip
    assert [x.split(", ")[0] for x in lines] == ["0: full", "1: full"]  # every minimax_m2 layer: full attention, MoE


@pytest.mark.parametrize("n", [2, 4])
def test_collectives_per_token_under_tp(n):
    # per layer: o_proj's all_sum, the q/k statistic ([1, 1, 2] fp32) and the
    # experts' one all_sum; each rank reads its intermediate slice of the stacks
    from mlx.nn.layers.distributed import ShardedToAllLinear

    from mlxcel_dist.checkpoint.loader import build_model, read_config
    from mlxcel_dist.parallel.shard import collect_plan

    c = read_config(CASES / "gqa_fp32")
    m = build_model(c)
    m.shard(Group.planned(n, 1))
    L, H = c["num_hidden_layers"], c["hidden_size"]
    assert sum(isinstance(x, ShardedToAllLinear) for _, x in m.named_modules()) == L
    assert m.collectives_per_token()["all_sum"] == (3 * L, L * (H * 4 + 2 * 4 + H * 4))
    I = c["intermediate_size"]
    plan = collect_plan(m)
    rows = [(I // n, 2 * I // n), (I + I // n, I + 2 * I // n)]
    assert plan["model.layers.0.mlp.experts.gate_up_proj.weight"] == (1, rows)
    assert plan["model.layers.0.mlp.experts.down_proj.weight"] == (2, [rows[0]])
