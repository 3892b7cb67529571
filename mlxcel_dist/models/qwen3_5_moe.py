"""Qwen3.5 MoE (`qwen3_5_moe`: the text model of
Qwen3_5MoeForConditionalGeneration as hub checkpoints store it, Qwen3.5-35B-A3B
/ 397B-A17B; `qwen3_5_moe_text`: Qwen3_5MoeForCausalLM).

Hidden states [B, L, hidden]. The hybrid decoder of mlxcel_dist/nn/deltanet.py
(as qwen3_next) with Qwen3.5's DeltaNet projections: `in_proj_qkv` (rows: q
of every key head, then k, then v), `in_proj_z`, `in_proj_b`, `in_proj_a`.
Every layer's MLP is the routed MoE with a gated shared expert (top-k
weights always renormalised). RoPE: `rope_parameters` with mrope sections;
text positions are the same on every mrope axis, so it is plain partial
RoPE (partial_rotary_factor, default 0.25).

Config: a multimodal config.json nests the text model under `text_config`
(read here; the vision config is ignored). Weights: the hub's
`model.language_model.*` (and mlx-lm's `language_model.model.*` /
`language_model.lm_head.*`) map onto `model.*` / `lm_head.*`; the vision tower
(`model.visual.*`, `vision_tower.*`) and MTP layers (`mtp.*`) are dropped.
Experts: one key per expert (`mlp.experts.N.*`, what save_pretrained writes)
or fused (`mlp.experts.gate_up_proj` [E, 2I, hidden], `mlp.experts.down_proj`
[E, hidden, I]) become mlx-lm's `mlp.switch_mlp.*` lazily; mlx-lm's conv
layout and stored norms are read as they are (deltanet.mlx_lm_norms).

Tensor parallelism: as qwen3_next (deltanet.py); `in_proj_qkv` keeps three
row ranges (this rank's q, k and v heads).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..nn import deltanet
from ..nn.deltanet import LINEAR, GatedAttention, GatedDeltaNet, HybridLayer, SharedExpertMoE
from ..errors import UserError
from ..nn.experts import stack_expert_refs
from ..nn.layers import GemmaRMSNorm
from ..nn.rope import RoPE
from ..checkpoint.weights import swap_last_axes, take_range
from .base import BaseModelArgs, CausalLM, DecoderStack

NOT_TEXT = ("model.visual.", "visual.", "vision_tower.", "model.vision_tower.", "mtp.", "model.mtp.")
PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
            ("language_model.lm_head.", "lm_head."), ("language_model.", "model."))


@dataclass
class ModelArgs(BaseModelArgs):
    # Defaults are transformers' Qwen3_5MoeTextConfig defaults.
    model_type: str = "qwen3_5_moe_text"
    vocab_size: int = 248320
    hidden_size: int = 2048
    num_hidden_layers: int = 40
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
    intermediate_size: int | None = None  # no dense MLP (what `info` shows)
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts_per_tok: int = 8
    num_experts: int = 256
    layer_types: list | None = None
    full_attention_interval: int | None = None  # transformers-4 form of layer_types

    @classmethod
    def from_dict(cls, params: dict):
        # The multimodal checkpoint nests the text model under text_config.
        if isinstance(params.get("text_config"), dict):
            text = dict(params["text_config"])
            if "tie_word_embeddings" in params and "tie_word_embeddings" not in text:
                text["tie_word_embeddings"] = params["tie_word_embeddings"]
            params = {**text, "model_type": params.get("model_type", "qwen3_5_moe")}
        return super().from_dict(params)

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.layer_types = deltanet.hybrid_layer_types(self.layer_types, self.num_hidden_layers,
                                                       self.full_attention_interval)
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise UserError(f"{self.model_type}: num_experts_per_tok {self.num_experts_per_tok} must be in "
                            f"1..{self.num_experts}")
        self.rope = deltanet.hybrid_rope(self)


class Qwen3_5MoeTextModel(DecoderStack):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        rope = RoPE(args.head_dim, args.rope, args.max_position_embeddings)
        self.layers = [
            HybridLayer(kind, GatedDeltaNet(args, fused=False) if kind == LINEAR else GatedAttention(args, rope),
                        SharedExpertMoE(args, norm_topk_prob=True), args)
            for kind in args.layer_types
        ]
        self.norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)

    def masks(self, L: int, cache) -> dict:
        return deltanet.stack_masks(L, cache, self.stage_layer_types)


class Model(CausalLM):
    pipeline_stages = True  # layers are independent: only the hidden state crosses stages

    def __init__(self, args: ModelArgs):
        super().__init__(args, Qwen3_5MoeTextModel(args))

    def make_cache(self):
        return deltanet.make_cache(self.model.stage_layer_types)

    def quant_override(self, path: str):
        return deltanet.gate_quant_override(path)

    def mlx_lm_path(self, path: str, config: dict) -> str:
        """A module's path in mlx-lm's model of this config (config.json's per-layer
        quantization is keyed by it): the multimodal form wraps the text model."""
        return "language_model." + path if config.get("model_type") == "qwen3_5_moe" else path

    def describe_layers(self) -> list[str]:
        return deltanet.describe(self)

    def sanitize(self, weights: dict) -> dict:
        """The text model's names from the hub's (or mlx-lm's) multimodal
        layout; experts stacked; mlx-lm's conv layout (module doc)."""
        out = {}
        I = self.args.moe_intermediate_size
        for name, w in weights.items():
            if name.startswith(NOT_TEXT):
                continue
            for old, new in PREFIXES:
                if name.startswith(old):
                    name = new + name[len(old) :]
                    break
            if name.endswith(".mlp.experts.gate_up_proj"):  # [E, 2I, hidden]: gate rows, then up
                base = name[: -len("experts.gate_up_proj")] + "switch_mlp."
                out[base + "gate_proj.weight"] = take_range(w, 1, 0, I)
                out[base + "up_proj.weight"] = take_range(w, 1, I, 2 * I)
                continue
            if name.endswith(".mlp.experts.down_proj"):  # [E, hidden, I]
                out[name[: -len("experts.down_proj")] + "switch_mlp.down_proj.weight"] = w
                continue
            out[name] = w
        if deltanet.mlx_lm_norms(self, out):
            out = {k: swap_last_axes(w) if k.endswith("linear_attn.conv1d.weight") else w for k, w in out.items()}
        return super().sanitize(stack_expert_refs(out, self.args.num_experts))

    def shard(self, group):
        deltanet.shard_hybrid_layers(self.layers, group)
        self.shard_head(group)

    def collectives_per_token(self) -> dict:
        """The usual ones plus one all_sum per sharded MoE block."""
        return deltanet.moe_collectives(self, super().collectives_per_token())
