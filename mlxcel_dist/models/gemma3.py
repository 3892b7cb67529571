"""Gemma 3 text model (`gemma3_text`, and the text tower of multimodal `gemma3`).

Hidden states [B, L, hidden]; q [B, n_heads, L, head_dim], k/v [B, n_kv_heads,
L, head_dim] (per-rank counts under tensor parallelism). Layers alternate
sliding-window (local RoPE base) and full attention (global RoPE base, with
rope scaling); both normalise q and k per head, scale scores by
query_pre_attn_scalar ** -0.5, and wrap attention and the GeGLU MLP in
pre- and post-norms. Embeddings are scaled by sqrt(hidden) in the compute
dtype and tied to the output head.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..nn.blocks import MLP, Attention, SandwichBlock
from ..errors import UserError
from ..nn.layers import GemmaRMSNorm, activation
from ..cache import layer_masks
from ..nn.rope import RoPE
from .base import FULL, SLIDING, BaseModelArgs, CausalLM, DecoderStack, derive_layer_types


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = "gemma3_text"
    vocab_size: int = 262208
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    query_pre_attn_scalar: float = 256
    sliding_window: int = 4096
    layer_types: list | None = None
    sliding_window_pattern: int | None = 6
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    max_position_embeddings: int = 131072
    use_bidirectional_attention: bool | None = False

    @classmethod
    def from_dict(cls, params: dict):
        # Multimodal checkpoints nest the text model under text_config.
        if isinstance(params.get("text_config"), dict):
            text = dict(params["text_config"])
            if "tie_word_embeddings" in params and "tie_word_embeddings" not in text:
                text["tie_word_embeddings"] = params["tie_word_embeddings"]
            # transformers' Gemma3ForConditionalGeneration never applies the
            # final logit softcap (only Gemma3ForCausalLM does): match it.
            text["final_logit_softcapping"] = None
            params = text
        return super().from_dict(params)

    def __post_init__(self):
        if self.use_bidirectional_attention:
            raise UserError("gemma3 with use_bidirectional_attention (an embedding model) is not supported")
        self.layer_types = derive_layer_types(
            self.layer_types, self.num_hidden_layers, self.sliding_window, self.sliding_window_pattern
        )
        self.rope = self._rope_per_kind()

    def _rope_per_kind(self) -> dict:
        # transformers 5: rope_parameters per layer kind. transformers 4:
        # rope_theta + rope_scaling for global layers, rope_local_base_freq local.
        rp = self.rope_parameters
        if rp is not None and (FULL in rp or SLIDING in rp):
            full = dict(rp.get(FULL) or {})
            sliding = dict(rp.get(SLIDING) or {})
        elif rp is not None:
            full, sliding = dict(rp), {}
        else:
            full, sliding = dict(self.rope_scaling or {}), {}
        if "type" in full and "rope_type" not in full:
            full["rope_type"] = full.pop("type")
        full.setdefault("rope_type", "default")
        full.setdefault("rope_theta", self.rope_theta)
        sliding.setdefault("rope_type", "default")
        sliding.setdefault("rope_theta", self.rope_local_base_freq)
        return {FULL: full, SLIDING: sliding}


class DecoderLayer(SandwichBlock):
    def __init__(self, args: ModelArgs, layer_idx: int):
        eps = args.rms_norm_eps
        kind = args.layer_types[layer_idx]
        attn = Attention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            scale=args.query_pre_attn_scalar**-0.5,
            window=args.sliding_window if kind == SLIDING else None,
            rope=RoPE(args.head_dim, args.rope[kind], args.max_position_embeddings),
            bias=args.attention_bias,
            qk_norm=lambda d: GemmaRMSNorm(d, eps),
            # transformers' Gemma3 never applies attn_logit_softcapping (Gemma 3
            # replaced it with q/k norms); the reference wins, so neither do we.
            softcap=None,
        )
        mlp = MLP(args.hidden_size, args.intermediate_size, activation(args.hidden_activation))
        super().__init__(attn, mlp, args.hidden_size, lambda d: GemmaRMSNorm(d, eps))


def gemma3_masks(L: int, cache, args: ModelArgs, layer_types: list | None = None) -> dict:
    """The global and the sliding mask for L new tokens, built once per forward
    through the shared selector (a decode step needs none). `layer_types`:
    the kinds of the layers `cache` is for (default: every layer's)."""
    return layer_masks(L, cache, args.layer_types if layer_types is None else layer_types, args.sliding_window)


class Gemma3TextModel(DecoderStack):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)

    def embed(self, inputs):
        h = self.embed_tokens(inputs)
        # sqrt(hidden) rounded once to fp32, then to the compute dtype (as the reference).
        h = h * mx.array(self.args.hidden_size**0.5, mx.float32).astype(h.dtype)
        return h

    def masks(self, L: int, cache) -> dict:
        return gemma3_masks(L, cache, self.args, self.stage_layer_types)


class Model(CausalLM):
    pipeline_stages = True  # plain DecoderStack: runs in --pp stages (pipeline.py)

    def __init__(self, args: ModelArgs):
        super().__init__(args, Gemma3TextModel(args))

    split_decode = True  # the engine's one-row step (decode.SplitSegments) may run its layers' pre/attend/post split

    def __call__(self, inputs, cache=None):
        return self.softcap(super().__call__(inputs, cache))

    def decode_logits(self, h):
        """Logits of the final hidden state of a split decode step (as __call__ after its layers)."""
        return self.softcap(self.head(self.model.norm(h)))

    def softcap(self, logits):
        if self.args.final_logit_softcapping:
            cap = self.args.final_logit_softcapping
            logits = mx.tanh(logits / cap) * cap
        return logits

    def sanitize(self, weights: dict) -> dict:
        """Map multimodal names onto the text model; drop the vision parts and
        (in the shared sanitize) a stored copy of the tied output head."""
        out = {}
        for name, w in weights.items():
            if name.startswith(("vision_tower.", "multi_modal_projector.", "model.vision_tower.")):
                continue
            if name.startswith("model.multi_modal_projector."):
                continue
            for old, new in (
                ("language_model.model.", "model."),  # transformers 4 multimodal
                ("model.language_model.", "model."),  # transformers 5 multimodal
                ("language_model.lm_head.", "lm_head."),
            ):
                if name.startswith(old):
                    name = new + name[len(old) :]
                    break
            out[name] = w
        return super().sanitize(out)
