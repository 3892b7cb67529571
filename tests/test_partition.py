"""The uneven tensor-parallel split (partition.head_partition, split_counts,
split_ranges, kv_slots) as properties over head counts, KV counts, rank
counts and rank weights."""

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxcel_dist.errors import UserError
from mlxcel_dist.parallel.partition import head_partition, kv_slots, split_counts, split_ranges


@st.composite
def heads_and_ranks(draw, weighted=False):
    kv = draw(st.integers(1, 16))
    g = draw(st.integers(1, 8))
    size = draw(st.integers(1, kv * g))
    weights = None
    if weighted:
        weights = draw(st.lists(st.integers(1, 9), min_size=size, max_size=size))
    return kv * g, kv, size, weights


def _check_partition(H, KV, size, weights):
    parts = head_partition(H, KV, size, weights)
    g = H // KV
    assert len(parts) == size
    # every q head on exactly one rank, contiguous, in rank order
    assert parts[0][0] == 0 and parts[-1][1] == H
    for (a, b, _, _), (c, _, _, _) in zip(parts, parts[1:]):
        assert b == c
    for q0, q1, kv0, kv1 in parts:
        assert q1 > q0  # no rank idle
        # exactly the KV heads its q heads use
        assert set(range(kv0, kv1)) == {h // g for h in range(q0, q1)}
        if KV >= size:  # whole KV-head groups: no KV head on two ranks
            assert q0 % g == 0 and q1 % g == 0
    return parts, g


@settings(max_examples=300, deadline=None)
@given(heads_and_ranks())
def test_even_partition(case):
    H, KV, size, _ = case
    parts, g = _check_partition(H, KV, size, None)
    shares = [q1 - q0 for q0, q1, _, _ in parts]
    # as even as possible: within one unit (a KV group when groups are split whole, else one head)
    unit = g if KV >= size else 1
    assert max(shares) - min(shares) <= unit
    if H % size == 0 and (KV % size == 0 or size % KV == 0):  # the old even rule gives the same split
        per = H // size
        assert shares == [per] * size


@settings(max_examples=300, deadline=None)
@given(heads_and_ranks(weighted=True))
def test_weighted_partition(case):
    H, KV, size, weights = case
    parts, g = _check_partition(H, KV, size, weights)
    unit = g if KV >= size else 1
    units = [(q1 - q0) // unit for q0, q1, _, _ in parts]
    total = sum(units)
    quota = [Fraction(total * w, sum(weights)) for w in weights]
    if all(q >= 1 for q in quota):  # proportional: within one unit of the exact quota
        assert all(abs(u - q) < 1 for u, q in zip(units, quota))
    # heavier ranks never get fewer units
    for i in range(size):
        for j in range(size):
            if weights[i] > weights[j]:
                assert units[i] >= units[j]


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 12), st.sampled_from([1, 1, 32, 64]), st.data())
def test_split_ranges(total, size, unit, data):
    total = total * unit
    weights = data.draw(st.one_of(st.none(), st.lists(st.integers(1, 9), min_size=size, max_size=size)))
    if total // unit < size:
        with pytest.raises(UserError):
            split_ranges(total, size, weights, unit, "x")
        return
    ranges = split_ranges(total, size, weights, unit, "x")
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(b == c for (_, b), (c, _) in zip(ranges, ranges[1:]))
    assert all(s % unit == 0 and e % unit == 0 and e > s for s, e in ranges)
    counts = [(e - s) // unit for s, e in ranges]
    if weights is None:
        assert max(counts) - min(counts) <= 1
    assert counts == split_counts(total // unit, size, weights)


@settings(max_examples=300, deadline=None)
@given(heads_and_ranks())
def test_kv_slots_make_plain_gqa(case):
    H, KV, size, _ = case
    g = H // KV
    for q0, q1, kv0, kv1 in head_partition(H, KV, size):
        slots = kv_slots(q0, q1, H, KV)
        n = q1 - q0
        assert n % len(slots) == 0
        m = n // len(slots)
        # local q head i reads slot i // m, which holds the KV head it uses
        assert all(slots[i // m] == (q0 + i) // g for i in range(n))
        assert sorted(set(slots)) == list(range(kv0, kv1))
        if q0 % g == 0 and (q1 % g == 0 or kv1 - kv0 == 1):  # whole (or part of one) group: no repeats
            assert slots == list(range(kv0, kv1))


def test_examples():
    # the case: 4 heads, 2 KV heads, 3 ranks
    assert head_partition(4, 2, 3) == [(0, 2, 0, 1), (2, 3, 1, 2), (3, 4, 1, 2)]
    # 8 heads, 2 KV heads: the middle rank holds both KV heads
    assert head_partition(8, 2, 3) == [(0, 3, 0, 1), (3, 6, 0, 2), (6, 8, 1, 2)]
    assert kv_slots(3, 6, 8, 2) == [0, 1, 1]
    # 8 heads, 4 KV heads: whole groups of 2
    assert head_partition(8, 4, 3) == [(0, 4, 0, 2), (4, 6, 2, 3), (6, 8, 3, 4)]
    assert head_partition(8, 4, 3, [1, 1, 2]) == [(0, 2, 0, 1), (2, 4, 1, 2), (4, 8, 2, 4)]
    assert split_ranges(256, 3) == [(0, 86), (86, 171), (171, 256)]
    assert split_ranges(10, 3, [3, 1, 1]) == [(0, 6), (6, 8), (8, 10)]
    with pytest.raises(UserError, match="5 ranks cannot split 4 attention heads"):
        head_partition(4, 2, 5)
    with pytest.raises(UserError, match="down_proj"):
        split_ranges(128, 3, unit=64, what="down_proj's inputs")
    assert math.gcd(1) == 1
