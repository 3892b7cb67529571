"""Gemma 4 text model (`gemma4_text`, and the text model of multimodal `gemma4`).

Hidden states [B, L, hidden]; q [B, n_heads, L, head_dim], k/v [B,
n_kv_heads, L, head_dim] (per-rank counts under tensor parallelism), where
head_dim and n_kv_heads are the layer's own: full layers have theirs
(`global_head_dim`, `num_global_key_value_heads`, or transformers 5.24's
`per_layer_config`). Per-layer inputs (PLE) [B, L, num_layers, P].

What is Gemma 4's own (blocks.Gemma4Attention, blocks.Gemma4Router,
blocks.Gemma4Experts, blocks.ProportionalRoPE):
- RMSNorms scale by w (not 1 + w); attention scale 1 with q/k norms and a
  weightless norm on v; on full layers with `attention_k_eq_v` v is the raw
  k projection (before k_norm), v-normed;
- full layers use "proportional" partial RoPE (rotated pairs (i, i + D/2)
  for the first partial * D/2 frequencies, exponents over the whole D);
- every layer ends by multiplying by its `layer_scalar`;
- PLE: a [V_ple, layers * P] table (scaled by sqrt(P)) plus a projection of
  the embeddings (scaled by hidden^-0.5, RMS-normed per layer), summed and
  scaled by 2^-0.5; each layer gates it with its output (gate, act, *,
  projection, norm) and adds it to the residual;
- KV sharing: the last `num_kv_shared_layers` layers read the keys/values of
  the last earlier layer of their kind (cache.SharedKVCache; they have no
  k/v projections) and, with `use_double_wide_mlp`, a twice-wide MLP;
- MoE variant: experts beside the dense MLP, each branch with its own
  post-norm, then the shared post-norm; router on the un-normed residual;
- final logit softcap (the multimodal class applies it too).

Tensor parallelism: attention heads and both MLP branches split as usual,
each branch summed (all_sum) before its own post-norm: the dense MLP's
down_proj and the experts' partial sums (experts split on their
intermediate dimension, or whole experts per rank with `--moe-split experts`;
router replicated). PLE tables and projections,
norms and layer scalars are replicated.

Pipeline stages (--pp): the first stage embeds and computes every layer's
PLE; each stage hands on the hidden state and the later layers' PLE in one
message. KV-shared layers stay on their source's stage (CausalLM.stage_cuts;
pipeline.py says why).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..nn.blocks import MLP, Gemma4Attention, Gemma4Block, Gemma4Experts, Gemma4Router, gemma4_expert_name, \
    gemma4_rope, gemma4_rope_params
from ..errors import UserError
from ..nn.layers import RMSNormFP32Scale, activation, gated_fp32
from ..parallel.shard import shard_attention, shard_mlp, shard_switch_glu
from .base import (FULL, SLIDING, BaseModelArgs, CausalLM, DecoderStack, derive_layer_types, receive_packed,
                   send_packed, shared_kv_caches)

_MULTIMODAL_DROP = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.",
                    "vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.")


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = "gemma4_text"
    vocab_size: int = 262_144
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 30
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131_072
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    rope_parameters: dict | None = None
    attention_bias: bool = False
    sliding_window: int = 512
    layer_types: list | None = None
    final_logit_softcapping: float | None = None
    use_bidirectional_attention: str | None = None
    vocab_size_per_layer_input: int = 262_144
    hidden_size_per_layer_input: int | None = 256
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    enable_moe_block: bool = False
    use_double_wide_mlp: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    # the full layers' overrides: the published checkpoints' keys, or transformers 5.24's per_layer_config
    global_head_dim: int = 512
    num_global_key_value_heads: int | None = None
    per_layer_config: dict | None = None

    @classmethod
    def from_dict(cls, params: dict):
        # Multimodal checkpoints nest the text model under text_config.
        if isinstance(params.get("text_config"), dict):
            text = dict(params["text_config"])
            if "tie_word_embeddings" in params and "tie_word_embeddings" not in text:
                text["tie_word_embeddings"] = params["tie_word_embeddings"]
            params = text
        return super().from_dict(params)

    def __post_init__(self):
        if self.use_bidirectional_attention == "all":
            raise UserError("gemma4 with use_bidirectional_attention 'all' (an encoder) is not supported")
        if self.layer_types is None:
            types = derive_layer_types(None, self.num_hidden_layers, self.sliding_window, 6)
        else:
            types = derive_layer_types(self.layer_types, self.num_hidden_layers, self.sliding_window)
        types[-1] = FULL  # transformers forces the last layer to full attention (with a warning)
        self.layer_types = types
        self.layer_heads = self._layer_heads()  # per layer: (head_dim, num_key_value_heads)
        self.kv_source = self._kv_sources()  # per layer: the layer whose KV it reads, or None
        self.rope = gemma4_rope_params(self.rope_parameters, self.layer_types, "gemma4")
        if not self.hidden_size_per_layer_input:
            self.hidden_size_per_layer_input = 0
        if self.enable_moe_block:
            if not (self.num_experts and self.top_k_experts and self.moe_intermediate_size):
                raise UserError("gemma4 enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size")
            if not 1 <= self.top_k_experts <= self.num_experts:
                raise UserError(f"gemma4 top_k_experts {self.top_k_experts} must be in 1..{self.num_experts}")

    def _layer_heads(self) -> list:
        if self.per_layer_config is not None:
            over = {}
            for key, val in self.per_layer_config.items():
                try:
                    i = int(key)
                except (TypeError, ValueError):
                    raise UserError(f"gemma4 per_layer_config key {key!r} is not a layer index") from None
                bad = sorted(set(val) - {"head_dim", "num_key_value_heads"})
                if bad or not 0 <= i < self.num_hidden_layers:
                    raise UserError(f"gemma4 per_layer_config[{key}] overrides {bad or 'a missing layer'}: unsupported")
                over[i] = val
        else:
            full = {"head_dim": self.global_head_dim}
            if self.attention_k_eq_v and self.num_global_key_value_heads is not None:
                full["num_key_value_heads"] = self.num_global_key_value_heads
            over = {i: full for i, t in enumerate(self.layer_types) if t == FULL}
        heads = [
            (int(over.get(i, {}).get("head_dim", self.head_dim)),
             int(over.get(i, {}).get("num_key_value_heads", self.num_key_value_heads)))
            for i in range(self.num_hidden_layers)
        ]
        for kind in set(self.layer_types):
            # transformers builds one RoPE per kind from the kind's first layer
            if len({h for h, t in zip(heads, self.layer_types) if t == kind}) > 1:
                raise UserError(f"gemma4 per_layer_config gives {kind} layers different head shapes: unsupported")
        return heads

    def _kv_sources(self) -> list:
        n, shared = self.num_hidden_layers, self.num_kv_shared_layers or 0
        if not 0 <= shared < n:
            raise UserError(f"gemma4 num_kv_shared_layers {shared} must be in 0..{n - 1}")
        first = n - shared
        sources = [None] * n
        for i in range(first, n):
            kind = self.layer_types[i]
            earlier = [j for j in range(first) if self.layer_types[j] == kind]
            if not earlier:
                raise UserError(f"gemma4 layer {i} shares the KV of a {kind} layer, but no earlier layer is one")
            sources[i] = earlier[-1]
        return sources

    def is_shared(self, i: int) -> bool:
        return self.kv_source[i] is not None


class DecoderLayer(Gemma4Block):
    def __init__(self, args: ModelArgs, i: int):
        kind = args.layer_types[i]
        head_dim, kv_heads = args.layer_heads[i]
        eps = args.rms_norm_eps
        H = args.hidden_size

        def norm(d):
            return RMSNormFP32Scale(d, eps)

        attn = Gemma4Attention(
            H, args.num_attention_heads, kv_heads, head_dim,
            window=args.sliding_window if kind == SLIDING else None,
            rope=gemma4_rope(args.rope[kind], head_dim),
            eps=eps,
            bias=args.attention_bias,
            k_eq_v=args.attention_k_eq_v and kind == FULL,
            reads_kv=args.is_shared(i),
        )  # fmt: skip
        act = activation(args.hidden_activation)
        wide = 2 if args.use_double_wide_mlp and args.is_shared(i) else 1
        moe = None
        if args.enable_moe_block:
            moe = (Gemma4Router(H, args.num_experts, args.top_k_experts, eps),
                   Gemma4Experts(args.num_experts, H, args.moe_intermediate_size, act))
        super().__init__(attn, MLP(H, args.intermediate_size * wide, act), H, norm, moe)
        P = args.hidden_size_per_layer_input
        if P:
            self.act = act
            self.per_layer_input_gate = nn.Linear(H, P, bias=False)
            self.per_layer_projection = nn.Linear(P, H, bias=False)
            self.post_per_layer_input_norm = norm(H)

    def __call__(self, x, mask=None, cache=None, per_layer_input=None):
        h = self.finish(x, self.self_attn(self.input_layernorm(x), mask, cache))
        if per_layer_input is not None:
            g = gated_fp32(self.act)(self.per_layer_input_gate(h), per_layer_input)
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return self.scaled(h)


def _scale(x, s: float):
    # A tensor times a python float: torch multiplies in fp32 and rounds once.
    return (x.astype(mx.float32) * s).astype(x.dtype)


class Gemma4TextModel(DecoderStack):
    # Under --pp the first stage computes every layer's per-layer inputs (PLE) and hands them on.
    first_stage_parts = ("embed_tokens", "embed_tokens_per_layer", "per_layer_model_projection",
                         "per_layer_projection_norm")
    last_stage_parts = ("norm",)

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNormFP32Scale(args.hidden_size, args.rms_norm_eps)
        P, n = args.hidden_size_per_layer_input, args.num_hidden_layers
        if P:
            self.embed_tokens_per_layer = nn.Embedding(args.vocab_size_per_layer_input, n * P)
            self.per_layer_model_projection = nn.Linear(args.hidden_size, n * P, bias=False)
            self.per_layer_projection_norm = RMSNormFP32Scale(P, args.rms_norm_eps)

    def embed(self, inputs):
        h = self.embed_tokens(inputs)
        # sqrt(hidden) rounded once to fp32, then to the compute dtype (as the reference).
        return h * mx.array(self.args.hidden_size**0.5, mx.float32).astype(h.dtype)

    def per_layer_inputs(self, inputs, h):
        """[B, L, layers, P]: the token's PLE row (scaled by sqrt(P)) and the
        normed projection of its embedding h, summed, times 2^-0.5."""
        a = self.args
        P, n = a.hidden_size_per_layer_input, a.num_hidden_layers
        B, L = inputs.shape
        tok = self.embed_tokens_per_layer(inputs)
        tok = tok * mx.array(P**0.5, mx.float32).astype(tok.dtype)
        proj = _scale(self.per_layer_model_projection(h), a.hidden_size**-0.5)
        proj = self.per_layer_projection_norm(proj.reshape(B, L, n, P))  # [B, L, layers, P]
        return _scale(proj + tok.reshape(B, L, n, P), 2.0**-0.5)

    def __call__(self, inputs, cache=None):
        """Under --pp (`stage`): a later stage receives the hidden state and
        the per-layer inputs of layers [start, N) in one message
        ([B, L, hidden + (N - start) * P]) and hands on those of [stop, N)."""
        if cache is None:
            cache = self.make_cache()  # shared-KV layers get their keys through the caches
        stage, (start, stop) = self.stage, self.stage_span
        a = self.args
        P, n, B, L = a.hidden_size_per_layer_input, a.num_hidden_layers, *inputs.shape
        if stage is not None:
            stage.begin()
        if stage is None or stage.first:
            h = self.embed(inputs)
            ple = self.per_layer_inputs(inputs, h) if P else None
        else:
            h, rest = receive_packed(stage, B, L, [a.hidden_size, (n - start) * P])
            ple = rest.reshape(B, L, n - start, P) if P else None
        masks = self.masks(L, cache)
        for i, (layer, kind, c) in enumerate(zip(self.stage_layers, self.stage_layer_types, cache)):
            h = layer(h, masks[kind], c, None if ple is None else ple[:, :, i, :])
        if stage is not None and not stage.last:
            return send_packed(stage, [h] + ([ple[:, :, stop - start :, :].reshape(B, L, -1)] if P else []))
        return self.norm(h)

    def make_cache(self) -> list:
        """This rank's layers' caches; a shared-KV layer's source is on its stage (`CausalLM.stage_cuts`)."""
        a, (start, stop) = self.args, self.stage_span
        return shared_kv_caches(self.stage_layer_types, a.sliding_window, a.kv_source[start:stop], start)


class Model(CausalLM):
    pipeline_stages = True  # shared KV stays on one stage (stage_cuts), PLE travels with the hidden state

    def __init__(self, args: ModelArgs):
        super().__init__(args, Gemma4TextModel(args))

    def __call__(self, inputs, cache=None):
        logits = super().__call__(inputs, cache)
        cap = self.args.final_logit_softcapping
        if cap:
            logits = mx.tanh(logits / cap) * cap
        return logits

    def make_cache(self):
        return self.model.make_cache()

    def stage_send_width(self, stop: int) -> int:
        """The hidden state and the per-layer inputs of layers [stop, N) (Gemma4TextModel.__call__)."""
        a = self.args
        return a.hidden_size + (a.num_hidden_layers - stop) * a.hidden_size_per_layer_input

    def describe_layers(self) -> list[str]:
        a = self.args
        out = []
        for i, (kind, layer) in enumerate(zip(a.layer_types, self.layers)):
            attn = layer.self_attn
            what = f"sliding (window {attn.window})" if kind == SLIDING else "full"
            parts = [what, f"head_dim {attn.head_dim}, {attn.total_num_kv_heads} KV heads", attn.rope.describe()]
            if a.kv_source[i] is not None:
                parts.append(f"shared-KV (reads layer {a.kv_source[i]})")
            elif attn.k_eq_v:
                parts.append("k = v")
            if a.enable_moe_block:
                parts.append(f"MoE {a.num_experts} experts top-{a.top_k_experts} + dense MLP")
            if a.use_double_wide_mlp and a.kv_source[i] is not None:
                parts.append("double-wide MLP")
            if a.hidden_size_per_layer_input:
                parts.append(f"per-layer input {a.hidden_size_per_layer_input}")
            out.append(f"{i}: " + ", ".join(parts))
        return out

    def sanitize(self, weights: dict) -> dict:
        """Map multimodal names onto the text model; drop the vision/audio
        towers and embedders, the k/v projections and norms a checkpoint may
        hold for shared-KV layers (transformers ignores them), and (in the
        shared sanitize) a stored copy of the tied output head."""
        shared = {f"model.layers.{i}.self_attn.{p}." for i, s in enumerate(self.args.kv_source) if s is not None
                  for p in ("k_proj", "v_proj", "k_norm", "v_norm")}  # fmt: skip
        out = {}
        for name, w in weights.items():
            if name.startswith(_MULTIMODAL_DROP):
                continue
            for old, new in (("model.language_model.", "model."), ("language_model.model.", "model."),
                             ("language_model.lm_head.", "lm_head.")):  # fmt: skip
                if name.startswith(old):
                    name = new + name[len(old) :]
                    break
            if name.rsplit(".", 1)[0] + "." in shared:
                continue
            out[gemma4_expert_name(name)] = w
        return super().sanitize(out)

    def shard(self, group):
        for layer in self.layers:
            shard_attention(layer.self_attn, group)  # k = v and shared-KV layers lack k/v projections
            shard_mlp(layer.mlp, group)
            if "experts" in layer:
                shard_switch_glu(layer.experts, group)
                if not group.single:
                    layer.experts.group = group
        self.shard_head(group)

    def collectives_per_token(self) -> dict:
        """The usual ones plus, per sharded MoE block, the experts' partial
        sums ([1, hidden] in the experts' dtype)."""
        plan = super().collectives_per_token()
        calls, nbytes = plan["all_sum"]
        for layer in self.layers:
            if "experts" in layer and not layer.experts.group.single:
                ex = layer.experts
                calls += 1
                d = ex.down_proj
                nbytes += d.weight.shape[1] * (d.scales if "scales" in d else d.weight).dtype.size
        return {**plan, "all_sum": (calls, nbytes)}
