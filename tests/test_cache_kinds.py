"""Each cache kind's interface (mlxcel_dist/cache/, one module a kind): a
snapshot restored gives back exactly what was held, and feeding on from it
gives what the cache gave before; a trim (where the kind can: keys, not a
state) drops exactly the last tokens; the static form's buffers are named
as `held()` hands them over; the prompt cache's entries of an eager cache
and of a row agree."""

import mlx.core as mx
import numpy as np
import pytest

from mlxcel_dist.cache import (ChunkedKVCache, ConvKVCache, DeltaNetCache, KVCache, LatentCache, QuantizedKV,
                               QuantizedKVCache, RecurrentCache, RotatingKVCache, SharedKVCache, StateCache,
                               StaticConvKV, StaticState)

H, D, W = 2, 32, 6  # kv heads, head_dim (a whole quantization group), window / chunk

KINDS = {
    "full": KVCache,
    "latent": LatentCache,
    "sliding": lambda: RotatingKVCache(W),
    "chunked": lambda: ChunkedKVCache(W),
    "quantized": lambda: QuantizedKVCache(4, 32),
    "recurrent": RecurrentCache,
    "deltanet": DeltaNetCache,
    "conv_full": lambda: ConvKVCache(KVCache(), 3),
    "conv_sliding": lambda: ConvKVCache(RotatingKVCache(W), 3),
}
KEYS = ["full", "latent", "sliding", "chunked", "quantized"]  # trimmable while every position is held


def _flat(xs) -> list:
    return [np.array(p) for x in xs for p in (x.parts if isinstance(x, QuantizedKV) else (x,))]


def feed(c, n: int, seed: int) -> list:
    """n new tokens (random, reproducible by seed) into c; what it returned."""
    rng = np.random.default_rng(seed)

    def rand(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    if isinstance(c, StateCache):
        conv, h = rand(1, 3, 8), rand(1, 8)
        c.update(conv, h, n)
        return _flat([conv, h])
    if isinstance(c, ConvKVCache):
        c.update_conv(rand(1, 2, H, D), rand(1, 2, H, D))
    k, v = rand(1, H, n, D), rand(1, H, n, D)
    return _flat(c.update_and_fetch(k, v))


def held(c) -> list:
    """What c holds, keys/values oldest first, then its state arrays."""
    kv, states = c.held()
    return _flat(kv + states)


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, b))


SCHEDULES = [[5, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1], [9, 2, 1], [3, 4]]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("kind", KINDS)
def test_a_restored_snapshot_holds_and_continues_exactly(kind, schedule):
    # Snapshot after the first updates, feed more, restore (in place and into a
    # fresh cache, as the prompt cache does): the same arrays, the same offset,
    # and the next update returns what it returned the first time.
    c = KINDS[kind]()
    for i, n in enumerate(schedule[:-1]):
        feed(c, n, i)
    snap, before, offset = c.snapshot(), held(c), c.offset
    first = feed(c, schedule[-1], 99)
    feed(c, 2, 7)
    for target in (c, KINDS[kind]()):
        target.restore_snapshot(snap)
        assert target.offset == offset and same(held(target), before)
        assert same(feed(target, schedule[-1], 99), first)


@pytest.mark.parametrize("kind", KEYS)
@pytest.mark.parametrize("prefix,more", [(3, 2), (1, 1), (4, 1)])
def test_a_trim_drops_exactly_the_last_tokens(kind, prefix, more):
    # Snapshot, feed `more` tokens one at a time (draft rollback's case), trim
    # them: the snapshot's arrays and offset, and the next update returns what
    # it returned from the snapshot.
    c = KINDS[kind]()
    feed(c, prefix, 0)
    before, offset = held(c), c.offset
    ref = KINDS[kind]()
    ref.restore_snapshot(c.snapshot())
    for j in range(more):
        feed(c, 1, 10 + j)
    assert c.can_trim(more)
    c.trim(more)
    assert c.offset == offset and same(held(c), before)
    assert same(feed(c, 2, 42), feed(ref, 2, 42))
    assert same(feed(c, 1, 43), feed(ref, 1, 43))


@pytest.mark.parametrize("kind", ["sliding", "chunked"])
def test_a_ring_that_dropped_keys_cannot_trim(kind):
    # Past its window a ring (or a chunked cache's kept keys) no longer holds
    # every position: a trim would leave the next query short of keys.
    c = KINDS[kind]()
    feed(c, W + 3, 0)  # a long prefill keeps all its keys: still trimmable
    assert c.can_trim(2)
    feed(c, 2, 1)  # the next update keeps only the window
    assert not c.can_trim(1)
    with pytest.raises(ValueError):
        c.trim(1)


@pytest.mark.parametrize("kind", ["recurrent", "deltanet", "conv_full", "conv_sliding"])
def test_a_state_is_never_trimmed(kind):
    c = KINDS[kind]()
    feed(c, 3, 0)
    assert not c.can_trim(1)
    with pytest.raises(ValueError):
        c.trim(1)


def test_a_shared_layer_holds_nothing_of_its_own():
    src = KVCache()
    c = SharedKVCache(src, 0)
    feed(src, 3, 0)
    assert c.snapshot() is None and c.kept() is None and c.held() == ([], [])
    assert c.can_trim(2) and c.static_form == "shared"
    c.trim(2)  # its source trims
    assert src.offset == 3


@pytest.mark.parametrize("kind", KINDS)
def test_the_static_form_names_what_held_hands_over(kind):
    # held() gives the static buffers' arrays in buffer_names' order; the
    # row view writes exactly those buffers.
    c = KINDS[kind]()
    feed(c, 4, 0)
    kv, states = c.held()
    kv_names, state_names = c.buffer_names(3)
    assert len(kv) == len(kv_names) and len(states) == len(state_names)
    buffers = {"pos": mx.zeros((1,), mx.int32)}
    for name, x in zip([*kv_names, *state_names], [*kv, *states]):
        buffers[name] = mx.zeros_like(x)
    view = c.row_view(buffers, 3, [])
    if isinstance(view, StaticConvKV):
        assert list(view.names) == list(kv_names) and view.conv.names == list(state_names)
    elif isinstance(view, StaticState):
        assert view.names == list(state_names)
    else:
        assert list(view.names) == list(kv_names)
    assert c.static_form is not None


@pytest.mark.parametrize("kind", ["full", "latent", "sliding", "chunked", "quantized", "recurrent", "deltanet"])
def test_the_prompt_cache_entry_of_a_row_is_the_eager_caches(kind):
    # What the prompt cache keeps of an eager cache (`kept`) and of a row's
    # arrays (`entry`, from `held()`'s form) are the same; restoring it
    # (`restore_kept`) into a fresh cache holds the same and continues alike.
    c = KINDS[kind]()
    feed(c, 5, 0)
    kept = c.kept()
    kv, states = c.held()
    entry = c.entry(kv, states, c.offset)
    assert c.cacheable
    if states:  # a state: a Snapshot of its arrays, then the offset
        assert entry.state[-1] == kept.state[-1] == c.offset
        assert same([np.array(x) for x in entry.arrays], [np.array(x) for x in kept.arrays])
    else:  # keys: (keys, values), QuantizedKVs under --kv-bits
        assert same(_flat(entry), _flat(kept))
    fresh = KINDS[kind]()
    fresh.restore_kept(kept, c.offset)
    assert fresh.offset == c.offset and same(held(fresh), held(c))
    assert same(feed(fresh, 1, 5), feed(c, 1, 5))


def test_conv_and_views_are_not_kept():
    assert not ConvKVCache(KVCache(), 3).cacheable
    from mlxcel_dist.cache import PrefixViewCache

    v = PrefixViewCache(KVCache())
    assert not v.cacheable and v.static_form is None and v.snapshot() is None
