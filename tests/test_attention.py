"""causal_attention against a dense numpy reference."""

import mlx.core as mx
import numpy as np
import pytest

from mlxcel_dist.nn.attention import causal_attention
from mlxcel_dist.nn.masks import create_sliding_window_prefill_mask


def reference(q, k, v, scale, window=None, softcap=None, sinks=None):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, H, L, D = q.shape
    S, Hkv = k.shape[2], k.shape[1]
    k = np.repeat(k, H // Hkv, axis=1)
    v = np.repeat(v, H // Hkv, axis=1)
    s = q @ k.transpose(0, 1, 3, 2) * scale
    if softcap:
        s = np.tanh(s / softcap) * softcap
    qp = np.arange(S - L, S)[:, None]
    kp = np.arange(S)[None, :]
    ok = kp <= qp
    if window:
        ok &= kp > qp - window
    s = np.where(ok, s, -np.inf)
    if sinks is not None:
        sk = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None], (B, H, L, 1))
        s = np.concatenate([sk, s], -1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if sinks is not None:
        p = p[..., 1:]
    return p @ v


def rand(*shape, seed=0):
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


@pytest.mark.parametrize("H,Hkv", [(4, 4), (8, 2), (4, 1)])
@pytest.mark.parametrize("L,S,window", [(20, 20, 6), (7, 30, 6), (1, 30, 6), (12, 12, None), (1, 9, None), (5, 5, 8)])
def test_matches_dense_reference(H, Hkv, L, S, window):
    q, k, v = rand(1, H, L, 16, seed=1), rand(1, Hkv, S, 16, seed=2), rand(1, Hkv, S, 16, seed=3)
    out = np.array(causal_attention(q, k, v, 0.25, window))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, reference(q, k, v, 0.25, window), atol=2e-5)


def test_over_window_prefill_with_model_mask_is_finite_and_exact():
    # The selector's mask passed in (as models do) gives the same answer.
    L, W = 40, 8
    q, k, v = rand(1, 4, L, 8, seed=4), rand(1, 2, L, 8, seed=5), rand(1, 2, L, 8, seed=6)
    mask = create_sliding_window_prefill_mask(L, 0, W)
    out = np.array(causal_attention(q, k, v, 0.3, W, mask=mask))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, reference(q, k, v, 0.3, W), atol=2e-5)


def test_decode_past_window_attends_trailing_window_only():
    S, W = 25, 5
    q, k, v = rand(1, 2, 1, 8, seed=7), rand(1, 2, S, 8, seed=8), rand(1, 2, S, 8, seed=9)
    out = np.array(causal_attention(q, k, v, 0.5, W))
    np.testing.assert_allclose(out, reference(q, k, v, 0.5, W), atol=2e-5)
    # and it differs from attending everything, so the window really applies
    assert not np.allclose(out, reference(q, k, v, 0.5, None), atol=1e-3)


@pytest.mark.parametrize("window", [None, 6])
def test_softcap_and_sinks(window):
    L = S = 15
    q, k, v = rand(1, 4, L, 8, seed=10) * 3, rand(1, 2, S, 8, seed=11) * 3, rand(1, 2, S, 8, seed=12)
    sinks = mx.array(np.array([0.5, -1.0, 2.0, 0.0], np.float32))
    out = np.array(causal_attention(q, k, v, 0.5, window, softcap=2.0))
    np.testing.assert_allclose(out, reference(q, k, v, 0.5, window, softcap=2.0), atol=2e-5)
    out = np.array(causal_attention(q, k, v, 0.5, window, sinks=sinks))
    np.testing.assert_allclose(out, reference(q, k, v, 0.5, window, sinks=sinks), atol=2e-5)
    out = np.array(causal_attention(q, k, v, 0.5, window, softcap=2.0, sinks=sinks))
    np.testing.assert_allclose(out, reference(q, k, v, 0.5, window, softcap=2.0, sinks=sinks), atol=2e-5)


def test_mask_width_mismatch_is_an_error():
    q, k, v = rand(1, 2, 3, 8), rand(1, 2, 6, 8), rand(1, 2, 6, 8)
    with pytest.raises(ValueError):
        causal_attention(q, k, v, 1.0, 4, mask=create_sliding_window_prefill_mask(3, 2, 4))
