"""Qwen3-Next (`qwen3_next`, Qwen3NextForCausalLM: Qwen3-Next-80B-A3B).

Hidden states [B, L, hidden]. The hybrid decoder of mlxcel_dist/nn/deltanet.py:
`layer_types` (or every `full_attention_interval`-th layer full, default 4)
picks a gated DeltaNet layer (`linear_attn`, fused `in_proj_qkvz` /
`in_proj_ba` per key head) or gated full attention (`self_attn`: q_proj
gives q and an output gate per head, (1 + w) q/k norms, partial RoPE,
head_dim its own key). The MLP of layer i is a routed MoE with a gated
shared expert when i is not in `mlp_only_layers` and (i + 1) %
`decoder_sparse_step` == 0, else a dense SwiGLU. Caches: a
`cache.DeltaNetCache` (conv + recurrent state) per linear layer, a KVCache
per full one; decode steps run eagerly (the state is not static KV).

Weights: transformers' per-expert keys `mlp.experts.N.*` are stacked lazily
into mlx-lm's `mlp.switch_mlp.*` (experts.stack_expert_refs); mlx-lm's own
layout (conv1d.weight [C, K, 1], the (1 + w) norms stored as 1 + w) is read
as it is (deltanet.mlx_lm_norms). MTP layers (`mtp.*`) are dropped.

Tensor parallelism: DeltaNet by key-head groups, attention by heads, MoE by
expert slices (or whole experts, --moe-split) with the shared expert split by
columns, one all_sum per block; see deltanet.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..nn import deltanet
from ..nn.blocks import MLP
from ..nn.deltanet import LINEAR, GatedAttention, GatedDeltaNet, HybridLayer, SharedExpertMoE
from ..errors import UserError
from ..nn.experts import stack_expert_refs
from ..nn.layers import GemmaRMSNorm, activation
from ..nn.rope import RoPE
from ..checkpoint.weights import swap_last_axes
from .base import FULL, BaseModelArgs, CausalLM, DecoderStack

DENSE, SPARSE = "dense", "sparse"


@dataclass
class ModelArgs(BaseModelArgs):
    # Defaults are transformers' Qwen3NextConfig defaults.
    model_type: str = "qwen3_next"
    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 48
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int | None = 256
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    rope_theta: float | None = None  # transformers-4 form
    rope_scaling: dict | None = None  # transformers-4 form
    partial_rotary_factor: float | None = None  # transformers-4 form (default 0.25)
    attention_bias: bool = False
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    decoder_sparse_step: int = 1
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts_per_tok: int = 10
    num_experts: int = 512
    norm_topk_prob: bool = True
    mlp_only_layers: list | None = None
    layer_types: list | None = None
    full_attention_interval: int | None = None  # transformers-4 form of layer_types

    def __post_init__(self):
        n = self.num_hidden_layers
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.layer_types = deltanet.hybrid_layer_types(self.layer_types, n, self.full_attention_interval)
        only, step = set(self.mlp_only_layers or []), self.decoder_sparse_step
        if self.num_experts > 0 and step < 1:
            raise UserError(f"qwen3_next: decoder_sparse_step must be >= 1, got {step}")
        self.mlp_layer_types = [SPARSE if i not in only and self.num_experts > 0 and (i + 1) % step == 0 else DENSE
                                for i in range(n)]
        if SPARSE in self.mlp_layer_types and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise UserError(f"qwen3_next: num_experts_per_tok {self.num_experts_per_tok} must be in "
                            f"1..{self.num_experts}")
        self.rope = deltanet.hybrid_rope(self)


class Qwen3NextModel(DecoderStack):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        rope = RoPE(args.head_dim, args.rope, args.max_position_embeddings)
        self.layers = [self._layer(args, rope, i) for i in range(args.num_hidden_layers)]
        self.norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)

    @staticmethod
    def _layer(args, rope, i: int) -> HybridLayer:
        kind = args.layer_types[i]
        mixer = GatedDeltaNet(args, fused=True) if kind == LINEAR else GatedAttention(args, rope)
        if args.mlp_layer_types[i] == SPARSE:
            mlp = SharedExpertMoE(args, args.norm_topk_prob)
        else:
            mlp = MLP(args.hidden_size, args.intermediate_size, activation(args.hidden_act))
        return HybridLayer(kind, mixer, mlp, args)

    def masks(self, L: int, cache) -> dict:
        return deltanet.stack_masks(L, cache, self.stage_layer_types)


class Model(CausalLM):
    pipeline_stages = True  # layers are independent: only the hidden state crosses stages

    def __init__(self, args: ModelArgs):
        super().__init__(args, Qwen3NextModel(args))

    def make_cache(self):
        return deltanet.make_cache(self.model.stage_layer_types)

    def describe_layers(self) -> list[str]:
        return deltanet.describe(self)

    def sanitize(self, weights: dict) -> dict:
        """Drop MTP weights; stack per-expert tensors into switch_mlp; read
        mlx-lm's conv layout and stored norms (module doc)."""
        weights = {k: w for k, w in weights.items() if not k.startswith("mtp.")}
        if deltanet.mlx_lm_norms(self, weights):
            weights = {k: swap_last_axes(w) if k.endswith("linear_attn.conv1d.weight") else w
                       for k, w in weights.items()}
        return super().sanitize(stack_expert_refs(weights, self.args.num_experts))

    def quant_override(self, path: str):
        return deltanet.gate_quant_override(path)

    def export_for_mlx_lm(self, weights: dict, config: dict) -> tuple[dict, dict]:
        """`convert`'s output as mlx-lm's qwen3_next reads it: its converted
        layout (deltanet.export_mlx_lm_layout) and the transformers-4 rope keys
        it requires (rope_theta, partial_rotary_factor). mlx-lm places full
        layers by full_attention_interval only: written when layer_types
        follow one (else mlx-lm cannot run the model as it is)."""
        config = dict(config)
        config.setdefault("rope_theta", self.args.rope["rope_theta"])
        config.setdefault("partial_rotary_factor", self.args.rope["partial_rotary_factor"])
        config.setdefault("mlp_only_layers", list(self.args.mlp_only_layers or []))
        types = self.args.layer_types
        if FULL in types:
            p = types.index(FULL) + 1
            if all((t == FULL) == ((i + 1) % p == 0) for i, t in enumerate(types)):
                config.setdefault("full_attention_interval", p)
        return deltanet.export_mlx_lm_layout(self, weights), config

    def shard(self, group):
        deltanet.shard_hybrid_layers(self.layers, group)
        self.shard_head(group)

    def collectives_per_token(self) -> dict:
        """The usual ones plus one all_sum per sharded MoE block."""
        return deltanet.moe_collectives(self, super().collectives_per_token())
