"""Tensor parallelism: one helper per block kind, applied after construction.

Attention: rank r holds q heads [r*H/N, (r+1)*H/N) and the KV heads those
queries use (split when N divides the KV heads, replicated when the KV heads
divide N); q/k/v become all-to-sharded, o_proj sharded-to-all (one all_sum).
MLP: gate/up all-to-sharded by columns, down sharded-to-all (one all_sum).
Norms, embeddings and the head stay replicated.

The helpers run before any weight is read: they swap in sharded layers whose
parameters are still lazy placeholders and attach a `ShardSpec` saying which
slice of each checkpoint tensor this rank needs, so the loader reads only that.

MLX-quantized layers (quant.py) run before sharding, so q/k/v/gate/up may be
QuantizedLinear; they become QuantizedAllToShardedLinear (rows of the packed
weight, scales and biases) and o/down QuantizedShardedToAllLinear (the input
slice in packed words and in scale groups, which must cut whole groups).
"""

from __future__ import annotations

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
        layer = ShardedToAllLinear(n, out_dims, bias=has_bias, group=group.mlx)
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
        layer = QuantizedShardedToAllLinear(n * gs, out_dims, bias=has_bias, group=group.mlx, **q)
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


def head_ranges(total_heads: int, total_kv_heads: int, n: int, r: int):
    """(q head range, kv head range) for rank r of n, or UserError."""
    if n < 1 or not 0 <= r < n:
        raise UserError(f"bad rank {r} of {n}")
    if total_heads % n:
        raise UserError(
            f"{n} ranks cannot split {total_heads} attention heads "
            f"({total_kv_heads} KV heads): use a rank count that divides {total_heads}"
        )
    if total_kv_heads % n and n % total_kv_heads:
        raise UserError(
            f"{n} ranks cannot split {total_kv_heads} KV heads "
            f"({total_heads} attention heads): the rank count must divide the KV heads "
            f"or be a multiple of them"
        )
    per = total_heads // n
    group = total_heads // total_kv_heads  # q heads per KV head
    q0, q1 = r * per, (r + 1) * per
    kv0, kv1 = q0 // group, (q1 - 1) // group + 1
    return (q0, q1), (kv0, kv1)


def shard_attention(attn: nn.Module, group: Group) -> None:
    """Shard q/k/v/o projections of a standard attention block in place.

    Needs `total_num_heads`, `total_num_kv_heads`, `head_dim`, q_proj and
    o_proj, and k_proj / v_proj where the block has them (blocks without
    them: k = v, or a layer reading another's KV); per-head parameters named
    in `attn.per_head_params` (e.g. attention sinks) are sliced with their heads.
    """
    if group.single:
        return
    (q0, q1), kv = head_ranges(attn.total_num_heads, attn.total_num_kv_heads, group.size(), group.rank())
    kv0, kv1 = faults.kv_heads(kv, attn.total_num_kv_heads, group)
    D = attn.head_dim
    attn.q_proj = _sharded(attn.q_proj, "rows", [(q0 * D, q1 * D)], group)
    # k/v where the block has them (Gemma 4's k = v layers have no v_proj; a
    # layer reading another's KV has neither, and its num_kv_heads becomes
    # the range its source keeps on this rank: the same head_ranges)
    for name in ("k_proj", "v_proj"):
        if name in attn:
            setattr(attn, name, _sharded(getattr(attn, name), "rows", [(kv0 * D, kv1 * D)], group))
    attn.o_proj = _sharded(attn.o_proj, "cols", [(q0 * D, q1 * D)], group, "o_proj")
    per_head = {}
    for name in getattr(attn, "per_head_params", ()):
        setattr(attn, name, _slice(getattr(attn, name), 0, [(q0, q1)]))
        per_head[name] = (0, [(q0, q1)])
    if per_head:
        attn.shard_spec = ShardSpec(per_head)
    attn.num_heads = q1 - q0
    attn.num_kv_heads = kv1 - kv0


def _rank_range(size: int, group: Group, what: str) -> tuple[int, int]:
    """This rank's contiguous [start, end) of `size` equal parts; `what` names
    the dimension in the error when the ranks cannot split it evenly."""
    n, r = group.size(), group.rank()
    if size % n:
        raise UserError(f"{n} ranks cannot split {what}")
    per = size // n
    return r * per, (r + 1) * per


def shard_mlp(mlp: nn.Module, group: Group, up=("gate_proj", "up_proj"), down="down_proj") -> None:
    """Column-shard the up projections and row-shard the down projection."""
    if group.single:
        return
    inter = getattr(mlp, up[0]).weight.shape[0]
    rng = [_rank_range(inter, group, f"the MLP's intermediate size {inter}")]
    for name in up:
        setattr(mlp, name, _sharded(getattr(mlp, name), "rows", rng, group))
    setattr(mlp, down, _sharded(getattr(mlp, down), "cols", rng, group, down))


def shard_layers(layers, group: Group, attn="self_attn", mlp="mlp") -> None:
    """The common decoder: shard each layer's attention and gated MLP."""
    for layer in layers:
        shard_attention(getattr(layer, attn), group)
        shard_mlp(getattr(layer, mlp), group)


def vocab_parallel_logits(layer: nn.Module, h: mx.array, group: Group) -> mx.array:
    """Logits [B, L, V] of an output head (`nn.Linear`, or an embedding used
    as one; quantized or not) whose work is split by vocabulary: rank r
    multiplies h by rows [r*V/N, (r+1)*V/N) of the (whole, replicated) weight,
    the same rows the full product would compute, and one all_gather of the
    [V/N, B*L] slices gives every rank the full logits. N must divide V."""
    n, r = group.size(), group.rank()
    quantized = isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    V = (layer.scales if quantized else layer.weight).shape[0]
    per = V // n
    rows = slice(r * per, (r + 1) * per)
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
    full = group.all_gather(part.reshape(B * L, per).T)  # [V, B*L], rank order
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


def shard_head_vector(module: nn.Module, name: str, heads: tuple, head_dim: int) -> None:
    """Slice `module.<name>`, laid out [total_heads * head_dim] along axis 0
    (e.g. OLMo 3's q/k norm over the whole projection), to the head range
    `heads` = (h0, h1), and record the slice so the loader reads only it."""
    h0, h1 = heads
    rng = [(h0 * head_dim, h1 * head_dim)]
    setattr(module, name, _slice(getattr(module, name), 0, rng))
    spec = getattr(module, "shard_spec", None)
    slices = dict(spec.slices) if isinstance(spec, ShardSpec) else {}
    slices[name] = (0, rng)
    module.shard_spec = ShardSpec(slices)


def shard_moe(moe: nn.Module, group: Group, experts: str = "experts") -> None:
    """Tensor-parallel mixture of experts: the router (any other child of
    `moe`) stays replicated, so every rank routes every token alike; each
    expert is split by its intermediate dimension I, rank r keeping slice
    [r*I/N, (r+1)*I/N) of every expert.

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
    i0, i1 = _rank_range(inter, group, f"the experts' intermediate size {inter}")
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
    sliced (gate/up output rows, down input columns [r*I/N, (r+1)*I/N)). The
    block sums its combined partial output over `group` once (one all_sum per
    block, not one per expert) and counts it in `collectives_per_token`. A
    down projection with a bias is refused (it would be added N times)."""
    if group.single:
        return
    for mlp in mlps:
        first = getattr(mlp, up[0])
        inter = first.scales.shape[0] if isinstance(first, nn.QuantizedLinear) else first.weight.shape[0]
        rng = [_rank_range(inter, group, f"an expert's intermediate size {inter}")]
        for name in up:
            _slice_linear_in_place(getattr(mlp, name), "rows", rng, name)
        _slice_linear_in_place(getattr(mlp, down), "cols", rng, down)


def shard_recurrent_block(block: nn.Module, group: Group) -> None:
    """Tensor-parallel RG-LRU recurrent block (RecurrentGemma): the recurrence
    and its gates are block-diagonal per head (`block.rg_lru.num_heads` blocks
    of `block_width` channels), so rank r keeps heads [r*H/N, (r+1)*H/N) and
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
    h0, h1 = _rank_range(H, group, f"the recurrent block's {H} heads")
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


def shard_stacked_experts(moe: nn.Module, group: Group, up=("gate_proj", "up_proj"), down="down_proj") -> None:
    """Split stacked expert projections by the intermediate dimension I, with
    no collective of their own: `moe.<up>.weight` [E, I, hidden] keep rows
    [r*I/N, (r+1)*I/N) of axis 1, `moe.<down>.weight` [E, hidden, I] the same
    range of axis 2 (the hub layout of e.g. Step-3.5: `moe.gate_proj.weight`).
    Every other child of `moe` (the router) stays replicated, so every rank
    routes alike; the block sums its partial output over the group once (and
    counts that all_sum in `collectives_per_token`)."""
    if group.single:
        return
    inter = getattr(moe, up[0]).weight.shape[1]
    rng = [_rank_range(inter, group, f"the experts' intermediate size {inter}")]
    for name, axis in [(u, 1) for u in up] + [(down, 2)]:
        stack = getattr(moe, name)
        if stack.weight.shape[axis] != inter:
            raise UserError(f"expert {name} has {stack.weight.shape[axis]} intermediate rows, expected {inter}")
        stack.weight = _slice(stack.weight, axis, rng)
        stack.shard_spec = ShardSpec({"weight": (axis, rng)})


def shard_fused_gate_up_experts(ex: nn.Module, group: Group) -> None:
    """Split stacked experts in transformers' Linear layout with gate and up
    fused as two halves (Gemma 4: `gate_up_proj` [E, 2I, hidden], rows
    [0, I) gate and [I, 2I) up; `down_proj` [E, hidden, I]) by their
    intermediate dimension: rank r keeps gate rows [i0, i1) and up rows
    [I + i0, I + i1) (still gate half then up half) and down columns
    [i0, i1). No collective here: the experts module sums its partial output
    over `group` (its `group` attribute, set here: one all_sum per block)."""
    if group.single:
        return
    inter = ex.down_proj.shape[2]
    if ex.gate_up_proj.shape[1] != 2 * inter:
        raise UserError(f"expert gate_up_proj has {ex.gate_up_proj.shape[1]} rows, expected 2 x {inter}")
    i0, i1 = _rank_range(inter, group, f"the experts' intermediate size {inter}")
    halves = [(i0, i1), (inter + i0, inter + i1)]
    ex.gate_up_proj = _slice(ex.gate_up_proj, 1, halves)
    ex.down_proj = _slice(ex.down_proj, 2, [(i0, i1)])
    ex.shard_spec = ShardSpec({"gate_up_proj": (1, halves), "down_proj": (2, [(i0, i1)])})
    ex.group = group


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
    (q0, q1), kv = head_ranges(H, KV, group.size(), group.rank())
    kv0, kv1 = faults.kv_heads(kv, KV, group)
    rows = [(q0 * D, q1 * D), ((H + kv0) * D, (H + kv1) * D), ((H + KV + kv0) * D, (H + KV + kv1) * D)]
    setattr(attn, packed, _sharded(getattr(attn, packed), "rows", rows, group))
    attn.o_proj = _sharded(attn.o_proj, "cols", [(q0 * D, q1 * D)], group, "o_proj")
    spec = {}
    for name, axis in per_kv_head:
        setattr(attn, name, _slice(getattr(attn, name), axis, [(kv0, kv1)]))
        spec[name] = (axis, [(kv0, kv1)])
    if spec:
        attn.shard_spec = ShardSpec(spec)
    attn.num_heads = q1 - q0
    attn.num_kv_heads = kv1 - kv0
