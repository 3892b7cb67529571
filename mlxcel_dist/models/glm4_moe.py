"""GLM-4.5 / GLM-4.6 MoE (`glm4_moe`, Glm4MoeForCausalLM).

Hidden states [B, L, hidden]; q [B, n_heads, L, head_dim], k/v [B,
n_kv_heads, L, head_dim] (per-rank counts under tensor parallelism).
Pre-norm llama blocks; attention with q/k/v biases (`attention_bias`; o_proj
never has one), optional q/k RMSNorm per head (`use_qk_norm`), head_dim its
own key, and partial rotary: only the first head_dim * `partial_rotary_factor`
features rotate (rotate-half, default factor 0.5 as transformers fills it
in), the rest pass through. The first `first_k_dense_replace` layers have
the dense SwiGLU MLP; the others a sparse block:

- router `mlp.gate.weight` [E, hidden] in fp32: scores = sigmoid(x W^T);
  `mlp.gate.e_score_correction_bias` [E] is added only to CHOOSE experts:
  groups (`n_group`) ranked by the sum of their two best biased scores, the
  best `topk_group` kept, then the top-k biased scores among them; the
  weights are the chosen unbiased scores, renormalised (`norm_topk_prob`,
  + 1e-20), times `routed_scaling_factor`, all fp32;
- routed experts stacked as `mlp.switch_mlp.*` (experts.SwitchGLU: only the
  chosen experts run; transformers' per-expert keys stacked lazily by
  sanitize), each output times its fp32 weight rounded to the hidden dtype;
- `mlp.shared_experts` (I * `n_shared_experts`) on every token, added.
Hub checkpoints append `num_nextn_predict_layers` MTP layers
(model.layers.N, N >= num_hidden_layers): dropped, as transformers does.

Tensor parallelism: attention by heads, dense MLPs and the shared expert by
intermediate columns, the router replicated, routed experts by intermediate
slice or whole experts (`--moe-split`, shard.shard_switch_glu); the block's
routed + shared partial output goes through one all_sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..nn.blocks import MLP, Attention, PreNormBlock
from ..parallel.collectives import SINGLE
from ..errors import UserError
from ..nn.experts import SwitchGLU, stack_expert_refs, top_k, use_grouped
from ..nn.layers import RMSNorm, activation, gated_fp32
from ..nn.rope import RoPE
from ..parallel.shard import shard_attention, shard_expert_mlps, shard_mlp, shard_switch_glu
from .base import BaseModelArgs, CausalLM, DecoderStack, derive_layer_types, describe_layers

DENSE, SPARSE = "dense", "sparse"


@dataclass
class ModelArgs(BaseModelArgs):
    # Defaults are transformers' Glm4MoeConfig defaults.
    model_type: str = "glm4_moe"
    vocab_size: int = 151552
    hidden_size: int = 4096
    intermediate_size: int = 10944
    num_hidden_layers: int = 46
    num_attention_heads: int = 96
    num_key_value_heads: int = 8
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    partial_rotary_factor: float | None = None  # transformers 4 / hub: top level
    attention_bias: bool = False
    use_qk_norm: bool = False
    moe_intermediate_size: int = 1408
    num_experts_per_tok: int = 8
    n_routed_experts: int | None = None
    num_local_experts: int | None = None  # transformers' alias
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    num_nextn_predict_layers: int = 0

    def __post_init__(self):
        n = self.num_hidden_layers
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        E = self.n_routed_experts if self.n_routed_experts is not None else self.num_local_experts
        self.n_routed_experts = 128 if E is None else E
        self.layer_types = derive_layer_types(None, n, None)
        self.mlp_layer_types = [DENSE if i < self.first_k_dense_replace else SPARSE for i in range(n)]
        if SPARSE in self.mlp_layer_types:
            self._check_routing()
        self.rope = self._rope()

    def _rope(self) -> dict:
        """transformers' rope_parameters: rope_scaling (t4) or rope_parameters,
        rope_theta where missing, partial_rotary_factor from the top level
        (t4), else 0.5 (Glm4MoeConfig's default)."""
        params = dict(self.rope_scaling or self.rope_parameters or {})
        params.setdefault("rope_type", params.get("type", "default"))
        params.setdefault("rope_theta", 10_000.0 if self.rope_theta is None else self.rope_theta)
        if "partial_rotary_factor" not in params:
            params["partial_rotary_factor"] = 0.5 if self.partial_rotary_factor is None else self.partial_rotary_factor
        if params["rope_type"] != "default":
            raise UserError(f"glm4_moe: rope_type {params['rope_type']!r} is not supported (default only)")
        return params

    def _check_routing(self):
        E, G = self.n_routed_experts, self.n_group
        if not 1 <= self.num_experts_per_tok <= E:
            raise UserError(f"glm4_moe: num_experts_per_tok {self.num_experts_per_tok} must be in 1..{E}")
        if G < 1 or E % G or E // G < 2:
            raise UserError(f"glm4_moe: n_group {G} must split n_routed_experts {E} into groups of at least 2")
        if not 1 <= self.topk_group <= G:
            raise UserError(f"glm4_moe: topk_group {self.topk_group} must be in 1..{G} (n_group)")
        if self.num_experts_per_tok > self.topk_group * (E // G):
            raise UserError("glm4_moe: num_experts_per_tok exceeds the experts of the topk_group groups")
        if self.n_shared_experts < 1:
            raise UserError("glm4_moe: n_shared_experts must be at least 1")


class Router(nn.Module):
    """`mlp.gate`: weight [E, hidden] and the choice-only correction bias."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        E = args.n_routed_experts
        self.weight = mx.zeros((E, args.hidden_size))
        self.e_score_correction_bias = mx.zeros((E,))
        self.top_k, self.n_group, self.topk_group = args.num_experts_per_tok, args.n_group, args.topk_group
        self.norm_topk_prob = args.norm_topk_prob
        self.routed_scaling_factor = args.routed_scaling_factor

    def __call__(self, x):
        """x [N, hidden] -> (indices [N, k], weights [N, k] fp32)."""
        scores = mx.sigmoid(x.astype(mx.float32) @ self.weight.astype(mx.float32).T)  # [N, E], fp32
        choice = scores + self.e_score_correction_bias.astype(mx.float32)
        N, E = choice.shape
        G = self.n_group
        if self.topk_group < G:
            grouped = choice.reshape(N, G, E // G)  # a group's score: the sum of its two best
            best2 = mx.topk(grouped, 2, axis=-1).sum(axis=-1)  # [N, G]
            keep = mx.argpartition(-best2, kth=self.topk_group - 1, axis=-1)[:, : self.topk_group]
            mask = mx.put_along_axis(mx.zeros((N, G), dtype=mx.bool_), keep, mx.array(True), axis=-1)
            choice = mx.where(mx.repeat(mask, E // G, axis=-1), choice, -mx.inf)
        k = self.top_k
        idx = top_k(choice, k, ascending=True)  # [N, k]: SwitchGLU's index_add order
        w = mx.take_along_axis(scores, idx, axis=-1)  # the unbiased scores
        if self.norm_topk_prob:
            w = w / (w.sum(axis=-1, keepdims=True) + 1e-20)
        return idx, w * self.routed_scaling_factor


class SparseMoeBlock(nn.Module):
    """Routed stacked experts plus the shared expert; one all_sum once sharded."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        act = activation(args.hidden_act)
        self.gate = Router(args)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.n_routed_experts,
                                    gated_fp32(act))
        self.shared_experts = MLP(args.hidden_size, args.moe_intermediate_size * args.n_shared_experts, act)
        self.group = SINGLE  # the job's group once the experts are split (shard)

    def __call__(self, x):
        B, L, D = x.shape
        flat = x.reshape(B * L, D)  # [N, hidden]
        idx, w = self.gate(flat)
        routed = self.switch_mlp(flat, idx, w, grouped=use_grouped(idx.size, L), ascending=True)
        y = routed.reshape(B, L, D) + self.shared_experts(x)
        return self.group.all_sum(y)  # routed + shared partial outputs of this rank


class DecoderLayer(PreNormBlock):
    def __init__(self, args: ModelArgs, rope: RoPE, i: int):
        eps = args.rms_norm_eps
        self_attn = Attention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            scale=args.head_dim**-0.5,
            rope=rope,
            bias=args.attention_bias,
            o_bias=False,
            qk_norm=(lambda d: RMSNorm(d, eps)) if args.use_qk_norm else None,
        )
        if args.mlp_layer_types[i] == SPARSE:
            mlp = SparseMoeBlock(args)
        else:
            mlp = MLP(args.hidden_size, args.intermediate_size, activation(args.hidden_act))
        super().__init__(self_attn, mlp, args.hidden_size, lambda d: RMSNorm(d, eps))


class Glm4MoeModel(DecoderStack):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        rope = RoPE(args.head_dim, args.rope, args.max_position_embeddings)
        self.layers = [DecoderLayer(args, rope, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Model(CausalLM):
    pipeline_stages = True  # a DecoderStack of independent layers: runs in --pp stages (pipeline.py)
    split_decode = True  # the engine's one-row step (decode.SplitSegments) may run its layers' pre/attend/post split (fused decode attention)

    def __init__(self, args: ModelArgs):
        super().__init__(args, Glm4MoeModel(args))

    def describe_layers(self) -> list[str]:
        a = self.args
        out = []
        for line, layer, kind in zip(describe_layers(self), self.layers, a.mlp_layer_types):
            line += f", rotary {layer.self_attn.rope.dims}/{a.head_dim} dims"
            if kind == SPARSE:
                line += (f", moe {a.n_routed_experts} experts top-{a.num_experts_per_tok} "
                         f"(groups {a.topk_group}/{a.n_group}) + {a.n_shared_experts} shared"
                         f"{layer.mlp.switch_mlp.describe()}")
            else:
                line += ", dense mlp"
            out.append(line)
        return out

    def sanitize(self, weights: dict) -> dict:
        """Drop the MTP layers (index >= num_hidden_layers); stack
        transformers' per-expert tensors into mlx-lm's switch_mlp names."""
        n = self.args.num_hidden_layers
        kept = {}
        for name, w in weights.items():
            parts = name.split(".", 3)
            if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= n:
                continue
            kept[name] = w
        return super().sanitize(stack_expert_refs(kept, self.args.n_routed_experts))

    def shard(self, group):
        for layer in self.layers:
            shard_attention(layer.self_attn, group)
            if isinstance(layer.mlp, SparseMoeBlock):
                shard_switch_glu(layer.mlp.switch_mlp, group)
                shard_expert_mlps([layer.mlp.shared_experts], group)
                layer.mlp.group = group
            else:
                shard_mlp(layer.mlp, group)
        self.shard_head(group)

    def collectives_per_token(self) -> dict:
        """The usual ones plus one all_sum ([1, hidden], the experts' dtype)
        per sharded sparse block (routed and shared experts together)."""
        plan = super().collectives_per_token()
        calls, nbytes = plan["all_sum"]
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoeBlock) and not layer.mlp.group.single:
                down = layer.mlp.shared_experts.down_proj
                calls += 1
                nbytes += self.args.hidden_size * (down.scales if "scales" in down else down.weight).dtype.size
        return {**plan, "all_sum": (calls, nbytes)}
