"""Qwen3 MoE (`qwen3_moe`, Qwen3MoeForCausalLM: Qwen3-30B-A3B, Qwen3-235B-A22B).

Hidden states [B, L, hidden]; q [B, n_heads, L, head_dim], k/v [B,
n_kv_heads, L, head_dim] (per-rank counts under tensor parallelism). The
qwen3 decoder (q/k RMSNorm per head before RoPE, head_dim its own key) whose
MLP is, on layer i, a sparse block when i is not in `mlp_only_layers` and
(i + 1) % `decoder_sparse_step` == 0, else the dense SwiGLU MLP:

- router `mlp.gate.weight` [E, hidden] in the hidden dtype; softmax in fp32,
  top-k, renormalised when `norm_topk_prob`, then rounded to the hidden dtype;
- routed experts (I = `moe_intermediate_size`) as `mlp.switch_mlp.*`
  stacked (experts.SwitchGLU: only the chosen experts run); transformers'
  per-expert keys `mlp.experts.N.*` are stacked lazily by sanitize.
No shared expert. Sliding windows: transformers 5.24 gives EVERY layer the
window when `use_sliding_window` (max_window_layers is not read), so do we.

Tensor parallelism: attention by heads, dense MLPs by columns, the router
replicated, routed experts by intermediate slice or whole experts
(`--moe-split`, shard.shard_switch_glu); one all_sum per sparse block.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..nn.blocks import MLP, Attention, PreNormBlock
from ..errors import UserError
from ..nn.experts import SoftmaxMoE, stack_expert_refs
from ..nn.layers import RMSNorm, activation
from ..nn.rope import RoPE
from ..parallel.shard import shard_attention, shard_mlp, shard_switch_glu
from .base import FULL, SLIDING, BaseModelArgs, CausalLM, DecoderStack, derive_layer_types, describe_layers, \
    single_rope_params

DENSE, SPARSE = "dense", "sparse"


@dataclass
class ModelArgs(BaseModelArgs):
    # Defaults are transformers' Qwen3MoeConfig defaults.
    model_type: str = "qwen3_moe"
    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 24
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    attention_bias: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int | None = None  # read by neither transformers 5.24 nor us
    layer_types: list | None = None
    decoder_sparse_step: int = 1
    moe_intermediate_size: int = 768
    num_experts_per_tok: int = 8
    num_experts: int | None = None  # transformers 4 / hub name
    num_local_experts: int | None = None  # what transformers 5 saves
    norm_topk_prob: bool = False
    mlp_only_layers: list | None = None

    def __post_init__(self):
        n = self.num_hidden_layers
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        E = self.num_experts if self.num_experts is not None else self.num_local_experts
        self.num_experts = self.num_local_experts = 128 if E is None else E
        self.sliding_window = self.sliding_window if self.use_sliding_window else None
        types = self.layer_types
        if types is None and self.sliding_window is not None:
            types = [SLIDING] * n  # every layer: transformers' mask and attention both take the window
        self.layer_types = derive_layer_types(types, n, self.sliding_window)
        only = set(self.mlp_only_layers or [])
        step = self.decoder_sparse_step
        if self.num_experts > 0 and step < 1:
            raise UserError(f"qwen3_moe: decoder_sparse_step must be >= 1, got {step}")
        self.mlp_layer_types = [
            SPARSE if i not in only and self.num_experts > 0 and (i + 1) % step == 0 else DENSE for i in range(n)
        ]
        if SPARSE in self.mlp_layer_types and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise UserError(f"qwen3_moe: num_experts_per_tok {self.num_experts_per_tok} must be in 1..{self.num_experts}")
        self.rope = single_rope_params(self.rope_parameters, self.rope_scaling, self.rope_theta,
                                       self.max_position_embeddings)


class SparseMoeBlock(SoftmaxMoE):
    """Softmax top-k router over stacked experts; one all_sum once sharded."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, args.norm_topk_prob)


class DecoderLayer(PreNormBlock):
    def __init__(self, args: ModelArgs, rope: RoPE, i: int):
        eps = args.rms_norm_eps
        self_attn = Attention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            scale=args.head_dim**-0.5,
            window=args.sliding_window if args.layer_types[i] == SLIDING else None,
            rope=rope,
            bias=args.attention_bias,
            qk_norm=lambda d: RMSNorm(d, eps),
        )
        if args.mlp_layer_types[i] == SPARSE:
            mlp = SparseMoeBlock(args)
        else:
            mlp = MLP(args.hidden_size, args.intermediate_size, activation(args.hidden_act))
        super().__init__(self_attn, mlp, args.hidden_size, lambda d: RMSNorm(d, eps))


class Qwen3MoeModel(DecoderStack):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        rope = RoPE(args.head_dim, args.rope, args.max_position_embeddings)
        self.layers = [DecoderLayer(args, rope, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Model(CausalLM):
    pipeline_stages = True  # a DecoderStack of independent layers: runs in --pp stages (pipeline.py)
    split_decode = True  # the engine's one-row step (decode.SplitSegments) may run its layers' pre/attend/post split (fused decode attention)

    def __init__(self, args: ModelArgs):
        super().__init__(args, Qwen3MoeModel(args))

    def describe_layers(self) -> list[str]:
        a = self.args
        out = []
        for line, layer, kind in zip(describe_layers(self), self.layers, a.mlp_layer_types):
            if kind == SPARSE:
                norm = "renormalised" if a.norm_topk_prob else "not renormalised"
                line += (f", moe {a.num_experts} experts top-{a.num_experts_per_tok} ({norm})"
                         f"{layer.mlp.switch_mlp.describe()}")
            else:
                line += ", dense mlp"
            out.append(line)
        return out

    def sanitize(self, weights: dict) -> dict:
        """Stack transformers' per-expert tensors into mlx-lm's switch_mlp names."""
        return super().sanitize(stack_expert_refs(weights, self.args.num_experts))

    def shard(self, group):
        for layer in self.layers:
            shard_attention(layer.self_attn, group)
            if isinstance(layer.mlp, SparseMoeBlock):
                shard_switch_glu(layer.mlp.switch_mlp, group)
                layer.mlp.group = group
            else:
                shard_mlp(layer.mlp, group)
        self.shard_head(group)

    def collectives_per_token(self) -> dict:
        """The usual ones plus one all_sum ([1, hidden], the hidden dtype) per
        sharded sparse block."""
        plan = super().collectives_per_token()
        calls, nbytes = plan["all_sum"]
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoeBlock) and not layer.mlp.group.single:
                gate = layer.mlp.gate
                calls += 1
                nbytes += self.args.hidden_size * (gate.scales if "scales" in gate else gate.weight).dtype.size
        return {**plan, "all_sum": (calls, nbytes)}
