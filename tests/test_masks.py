"""Property tests for the shared mask builders and their agreement with the caches."""

import itertools

import mlx.core as mx
import numpy as np
import pytest

from mlxcel_dist.nn.attention import causal_attention
from mlxcel_dist.cache import KVCache, RotatingKVCache, layer_masks
from mlxcel_dist.nn.masks import (
    CAUSAL,
    create_causal_mask,
    create_causal_mask_with_window,
    create_causal_mask_with_window_full,
    create_sliding_window_prefill_mask,
)


def dense(size, offset, num_keys, window=None):
    """Reference by definition: query at offset+q sees key at position p iff
    p <= q_pos and (no window or q_pos - window < p)."""
    end = offset + size
    m = np.zeros((size, num_keys), bool)
    for qi in range(size):
        qp = offset + qi
        for ki in range(num_keys):
            kp = end - num_keys + ki
            m[qi, ki] = kp <= qp and (window is None or kp > qp - window)
    return m


SWEEP = [(s, o, w) for s in (1, 2, 3, 5, 8, 13) for o in (0, 1, 4, 7, 12, 30) for w in (1, 2, 4, 8, 16)]


@pytest.mark.parametrize("size,offset", [(s, o) for s in (1, 3, 8) for o in (0, 5)])
def test_causal_mask_matches_definition(size, offset):
    m = np.array(create_causal_mask(size, offset))
    assert m.shape == (size, offset + size)
    np.testing.assert_array_equal(m, dense(size, offset, offset + size))


def test_full_window_mask_matches_definition_and_no_empty_row():
    for size, offset, window in SWEEP:
        m = np.array(create_causal_mask_with_window_full(size, offset, window))
        assert m.shape == (size, offset + size)
        np.testing.assert_array_equal(m, dense(size, offset, offset + size, window))
        assert m.any(axis=1).all(), (size, offset, window)
        # every query sees exactly min(window, its position + 1) keys
        np.testing.assert_array_equal(m.sum(1), np.minimum(window, offset + np.arange(size) + 1))


def test_capped_mask_is_trailing_window_and_refuses_long_prefill():
    for size, offset, window in SWEEP:
        if size > window and size + offset > window:
            with pytest.raises(ValueError):
                create_causal_mask_with_window(size, offset, window)
            continue
        m = np.array(create_causal_mask_with_window(size, offset, window))
        keys = min(offset + size, window)
        assert m.shape == (size, keys)
        full = dense(size, offset, offset + size, window)
        np.testing.assert_array_equal(m, full[:, full.shape[1] - keys :])
        assert m.any(axis=1).all()


@pytest.mark.parametrize("size,kept,window", [(10, 0, 4), (9, 0, 1), (20, 0, 8), (7, 3, 4), (12, 7, 8)])
def test_long_prefill_attends_every_row_through_project_code(size, kept, window):
    # Why the capped form is refused past the window: the first queries of a
    # prefill longer than the window would see none of the trailing `window`
    # keys (an all -inf row: NaN). What models use instead must give every
    # query exactly its window. Checked through the project's own path:
    # layer_masks on a sliding cache that returned `kept` earlier keys, then
    # causal_attention with that mask and with the mask it derives itself.
    # Zero queries make the scores equal, so a query's output is the mean of
    # the one-hot values of the keys it attends: nonzero exactly there.
    cache = RotatingKVCache(window)
    if kept:
        cache.update_and_fetch(*_kv(range(kept)))  # kept < window: it keeps them all
    assert cache.sliding_offset == kept
    types = ["full_attention", "sliding_attention"]
    masks = layer_masks(size, [KVCache(), cache], types, window)
    assert masks["full_attention"] == CAUSAL
    mask = masks["sliding_attention"]
    assert not isinstance(mask, str), "a long sliding prefill needs a windowed mask"
    S = kept + size
    assert mask.shape == (size, S)
    q = mx.zeros((1, 2, size, 4))
    k = mx.zeros((1, 1, S, 4))
    v = mx.eye(S)[None, None]  # [1, 1, S, S]: value of key j is one-hot j
    positions = np.arange(S)
    for m in (mask, None):
        out = np.array(causal_attention(q, k, v, 1.0, window, mask=m))  # [1, 2, size, S]
        assert np.isfinite(out).all(), "a query row attended no key"
        for qi in range(size):
            qp = kept + qi
            want = (positions <= qp) & (positions > qp - window)
            for h in range(2):
                np.testing.assert_array_equal(out[0, h, qi] > 0, want)
                np.testing.assert_allclose(out[0, h, qi][want], 1 / want.sum(), rtol=1e-6)


def test_selector_regimes():
    W = 8
    # fresh prefill longer than the window: the full [size, size] windowed mask
    m = np.array(create_sliding_window_prefill_mask(20, 0, W))
    np.testing.assert_array_equal(m, dense(20, 0, 20, W))
    # cache rolled over: key axis == kept keys + new keys, windowed
    for kept, size in [(W - 1, 3), (W - 1, 20), (5, 4)]:
        m = np.array(create_sliding_window_prefill_mask(size, kept, W))
        assert m.shape == (size, kept + size)
        np.testing.assert_array_equal(m, dense(size, kept, kept + size, W))
    # within the window: identical to the capped builder
    for size, off in [(3, 0), (4, 4), (1, 7), (8, 0)]:
        np.testing.assert_array_equal(
            np.array(create_sliding_window_prefill_mask(size, off, W)),
            np.array(create_causal_mask_with_window(size, off, W)),
        )


def test_selector_never_has_empty_rows():
    for size, offset, window in SWEEP:
        kept = min(offset, window - 1)
        m = np.array(create_sliding_window_prefill_mask(size, kept, window))
        assert m.shape == (size, kept + size)
        assert m.any(axis=1).all()


def _kv(positions, H=1, D=2):
    # keys whose every feature is the token position, so returned keys reveal it
    p = mx.array(np.array(positions, np.float32))
    k = mx.broadcast_to(p[None, None, :, None], (1, H, len(positions), D))
    return k, k


@pytest.mark.parametrize("window", [1, 3, 8])
@pytest.mark.parametrize("seed", range(6))
def test_rotating_cache_returns_the_window_and_mask_agrees(window, seed):
    rng = np.random.default_rng(seed)
    cache, pos = RotatingKVCache(window), 0
    for _ in range(25):
        n = int(rng.choice([1, 1, 1, 2, 3, window, window + 2, 2 * window + 1]))
        kept = cache.sliding_offset
        keys, _ = cache.update_and_fetch(*_kv(range(pos, pos + n)))
        got = np.array(keys[0, 0, :, 0]).astype(int)
        assert cache.returned == len(got) == kept + n
        if n == 1:
            # ring order: the set of the last `window` positions
            assert sorted(got) == list(range(max(0, pos + 1 - window), pos + 1))
        else:
            # temporal order: up to window-1 earlier keys, then all new ones
            assert list(got) == list(range(pos - kept, pos + n))
            mask = np.array(create_sliding_window_prefill_mask(n, kept, window))
            assert mask.shape[1] == len(got)
            # mask by absolute positions == the definition
            for qi in range(n):
                qp = pos + qi
                np.testing.assert_array_equal(mask[qi], (got <= qp) & (got > qp - window))
        pos += n
        assert cache.offset == pos


def test_kv_cache_returns_everything():
    cache, pos = KVCache(), 0
    for n in [5, 1, 1, 300, 2, 1]:
        assert cache.sliding_offset == pos
        keys, values = cache.update_and_fetch(*_kv(range(pos, pos + n)))
        pos += n
        assert list(np.array(keys[0, 0, :, 0]).astype(int)) == list(range(pos))
        assert cache.returned == pos


def test_rows_mask_is_each_rows_mask_at_its_own_offset():
    # batch.py's prefill of several prompts: key slot = position (a full
    # layer), rows at different offsets; each row's mask is the single-offset
    # builder's over the keys it has, and nothing past them.
    from mlxcel_dist.nn.masks import create_rows_mask

    for size, window in [(s, w) for s in (1, 3, 8) for w in (None, 1, 4, 16)]:
        offsets = [0, 5, 12, 1]
        K = max(offsets) + size
        m = np.array(create_rows_mask(size, mx.array(offsets), mx.arange(K), window))
        assert m.shape == (len(offsets), 1, size, K)
        for b, o in enumerate(offsets):
            ref = create_causal_mask(size, o) if window is None else create_causal_mask_with_window_full(size, o, window)
            np.testing.assert_array_equal(m[b, 0, :, : o + size], np.array(ref))
            assert not m[b, 0, :, o + size :].any()
            assert m[b, 0].any(axis=1).all()


def test_rows_mask_on_a_ring_matches_definition():
    # A sliding layer's prefill ring (window + chunk slots): slot k holds the
    # latest position = k (mod R) before the chunk's end; -1 never written.
    from mlxcel_dist.nn.masks import create_rows_mask

    window, size = 4, 3
    R = window + size
    offsets = np.array([0, 2, 9, 20])
    end = offsets + size
    k = np.arange(R)
    pos = end[:, None] - 1 - (end[:, None] - 1 - k) % R
    m = np.array(create_rows_mask(size, mx.array(offsets), mx.array(pos), window))
    for b, o in enumerate(offsets):
        for q in range(size):
            qp = o + q
            want = [p >= 0 and qp - window < p <= qp for p in pos[b]]
            np.testing.assert_array_equal(m[b, 0, q], want)
            assert m[b, 0, q].sum() == min(window, qp + 1)  # every key of its window, once


# --------------------------------------------------------------------------- chunked attention (llama4)


def chunk_rule(qp: int, kp: int, chunk: int) -> bool:
    """By definition: key position kp visible to query position qp."""
    return 0 <= kp <= qp and kp // chunk == qp // chunk


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_chunked_mask_matches_definition_for_every_offset_and_length(chunk):
    from mlxcel_dist.nn.masks import create_chunked_mask

    for size in range(1, 14):
        for offset in range(0, 26):
            for num_keys in range(offset % chunk + size, offset + size + 1):
                m = np.array(create_chunked_mask(size, offset, chunk, num_keys))
                first = offset + size - num_keys  # the keys are the last num_keys positions
                want = [[chunk_rule(offset + q, first + k, chunk) for k in range(num_keys)] for q in range(size)]
                np.testing.assert_array_equal(m, want, err_msg=f"{size=} {offset=} {num_keys=} {chunk=}")
                assert m.any(axis=1).all()
    with pytest.raises(ValueError, match="cannot serve"):
        create_chunked_mask(3, 5, 4, 3)  # its first query (5) needs key 4, which is not among the keys


@pytest.mark.parametrize("chunk", [1, 3, 8])
@pytest.mark.parametrize("seed", range(4))
def test_chunked_cache_returns_its_chunk_and_mask_agrees(chunk, seed):
    # Updates of every size, aligned to the chunk or not (prefill chunks,
    # decode steps): the keys returned, masked as ChunkedKVCache.mask says,
    # are exactly each query's chunk up to itself.
    from mlxcel_dist.cache import ChunkedKVCache

    rng = np.random.default_rng(seed)
    cache, pos = ChunkedKVCache(chunk), 0
    assert cache.window == cache.chunk == chunk
    for _ in range(30):
        n = int(rng.choice([1, 1, 1, 2, 3, chunk, chunk + 1, 2 * chunk + 3]))
        mask = cache.mask(n)  # before the update, as layer_masks asks
        keys, _ = cache.update_and_fetch(*_kv(range(pos, pos + n)))
        got = np.array(keys[0, 0, :, 0]).astype(int)
        assert list(got) == list(range(pos - (len(got) - n), pos + n))  # oldest first, the new ones last
        assert len(got) - n == min(pos, chunk - 1)
        if mask is None or isinstance(mask, str):
            full = np.array(create_causal_mask(n, len(got) - n))
        else:
            full = np.array(mask)
        want = [[chunk_rule(pos + q, p, chunk) for p in got] for q in range(n)]
        np.testing.assert_array_equal(full, want, err_msg=f"{pos=} {n=} mask={mask!r}")
        pos += n


def test_layer_masks_builds_the_chunk_mask_once_per_kind():
    from mlxcel_dist.cache import CHUNKED, FULL, make_layer_caches

    kinds = [CHUNKED, FULL, CHUNKED]
    caches = make_layer_caches(kinds, None, 4)
    for c in caches:
        c.update_and_fetch(*_kv(range(6)))
    masks = layer_masks(5, caches, kinds, None, 4)
    assert set(masks) == {CHUNKED, FULL} and masks[FULL] == CAUSAL
    assert np.array(masks[CHUNKED]).shape == (5, 3 + 5)  # 3 kept keys (chunk - 1) + 5 new
    fresh = layer_masks(9, None, kinds, None, 4)  # a cache-less pass: what fresh caches need
    np.testing.assert_array_equal(np.array(fresh[CHUNKED]), [[chunk_rule(q, k, 4) for k in range(9)] for q in range(9)])


@pytest.mark.parametrize("chunk", [3, 8])
def test_static_decode_slots_of_a_chunked_layer_are_its_chunk(chunk):
    # decode.StaticCache on a chunked layer: position p in slot p % S (a ring
    # of `chunk` slots once that long); the visible slots 0 .. last_slot(p)
    # hold exactly the positions of p's chunk up to p.
    from mlxcel_dist.engine.decode import StaticCache

    for S in sorted({chunk, 2, 5} - {s for s in (2, 5) if s >= chunk}):
        for pos in range(0, 40 if S == chunk else S):
            state = {"pos": mx.array(pos, mx.int32), "k0": mx.zeros((1, 1, S, 1)), "v0": mx.zeros((1, 1, S, 1))}
            view = StaticCache(state, 0, chunk, chunk)
            held = {view.slot(p): p for p in range(pos + 1)}  # the latest position written to each slot
            m = np.array(view.mask(1))[0]
            want = [j in held and chunk_rule(pos, held[j], chunk) for j in range(S)]
            np.testing.assert_array_equal(m, want, err_msg=f"{S=} {pos=}")
            assert m.sum() == pos % chunk + 1


def test_rows_mask_with_a_chunk_matches_definition():
    # batch.py's per-row masks (prompts prefilled together, decode rows at
    # their own positions) on a ring of chunk + prefill-chunk slots: row b's
    # query sees the slots holding positions of its own attention chunk.
    from mlxcel_dist.nn.masks import create_rows_mask

    for chunk, size in [(4, 3), (8, 5), (3, 1)]:
        R = chunk + size
        offsets = np.array([0, 2, 9, 20, 13])
        end = offsets + size
        pos = end[:, None] - 1 - (end[:, None] - 1 - np.arange(R)) % R  # slot k: latest position = k mod R
        m = np.array(create_rows_mask(size, mx.array(offsets), mx.array(pos), chunk=chunk))
        for b, o in enumerate(offsets):
            for q in range(size):
                qp = o + q
                np.testing.assert_array_equal(m[b, 0, q], [chunk_rule(qp, p, chunk) for p in pos[b]])
                assert m[b, 0, q].sum() == qp % chunk + 1  # every key of its chunk, once
