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

The cuts themselves (shares of a dimension, head ranges, KV slots, expert
ranges) are partition.py's arithmetic, which needs no model or MLX.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import (
    AllToShardedLinear,
    QuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear,
    ShardedToAllLinear,
)

from ..cluster import faults
from .collectives import Group
from ..errors import UserError
from .partition import expert_ranges, head_ranges, kv_slots, moe_split, slot_ranges, split_ranges
from ..nn.quant import quantized_col_ranges


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


def _cut(layer: nn.Module, spec: dict, src: nn.Module | None = None) -> None:
    """Set `layer`'s tensors named in `spec` (name -> (axis, ranges)) to
    `src`'s (default: its own) cut to those ranges; `spec` becomes its ShardSpec."""
    src = layer if src is None else src
    for name, (axis, ranges) in spec.items():
        setattr(layer, name, _slice(getattr(src, name), axis, ranges))
    layer.shard_spec = ShardSpec(spec)


def _col_spec(layer: nn.Module, axis: int, ranges, what: str) -> dict:
    """The slices that keep input columns `ranges` (along `axis`) of a
    (Quantized)Linear or SwitchLinear: its weight's, or for a quantized one
    the packed words and whole scale/bias groups (UserError naming `what`)."""
    if layer.get("scales") is None:
        return {"weight": (axis, ranges)}
    packed, groups = quantized_col_ranges(ranges, layer.group_size, layer.bits, what)
    spec = {"weight": (axis, packed), "scales": (axis, groups)}
    if layer.get("biases") is not None:
        spec["biases"] = (axis, groups)
    return spec


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
        spec = {"weight": (0, ranges)}
        if has_bias:
            spec["bias"] = (0, ranges)
    else:
        layer = SumShardedToAll(n, out_dims, bias=has_bias, group=group.mlx)
        layer.tp = group
        spec = {"weight": (1, ranges)}
        if has_bias:
            layer.bias = linear.bias  # added once, after the all_sum
    _cut(layer, spec, linear)
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
    else:
        spec = _col_spec(linear, 1, ranges, f"{n} ranks cannot split {name} ({in_dims} inputs)")
        layer = QuantizedSumShardedToAll(n * gs, out_dims, bias=has_bias, group=group.mlx, **q)
        layer.tp = group
        if has_bias:
            layer.bias = linear.bias  # added once, after the all_sum
    if not has_biases:
        layer.biases = None
    _cut(layer, spec, linear)
    return layer


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
    per_head = {name: (0, [(q0, q1)]) for name in getattr(attn, "per_head_params", ())}
    if per_head:
        _cut(attn, per_head)
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
    _cut(ex, {"gate_up_proj": (2, pairs), "gate_up_proj_bias": (1, pairs), "down_proj": (1, [(i0, i1)])})
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
        what = f"cannot split {name} ({linear.weight.shape[1] * 32 // linear.bits} inputs)" if quantized else name
        spec = _col_spec(linear, 1, ranges, what)
    _cut(linear, spec)


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
    _cut(block.conv_1d, {"weight": (0, chans), "bias": (0, chans)})
    heads = [(h0, h1)]
    spec = {"recurrent_param": (0, chans)}
    for name in ("input_gate_weight", "input_gate_bias", "recurrent_gate_weight", "recurrent_gate_bias"):
        spec[name] = (0, heads)
    _cut(lru, spec)
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
    _cut(block.conv1d, {"weight": (0, qkv)})
    _cut(block, {"dt_bias": (0, [(v0, v1)]), "A_log": (0, [(v0, v1)])})
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
    spec = {name: (axis, slot_ranges(slots)) for name, axis in per_kv_head}
    if spec:
        _cut(attn, spec)
    attn.num_heads = q1 - q0
    attn.num_kv_heads = len(slots)


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
    _cut(down, _col_spec(down, 2, rng, "cannot split the experts' down_proj"))


def _slice_params(layer: nn.Module, axis: int, ranges: list) -> None:
    """Every stored tensor of a (Quantized)SwitchLinear (weight, scales,
    biases) cut to `ranges` of `axis` (not the packed one), with its ShardSpec."""
    _cut(layer, {p: (axis, ranges) for p in ("weight", "scales", "biases") if layer.get(p) is not None})
