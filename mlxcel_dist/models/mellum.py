"""Mellum (`mellum`, JetBrains' MellumForCausalLM): a Qwen3-MoE style decoder.

Hidden states [B, L, hidden]; q [B, n_heads, L, head_dim], k/v [B,
n_kv_heads, L, head_dim] (per-rank counts under tensor parallelism). Pre-norm
blocks (llama RMSNorm); q_norm / k_norm are RMSNorms over head_dim, applied
per head BEFORE RoPE. Each layer kind (`layer_types`: sliding or full) has its
own RoPE (`rope_parameters[kind]`, default thetas 500000 full / 10000
sliding); sliding layers see `sliding_window` keys.

MLP per layer by `mlp_layer_types`: "dense" is the gated SwiGLU MLP
(`intermediate_size`), "sparse" the mixture of experts:
- router `mlp.gate.weight` [E, hidden] (no bias); softmax over all E logits
  in fp32, top-k of the probabilities, renormalised over the k when
  `norm_topk_prob`, cast to the hidden dtype;
- experts `mlp.experts.N.{gate,up,down}_proj.weight` ([I, hidden], [I,
  hidden], [hidden, I], I = `moe_intermediate_size`): one module per expert,
  as the checkpoint stores them (transformers 5 stacks them on load and
  unstacks them on save), so the loader reads each by name;
- out = sum over experts e (in index order, as the reference's index_add)
  of w[:, e] * expert_e(x), with w the routing weights scattered to [N, E]
  (zero for experts a token did not choose). Every expert runs on every
  token: exact and compile-friendly, but E/k times the routed work.
Tensor parallelism: the router is replicated, every expert (routed) is split
by its intermediate dimension (`shard.shard_expert_mlps`) and the block sums
its partial output once (one all_sum per MoE block).
MTP weights (`mtp.*`, `num_nextn_predict_layers`) are dropped, as transformers does.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..nn.blocks import MLP, Attention, PreNormBlock
from ..parallel.collectives import SINGLE
from ..errors import UserError
from ..nn.experts import softmax_top_k
from ..nn.layers import RMSNorm, activation
from ..nn.rope import RoPE
from ..parallel.shard import shard_attention, shard_expert_mlps, shard_mlp
from .base import FULL, SLIDING, BaseModelArgs, CausalLM, DecoderStack, derive_layer_types, describe_layers

DENSE, SPARSE = "dense", "sparse"
# MellumConfig's default when a config has no rope_parameters.
DEFAULT_ROPE = {
    FULL: {"rope_type": "default", "rope_theta": 500000.0},
    SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
}


@dataclass
class ModelArgs(BaseModelArgs):
    # Defaults are transformers' MellumConfig defaults.
    model_type: str = "mellum"
    vocab_size: int = 98304
    hidden_size: int = 2304
    intermediate_size: int = 7168
    num_hidden_layers: int = 28
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    attention_bias: bool = False
    sliding_window: int | None = 1024
    moe_intermediate_size: int = 896
    num_experts_per_tok: int = 8
    num_local_experts: int = 64
    norm_topk_prob: bool = True
    layer_types: list | None = None
    mlp_layer_types: list | None = None

    @classmethod
    def from_dict(cls, params: dict):
        params = dict(params)
        # transformers' attribute_map alias (save_pretrained writes num_local_experts).
        if "num_local_experts" not in params and "num_experts" in params:
            params["num_local_experts"] = params["num_experts"]
        return super().from_dict(params)

    def __post_init__(self):
        n = self.num_hidden_layers
        # MellumConfig: no layer_types means every layer full (no pattern).
        types = self.layer_types if self.layer_types is not None else [FULL] * n
        self.layer_types = derive_layer_types(types, n, self.sliding_window)
        mlp = self.mlp_layer_types if self.mlp_layer_types is not None else [SPARSE] * n
        if len(mlp) != n or set(mlp) - {DENSE, SPARSE}:
            raise UserError(f"mellum config mlp_layer_types must be {n} entries of 'dense'/'sparse', got {mlp}")
        self.mlp_layer_types = list(mlp)
        if SPARSE in mlp and not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise UserError(
                f"mellum: num_experts_per_tok {self.num_experts_per_tok} must be in 1..{self.num_local_experts}"
            )
        self.rope = self._rope_per_kind()

    def _rope_per_kind(self) -> dict:
        rp = self.rope_parameters if self.rope_parameters is not None else DEFAULT_ROPE
        if not isinstance(rp, dict) or not all(isinstance(rp.get(k), dict) for k in set(self.layer_types)):
            # transformers' MellumRotaryEmbedding reads rope_parameters[kind] for every kind used.
            raise UserError(
                f"mellum config rope_parameters must hold one entry per layer kind used "
                f"({sorted(set(self.layer_types))}), got {rp!r}"
            )
        out = {}
        for kind in set(self.layer_types):
            p = dict(rp[kind])
            p.setdefault("rope_type", "default")
            if p["rope_type"] not in ("default", "linear"):
                raise UserError(f"mellum: rope_type {p['rope_type']!r} is not supported (default, linear)")
            factor = p.get("partial_rotary_factor")
            if factor is not None and float(factor) != 1.0:
                # the reference's rotate-half applies cos/sin to the whole head
                raise UserError(f"mellum: partial_rotary_factor {factor} is not supported")
            if "rope_theta" not in p:
                raise UserError(f"mellum config rope_parameters[{kind!r}] has no rope_theta")
            out[kind] = p
        return out


class SparseMoeBlock(nn.Module):
    """Router (`gate`) -> softmax -> top-k (-> renormalise) -> weighted sum
    of the experts' outputs; one all_sum over `group` once sharded."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.gate = nn.Linear(args.hidden_size, args.num_local_experts, bias=False)
        act = activation(args.hidden_act)
        self.experts = [
            MLP(args.hidden_size, args.moe_intermediate_size, act) for _ in range(args.num_local_experts)
        ]
        self.group = SINGLE  # the job's group once the experts are split (shard)

    def routing(self, x):
        """x [N, hidden] -> routing weights [N, E] in x's dtype (zero off the top-k)."""
        logits = self.gate(x)  # [N, E]
        idx, top = softmax_top_k(logits, self.top_k, self.norm_topk_prob)
        top = top.astype(logits.dtype)
        return mx.put_along_axis(mx.zeros(logits.shape, dtype=top.dtype), idx, top, axis=-1)

    def __call__(self, x):
        B, L, D = x.shape
        x = x.reshape(B * L, D)  # [N, hidden]
        w = self.routing(x)
        y = mx.zeros_like(x)
        for e, expert in enumerate(self.experts):
            # in expert order, as the reference's index_add; unrouted terms are exact zeros
            y = y + expert(x) * w[:, e : e + 1]
        y = self.group.all_sum(y)  # this rank's intermediate slice of every expert
        return y.reshape(B, L, D)


class DecoderLayer(PreNormBlock):
    def __init__(self, args: ModelArgs, layer_idx: int):
        eps = args.rms_norm_eps
        kind = args.layer_types[layer_idx]
        self_attn = Attention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            scale=args.head_dim**-0.5,
            window=args.sliding_window if kind == SLIDING else None,
            rope=RoPE(args.head_dim, args.rope[kind], args.max_position_embeddings),
            bias=args.attention_bias,
            qk_norm=lambda d: RMSNorm(d, eps),
        )
        if args.mlp_layer_types[layer_idx] == SPARSE:
            mlp = SparseMoeBlock(args)
        else:
            mlp = MLP(args.hidden_size, args.intermediate_size, activation(args.hidden_act))
        super().__init__(self_attn, mlp, args.hidden_size, lambda d: RMSNorm(d, eps))


class MellumModel(DecoderStack):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Model(CausalLM):
    pipeline_stages = True  # a DecoderStack of independent layers: runs in --pp stages (pipeline.py)
    split_decode = True  # the engine's one-row step (decode.SplitSegments) may run its layers' pre/attend/post split (fused decode attention)

    def __init__(self, args: ModelArgs):
        super().__init__(args, MellumModel(args))

    def describe_layers(self) -> list[str]:
        a = self.args
        moe = f", moe {a.num_local_experts} experts top-{a.num_experts_per_tok}"
        return [
            line + (moe if kind == SPARSE else ", dense mlp")
            for line, kind in zip(describe_layers(self), a.mlp_layer_types)
        ]

    def sanitize(self, weights: dict) -> dict:
        """Drop the multi-token-prediction layer (`mtp.*`, unused by
        transformers' forward) and a stored copy of a tied head."""
        return super().sanitize({n: w for n, w in weights.items() if not n.startswith("mtp.")})

    def shard(self, group):
        for layer in self.layers:
            shard_attention(layer.self_attn, group)
            if isinstance(layer.mlp, SparseMoeBlock):
                shard_expert_mlps(layer.mlp.experts, group)
                layer.mlp.group = group
            else:
                shard_mlp(layer.mlp, group)
        self.shard_head(group)

    def collectives_per_token(self) -> dict:
        """The usual ones plus one all_sum ([1, hidden], the experts' dtype)
        per sharded MoE block."""
        plan = super().collectives_per_token()
        calls, nbytes = plan["all_sum"]
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoeBlock) and not layer.mlp.group.single:
                down = layer.mlp.experts[0].down_proj
                calls += 1
                nbytes += self.args.hidden_size * (down.scales if "scales" in down else down.weight).dtype.size
        return {**plan, "all_sum": (calls, nbytes)}
