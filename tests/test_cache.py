"""The cache protocol (cache.LayerCache): masks each cache kind asks for, and
layers that read another layer's KV (SharedKVCache) in every feeding mode,
eager and on decode.py's static buffers."""

from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxcel_dist.nn.attention import causal_attention
from mlxcel_dist.cache import FULL, SLIDING, KVCache, RotatingKVCache, SharedKVCache, make_layer_caches
from mlxcel_dist.engine.generation import sequence_logits
from mlxcel_dist.models.base import Capabilities
from mlxcel_dist.cache import layer_masks
from mlxcel_dist.nn.masks import CAUSAL, create_causal_mask, create_causal_mask_with_window_full

WINDOW = 4


@pytest.mark.parametrize("chunks", [[1, 1, 1], [3, 1, 1], [6, 2, 1, 5], [2, 9, 1]])
def test_each_cache_asks_for_the_mask_its_keys_need(chunks):
    # Before each update, the cache's mask has exactly as many keys as the
    # update returns, and it is the windowed causal mask over their positions.
    rot, full = RotatingKVCache(WINDOW), KVCache()
    for n in chunks:
        for c in (rot, full):
            m, before = c.mask(n), c.offset
            k = mx.arange(before, before + n, dtype=mx.float32).reshape(1, 1, n, 1)
            keys, _ = c.update_and_fetch(k, k)
            pos = np.array(keys).reshape(-1).astype(int)
            if n == 1:
                assert m is None
                if c is rot:  # the ring hands a single query exactly its window
                    assert sorted(pos) == list(range(max(0, before + 1 - WINDOW), before + 1))
                continue
            want = (pos[None, :] <= np.arange(before, before + n)[:, None])
            if c is rot:
                want &= pos[None, :] > np.arange(before, before + n)[:, None] - WINDOW
            if isinstance(m, str):  # "causal": queries aligned to the last keys
                assert m == CAUSAL
                got = np.arange(len(pos))[None, :] <= np.arange(len(pos) - n, len(pos))[:, None]
            else:
                got = np.array(m)
            assert got.shape == want.shape and (got == want).all(), (n, before)
            assert c.last[2] == before


class SharedToy(nn.Module, Capabilities):
    """Four single-head attention layers without RoPE (sliding, full, then a
    sliding and a full layer that read layers 0 and 1's KV, as Gemma 3n/4's
    last layers do), residual, tied head."""

    kinds = [SLIDING, FULL, SLIDING, FULL]
    reads = {2: 0, 3: 1}

    def __init__(self, vocab=23, dim=8):
        super().__init__()
        self.args = SimpleNamespace(vocab_size=vocab, layer_types=self.kinds)
        self.engine = None  # the model contract's slot (generation.batch_engine)
        self.embed = nn.Embedding(vocab, dim)
        self.q = [nn.Linear(dim, dim, bias=False) for _ in self.kinds]
        self.kv = [nn.Linear(dim, 2 * dim, bias=False) for i in range(len(self.kinds)) if i not in self.reads]

    def make_cache(self):
        caches = make_layer_caches(self.kinds, WINDOW)
        for i, j in self.reads.items():
            caches[i] = SharedKVCache(caches[j], j)
        return caches

    def __call__(self, inputs, cache=None):
        cache = self.make_cache() if cache is None else cache
        L = inputs.shape[1]
        masks = layer_masks(L, cache, self.kinds, WINDOW)
        h = self.embed(inputs)
        for i, kind in enumerate(self.kinds):
            q = self.q[i](h)[:, None]  # [B, 1, L, D]
            if i in self.reads:
                k, v = cache[i].fetch()
            else:
                k, v = mx.split(self.kv[i](h)[:, None], 2, axis=-1)
                k, v = cache[i].update_and_fetch(k, v)
            window = WINDOW if kind == SLIDING else None
            h = h + causal_attention(q, k, v, scale=0.5, window=window, mask=masks[kind])[:, 0]
        return self.embed.as_linear(h)

    def reference(self, ids):
        """Dense full-sequence forward: every layer sees all keys through the windowed mask of its kind."""
        h = self.embed(mx.array(ids)[None])
        T = len(ids)
        kv = {}
        for i, kind in enumerate(self.kinds):
            q = self.q[i](h)[:, None]
            src = self.reads.get(i, i)
            if src == i:
                kv[i] = mx.split(self.kv[i](h)[:, None], 2, axis=-1)
            k, v = kv[src]
            mask = create_causal_mask_with_window_full(T, 0, WINDOW) if kind == SLIDING else create_causal_mask(T)
            h = h + mx.fast.scaled_dot_product_attention(q, k, v, scale=0.5, mask=mask)[:, 0]
        return np.array(self.embed.as_linear(h)[0])


@pytest.mark.parametrize("mode", [dict(), dict(prefill_step=3), dict(decode_from=2), dict(decode_from=7),
                                  dict(decode_from=9, prefill_step=2), dict(decode_from=1)])
@pytest.mark.parametrize("compiled", [True, False])
def test_shared_kv_layers_match_the_dense_reference(mode, compiled, monkeypatch):
    import mlxcel_dist.engine.decode as decode

    monkeypatch.setattr(decode, "STEP", 4)  # decode crosses regrowths and wraps the sliding ring
    mx.random.seed(3)
    model = SharedToy()
    ids = np.random.default_rng(0).integers(0, 23, 21)
    want = model.reference(ids)
    got = sequence_logits(model, ids, compiled=compiled, **mode)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, err_msg=str(mode))


def test_shared_cache_reports_the_source_offset_and_mask():
    src = RotatingKVCache(WINDOW)
    shared = SharedKVCache(src, 0)
    with pytest.raises(RuntimeError, match="not been updated"):
        shared.fetch()
    x = mx.zeros((1, 1, 6, 2))
    assert (np.array(shared.mask(6)) == np.array(src.mask(6))).all()
    k, _ = src.update_and_fetch(x, x)
    assert shared.offset == 0 and shared.fetch()[0] is k and shared.window == WINDOW
    src.update_and_fetch(x[:, :, :1], x[:, :, :1])
    assert shared.offset == 6
