"""How ranks split a dimension, on paper: pure integer and rational
arithmetic (no MLX), so every rank computes the same cut and the CLI checks
a split before launch.

    split_counts / split_ranges   contiguous shares, even or by rank weights
    head_partition / head_ranges  q heads in whole KV groups, their KV heads
    kv_slots / slot_ranges        the KV heads a rank holds, the rows it reads
    expert_ranges / moe_split     whole routed experts per rank (--moe-split)

shard.py applies these cuts to a model's layers.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import TYPE_CHECKING

from ..errors import UserError

if TYPE_CHECKING:
    from .collectives import Group


def _check_weights(size: int, weights) -> list[Fraction]:
    if size < 1:
        raise UserError(f"bad rank count {size}")
    if weights is None:
        return [Fraction(1)] * size
    if len(weights) != size:
        raise UserError(f"{len(weights)} rank weights for {size} ranks")
    out = [Fraction(w) for w in weights]  # exact: every rank computes the same split
    if any(w <= 0 for w in out):
        raise UserError(f"rank weights must be positive, got {', '.join(map(str, weights))}")
    return out


def split_counts(units: int, size: int, weights=None) -> list[int]:
    """How many of `units` each of `size` ranks gets: every rank at least one,
    shares proportional to `weights` (default: equal) by largest remainders
    (ties to the lower rank), so with equal weights they differ by at most one.
    Pure integer/rational arithmetic: every rank computes the same answer.
    UserError when there are fewer units than ranks."""
    w = _check_weights(size, weights)
    if units < size:
        raise UserError(f"{size} ranks cannot split {units}")
    total = sum(w)
    quota = [units * x / total for x in w]
    counts = [int(q) for q in quota]  # floor (quotas are non-negative)
    order = sorted(range(size), key=lambda r: (-(quota[r] - counts[r]), r))
    for r in order[: units - sum(counts)]:
        counts[r] += 1
    # every rank needs at least one unit: take them from the largest shares
    for r in range(size):
        while counts[r] == 0:
            donor = max((i for i in range(size) if counts[i] > 1), key=lambda i: (counts[i] - quota[i], counts[i], -i))
            counts[donor] -= 1
            counts[r] += 1
    return counts


def split_ranges(total: int, size: int, weights=None, unit: int = 1, what: str | None = None) -> list[tuple]:
    """Contiguous [start, stop) of `total` per rank, cut only at multiples of
    `unit` (a quantization group), shares as `split_counts` gives them.
    UserError naming `what` when no such cut exists."""
    units = total // unit
    if total % unit or units < size:
        what = what or "a dimension"
        if unit > 1:
            raise UserError(f"{size} ranks cannot split {what} ({total}) at whole quantization groups of "
                            f"{unit}: there are {total / unit:g}")
        raise UserError(f"{size} ranks cannot split {what} ({total})")
    ranges, start = [], 0
    for c in split_counts(units, size, weights):
        ranges.append((start * unit, (start + c) * unit))
        start += c
    return ranges


def head_partition(n_heads: int, n_kv_heads: int, size: int, weights=None, unit: int = 1) -> list[tuple]:
    """Per rank (q_start, q_stop, kv_start, kv_stop): contiguous q head ranges
    covering every head once, and the KV heads exactly those queries use (q
    head h uses KV head h // (n_heads // n_kv_heads)).

    With at least `size` KV heads, ranks get whole KV-head groups (split as
    `split_counts`: equal weights give counts within one group of each other)
    and no KV head is on two ranks. With fewer, the q heads themselves are
    split (within one head of each other), and a KV head whose group spans
    two ranks is held by both. `unit`: q heads per cut besides that (whole
    quantization groups of o_proj's input). UserError when a rank would get
    no q head (or no cut exists)."""
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise UserError(f"{n_heads} attention heads are not a multiple of {n_kv_heads} KV heads")
    if size > n_heads:
        raise UserError(
            f"{size} ranks cannot split {n_heads} attention heads ({n_kv_heads} KV heads): "
            f"use at most {n_heads} ranks"
        )
    g = n_heads // n_kv_heads  # q heads per KV head
    step = math.lcm(g if n_kv_heads >= size else 1, unit)
    if n_heads % step or n_heads // step < size:
        raise UserError(f"{size} ranks cannot split {n_heads} attention heads at o_proj's quantization groups "
                        f"({unit} heads each)")
    out = []
    for q0, q1 in split_ranges(n_heads, size, weights, step):
        out.append((q0, q1, q0 // g, (q1 - 1) // g + 1))
    return out


def head_ranges(total_heads: int, total_kv_heads: int, n: int, r: int, weights=None, unit: int = 1):
    """(q head range, kv head range) for rank r of n (`head_partition`), or UserError."""
    if n < 1 or not 0 <= r < n:
        raise UserError(f"bad rank {r} of {n}")
    q0, q1, kv0, kv1 = head_partition(total_heads, total_kv_heads, n, weights, unit)[r]
    return (q0, q1), (kv0, kv1)


def kv_slots(q0: int, q1: int, n_heads: int, n_kv_heads: int) -> list[int]:
    """The KV heads a rank's attention holds, in order, so that local q head i
    uses slot i // m for one m (the plain GQA layout every attention kernel
    takes): the KV heads q0..q1-1 use, each repeated run/m times, m the gcd
    of the runs of q heads per KV head. Whole groups (or part of one): each
    KV head once. A range that cuts groups unevenly (e.g. heads 3-5 with 4
    per KV head: runs 1, 2) repeats a KV head (slots 0, 1, 1): the rank
    computes it twice, which is exact (the same rows of k_proj/v_proj)."""
    g = n_heads // n_kv_heads
    runs = []
    for h in range(q0, q1):
        if runs and runs[-1][0] == h // g:
            runs[-1][1] += 1
        else:
            runs.append([h // g, 1])
    m = math.gcd(*(c for _, c in runs))
    return [kv for kv, c in runs for _ in range(c // m)]


def slot_ranges(slots, width: int = 1, offset: int = 0) -> list[tuple]:
    """Row ranges of `slots` (heads of `width` rows each, after `offset` rows),
    neighbouring heads merged: what the loader reads."""
    out = []
    for s in slots:
        a, b = offset + s * width, offset + (s + 1) * width
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


MOE_SPLITS = ("intermediate", "experts")


def moe_split(group: Group) -> str:
    """The group's routed-expert placement (--moe-split, parsed on every rank
    like --rank-weights): "intermediate" (default) or "experts"."""
    return getattr(group, "moe_split", None) or "intermediate"


def expert_ranges(num_experts: int, size: int, weights=None) -> list[tuple]:
    """Whole experts per rank under expert placement: contiguous [e0, e1),
    shares as `split_ranges` gives them (weights respected)."""
    return split_ranges(num_experts, size, weights, what="the routed experts")
