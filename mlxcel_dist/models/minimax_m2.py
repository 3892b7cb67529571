"""MiniMax-M2 (`minimax_m2`, MiniMaxM2ForCausalLM), as transformers 5.24 runs it.

Hidden states [B, L, hidden]; q_proj output [B, L, n_heads * head_dim], then q
[B, n_heads, L, head_dim], k/v [B, n_kv_heads, L, head_dim] (per-rank counts
under tensor parallelism). Pre-norm blocks (llama RMSNorm), every layer full
causal attention (no sliding or other layer kinds in transformers' model).

- q and k are RMS-normalised over the WHOLE projection (all heads at once,
  `q_norm` [n_heads * head_dim], `k_norm` [n_kv_heads * head_dim]), llama
  style: w * (x * rsqrt(mean(x^2) + eps)).to(dtype), before the head reshape;
- partial RoPE: the first `rotary_dim` (= partial_rotary_factor * head_dim)
  features of each head rotate (rotate-half), the rest pass through;
- every MLP is sparse: router `mlp.gate.weight` [E, hidden] in the hidden
  dtype, scores = sigmoid (fp32), `mlp.e_score_correction_bias` [E] added
  only to CHOOSE the top-k, weights = the chosen unbiased scores / their sum;
  experts stacked as transformers saves them (`mlp.experts.gate_up_proj`
  [E, 2I, hidden]: gate rows then up rows, `down_proj` [E, hidden, I]; here
  `experts.SwitchGLU`'s fused SwitchLinear modules, `.weight`, so they
  quantize), only the chosen experts run (mx.gather_mm, or mx.gather_qmm
  quantized).

Weight layouts read (`sanitize`, renames and lazy stacking views: a rank still
reads only its slices): transformers 5.24's (above); the hub's
(`block_sparse_moe.gate.weight`, `block_sparse_moe.e_score_correction_bias`,
`block_sparse_moe.experts.N.w1/w3/w2.weight` = gate/up/down per expert); and
mlx-lm's `block_sparse_moe.switch_mlp.{gate,up,down}_proj.{weight,scales,biases}`
[E, I, hidden] / [E, hidden, I], quantized (mlx_lm.convert) or not.

Tensor parallelism: heads split (`shard_attention`); the whole-projection
norm's statistic spans heads on other ranks, so each rank sums the squares of
its own q and k features and ONE all_sum of [B, L, 2] fp32 per layer gives
every rank the exact totals (KV heads held by several ranks counted once);
the norm weights are sliced with their heads (`shard_head_vector`). That is
cheaper than a replicated q/k projection: 8 bytes per token per layer on the
wire instead of every rank reading all of q_proj and k_proj (for MiniMax-M2
~22M weights per layer, (n-1)/n of them extra per rank and token). Experts
split by their intermediate dimension (quantized down_proj at whole groups)
or as whole experts per rank (`--moe-split`, `shard_switch_glu`), the router
replicated; one all_sum per MoE block.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..nn.blocks import Attention
from ..parallel.collectives import SINGLE
from ..errors import UserError
from ..nn.experts import SwitchGLU, top_k
from ..nn.layers import RMSNorm, activation, gated_fp32
from ..nn.rope import RoPE
from ..parallel.partition import head_partition, slot_ranges
from ..parallel.shard import rank_heads, shard_attention, shard_head_vector, shard_switch_glu
from ..checkpoint.weights import join
from .base import FULL, BaseModelArgs, CausalLM, DecoderStack, describe_layers, single_rope_params

DEFAULT_THETA = 5_000_000.0  # MiniMaxM2Config.default_theta


@dataclass
class ModelArgs(BaseModelArgs):
    # Defaults are transformers' MiniMaxM2Config defaults.
    model_type: str = "minimax_m2"
    vocab_size: int = 200064
    hidden_size: int = 3072
    intermediate_size: int = 1536
    num_hidden_layers: int = 62
    num_attention_heads: int = 48
    num_key_value_heads: int = 8
    head_dim: int | None = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 196608
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    num_experts_per_tok: int = 8
    num_local_experts: int = 256
    rope_parameters: dict | None = None
    # the transformers-4 / hub form
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rotary_dim: int | None = None
    partial_rotary_factor: float | None = None
    use_qk_norm: bool = True
    scoring_func: str = "sigmoid"
    use_routing_bias: bool = True

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.layer_types = [FULL] * self.num_hidden_layers
        if not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise UserError(f"minimax_m2: num_experts_per_tok must be in 1..{self.num_local_experts}")
        # transformers always normalises q/k and routes by sigmoid with the bias
        if not self.use_qk_norm or self.scoring_func != "sigmoid" or not self.use_routing_bias:
            raise UserError("minimax_m2: only use_qk_norm, sigmoid scoring and the routing bias are supported")
        self.rope = self._rope()

    def _rope(self) -> dict:
        # transformers 5: rope_parameters (with partial_rotary_factor); 4 / hub:
        # rope_theta + rotary_dim (MiniMaxM2Config reads rotary_dim / head_dim).
        src = dict(self.rope_scaling or self.rope_parameters or {})
        factor = src.pop("partial_rotary_factor", None)
        if factor is None:
            factor = self.partial_rotary_factor
        if factor is None and self.rotary_dim is not None:
            factor = self.rotary_dim / self.head_dim
        theta = DEFAULT_THETA if self.rope_theta is None else self.rope_theta
        params = single_rope_params(src, None, theta, self.max_position_embeddings)
        params["partial_rotary_factor"] = 1.0 if factor is None else float(factor)
        return params


class MiniMaxM2Attention(Attention):
    """Attention whose q/k RMSNorm spans the whole projection; `norm_group`
    (set by Model.shard) makes that statistic global across ranks."""

    def __init__(self, args: ModelArgs):
        super().__init__(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            scale=args.head_dim**-0.5,
            rope=RoPE(args.head_dim, args.rope, args.max_position_embeddings),
        )
        self.q_norm = RMSNorm(args.num_attention_heads * args.head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(args.num_key_value_heads * args.head_dim, args.rms_norm_eps)
        self.norm_group = SINGLE  # Model.shard sets the job's group
        self.kv_replicas = 1  # ranks holding each KV head (even replication)
        self._kv_owned = None  # [kv slots * D] 0/1: which held KV heads this rank's sum counts (uneven)

    def _whole_norm(self, q, k):
        # Reference: w * (x * rsqrt(mean(x^2) + eps)).to(dtype) over all heads, stats in fp32.
        qf, kf = q.astype(mx.float32), k.astype(mx.float32)
        # Sums of squares of this rank's features: [B, L, 2] (q, k); a KV head
        # held by several ranks (or twice here) counts once (times 1 or 0: exact).
        kk = kf * kf if self._kv_owned is None else kf * kf * self._kv_owned
        ssq = mx.concatenate([(qf * qf).sum(-1, keepdims=True), kk.sum(-1, keepdims=True)], axis=-1)
        ssq = self.norm_group.all_sum(ssq)
        D = self.head_dim
        count = mx.array([self.total_num_heads * D, self.total_num_kv_heads * D * self.kv_replicas], mx.float32)
        inv = mx.rsqrt(ssq / count + self.q_norm.eps)
        q = self.q_norm.weight * (qf * inv[..., :1]).astype(q.dtype)
        k = self.k_norm.weight * (kf * inv[..., 1:]).astype(k.dtype)
        return q, k

    def position(self, q, k, offset):
        # rotated in fp32, rounded once: a half-precision mx.fast.rope rounds
        # more than the reference (whose bf16 cos/sin products round twice)
        q32, k32 = self.rope(q.astype(mx.float32), offset), self.rope(k.astype(mx.float32), offset)
        return q32.astype(q.dtype), k32.astype(k.dtype)

    def project(self, x):
        B, L, _ = x.shape
        q, k = self._whole_norm(self.q_proj(x), self.k_proj(x))
        # [B, L, heads * D] -> [B, heads, L, D]
        q = q.reshape(B, L, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)
        k = k.reshape(B, L, self.num_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.num_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        return q, k, v


class SparseMoeBlock(nn.Module):
    """Sigmoid top-k router with a choice-only correction bias over stacked
    experts (`experts.SwitchGLU`, fused gate_up: transformers' names; each
    fp32-weighted output rounded, summed in routed order); one all_sum once
    sharded."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        E = args.num_local_experts
        self.top_k = args.num_experts_per_tok
        self.gate = nn.Linear(args.hidden_size, E, bias=False)
        self.e_score_correction_bias = mx.zeros((E,))
        self.experts = SwitchGLU(args.hidden_size, args.intermediate_size, E, gated_fp32(activation(args.hidden_act)),
                                 fused=True, combine="sum")
        self.group = SINGLE  # the job's group once the experts are split (shard)

    def route(self, x):
        """x [N, hidden] -> (indices [N, k], weights [N, k] fp32)."""
        scores = mx.sigmoid(self.gate(x).astype(mx.float32))  # [N, E]: logits in the weights' dtype, as the reference
        choice = scores + self.e_score_correction_bias.astype(mx.float32)
        k = self.top_k
        idx = top_k(choice, k)  # [N, k], order irrelevant
        w = mx.take_along_axis(scores, idx, axis=-1)  # the unbiased scores
        return idx, w / w.sum(axis=-1, keepdims=True)

    def __call__(self, x):
        B, L, D = x.shape
        flat = x.reshape(B * L, D)  # [N, hidden]
        idx, w = self.route(flat)
        return self.group.all_sum(self.experts(flat, idx, w)).reshape(B, L, D)  # this rank's slice or experts


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = MiniMaxM2Attention(args)
        self.mlp = SparseMoeBlock(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def __call__(self, x, mask=None, cache=None):
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))

    # split decode (decode.SplitSegments): pre -> self_attn.attend -> post
    def pre(self, x, cache):
        return (x, *self.self_attn.qkv(self.input_layernorm(x), cache))

    def post(self, x, o):
        h = x + self.self_attn.out(o)
        return h + self.mlp(self.post_attention_layernorm(h))


class MiniMaxM2Model(DecoderStack):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.layers = [DecoderLayer(args) for _ in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Model(CausalLM):
    pipeline_stages = True  # a plain DecoderStack: runs in --pp stages (pipeline.py)
    split_decode = True  # layers have pre/post: decode steps compile around the attention kernels

    def __init__(self, args: ModelArgs):
        super().__init__(args, MiniMaxM2Model(args))

    def describe_layers(self) -> list[str]:
        a = self.args
        dims = int(a.head_dim * a.rope["partial_rotary_factor"])
        extra = (
            f", rotary {dims}/{a.head_dim} dims, q/k norm over the whole projection, "
            f"moe {a.num_local_experts} experts top-{a.num_experts_per_tok} (sigmoid, correction bias)"
        )
        return [line + extra for line in describe_layers(self)]

    def sanitize(self, weights: dict) -> dict:
        """Our layout (transformers' names with `.weight` on the stacked
        experts: `mlp.experts.gate_up_proj.weight` [E, 2I, hidden],
        `down_proj.weight` [E, hidden, I]) from transformers 5.24's, the hub's
        per-expert w1/w3/w2 and mlx-lm's switch_mlp stacks, quantized or not
        (gate and up joined on the intermediate axis: rows are whole in the
        packed layout too); `block_sparse_moe.` is `mlp.`."""
        out, experts, stacks = {}, {}, {}
        for name, w in weights.items():
            name = name.replace(".block_sparse_moe.", ".mlp.")
            if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
                out[name + ".weight"] = w  # transformers' tensor, our fused SwitchLinear
                continue
            if ".mlp.experts." in name and name.endswith((".w1.weight", ".w2.weight", ".w3.weight")):
                head, rest = name.split(".mlp.experts.", 1)
                e, which, _ = rest.split(".")
                experts.setdefault(head, {}).setdefault(which, {})[int(e)] = w
                continue
            if ".mlp.switch_mlp." in name:
                head, rest = name.split(".mlp.switch_mlp.", 1)
                stacks.setdefault(head, {})[rest] = w
                continue
            out[name] = w
        for head, parts in stacks.items():  # mlx-lm: [E, I, hidden] gate and up, [E, hidden, I] down
            pre = f"{head}.mlp.experts."
            for key, w in parts.items():
                proj, suffix = key.split(".")
                if proj == "down_proj":
                    out[pre + key] = w
                elif proj == "gate_proj":
                    if w is None:  # names only (quantization overrides): gate and up are one tensor here
                        out[f"{pre}gate_up_proj.{suffix}"] = None
                    elif f"up_proj.{suffix}" not in parts:
                        raise UserError(f"{head}: switch_mlp.gate_proj.{suffix} without up_proj.{suffix}")
                    else:
                        out[f"{pre}gate_up_proj.{suffix}"] = join([w, parts[f"up_proj.{suffix}"]], axis=1)
                elif f"gate_proj.{suffix}" not in parts:  # up_proj without gate_proj
                    if w is not None:
                        raise UserError(f"{head}: switch_mlp.up_proj.{suffix} without gate_proj.{suffix}")
                    out[f"{pre}gate_up_proj.{suffix}"] = None
        E = self.args.num_local_experts
        for head, parts in experts.items():
            if any(sorted(parts.get(k, {})) != list(range(E)) for k in ("w1", "w2", "w3")):
                raise UserError(f"{head}: the hub layout needs w1, w2 and w3 of all {E} experts")
            # per expert [w1; w3] = [2I, hidden] (gate rows then up rows), stacked
            gate_up = join([join([parts["w1"][e], parts["w3"][e]], axis=0) for e in range(E)], stack=True)
            out[f"{head}.mlp.experts.gate_up_proj.weight"] = gate_up
            out[f"{head}.mlp.experts.down_proj.weight"] = join([parts["w2"][e] for e in range(E)], stack=True)
        return super().sanitize(out)

    def shard(self, group):
        for layer in self.layers:
            shard_attention(layer.self_attn, group)
            shard_switch_glu(layer.mlp.experts, group)
            if not group.single:
                layer.mlp.group = group
                self._shard_whole_norm(layer.self_attn, group)
        self.shard_head(group)

    @staticmethod
    def _shard_whole_norm(attn, group):
        """This rank's slices of the norm weights and who counts each KV head."""
        n, r = group.size(), group.rank()
        H, KV, D = attn.total_num_heads, attn.total_num_kv_heads, attn.head_dim
        q0, q1, slots = rank_heads(attn, group)
        shard_head_vector(attn.q_norm, "weight", (q0, q1), D)
        shard_head_vector(attn.k_norm, "weight", slot_ranges(slots), D)
        attn.norm_group = group
        parts = head_partition(H, KV, n, group.weights)
        if group.weights is None and (KV % n == 0 or n % KV == 0):
            # the even split: each KV head on n / KV ranks alike, counted as often
            attn.kv_replicas = max(1, n // KV)
        else:
            # the lowest rank holding a KV head counts it, in its first slot
            owner = {kv: next(i for i, p in enumerate(parts) if p[2] <= kv < p[3]) for kv in range(KV)}
            first = {kv: slots.index(kv) for kv in set(slots)}
            own = [float(owner[kv] == r and first[kv] == i) for i, kv in enumerate(slots)]
            attn._kv_owned = mx.repeat(mx.array(own, mx.float32), D)

    def collectives_per_token(self) -> dict:
        """The usual ones plus, per sharded layer, the q/k sums of squares
        ([1, 1, 2] float32) and the MoE block's all_sum ([1, hidden], the
        experts' dtype)."""
        plan = super().collectives_per_token()
        calls, nbytes = plan["all_sum"]
        for layer in self.layers:
            if not layer.self_attn.norm_group.single:
                calls, nbytes = calls + 1, nbytes + 2 * 4
            if not layer.mlp.group.single:
                d = layer.mlp.experts.down_proj
                dt = (d.scales if "scales" in d else d.weight).dtype
                calls, nbytes = calls + 1, nbytes + self.args.hidden_size * dt.size
        return {**plan, "all_sum": (calls, nbytes)}
