"""gpt_oss's experts on the CPU.

- The expert matmul with half-precision weights: casting only the routed
  experts (fewer (row, expert) pairs than experts, as in decode) must give
  exactly what casting every expert gives (the fixtures have 2-6 experts, so
  their decode steps rarely take the routed path).
- Prefill's grouped path (rows sorted by expert, dense matmuls per expert)
  against the gathered one (gather_mm per row): bit for bit, per rank under
  tensor parallelism too, and which inputs take it.
"""

import mlx.core as mx
import numpy as np
import pytest

from mlxcel_dist.models import gpt_oss


def whole_cast(x, w, indices):
    return mx.gather_mm(x.astype(mx.float32), w.astype(mx.float32), rhs_indices=indices).astype(x.dtype)


@pytest.mark.parametrize("rows,k", [(1, 4), (3, 2), (4, 4)])
def test_routed_cast_equals_whole_cast(rows, k):
    E, K, M = 16, 64, 48
    rng = np.random.default_rng(rows * 10 + k)
    w = mx.array(rng.normal(size=(E, K, M)).astype(np.float32) * 0.1).astype(mx.bfloat16)
    x = mx.array(rng.normal(size=(rows, 1, 1, K)).astype(np.float32)).astype(mx.bfloat16)
    indices = mx.array(np.stack([rng.choice(E, size=k, replace=False) for _ in range(rows)]))
    device = mx.default_device()
    mx.set_default_device(mx.cpu)  # the CPU path (gather_mm asks the default device)
    try:
        got = gpt_oss.gather_mm(x, w, indices)
        want = whole_cast(x, w, indices)
    finally:
        mx.set_default_device(device)
    assert got.shape == want.shape == (rows, k, 1, M)
    assert got.dtype == mx.bfloat16
    assert np.array_equal(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)))
    # the fp32 products, rounded once: within a bf16 rounding of float64
    x64 = np.array(x.astype(mx.float32))[:, 0, 0]  # [rows, K]
    w64 = np.array(w.astype(mx.float32))[np.array(indices)]  # [rows, k, K, M]
    ref = np.einsum("rk,rjkm->rjm", x64, w64)
    np.testing.assert_allclose(np.array(got.astype(mx.float32))[:, :, 0], ref, rtol=2**-8, atol=1e-6)


def _experts(E=8, hidden=64, inter=48, seed=0):
    ex = gpt_oss.Experts(E, hidden, inter, 1.702, 7.0)
    rng = np.random.default_rng(seed)
    ex.update({k: mx.array(rng.normal(size=v.shape).astype(np.float32) * 0.1) for k, v in ex.parameters().items()})
    return ex, rng


def test_relayout_keeps_names_shapes_and_values():
    # mlx-lm's memory layout ([E, out, in] row-major) behind the same parameters
    ex, _ = _experts()
    before = {k: (v.shape, np.array(v)) for k, v in ex.parameters().items()}
    ex.relayout()
    after = ex.parameters()
    assert sorted(after) == sorted(before)
    for k, (shape, values) in before.items():
        assert after[k].shape == shape and np.array_equal(np.array(after[k]), values), k
    w = ex.gate_up_proj
    ex.relayout()  # idempotent: an array already relaid is kept
    assert ex.gate_up_proj is w


def _skewed_routing(rows, k, E, rng):
    """[rows, k] uint32 expert ids where expert 0 takes most rows (every row
    but a few), experts E-2 and E-1 none, the rest a few each."""
    idx = []
    for r in range(rows):
        others = rng.choice(E - 3, size=k, replace=False) + 1  # experts 1..E-3
        first = 0 if r % 8 else others[-1]
        idx.append([first, *others[: k - 1]] if first == 0 else list(others))
    return mx.array(np.array(idx, np.uint32))


def _on_cpu(fn):
    device = mx.default_device()
    mx.set_default_device(mx.cpu)  # the CPU paths (gather_mm and dense_mm ask the default device)
    try:
        return fn()
    finally:
        mx.set_default_device(device)


def _dense_block(ex, x, idx, w):
    """transformers' GptOssExperts math in float64 numpy, row by row."""
    xs, wi, wr = np.array(x.astype(mx.float32)), np.array(idx), np.array(w.astype(mx.float32))
    gu_w, gu_b = np.array(ex.gate_up_proj.astype(mx.float32)), np.array(ex.gate_up_proj_bias.astype(mx.float32))
    dn_w, dn_b = np.array(ex.down_proj.astype(mx.float32)), np.array(ex.down_proj_bias.astype(mx.float32))
    ref = np.zeros((xs.shape[0], dn_w.shape[-1]))
    for r in range(xs.shape[0]):
        for j in range(wi.shape[1]):
            e = wi[r, j]
            gu = xs[r].astype(np.float64) @ gu_w[e] + gu_b[e]
            g, u = np.minimum(gu[::2], 7.0), np.clip(gu[1::2], -7.0, 7.0)
            h = (u + 1) * g / (1 + np.exp(-1.702 * g))
            ref[r] += wr[r, j] * (h @ dn_w[e] + dn_b[e])
    return ref


@pytest.mark.parametrize("rows,k", [(40, 4), (17, 2), (64, 1)])
def test_grouped_equals_gathered_on_cpu(rows, k):
    # prefill's grouped path (rows sorted by expert, one dense matmul per
    # expert) is bit-identical to the gathered one on the CPU in fp32, with
    # experts that get no rows and one that gets most
    ex, rng = _experts(seed=rows)
    ex.relayout()
    x = mx.array(rng.normal(size=(rows, 64)).astype(np.float32))
    idx = _skewed_routing(rows, k, 8, rng)
    counts = np.bincount(np.array(idx).ravel(), minlength=8)
    assert counts[6] == counts[7] == 0 and counts[0] >= rows * 3 // 4
    w = mx.softmax(mx.array(rng.normal(size=(rows, k)).astype(np.float32)), axis=-1)
    gathered = _on_cpu(lambda: np.array(ex(x, idx, w, grouped=False)))
    grouped = _on_cpu(lambda: np.array(ex(x, idx, w, grouped=True)))
    assert np.array_equal(grouped, gathered)
    np.testing.assert_allclose(grouped, _dense_block(ex, x, idx, w), rtol=1e-4, atol=1e-5)


def test_grouped_equals_gathered_on_cpu_bf16():
    # half weights on the CPU: both paths multiply in fp32 and round once
    rows, k = 48, 2
    ex, rng = _experts(seed=5)
    ex.update({n: v.astype(mx.bfloat16) for n, v in ex.parameters().items()})
    ex.relayout()
    x = mx.array(rng.normal(size=(rows, 64)).astype(np.float32)).astype(mx.bfloat16)
    idx = _skewed_routing(rows, k, 8, rng)
    w = mx.softmax(mx.array(rng.normal(size=(rows, k)).astype(np.float32)), axis=-1).astype(mx.bfloat16)
    gathered = _on_cpu(lambda: ex(x, idx, w, grouped=False))
    grouped = _on_cpu(lambda: ex(x, idx, w, grouped=True))
    assert grouped.dtype == gathered.dtype == mx.bfloat16
    assert np.array_equal(np.array(grouped.astype(mx.float32)), np.array(gathered.astype(mx.float32)))


@pytest.mark.parametrize("n", [2, 4])
def test_grouped_equals_gathered_per_rank(n):
    # tensor parallelism: each rank holds a slice of every expert's
    # intermediate dim; the grouped path runs per rank unchanged (the routing,
    # so the per-expert counts, is every rank's), bit-identical to the
    # gathered one, and the ranks' partial sums add up to the whole block
    from types import SimpleNamespace

    from mlxcel_dist.parallel.collectives import SINGLE, Group
    from mlxcel_dist.parallel.shard import shard_moe

    rows, k = 40, 2
    whole, rng = _experts(seed=11)
    whole.relayout()
    x = mx.array(rng.normal(size=(rows, 64)).astype(np.float32))
    idx = _skewed_routing(rows, k, 8, rng)
    w = mx.softmax(mx.array(rng.normal(size=(rows, k)).astype(np.float32)), axis=-1)
    bias = np.array((whole.down_proj_bias[idx] * w[..., None]).sum(axis=1))
    total = np.zeros((rows, 64), np.float64)
    for r in range(n):
        ex, _ = _experts(seed=11)
        shard_moe(SimpleNamespace(experts=ex), Group.planned(n, r))
        ex.relayout()  # as Model.load_weights, after sharding
        assert ex.down_proj.shape == (8, 48 // n, 64)
        ex.group = SINGLE  # this rank's partial sum (plus the bias) without the all_sum
        gathered = _on_cpu(lambda: np.array(ex(x, idx, w, grouped=False)))
        grouped = _on_cpu(lambda: np.array(ex(x, idx, w, grouped=True)))
        assert np.array_equal(grouped, gathered), r
        total += grouped - bias
    want = _on_cpu(lambda: np.array(whole(x, idx, w, grouped=True)))
    np.testing.assert_allclose(total + bias, want, rtol=1e-5, atol=1e-5)


def test_prefill_groups_and_decode_gathers(monkeypatch):
    # the model's MoE block: a prefill of many (token, expert) rows runs
    # grouped; a decode step ([B, 1], even with as many rows) and a short
    # input stay gathered; GROUP_ROWS None turns grouping off
    args = gpt_oss.ModelArgs(hidden_size=64, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2,
                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                             vocab_size=32)
    moe = gpt_oss.MoE(args)
    rng = np.random.default_rng(3)
    moe.update({"router": {"weight": mx.array(rng.normal(size=(8, 64)).astype(np.float32)),
                           "bias": mx.zeros((8,))}})
    moe.experts.update({n: mx.array(rng.normal(size=v.shape).astype(np.float32) * 0.1)
                        for n, v in moe.experts.parameters().items()})
    moe.experts.relayout()
    calls = []
    orig = gpt_oss.Experts._grouped
    monkeypatch.setattr(gpt_oss.Experts, "_grouped", lambda self, *a: calls.append(a[1].size) or orig(self, *a))
    monkeypatch.setattr(gpt_oss, "GROUP_ROWS", 64)

    def run(B, L):
        x = mx.array(rng.normal(size=(B, L, 64)).astype(np.float32))
        calls.clear()
        out = _on_cpu(lambda: np.array(moe(x)))
        return out, list(calls)

    _, c = run(1, 200)  # prefill: 400 rows
    assert c == [400]
    _, c = run(2, 32)  # two prompts prefilled together: 128 rows
    assert c == [128]
    _, c = run(64, 1)  # a batch decode step: 128 rows, one token each
    assert c == []
    _, c = run(1, 1)  # a decode step
    assert c == []
    _, c = run(1, 31)  # 62 rows: below GROUP_ROWS
    assert c == []
    monkeypatch.setattr(gpt_oss, "GROUP_ROWS", None)
    _, c = run(1, 200)
    assert c == []
