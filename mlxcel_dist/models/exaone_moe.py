"""EXAONE MoE (`exaone_moe`, LG's ExaoneMoeForCausalLM, e.g. K-EXAONE).

Hidden states [B, L, hidden]; q [B, n_heads, L, head_dim], k/v [B,
n_kv_heads, L, head_dim] (per-rank counts under tensor parallelism).
Pre-norm blocks (llama RMSNorm; unlike exaone4's post-norm), q/k RMSNorm per
head before RoPE. Layer kinds: `layer_types`, else every
`sliding_window_pattern`-th layer global (an int, as transformers derives
it). With a window, global layers carry no RoPE (NoPE); without one every
layer is global and rotated. One RoPE (`rope_parameters`) for all.

MLP per layer by `mlp_layer_types` (else the first `first_k_dense_replace`
layers dense): "dense" is the SwiGLU MLP (`intermediate_size`), "sparse":
- router `mlp.gate.weight` [E, hidden] in fp32: scores = sigmoid(x W^T);
  `mlp.e_score_correction_bias` [E] is added only to CHOOSE experts:
  groups (`n_group`, E/n_group experts each) ranked by the sum of their two
  best biased scores, the best `topk_group` groups kept, then the top-k
  biased scores among them; the weights are the chosen UNBIASED scores,
  renormalised (`norm_topk_prob`, + 1e-20) then times `routed_scaling_factor`,
  all fp32;
- experts `mlp.experts.N.{gate,up,down}_proj.weight` (I =
  `moe_intermediate_size`), one module per expert as the checkpoint stores
  them; each expert's output times its fp32 weight is rounded to the hidden
  dtype and accumulated in expert order (the reference's index_add); every
  expert runs on every token (unrouted weights are exact zeros);
- `mlp.shared_experts` (I * `num_shared_experts`) on every token, added.
Tensor parallelism: router replicated; routed and shared experts split by
their intermediate dimension (`shard.shard_expert_mlps`); the block's partial
output (routed + shared) is summed once (one all_sum per MoE block).
`mtp.*` weights are dropped, as transformers does.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..nn.blocks import MLP, Attention, PreNormBlock
from ..parallel.collectives import SINGLE
from ..errors import UserError
from ..nn.layers import RMSNorm, activation
from ..nn.rope import RoPE
from ..parallel.shard import shard_attention, shard_expert_mlps, shard_mlp
from .base import (
    FULL,
    SLIDING,
    BaseModelArgs,
    CausalLM,
    DecoderStack,
    derive_layer_types,
    describe_layers,
)

DENSE, SPARSE = "dense", "sparse"


@dataclass
class ModelArgs(BaseModelArgs):
    # Defaults are transformers' ExaoneMoeConfig defaults.
    model_type: str = "exaone_moe"
    vocab_size: int = 102400
    hidden_size: int = 4096
    intermediate_size: int = 16384
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None  # the transformers-4 form, read as transformers 5 does
    rope_parameters: dict | None = None
    sliding_window: int | None = 4096
    sliding_window_pattern: str | int | None = 4
    layer_types: list | None = None
    mlp_layer_types: list | None = None
    first_k_dense_replace: int = 1
    moe_intermediate_size: int = 1024
    num_experts: int = 64
    num_experts_per_tok: int = 8
    num_shared_experts: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    n_group: int = 1
    topk_group: int = 1

    def __post_init__(self):
        n = self.num_hidden_layers
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.layer_types = derive_layer_types(self._pattern_layer_types(), n, self.sliding_window)
        mlp = self.mlp_layer_types
        if mlp is None:
            mlp = [DENSE if i < self.first_k_dense_replace else SPARSE for i in range(n)]
        if len(mlp) != n or set(mlp) - {DENSE, SPARSE}:
            raise UserError(f"exaone_moe config mlp_layer_types must be {n} entries of 'dense'/'sparse', got {mlp}")
        self.mlp_layer_types = list(mlp)
        if SPARSE in mlp:
            self._check_routing()
        self.rope = self.one_rope()

    def _pattern_layer_types(self) -> list | None:
        """layer_types as given; else every P-th layer global for an int
        sliding_window_pattern P (transformers' ExaoneMoeConfig); without a
        window every layer is global."""
        if self.layer_types is not None or self.sliding_window is None:
            return self.layer_types
        p = self.sliding_window_pattern
        if isinstance(p, int) and not isinstance(p, bool) and p >= 1:
            return [SLIDING if (i + 1) % p else FULL for i in range(self.num_hidden_layers)]
        # transformers cannot derive kinds from a string ("LLLG") either
        raise UserError(
            f"exaone_moe config sliding_window_pattern {p!r} is not a positive integer and there is no layer_types"
        )

    def _check_routing(self):
        E, G = self.num_experts, self.n_group
        if not 1 <= self.num_experts_per_tok <= E:
            raise UserError(f"exaone_moe: num_experts_per_tok {self.num_experts_per_tok} must be in 1..{E}")
        if G < 1 or E % G or E // G < 2:
            raise UserError(f"exaone_moe: n_group {G} must split num_experts {E} into groups of at least 2")
        if not 1 <= self.topk_group <= G:
            raise UserError(f"exaone_moe: topk_group {self.topk_group} must be in 1..{G} (n_group)")
        if self.num_experts_per_tok > self.topk_group * (E // G):
            raise UserError("exaone_moe: num_experts_per_tok exceeds the experts of the topk_group groups")
        if self.num_shared_experts < 1:
            raise UserError("exaone_moe: num_shared_experts must be at least 1")


class SparseMoeBlock(nn.Module):
    """Sigmoid router with a choice-only correction bias and group-limited
    top-k, routed experts plus a shared expert; one all_sum once sharded."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        E = args.num_experts
        self.top_k, self.n_group, self.topk_group = args.num_experts_per_tok, args.n_group, args.topk_group
        self.norm_topk_prob = args.norm_topk_prob
        self.routed_scaling_factor = args.routed_scaling_factor
        act = activation(args.hidden_act)
        self.gate = nn.Linear(args.hidden_size, E, bias=False)
        self.e_score_correction_bias = mx.zeros((E,))
        self.experts = [MLP(args.hidden_size, args.moe_intermediate_size, act) for _ in range(E)]
        self.shared_experts = MLP(args.hidden_size, args.moe_intermediate_size * args.num_shared_experts, act)
        self.group = SINGLE  # the job's group once the experts are split (shard)

    def routing(self, x):
        """x [N, hidden] -> routing weights [N, E] fp32 (zero off the chosen k)."""
        scores = mx.sigmoid(self.gate(x.astype(mx.float32)))  # [N, E], fp32 as the reference
        choice = scores + self.e_score_correction_bias.astype(mx.float32)
        N, E = choice.shape
        G = self.n_group
        if self.topk_group < G:
            # [N, G, E/G]: a group's score is the sum of its two best (order-free)
            grouped = choice.reshape(N, G, E // G)
            best2 = mx.topk(grouped, 2, axis=-1).sum(axis=-1)  # [N, G]
            keep = mx.argpartition(-best2, kth=self.topk_group - 1, axis=-1)[:, : self.topk_group]
            mask = mx.put_along_axis(mx.zeros((N, G), dtype=mx.bool_), keep, mx.array(True), axis=-1)
            choice = mx.where(mx.repeat(mask, E // G, axis=-1), choice, -mx.inf)
        k = self.top_k
        idx = mx.argpartition(-choice, kth=k - 1, axis=-1)[:, :k]  # [N, k], order irrelevant
        w = mx.take_along_axis(scores, idx, axis=-1)  # the unbiased scores
        if self.norm_topk_prob:
            w = w / (w.sum(axis=-1, keepdims=True) + 1e-20)
        w = w * self.routed_scaling_factor
        return mx.put_along_axis(mx.zeros((N, E), dtype=mx.float32), idx, w, axis=-1)

    def __call__(self, x):
        B, L, D = x.shape
        xf = x.reshape(B * L, D)  # [N, hidden]
        w = self.routing(xf)
        y = mx.zeros_like(xf)
        for e, expert in enumerate(self.experts):
            # expert output x fp32 weight, rounded to the hidden dtype, summed in expert order
            y = y + (expert(xf) * w[:, e : e + 1]).astype(xf.dtype)
        y = y.reshape(B, L, D) + self.shared_experts(x)
        return self.group.all_sum(y)  # this rank's intermediate slice of every expert


class DecoderLayer(PreNormBlock):
    def __init__(self, args: ModelArgs, rope: RoPE, layer_idx: int):
        eps = args.rms_norm_eps
        sliding = args.layer_types[layer_idx] == SLIDING
        self_attn = Attention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            scale=args.head_dim**-0.5,
            window=args.sliding_window if sliding else None,
            # the reference rotates iff the model has no window or the layer slides
            rope=rope if args.sliding_window is None or sliding else None,
            qk_norm=lambda d: RMSNorm(d, eps),
        )
        if args.mlp_layer_types[layer_idx] == SPARSE:
            mlp = SparseMoeBlock(args)
        else:
            mlp = MLP(args.hidden_size, args.intermediate_size, activation(args.hidden_act))
        super().__init__(self_attn, mlp, args.hidden_size, lambda d: RMSNorm(d, eps))


class ExaoneMoeModel(DecoderStack):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        rope = RoPE(args.head_dim, args.rope, args.max_position_embeddings)
        self.layers = [DecoderLayer(args, rope, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Model(CausalLM):
    pipeline_stages = True  # a DecoderStack of independent layers: runs in --pp stages (pipeline.py)
    split_decode = True  # the engine's one-row step (decode.SplitSegments) may run its layers' pre/attend/post split (fused decode attention)

    def __init__(self, args: ModelArgs):
        super().__init__(args, ExaoneMoeModel(args))

    def describe_layers(self) -> list[str]:
        a = self.args
        moe = (
            f", moe {a.num_experts} experts top-{a.num_experts_per_tok} "
            f"(groups {a.topk_group}/{a.n_group}) + {a.num_shared_experts} shared"
        )
        return [
            line + (moe if kind == SPARSE else ", dense mlp")
            for line, kind in zip(describe_layers(self), a.mlp_layer_types)
        ]

    def sanitize(self, weights: dict) -> dict:
        """Drop the multi-token-prediction layer (`mtp.*`); read the
        correction bias under either name (`mlp.gate.e_score_correction_bias`,
        transformers' in-memory name, is saved as `mlp.e_score_correction_bias`);
        drop a stored copy of a tied head."""
        out = {}
        for name, w in weights.items():
            if name.startswith("mtp."):
                continue
            out[name.replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias")] = w
        return super().sanitize(out)

    def shard(self, group):
        for layer in self.layers:
            shard_attention(layer.self_attn, group)
            if isinstance(layer.mlp, SparseMoeBlock):
                shard_expert_mlps([*layer.mlp.experts, layer.mlp.shared_experts], group)
                layer.mlp.group = group
            else:
                shard_mlp(layer.mlp, group)
        self.shard_head(group)

    def collectives_per_token(self) -> dict:
        """The usual ones plus one all_sum ([1, hidden], the experts' dtype)
        per sharded MoE block (routed and shared experts together)."""
        plan = super().collectives_per_token()
        calls, nbytes = plan["all_sum"]
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoeBlock) and not layer.mlp.group.single:
                down = layer.mlp.shared_experts.down_proj
                calls += 1
                nbytes += self.args.hidden_size * (down.scales if "scales" in down else down.weight).dtype.size
        return {**plan, "all_sum": (calls, nbytes)}
