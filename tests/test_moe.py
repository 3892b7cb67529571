"""gpt_oss's expert matmul on the CPU with half-precision weights: casting only
the routed experts (fewer (row, expert) pairs than experts, as in decode) must
give exactly what casting every expert gives (the fixtures have 2-6 experts,
so their decode steps rarely take the routed path)."""

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


@pytest.mark.parametrize("rows,k", [(40, 4), (17, 2)])
def test_sorted_rows_equal_unsorted_on_cpu(rows, k, monkeypatch):
    # the sorted-by-expert path (mlx-lm's SwitchGLU steps) is bit-identical to
    # the unsorted one on the CPU (fp32): the same products, in another row order
    ex, rng = _experts(seed=rows)
    ex.relayout()
    x = mx.array(rng.normal(size=(rows, 64)).astype(np.float32))
    idx = mx.array(np.stack([rng.choice(8, k, replace=False) for _ in range(rows)]).astype(np.uint32))
    w = mx.softmax(mx.array(rng.normal(size=(rows, k)).astype(np.float32)), axis=-1)
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        monkeypatch.setattr(gpt_oss, "SORT_ROWS", None)
        unsorted = np.array(ex(x, idx, w))
        monkeypatch.setattr(gpt_oss, "SORT_ROWS", 1)
        calls = []
        orig = gpt_oss.Experts._sorted
        monkeypatch.setattr(gpt_oss.Experts, "_sorted", lambda self, *a: calls.append(1) or orig(self, *a))
        sorted_ = np.array(ex(x, idx, w))
        assert calls == [1]
    finally:
        mx.set_default_device(device)
    assert np.array_equal(sorted_, unsorted)
    # and both are the dense per-row products
    xs, wi = np.array(x), np.array(idx)
    gu_w, gu_b = np.array(ex.gate_up_proj), np.array(ex.gate_up_proj_bias)
    dn_w, dn_b = np.array(ex.down_proj), np.array(ex.down_proj_bias)
    ref = np.zeros((rows, 64))
    for r in range(rows):
        for j in range(k):
            e = wi[r, j]
            gu = xs[r] @ gu_w[e] + gu_b[e]
            g, u = np.minimum(gu[::2], 7.0), np.clip(gu[1::2], -7.0, 7.0)
            h = (u + 1) * g / (1 + np.exp(-1.702 * g))
            ref[r] += np.array(w)[r, j] * (h @ dn_w[e] + dn_b[e])
    np.testing.assert_allclose(unsorted, ref, rtol=1e-4, atol=1e-5)
