"""Llama 4 beyond the per-family runners: the config forms (text model,
multimodal wrapper, hub keys) and their layer kinds, mlx-lm's expert layout
read by slices, and mlx-lm's own logits at np 1 and 2. (The chunk mask's
property tests are in test_masks, the batch engine's rows in test_batch.)"""

import json
import sys

import numpy as np
import pytest

from mlxcel_dist.harness import all_mode_logits, model_window
from mlxcel_dist.checkpoint.loader import load_model, model_args, read_config
from mlxcel_dist.checkpoint.weights import join, open_checkpoint, swap_last_axes

from reference_cases import FIXTURES, FP32_REL_TOL, compare
from testproc import run_cmd

CASES = FIXTURES / "llama4"
MLX_LM = FIXTURES / "mlx_lm" / "llama4_q4"
CHUNKED, FULL = "chunked_attention", "full_attention"


def test_config_forms_give_the_same_model():
    text = model_args(read_config(CASES / "gqa_fp32"))
    assert text.model_type == "llama4_text"
    assert text.layer_types == [CHUNKED, CHUNKED, CHUNKED, FULL] and text.no_rope_layers == [1, 1, 1, 0]
    assert text.moe_layers == [1, 3] and text.attention_chunk_size == 8
    hub = model_args(json.loads((CASES / "gqa_fp32" / "config_t4.json").read_text()))  # no layer_types, []
    assert (hub.layer_types, hub.moe_layers, hub.rope) == (text.layer_types, text.moe_layers, text.rope)
    mm = model_args(read_config(CASES / "multimodal_fp32"))
    assert mm.model_type == "llama4" and mm.num_attention_heads == 12 and mm.moe_layers == [0, 1, 2, 3]
    explicit = model_args({**read_config(CASES / "mqa_bf16")})
    assert explicit.layer_types == [CHUNKED, FULL, CHUNKED] and not explicit.use_qk_norm
    no_chunk = model_args({**read_config(CASES / "gqa_fp32"), "attention_chunk_size": None, "layer_types": None})
    assert no_chunk.layer_types == [FULL] * 4  # RoPE layers without a chunk attend globally (transformers' rule)


def test_harness_modes_cross_the_attention_chunk():
    m = load_model(CASES / "gqa_fp32").model
    assert model_window(m) == 8  # the chunk: chunked prefill steps 3 and 11, decode from 4 and 19


def test_info_names_each_layer():
    lines = load_model(CASES / "gqa_fp32").model.describe_layers()
    assert "chunked (chunk 8)" in lines[0] and "q/k l2 norm" in lines[0] and "dense mlp (96)" in lines[0]
    assert "moe 4 experts top-1 (sigmoid) + shared expert" in lines[1]
    assert lines[3].startswith("3: full, no rope (NoPE), temperature tuning (floor 4, scale 0.1)")


def test_swapped_expert_stacks_read_only_the_slices_asked():
    # transformers' bmm tensors ([E, H, 2I], [E, I, H]) as our Linear layout
    # ([E, 2I, H], [E, H, I]): a rank's gate/up halves and down columns
    # (shard_switch_glu) are slices of the swapped whole.
    refs = open_checkpoint(CASES / "gqa_fp32")
    pre = "model.layers.1.feed_forward.experts."
    gate_up, down = swap_last_axes(refs[pre + "gate_up_proj"]), swap_last_axes(refs[pre + "down_proj"])
    whole, wd = np.array(gate_up.read()), np.array(down.read())
    np.testing.assert_array_equal(whole, np.array(refs[pre + "gate_up_proj"].read()).swapaxes(1, 2))
    assert whole.shape == gate_up.shape == (4, 64, 64) and wd.shape == down.shape == (4, 64, 32)
    for axis, ranges in [(1, [(3, 11), (32 + 3, 32 + 11)]), (2, [(0, 5)]), (0, [(2, 4)])]:
        sl = np.concatenate([np.take(whole, np.arange(s, e), axis=axis) for s, e in ranges], axis=axis)
        assert gate_up.sliced_shape(axis, ranges) == sl.shape
        np.testing.assert_array_equal(np.array(gate_up.read(axis, ranges)), sl)
    np.testing.assert_array_equal(np.array(down.read(2, [(4, 20)])), wd[:, :, 4:20])
    joined = join([refs[pre + "gate_up_proj"], refs[pre + "gate_up_proj"]], axis=2)  # a join of the source axis
    np.testing.assert_array_equal(np.array(swap_last_axes(joined).read(1, [(60, 70)])),
                                  np.concatenate([whole, whole], axis=1)[:, 60:70])  # fmt: skip


def test_mlx_lm_checkpoint_matches_mlx_lm_at_np1():
    z = np.load(MLX_LM / "mlx_lm_reference.npz")
    for mode, logits in all_mode_logits(load_model(MLX_LM).model, z["ids"]).items():
        r = compare(logits, z["logits"], FP32_REL_TOL)
        assert r["ok"], (mode, r)


@pytest.mark.parametrize("n", [2])
def test_mlx_lm_checkpoint_matches_mlx_lm_at_np2(n, tmp_path):
    p = run_cmd([sys.executable, "-m", "mlxcel_dist.cli", "logit-match", str(MLX_LM), "--np", str(n), "--backend",
                 "mpi", "--reference", str(MLX_LM / "mlx_lm_reference.npz")], timeout=300, cwd=tmp_path)  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"np{n} vs reference" in p.stdout and " NO" not in p.stdout


@pytest.mark.parametrize("n", [2, 4])
def test_collectives_per_token_under_tp(n):
    # per layer o_proj's all_sum; a dense layer's MLP down_proj; a MoE layer's
    # routed + shared partial sums in ONE all_sum (no expert reduces alone)
    from mlx.nn.layers.distributed import ShardedToAllLinear

    from mlxcel_dist.parallel.collectives import Group
    from mlxcel_dist.checkpoint.loader import build_model
    from mlxcel_dist.parallel.shard import collect_plan

    c = read_config(CASES / "gqa_fp32")
    m = build_model(c)
    m.shard(Group.planned(n, 1))
    for layer in m.layers:
        if layer.is_moe:
            assert not any(isinstance(x, ShardedToAllLinear) for _, x in layer.feed_forward.named_modules())
    L, H = c["num_hidden_layers"], c["hidden_size"]
    dense = L - len(m.args.moe_layers)
    assert sum(isinstance(x, ShardedToAllLinear) for _, x in m.named_modules()) == L + dense
    assert m.collectives_per_token()["all_sum"] == (2 * L, 2 * L * H * 4)
    I = c["intermediate_size"]
    plan = collect_plan(m)
    rows = [(I // n, 2 * I // n), (I + I // n, I + 2 * I // n)]
    assert plan["model.layers.1.feed_forward.experts.gate_up_proj.weight"] == (1, rows)
    assert plan["model.layers.1.feed_forward.experts.down_proj.weight"] == (2, [rows[0]])
