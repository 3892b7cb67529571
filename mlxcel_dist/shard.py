"""Tensor parallelism: one helper per block kind, applied after construction.

Any rank count that is at most the q heads works, evenly or not
(`head_partition`, `split_ranges`): shares are contiguous, as even as the
units allow, or proportional to the group's rank weights (--rank-weights).

Attention: rank r holds a contiguous range of q heads, in whole KV-head groups
when there are at least N groups, else as even a split of the q heads as
possible, and exactly the KV heads those queries use (a KV head whose group
spans two ranks is held by both); q/k/v become all-to-sharded, o_proj
sharded-to-all (one all_sum). MLP: gate/up all-to-sharded by columns, down
sharded-to-all (one all_sum). Norms, embeddings and the head weights stay
replicated (the head's work is split by vocabulary rows).

The helpers run before any weight is read: they swap in sharded layers whose
parameters are still lazy placeholders and attach a `ShardSpec` saying which
slice of each checkpoint tensor this rank needs, so the loader reads only that.

MLX-quantized layers (quant.py) run before sharding, so q/k/v/gate/up may be
QuantizedLinear; they become QuantizedAllToShardedLinear (rows of the packed
weight, scales and biases) and o/down QuantizedShardedToAllLinear (the input
slice in packed words and in scale groups, which must cut whole groups).
"""

from __future__ import annotations

import math
from fractions import Fraction

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import (
    AllToShardedLinear,
    QuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear,
    ShardedToAllLinear,
)

from . import faults
from .collectives import Group
from .errors import UserError
from .quant import quantized_col_ranges


class ShardSpec:
    """Per-parameter slices: name -> (axis, [(start, stop), ...]) of the full
    tensor, in the stored tensor's own units (for a quantized layer: packed
    uint32 words of `weight`, groups of `scales`/`biases`), so the loader
    reads exactly these ranges from the file."""

    def __init__(self, slices: dict):
        self.slices = slices

    def __repr__(self):
        return f"ShardSpec({self.slices})"


def _slice(w: mx.array, axis: int, ranges) -> mx.array:
    parts = [w[(slice(None),) * axis + (slice(a, b),)] for a, b in ranges]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=axis)


class SumShardedToAll(ShardedToAllLinear):
    """ShardedToAllLinear whose all_sum is `tp`'s (a `collectives.Group`):
    MLX's calls mx.distributed.all_sum on an MLX group, which a pipeline
    stage's `ChainGroup` is not."""

    def __call__(self, x: mx.array) -> mx.array:
        x = self.tp.all_sum(x @ self["weight"].T)
        return x + self["bias"] if "bias" in self else x


class QuantizedSumShardedToAll(QuantizedShardedToAllLinear):
    """QuantizedShardedToAllLinear with `tp`'s all_sum (as `SumShardedToAll`)."""

    def __call__(self, x: mx.array) -> mx.array:
        x = mx.quantized_matmul(x, self["weight"], scales=self["scales"], biases=self.get("biases"),
                                transpose=True, group_size=self.group_size, bits=self.bits, mode=self.mode)
        x = self.tp.all_sum(x)
        return x + self["bias"] if "bias" in self else x


def _sharded(linear: nn.Module, kind: str, ranges, group: Group, name: str = "layer") -> nn.Module:
    """Swap `linear` for an AllToShardedLinear (kind "rows": output slice) or a
    ShardedToAllLinear (kind "cols": input slice) holding only `ranges`
    (logical rows / input columns). A QuantizedLinear becomes the quantized
    counterpart, see `_sharded_quantized`."""
    if isinstance(linear, nn.QuantizedLinear):
        return _sharded_quantized(linear, kind, ranges, group, name)
    has_bias = "bias" in linear
    out_dims, in_dims = linear.weight.shape
    n = group.size()
    # The constructors want evenly divisible dims; shapes are replaced below
    # (replicated KV heads are not an even split of the output).
    if kind == "rows":
        layer = AllToShardedLinear(in_dims, n, bias=has_bias, group=group.mlx)
        layer.weight = _slice(linear.weight, 0, ranges)
        if has_bias:
            layer.bias = _slice(linear.bias, 0, ranges)
        spec = {"weight": (0, ranges)}
        if has_bias:
            spec["bias"] = (0, ranges)
    else:
        layer = SumShardedToAll(n, out_dims, bias=has_bias, group=group.mlx)
        layer.tp = group
        layer.weight = _slice(linear.weight, 1, ranges)
        if has_bias:
            layer.bias = linear.bias  # added once, after the all_sum
        spec = {"weight": (1, ranges)}
    layer.shard_spec = ShardSpec(spec)
    return layer


def _sharded_quantized(linear: nn.QuantizedLinear, kind: str, ranges, group, name: str) -> nn.Module:
    """QuantizedAllToShardedLinear / QuantizedShardedToAllLinear.

    Rows (output slice): rows of the packed weight, scales, biases and bias,
    the same ranges as unquantized (each row is quantized on its own).
    Cols (input slice): the packed weight's words [start*bits/32,
    stop*bits/32) and the scale/bias groups [start/gs, stop/gs); the slice
    must be whole groups (UserError otherwise). The bias is replicated and
    added once, after the all_sum."""
    gs, bits, mode = linear.group_size, linear.bits, linear.mode
    has_bias = "bias" in linear
    has_biases = linear.get("biases") is not None
    out_dims, packed_in = linear.weight.shape
    in_dims = packed_in * 32 // bits
    n = group.size()
    q = {"group_size": gs, "bits": bits, "mode": mode}
    # Placeholder shapes (lazy, never evaluated) that the constructors accept;
    # the real slices replace them below.
    if kind == "rows":
        layer = QuantizedAllToShardedLinear(in_dims, n, bias=has_bias, group=group.mlx, **q)
        names = ["weight", "scales"] + ["biases"] * has_biases + ["bias"] * has_bias
        spec = {p: (0, ranges) for p in names}
        for p in names:
            setattr(layer, p, _slice(linear[p], 0, ranges))
    else:
        packed, groups = quantized_col_ranges(ranges, gs, bits, f"{n} ranks cannot split {name} ({in_dims} inputs)")
        layer = QuantizedSumShardedToAll(n * gs, out_dims, bias=has_bias, group=group.mlx, **q)
        layer.tp = group
        spec = {"weight": (1, packed), "scales": (1, groups)}
        if has_biases:
            spec["biases"] = (1, groups)
        for p, (axis, rng) in spec.items():
            setattr(layer, p, _slice(linear[p], axis, rng))
        if has_bias:
            layer.bias = linear.bias  # added once, after the all_sum
    if not has_biases:
        layer.biases = None
    layer.shard_spec = ShardSpec(spec)
    return layer


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


def rank_heads(attn: nn.Module, group: Group) -> tuple[int, int, list[int]]:
    """(q0, q1, KV slots) of this rank for `attn` (`total_num_heads`,
    `total_num_kv_heads`): `head_partition` with the group's rank weights,
    the slots of `kv_slots` (shifted under the wrong-kv-slice fault)."""
    H, KV, D = attn.total_num_heads, attn.total_num_kv_heads, attn.head_dim
    o = attn.o_proj
    unit = math.lcm(D, o.group_size) // D if isinstance(o, nn.QuantizedLinear) else 1  # heads per cut
    try:
        (q0, q1), kv = head_ranges(H, KV, group.size(), group.rank(), group.weights, unit)
    except UserError:
        if unit == 1 or group.size() > H:
            raise
        raise UserError(
            f"{group.size()} ranks cannot split o_proj ({H * D} inputs: {H} heads of {D}) at whole quantization "
            f"groups of {o.group_size}; use a rank count that gives whole groups, or a checkpoint quantized with "
            f"a smaller group size"
        ) from None
    shifted = faults.kv_heads(kv, KV, group)
    slots = [(s + shifted[0] - kv[0]) % KV for s in kv_slots(q0, q1, H, KV)]
    return q0, q1, slots


def shard_attention(attn: nn.Module, group: Group) -> None:
    """Shard q/k/v/o projections of a standard attention block in place.

    Needs `total_num_heads`, `total_num_kv_heads`, `head_dim`, q_proj
    (`q_proj_width` rows a head where it is not head_dim) and o_proj, and k_proj / v_proj where the block has them (blocks without
    them: k = v, or a layer reading another's KV); per-head parameters named
    in `attn.per_head_params` (e.g. attention sinks) are sliced with their heads.
    """
    if group.single:
        return
    q0, q1, slots = rank_heads(attn, group)
    D = attn.head_dim
    W = getattr(attn, "q_proj_width", None) or D  # q_proj rows per head (a gated attention's q and gate: 2 D)
    attn.q_proj = _sharded(attn.q_proj, "rows", [(q0 * W, q1 * W)], group)
    # k/v where the block has them (Gemma 4's k = v layers have no v_proj; a
    # layer reading another's KV has neither, and its num_kv_heads becomes
    # the slots its source keeps on this rank: the same rank_heads)
    for name in ("k_proj", "v_proj"):
        if name in attn:
            setattr(attn, name, _sharded(getattr(attn, name), "rows", slot_ranges(slots, D), group))
    attn.o_proj = _sharded(attn.o_proj, "cols", [(q0 * D, q1 * D)], group, "o_proj")
    per_head = {}
    for name in getattr(attn, "per_head_params", ()):
        setattr(attn, name, _slice(getattr(attn, name), 0, [(q0, q1)]))
        per_head[name] = (0, [(q0, q1)])
    if per_head:
        attn.shard_spec = ShardSpec(per_head)
    attn.num_heads = q1 - q0  # this rank's; total_num_heads stays the model's
    attn.num_kv_heads = len(slots)


def shard_latent_attention(attn: nn.Module, group: Group) -> None:
    """Shard multi-head latent attention (DeepSeek's MLA) by heads: rank r
    keeps heads [h0, h1) (`split_ranges`; o_proj's quantization groups
    permitting): their rows of q_b_proj (or q_proj; `q_head_dim` each) and
    kv_b_proj (`kv_head_dim` each: k_nope then v), their o_proj input columns
    (`v_head_dim` each, one all_sum). The latent projections (q_a_proj,
    kv_a_proj_with_mqa) and their norms stay replicated: every rank computes
    the whole latent, which is small."""
    if group.single:
        return
    H, o = attn.total_num_heads, attn.o_proj
    unit = math.lcm(attn.v_head_dim, o.group_size) // attn.v_head_dim if isinstance(o, nn.QuantizedLinear) else 1
    h0, h1 = _rank_range(H, group, "the attention heads", unit)
    q = "q_b_proj" if "q_b_proj" in attn else "q_proj"
    setattr(attn, q, _sharded(getattr(attn, q), "rows", [(h0 * attn.q_head_dim, h1 * attn.q_head_dim)], group))
    attn.kv_b_proj = _sharded(attn.kv_b_proj, "rows", [(h0 * attn.kv_head_dim, h1 * attn.kv_head_dim)], group)
    attn.o_proj = _sharded(o, "cols", [(h0 * attn.v_head_dim, h1 * attn.v_head_dim)], group, "o_proj")
    attn.num_heads = h1 - h0  # this rank's; total_num_heads stays the model's


def _quant_unit(layer) -> int:
    """The input columns a cut of `layer`'s input must be a multiple of: its
    quantization group size (1 unquantized)."""
    return layer.group_size if isinstance(layer, nn.QuantizedLinear) else 1


def _rank_range(size: int, group: Group, what: str, unit: int = 1) -> tuple[int, int]:
    """This rank's contiguous [start, end) of `size` (`split_ranges` with the
    group's rank weights, cuts at multiples of `unit`); `what` names the
    dimension in the error when the ranks cannot split it."""
    return split_ranges(size, group.size(), group.weights, unit, what)[group.rank()]


def shard_mlp(mlp: nn.Module, group: Group, up=("gate_proj", "up_proj"), down="down_proj") -> None:
    """Column-shard the up projections and row-shard the down projection
    (cut at the down projection's quantization groups)."""
    if group.single:
        return
    inter = getattr(mlp, up[0]).weight.shape[0]
    unit = _quant_unit(getattr(mlp, down))
    rng = [_rank_range(inter, group, f"{down}'s inputs", unit)]
    for name in up:
        setattr(mlp, name, _sharded(getattr(mlp, name), "rows", rng, group))
    setattr(mlp, down, _sharded(getattr(mlp, down), "cols", rng, group, down))


def shard_layers(layers, group: Group, attn="self_attn", mlp="mlp") -> None:
    """The common decoder: shard each layer's attention and gated MLP."""
    for layer in layers:
        shard_attention(getattr(layer, attn), group)
        shard_mlp(getattr(layer, mlp), group)


def vocab_parallel_logits(layer: nn.Module, h: mx.array, group: Group, ranges=None) -> mx.array:
    """Logits [B, L, V] of an output head (`nn.Linear`, or an embedding used
    as one; quantized or not) whose work is split by vocabulary: rank r
    multiplies h by its rows `ranges[r]` (default: `split_ranges` of V with
    the group's weights) of the (whole, replicated) weight, the same rows the
    full product would compute, and one all_gather of the [rows, B*L] slices
    gives every rank the full logits."""
    n, r = group.size(), group.rank()
    quantized = isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    V = (layer.scales if quantized else layer.weight).shape[0]
    if ranges is None:
        ranges = split_ranges(V, n, group.weights, what=f"the vocabulary ({V})")
    a, b = ranges[r]
    per = max(e - s for s, e in ranges)
    rows = slice(a, b)
    if quantized:
        biases = layer.get("biases")
        part = mx.quantized_matmul(h, layer.weight[rows], scales=layer.scales[rows],
                                   biases=None if biases is None else biases[rows], transpose=True,
                                   group_size=layer.group_size, bits=layer.bits, mode=layer.mode)
    else:
        part = h @ layer.weight[rows].T
    if "bias" in layer:
        part = part + layer.bias[rows]
    B, L, _ = part.shape
    part = part.reshape(B * L, b - a).T
    if b - a < per:
        # all_gather wants equal shapes: pad to the largest slice and drop the
        # padding after; the gather copies bits, so this is exact (an all_sum
        # of zero-filled [V, B*L] buffers would turn -0.0 into +0.0 and send N x more)
        part = mx.concatenate([part, mx.zeros((per - (b - a), B * L), part.dtype)])
    full = group.all_gather(part)  # [N*per, B*L], rank order
    if any(e - s != per for s, e in ranges):
        full = mx.concatenate([full[i * per : i * per + (e - s)] for i, (s, e) in enumerate(ranges)])
    return full.T.reshape(B, L, V)


def plan_sharded_linears(model: nn.Module) -> tuple[int, int]:
    """(all_sums, payload bytes) of one single-token forward through the
    sharded-to-all projections this module helped swap in (o_proj,
    down_proj, ...): one all_sum of [1, 1, out] each, in the layer's output
    dtype (a quantized layer's: its scales')."""
    calls = nbytes = 0
    for _, m in model.named_modules():
        if isinstance(m, (ShardedToAllLinear, QuantizedShardedToAllLinear)):
            dt = (m.scales if isinstance(m, QuantizedShardedToAllLinear) else m.weight).dtype
            calls += 1
            nbytes += m.weight.shape[0] * dt.size
    return calls, nbytes


def collect_plan(model: nn.Module) -> dict:
    """Full parameter name -> (axis, ranges) for every sharded parameter."""
    plan = {}
    for path, module in model.named_modules():
        spec = getattr(module, "shard_spec", None)
        if isinstance(spec, ShardSpec):
            prefix = f"{path}." if path else ""
            for pname, s in spec.slices.items():
                plan[prefix + pname] = s
    return plan


def shard_head_vector(module: nn.Module, name: str, heads, head_dim: int) -> None:
    """Slice `module.<name>`, laid out [total_heads * head_dim] along axis 0
    (e.g. OLMo 3's q/k norm over the whole projection), to the head range
    `heads` = (h0, h1) (or a list of such ranges, e.g. `slot_ranges`), and
    record the slice so the loader reads only it."""
    heads = [heads] if isinstance(heads[0], int) else heads
    rng = [(h0 * head_dim, h1 * head_dim) for h0, h1 in heads]
    setattr(module, name, _slice(getattr(module, name), 0, rng))
    spec = getattr(module, "shard_spec", None)
    slices = dict(spec.slices) if isinstance(spec, ShardSpec) else {}
    slices[name] = (0, rng)
    module.shard_spec = ShardSpec(slices)


def shard_moe(moe: nn.Module, group: Group, experts: str = "experts") -> None:
    """Tensor-parallel mixture of experts: the router (any other child of
    `moe`) stays replicated, so every rank routes every token alike; each
    expert is split by its intermediate dimension I, rank r keeping
    its slice [i0, i1) of every expert (`split_ranges`).

    `moe.<experts>` holds gate_up_proj [E, hidden, 2I] with gate and up
    interleaved along the last axis (column 2j = gate j, 2j+1 = up j), so the
    contiguous column range [2*i0, 2*i1) is exactly the gate/up pairs of slice
    [i0, i1), still interleaved; gate_up_proj_bias [E, 2I] likewise;
    down_proj [E, I, hidden] keeps rows [i0, i1); down_proj_bias is replicated.
    The experts module sums its partial outputs over `group` (its `group`
    attribute, set here: one all_sum per block) and adds the down bias once,
    after the sum.
    """
    if group.single:
        return
    ex = getattr(moe, experts)
    inter = ex.down_proj.shape[1]
    if ex.gate_up_proj.shape[2] != 2 * inter:
        raise UserError(f"expert gate_up_proj has {ex.gate_up_proj.shape[2]} columns, expected 2 x {inter}")
    i0, i1 = _rank_range(inter, group, "the experts' intermediate size")
    pairs = [(2 * i0, 2 * i1)]
    ex.gate_up_proj = _slice(ex.gate_up_proj, 2, pairs)
    ex.gate_up_proj_bias = _slice(ex.gate_up_proj_bias, 1, pairs)
    ex.down_proj = _slice(ex.down_proj, 1, [(i0, i1)])
    ex.shard_spec = ShardSpec(
        {"gate_up_proj": (2, pairs), "gate_up_proj_bias": (1, pairs), "down_proj": (1, [(i0, i1)])}
    )
    ex.group = group


def _slice_linear_in_place(linear: nn.Module, kind: str, ranges, name: str) -> None:
    """Slice a Linear / QuantizedLinear in place (its class kept, so it issues
    no collective): "rows" keeps output rows `ranges` (weight, scales, biases,
    bias), "cols" keeps input columns `ranges` (for a quantized layer, the
    packed words and scale groups, whole groups only). Attaches its ShardSpec."""
    quantized = isinstance(linear, nn.QuantizedLinear)
    if kind == "rows":
        names = ["weight", "bias"] + (["scales", "biases"] if quantized else [])
        spec = {p: (0, ranges) for p in names if linear.get(p) is not None}
    else:
        if "bias" in linear:
            raise UserError(f"{name} has a bias: a split down projection cannot add it once without a collective")
        if quantized:
            in_dims = linear.weight.shape[1] * 32 // linear.bits
            packed, groups = quantized_col_ranges(
                ranges, linear.group_size, linear.bits, f"cannot split {name} ({in_dims} inputs)"
            )
            spec = {"weight": (1, packed), "scales": (1, groups)}
            if linear.get("biases") is not None:
                spec["biases"] = (1, groups)
        else:
            spec = {"weight": (1, ranges)}
    for p, (axis, rng) in spec.items():
        setattr(linear, p, _slice(linear[p], axis, rng))
    linear.shard_spec = ShardSpec(spec)


def shard_expert_mlps(mlps, group: Group, up=("gate_proj", "up_proj"), down="down_proj") -> None:
    """Split gated MLPs that sit inside one mixture-of-experts block (each
    routed expert kept as its own module with gate/up/down Linears, as
    checkpoints that store `experts.N.*` have them; a shared expert) by their
    intermediate dimension, as `shard_mlp` does, but WITHOUT a collective of
    their own: the layers stay (Quantized)Linear and only their weights are
    sliced (gate/up output rows, down input columns [i0, i1), `split_ranges`). The
    block sums its combined partial output over `group` once (one all_sum per
    block, not one per expert) and counts it in `collectives_per_token`. A
    down projection with a bias is refused (it would be added N times)."""
    if group.single:
        return
    for mlp in mlps:
        first = getattr(mlp, up[0])
        inter = first.scales.shape[0] if isinstance(first, nn.QuantizedLinear) else first.weight.shape[0]
        rng = [_rank_range(inter, group, f"an expert {down}'s inputs", _quant_unit(getattr(mlp, down)))]
        for name in up:
            _slice_linear_in_place(getattr(mlp, name), "rows", rng, name)
        _slice_linear_in_place(getattr(mlp, down), "cols", rng, down)


def shard_recurrent_block(block: nn.Module, group: Group) -> None:
    """Tensor-parallel RG-LRU recurrent block (RecurrentGemma): the recurrence
    and its gates are block-diagonal per head (`block.rg_lru.num_heads` blocks
    of `block_width` channels), so rank r keeps its heads [h0, h1) (`split_ranges`) and
    their channels c in [h0*bw, h1*bw): the rows of linear_x / linear_y (with
    their biases), the depthwise conv1d's channels (`conv_1d.weight`
    [C, 1, width], `conv_1d.bias`), `rg_lru.recurrent_param` [C] and the
    per-head gate weights [H, bw, bw] / biases [H, bw]. Each rank's conv and
    LRU state covers its channels only; linear_out is sharded-to-all (one
    all_sum, its bias added once after it)."""
    if group.single:
        return
    lru = block.rg_lru
    H, bw = lru.num_heads, lru.block_width
    out = block.linear_out
    unit = math.lcm(bw, out.group_size) // bw if isinstance(out, nn.QuantizedLinear) else 1  # whole groups
    h0, h1 = _rank_range(H, group, "the recurrent block's heads", unit)
    chans = [(h0 * bw, h1 * bw)]
    block.linear_x = _sharded(block.linear_x, "rows", chans, group)
    block.linear_y = _sharded(block.linear_y, "rows", chans, group)
    block.linear_out = _sharded(block.linear_out, "cols", chans, group, "linear_out")
    conv = block.conv_1d
    conv.weight, conv.bias = _slice(conv.weight, 0, chans), _slice(conv.bias, 0, chans)
    conv.shard_spec = ShardSpec({"weight": (0, chans), "bias": (0, chans)})
    heads = [(h0, h1)]
    spec = {"recurrent_param": (0, chans)}
    for name in ("input_gate_weight", "input_gate_bias", "recurrent_gate_weight", "recurrent_gate_bias"):
        spec[name] = (0, heads)
    for name, (axis, rng) in spec.items():
        setattr(lru, name, _slice(getattr(lru, name), axis, rng))
    lru.shard_spec = ShardSpec(spec)
    lru.num_heads = h1 - h0


def shard_deltanet(block: nn.Module, group: Group) -> None:
    """Tensor-parallel gated DeltaNet (deltanet.GatedDeltaNet): rank r keeps
    whole key-head groups, key heads [k0, k1) (`split_ranges` of
    `total_k_heads`) and their value heads [m k0, m k1) (m value heads a key
    head): the rows of its projections (qwen3_next's per-key-head
    `in_proj_qkvz` / `in_proj_ba` as one range each; qwen3_5's `in_proj_qkv`
    as three, q / k / v, and `in_proj_z` / `in_proj_b` / `in_proj_a`), the
    same q / k / v channels of the depthwise conv1d, `dt_bias` / `A_log` of
    its value heads, out_proj's input columns (sharded-to-all: one all_sum;
    quantized: cuts at whole groups). The gated norm (per head dim) stays
    whole. Each rank's conv and recurrent state cover its heads only."""
    if group.single:
        return
    Hk, Hv, Dk, Dv = block.total_k_heads, block.total_v_heads, block.head_k_dim, block.head_v_dim
    m = Hv // Hk
    out = block.out_proj
    unit = math.lcm(m * Dv, out.group_size) // (m * Dv) if isinstance(out, nn.QuantizedLinear) else 1
    k0, k1 = _rank_range(Hk, group, "the linear attention's key heads", unit)
    v0, v1 = m * k0, m * k1
    qkv = [(k0 * Dk, k1 * Dk), (Hk * Dk + k0 * Dk, Hk * Dk + k1 * Dk), (2 * Hk * Dk + v0 * Dv, 2 * Hk * Dk + v1 * Dv)]
    if block.fused:
        w = 2 * Dk + 2 * m * Dv  # rows per key head: q, k, v, z
        block.in_proj_qkvz = _sharded(block.in_proj_qkvz, "rows", [(k0 * w, k1 * w)], group)
        block.in_proj_ba = _sharded(block.in_proj_ba, "rows", [(k0 * 2 * m, k1 * 2 * m)], group)
    else:
        block.in_proj_qkv = _sharded(block.in_proj_qkv, "rows", qkv, group)
        block.in_proj_z = _sharded(block.in_proj_z, "rows", [(v0 * Dv, v1 * Dv)], group)
        block.in_proj_b = _sharded(block.in_proj_b, "rows", [(v0, v1)], group)
        block.in_proj_a = _sharded(block.in_proj_a, "rows", [(v0, v1)], group)
    block.out_proj = _sharded(out, "cols", [(v0 * Dv, v1 * Dv)], group, "out_proj")
    conv = block.conv1d
    conv.weight = _slice(conv.weight, 0, qkv)
    conv.shard_spec = ShardSpec({"weight": (0, qkv)})
    block.dt_bias, block.A_log = _slice(block.dt_bias, 0, [(v0, v1)]), _slice(block.A_log, 0, [(v0, v1)])
    block.shard_spec = ShardSpec({"dt_bias": (0, [(v0, v1)]), "A_log": (0, [(v0, v1)])})
    block.num_k_heads, block.num_v_heads = k1 - k0, v1 - v0


def shard_packed_attention(attn: nn.Module, group: Group, packed: str = "W_pack", per_kv_head=()) -> None:
    """Shard an attention whose q, k and v come from ONE fused projection
    (Baichuan's `W_pack`, rows [q (H*D); k (KV*D); v (KV*D)]): rank r keeps
    its q heads and their KV heads as `shard_attention` does, i.e. three row
    ranges of the fused weight (one per segment), so its output is again
    [q; k; v] with the per-rank counts; o_proj is sharded-to-all (one
    all_sum). `per_kv_head` lists (name, axis) of parameters with one entry
    per KV head along `axis` (e.g. a conv kernel per KV head), sliced with
    the KV heads. Needs `total_num_heads`, `total_num_kv_heads`, `head_dim`."""
    if group.single:
        return
    H, KV, D = attn.total_num_heads, attn.total_num_kv_heads, attn.head_dim
    q0, q1, slots = rank_heads(attn, group)
    rows = [(q0 * D, q1 * D), *slot_ranges(slots, D, H * D), *slot_ranges(slots, D, (H + KV) * D)]
    setattr(attn, packed, _sharded(getattr(attn, packed), "rows", rows, group))
    attn.o_proj = _sharded(attn.o_proj, "cols", [(q0 * D, q1 * D)], group, "o_proj")
    spec = {}
    for name, axis in per_kv_head:
        setattr(attn, name, _slice(getattr(attn, name), axis, slot_ranges(slots)))
        spec[name] = (axis, slot_ranges(slots))
    if spec:
        attn.shard_spec = ShardSpec(spec)
    attn.num_heads = q1 - q0
    attn.num_kv_heads = len(slots)


MOE_SPLITS = ("intermediate", "experts")


def moe_split(group: Group) -> str:
    """The group's routed-expert placement (--moe-split, parsed on every rank
    like --rank-weights): "intermediate" (default) or "experts"."""
    return getattr(group, "moe_split", None) or "intermediate"


def expert_ranges(num_experts: int, size: int, weights=None) -> list[tuple]:
    """Whole experts per rank under expert placement: contiguous [e0, e1),
    shares as `split_ranges` gives them (weights respected)."""
    return split_ranges(num_experts, size, weights, what="the routed experts")


def shard_switch_glu(mlp: nn.Module, group: Group) -> None:
    """Split stacked routed experts (`experts.SwitchGLU`: gate/up [E, I,
    hidden] or fused gate_up [E, 2I, hidden], down [E, hidden, I], Linear or
    MLX-quantized) with no collective of their own; the router stays
    replicated and the block sums its partial output over the group once.

    "intermediate": rank r keeps rows [i0, i1) of axis 1 of gate/up (weight,
    scales, biases; fused: gate rows [i0, i1) and up rows [I + i0, I + i1))
    and the same input columns of down (axis 2; quantized: packed words and
    whole scale groups). "experts": rank r keeps the whole experts [e0, e1)
    (axis 0 of every parameter) and `mlp.expert_range` says which, so it
    weights the others' routed rows zero."""
    if group.single:
        return
    ups = ["gate_up_proj"] if mlp.fused else ["gate_proj", "up_proj"]
    if moe_split(group) == "experts":
        e0, e1 = expert_ranges(mlp.num_experts, group.size(), group.weights)[group.rank()]
        for name in (*ups, "down_proj"):
            _slice_params(getattr(mlp, name), 0, [(e0, e1)])
        mlp.expert_range = (e0, e1)
        return
    down = mlp.down_proj
    quantized = down.get("scales") is not None
    inter = down.scales.shape[2] * down.group_size if quantized else down.weight.shape[2]
    rng = [_rank_range(inter, group, "the experts' intermediate size", down.group_size if quantized else 1)]
    (i0, i1), = rng
    rows = [(i0, i1), (inter + i0, inter + i1)] if mlp.fused else rng  # fused: gate half, then up half
    for name in ups:
        layer = getattr(mlp, name)
        if layer.weight.shape[1] != inter * (2 if mlp.fused else 1):
            raise UserError(f"expert {name} has {layer.weight.shape[1]} rows, expected "
                            f"{'2 x ' if mlp.fused else ''}{inter} (down_proj's inputs)")
        _slice_params(layer, 1, rows)
    if quantized:
        packed, groups = quantized_col_ranges(rng, down.group_size, down.bits, "cannot split the experts' down_proj")
        spec = {"weight": (2, packed), "scales": (2, groups)}
        if down.get("biases") is not None:
            spec["biases"] = (2, groups)
    else:
        spec = {"weight": (2, rng)}
    for p, (axis, r) in spec.items():
        setattr(down, p, _slice(down[p], axis, r))
    down.shard_spec = ShardSpec(spec)


def _slice_params(layer: nn.Module, axis: int, ranges: list) -> None:
    """Every stored tensor of a (Quantized)SwitchLinear (weight, scales,
    biases) cut to `ranges` of `axis` (not the packed one), with its ShardSpec."""
    spec = {p: (axis, ranges) for p in ("weight", "scales", "biases") if layer.get(p) is not None}
    for p, (ax, r) in spec.items():
        setattr(layer, p, _slice(layer[p], ax, r))
    layer.shard_spec = ShardSpec(spec)
