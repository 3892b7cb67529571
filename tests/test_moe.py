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
