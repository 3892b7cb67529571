"""Gemma 3n text model (`gemma3n_text`, and the text model of multimodal
`gemma3n`, whose config nests it under `text_config`).

Layouts: token embeddings h0 [B, L, hidden]; the AltUp streams are one array
[n, B, L, hidden] (n = altup_num_inputs, stream `altup_active_idx` is the one
the layers compute on); per-layer inputs [B, L, num_layers, P] (P =
hidden_size_per_layer_input); q [B, n_heads, L, head_dim], k/v [B,
n_kv_heads, L, head_dim] (per-rank counts under tensor parallelism).

What each layer does (transformers' Gemma3nTextDecoderLayer): AltUp predicts
the n streams from each other (router-weighted 4x4 mix), the active
prediction runs attention (q/k/v RMS norms, v without scale, scores unscaled)
and a LAuReL low-rank residual, then the MLP (on the first layers with
Gaussian top-k activation sparsity), AltUp corrects every stream with the
innovation, and the per-layer input (a gated projection of the active stream
times the layer's slice of the per-layer embeddings) is added to the other
streams. The last `num_kv_shared_layers` layers compute no keys/values: each
reads those of the last earlier non-shared layer of its kind
(`cache.SharedKVCache`, so a cache-less forward still makes caches).

Tensor parallelism: attention heads and MLP columns are split (shard.py);
AltUp, LAuReL, the per-layer embeddings and projections are small (hidden x
a few hundred) and replicated. The sparsity cutoff needs the mean and the
standard deviation over the whole intermediate dimension: each rank all_sums
its [B, L, 3] partial statistics (sum, centred sum of squares, sum * local
mean), one small all_sum per sparse layer (replicating the gate instead
would keep a hidden x intermediate matrix whole on every rank).

Pipeline stages (--pp): the first stage embeds, builds the streams and every
layer's per-layer inputs; each stage hands on the streams and the later
layers' per-layer inputs in one message; the last merges the streams
(altup_unembed_projections) and norms. KV-shared layers stay on their
source's stage (CausalLM.stage_cuts; pipeline.py says why).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..nn.attention import causal_attention
from ..parallel.collectives import SINGLE
from ..errors import UserError
from ..nn.layers import RMSNormFP32Scale, activation
from ..nn.rope import RoPE
from ..parallel.shard import shard_attention, shard_mlp
from .base import (FULL, SLIDING, BaseModelArgs, CausalLM, DecoderStack, derive_layer_types, receive_packed,
                   send_packed, shared_kv_caches)


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = "gemma3n_text"
    vocab_size: int = 262400
    vocab_size_per_layer_input: int = 262144
    hidden_size: int = 2048
    hidden_size_per_layer_input: int = 256
    intermediate_size: int | list = 16384
    num_hidden_layers: int = 35
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    sliding_window: int = 512
    layer_types: list | None = None
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    final_logit_softcapping: float | None = 30.0
    hidden_activation: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    max_position_embeddings: int = 32768
    altup_active_idx: int = 0
    altup_correct_scale: bool = True
    altup_num_inputs: int = 4
    num_kv_shared_layers: int = 15
    laurel_rank: int = 64
    activation_sparsity_pattern: list | None = None
    # multimodal `gemma3n`: the token-id ranges embedded by embed_vision / embed_audio
    vision_config: dict | None = None
    audio_config: dict | None = None

    @classmethod
    def from_dict(cls, params: dict):
        # Multimodal checkpoints nest the text model under text_config; the
        # vision/audio configs say which token ids their embedders own.
        if isinstance(params.get("text_config"), dict):
            text = dict(params["text_config"])
            if "tie_word_embeddings" in params and "tie_word_embeddings" not in text:
                text["tie_word_embeddings"] = params["tie_word_embeddings"]
            for key in ("vision_config", "audio_config"):
                if not isinstance(params.get(key), dict):
                    raise UserError(f"gemma3n config.json: multimodal config without a {key} object")
                text[key] = params[key]
            params = {**text, "model_type": params.get("model_type", "gemma3n")}
        return super().from_dict(params)

    def __post_init__(self):
        N = self.num_hidden_layers
        if self.layer_types is None:  # transformers' default: every 5th layer full
            self.layer_types = [FULL if (i + 1) % 5 == 0 else SLIDING for i in range(N)]
        self.layer_types = derive_layer_types(self.layer_types, N, self.sliding_window)
        if isinstance(self.intermediate_size, int):
            self.intermediate_size = [self.intermediate_size] * N
        if len(self.intermediate_size) != N:
            raise UserError(f"config intermediate_size has {len(self.intermediate_size)} entries for {N} layers")
        asp = self.activation_sparsity_pattern
        if asp is None:  # transformers' default: the first 10 layers 0.95 sparse (if more than 10)
            asp = [0.95] * (10 if N > 10 else 0) + [0.0] * (N - (10 if N > 10 else 0))
        if not isinstance(asp, list) or len(asp) != N:
            raise UserError(f"config activation_sparsity_pattern must list one value per layer ({N}), got {asp!r}")
        if any(not 0.0 <= p < 1.0 for p in asp):
            raise UserError(f"config activation_sparsity_pattern values must lie in [0, 1), got {asp}")
        self.activation_sparsity_pattern = [float(p) for p in asp]
        if not 0 <= self.altup_active_idx < self.altup_num_inputs:
            raise UserError(f"config altup_active_idx {self.altup_active_idx} not in [0, {self.altup_num_inputs})")
        self.kv_source = self._kv_sources()
        self.rope = self._rope_per_kind()
        self.embedders = self._embedders()

    def _kv_sources(self) -> list:
        """Per layer: None (computes its own KV) or the layer whose KV it reads:
        the last layer of its kind before the shared range (transformers'
        kv_sharing_modes)."""
        N, S = self.num_hidden_layers, self.num_kv_shared_layers
        if not 0 <= S < N:
            raise UserError(f"config num_kv_shared_layers {S} must be in [0, {N})")
        first = N - S
        last_of = {kind: i for i, kind in enumerate(self.layer_types[:first])}
        missing = sorted({self.layer_types[i] for i in range(first, N)} - set(last_of))
        if S and missing:
            raise UserError(f"config: KV-shared layers of kind {missing} have no earlier layer of that kind")
        return [None if i < first else last_of[self.layer_types[i]] for i in range(N)]

    def _rope_per_kind(self) -> dict:
        # transformers 5: rope_parameters per layer kind. transformers 4:
        # rope_theta (+ rope_scaling) for full layers, rope_local_base_freq sliding.
        rp = self.rope_parameters
        if rp is not None and (FULL in rp or SLIDING in rp):
            full, sliding = dict(rp.get(FULL) or {}), dict(rp.get(SLIDING) or {})
        elif rp is not None:
            full, sliding = dict(rp), {}
        else:
            full, sliding = dict(self.rope_scaling or {}), {}
        for params in (full, sliding):
            if "type" in params and "rope_type" not in params:
                params["rope_type"] = params.pop("type")
            params.setdefault("rope_type", "default")
        full.setdefault("rope_theta", self.rope_theta)
        sliding.setdefault("rope_theta", self.rope_local_base_freq)
        return {FULL: full, SLIDING: sliding}

    def _embedders(self) -> dict:
        """{"embed_vision": (offset, size), "embed_audio": ...} of a multimodal config."""
        out = {}
        for name, cfg in (("embed_vision", self.vision_config), ("embed_audio", self.audio_config)):
            if cfg is None:
                continue
            try:
                offset, size, dims = int(cfg["vocab_offset"]), int(cfg["vocab_size"]), int(cfg["hidden_size"])
            except (KeyError, TypeError, ValueError):
                raise UserError(f"gemma3n config.json: {name[6:]}_config needs vocab_offset, vocab_size, hidden_size")
            out[name] = (offset, size, dims, float(cfg.get("rms_norm_eps", 1e-6)))
        return out


def _scalar(value: float, dtype) -> mx.array:
    # transformers keeps these constants as float32 buffers cast to the compute dtype.
    return mx.array(value, mx.float32).astype(dtype)


class RMSNormNoScale(nn.Module):
    """Gemma3nRMSNorm(with_scale=False): normalise in fp32, cast back."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def __call__(self, x):
        return mx.fast.rms_norm(x, None, self.eps)


class Attention(nn.Module):
    """Unscaled GQA attention with q/k/v RMS norms (v without a scale). A
    KV-shared layer has no k/v projections: it reads its source layer's keys
    and values through its `SharedKVCache`. The attribute contract of
    shard.py (`total_num_heads`, `num_heads`, ...) as blocks.Attention."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        kind = args.layer_types[layer_idx]
        H, KV, D, eps = args.num_attention_heads, args.num_key_value_heads, args.head_dim, args.rms_norm_eps
        if KV < 1 or H % KV:
            raise UserError(f"num_attention_heads {H} is not a multiple of num_key_value_heads {KV}")
        self.total_num_heads = self.num_heads = H
        self.total_num_kv_heads = self.num_kv_heads = KV
        self.head_dim = D
        self.per_head_params = ()
        self.window = args.sliding_window if kind == SLIDING else None
        self.rope = RoPE(D, args.rope[kind], args.max_position_embeddings)
        self.reads_layer = args.kv_source[layer_idx]
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, H * D, bias=bias)
        self.q_norm = RMSNormFP32Scale(D, eps)
        if self.reads_layer is None:
            self.k_proj = nn.Linear(args.hidden_size, KV * D, bias=bias)
            self.v_proj = nn.Linear(args.hidden_size, KV * D, bias=bias)
            self.k_norm = RMSNormFP32Scale(D, eps)
            self.v_norm = RMSNormNoScale(eps)
        self.o_proj = nn.Linear(H * D, args.hidden_size, bias=bias)

    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        D = self.head_dim
        # [B, L, heads * D] -> [B, L, heads, D] (norm per head) -> [B, heads, L, D]
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.num_heads, D)).transpose(0, 2, 1, 3)
        q = self.rope(q, cache.offset)
        if self.reads_layer is not None:
            k, v = cache.fetch()
        else:
            k = self.k_norm(self.k_proj(x).reshape(B, L, self.num_kv_heads, D)).transpose(0, 2, 1, 3)
            v = self.v_norm(self.v_proj(x).reshape(B, L, self.num_kv_heads, D)).transpose(0, 2, 1, 3)
            k, v = cache.update_and_fetch(self.rope(k, cache.offset), v)
        out = causal_attention(q, k, v, 1.0, self.window, mask=mask)
        # [B, heads, L, D] -> [B, L, heads * D]
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    """down(act(gate) * up); with activation sparsity p the gate first becomes
    relu(gate - (mean + std * Phi^-1(p))) over the whole intermediate
    dimension (`group` all_sums the per-rank statistics)."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        hidden, inter = args.hidden_size, args.intermediate_size[layer_idx]
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act = activation(args.hidden_activation)
        self.intermediate_size = inter  # the whole dimension, also once sharded
        self.sparsity = args.activation_sparsity_pattern[layer_idx]
        # transformers: Normal(0, 1).icdf(p) in float32, then cast to the compute dtype.
        self.std_multiplier = float(np.float32(NormalDist().inv_cdf(self.sparsity))) if self.sparsity else 0.0
        self.group = SINGLE  # Model.shard sets the job's group

    def gaussian_topk(self, g):
        gf = g.astype(mx.float32)
        s = gf.sum(-1, keepdims=True)
        local_mean = s / gf.shape[-1]
        m2 = mx.square(gf - local_mean).sum(-1, keepdims=True)
        # [B, L, 3]: what combines into the whole dimension's mean and variance (Chan et al.)
        stats = self.group.all_sum(mx.concatenate([s, m2, s * local_mean], axis=-1))
        n = self.intermediate_size
        mean = stats[..., 0:1] / n
        var = (stats[..., 1:2] + (stats[..., 2:3] - stats[..., 0:1] * mean)) / n
        std = mx.sqrt(mx.maximum(var, 0.0))
        cutoff = mean.astype(g.dtype) + std.astype(g.dtype) * _scalar(self.std_multiplier, g.dtype)
        return mx.maximum(g - cutoff, 0)

    def __call__(self, x):
        g = self.gate_proj(x)
        if self.sparsity > 0.0:
            g = self.gaussian_topk(g)
        a = self.act(g.astype(mx.float32)).astype(g.dtype)
        return self.down_proj(a * self.up_proj(x))


class AltUp(nn.Module):
    """Alternating updates over the [n, B, L, hidden] streams."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        n, hidden = args.altup_num_inputs, args.hidden_size
        self.n, self.active = n, args.altup_active_idx
        self.correct_output_scale = mx.zeros((hidden,))
        self.correction_coefs = nn.Linear(n, n, bias=False)
        self.prediction_coefs = nn.Linear(n, n * n, bias=False)
        self.modality_router = nn.Linear(hidden, n, bias=False)
        self.router_norm = RMSNormFP32Scale(hidden, args.rms_norm_eps)
        self.router_input_scale = hidden**-1.0

    def router_modalities(self, x):
        routed = self.modality_router(self.router_norm(x) * _scalar(self.router_input_scale, x.dtype))
        return mx.tanh(routed.astype(mx.float32)).astype(x.dtype)  # [B, L, n]

    def predict(self, h):
        m = self.router_modalities(h[self.active])
        B, L, _ = m.shape
        # [B, L, n*n] -> [B, L, n, n], transposed: coefs[..., i, j] multiplies stream i into prediction j
        coefs = self.prediction_coefs(m).reshape(B, L, self.n, self.n).transpose(0, 1, 3, 2)
        # [n, B, L, hidden] -> [B, L, hidden, n] @ [B, L, n, n] -> back to [n, B, L, hidden]
        pred = (h.transpose(1, 2, 3, 0) @ coefs).transpose(3, 0, 1, 2)
        return (pred + h).astype(h.dtype)

    def correct(self, pred, activated):
        m = self.router_modalities(activated)
        innovation = activated - pred[self.active]  # [B, L, hidden]
        # [B, L, n] -> [n, B, L, 1]: one coefficient per stream and token
        coefs = (self.correction_coefs(m) + 1.0).transpose(2, 0, 1)[..., None]
        return (innovation[None] * coefs + pred).astype(activated.dtype)

    def scale_corrected_output(self, x):
        return (x.astype(self.correct_output_scale.dtype) * self.correct_output_scale).astype(x.dtype)


class LaurelBlock(nn.Module):
    """Learned augmented residual: x + norm(right(left(x)))."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.linear_left = nn.Linear(args.hidden_size, args.laurel_rank, bias=False)
        self.linear_right = nn.Linear(args.laurel_rank, args.hidden_size, bias=False)
        self.post_laurel_norm = RMSNormFP32Scale(args.hidden_size, args.rms_norm_eps)

    def __call__(self, x):
        return x + self.post_laurel_norm(self.linear_right(self.linear_left(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        hidden, P, eps = args.hidden_size, args.hidden_size_per_layer_input, args.rms_norm_eps
        self.active, self.correct_scale = args.altup_active_idx, args.altup_correct_scale
        self.self_attn = Attention(args, layer_idx)
        self.mlp = MLP(args, layer_idx)
        self.input_layernorm = RMSNormFP32Scale(hidden, eps)
        self.post_attention_layernorm = RMSNormFP32Scale(hidden, eps)
        self.pre_feedforward_layernorm = RMSNormFP32Scale(hidden, eps)
        self.post_feedforward_layernorm = RMSNormFP32Scale(hidden, eps)
        self.act = activation(args.hidden_activation)
        self.altup = AltUp(args)
        self.laurel = LaurelBlock(args)
        self.per_layer_input_gate = nn.Linear(hidden, P, bias=False)
        self.per_layer_projection = nn.Linear(P, hidden, bias=False)
        self.post_per_layer_input_norm = RMSNormFP32Scale(hidden, eps)

    def __call__(self, x, per_layer_input, mask=None, cache=None):
        """x: the streams [n, B, L, hidden]; per_layer_input [B, L, P]."""
        pred = self.altup.predict(x)
        active = pred[self.active]
        normed = self.input_layernorm(active)
        laurel = self.laurel(normed)
        attn = self.post_attention_layernorm(self.self_attn(normed, mask, cache))
        h = ((active + attn) + laurel) / math.sqrt(2)
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        corrected = self.altup.correct(pred, h)
        first = corrected[self.active]
        if self.correct_scale:
            first = self.altup.scale_corrected_output(first)
        g = self.act(self.per_layer_input_gate(first).astype(mx.float32)).astype(first.dtype)
        extra = self.post_per_layer_input_norm(self.per_layer_projection(g * per_layer_input))
        # every stream but the first gets the per-layer input (transformers: corrected[1:] += ...)
        return mx.concatenate([corrected[:1], corrected[1:] + extra[None]], axis=0)


class MultimodalEmbedder(nn.Module):
    """Gemma3nMultimodalEmbedder for token ids in [offset, offset + size):
    norm(embedding(id - offset)), projected to hidden and normalised."""

    def __init__(self, offset: int, size: int, dims: int, eps: float, hidden: int):
        super().__init__()
        self.offset, self.size = offset, size
        self.embedding = nn.Embedding(size, dims)
        self.hard_embedding_norm = RMSNormFP32Scale(dims, eps)
        self.embedding_projection = nn.Linear(dims, hidden, bias=False)
        self.embedding_post_projection_norm = RMSNormNoScale(eps)

    def __call__(self, ids):
        return self.embedding_post_projection_norm(
            self.embedding_projection(self.hard_embedding_norm(self.embedding(ids - self.offset)))
        )


def _magnitude_matched(x, target):
    # x * target / sqrt(max(mean(x^2), 1e-5)), target = sqrt(mean(h0^2)) ([.., 1] each)
    return x * target / mx.sqrt(mx.maximum(mx.mean(x * x, axis=-1, keepdims=True), 1e-5))


class Gemma3nTextModel(DecoderStack):
    # Under --pp the first stage builds the AltUp streams and every layer's
    # per-layer inputs and hands them on; the last one merges the streams.
    first_stage_parts = ("embed_tokens", "embed_tokens_per_layer", "per_layer_model_projection",
                         "per_layer_projection_norm", "altup_projections", "embed_vision", "embed_audio")
    last_stage_parts = ("altup_unembed_projections", "norm")

    def __init__(self, args: ModelArgs):
        super().__init__(args)  # args, embed_tokens, stage
        N, P, hidden = args.num_hidden_layers, args.hidden_size_per_layer_input, args.hidden_size
        self.embed_tokens_per_layer = nn.Embedding(args.vocab_size_per_layer_input, N * P)
        self.per_layer_model_projection = nn.Linear(hidden, N * P, bias=False)
        self.per_layer_projection_norm = RMSNormFP32Scale(P, args.rms_norm_eps)
        self.altup_projections = [nn.Linear(hidden, hidden, bias=False) for _ in range(1, args.altup_num_inputs)]
        self.altup_unembed_projections = [
            nn.Linear(hidden, hidden, bias=False) for _ in range(1, args.altup_num_inputs)
        ]
        self.layers = [DecoderLayer(args, i) for i in range(N)]
        self.norm = RMSNormFP32Scale(hidden, args.rms_norm_eps)
        for name, (offset, size, dims, eps) in args.embedders.items():
            setattr(self, name, MultimodalEmbedder(offset, size, dims, eps, hidden))

    def embed(self, ids):
        """The scaled token embeddings [B, L, hidden]; a multimodal model's
        vision/audio token ids take their embedder's instead."""
        h = self.embed_tokens(ids)
        h = h * _scalar(self.args.hidden_size**0.5, h.dtype)
        if "embed_vision" in self:
            vision, audio = self.embed_vision, self.embed_audio
            # transformers: vision ids are [vision offset, audio offset), audio ids all
            # from the audio offset on; other ids look up the embedder's last row.
            for e, inside in (
                (vision, (ids >= vision.offset) & (ids < audio.offset)),
                (audio, ids >= audio.offset),
            ):
                emb = e(mx.where(inside, ids, e.offset + e.size - 1)).astype(h.dtype)
                h = mx.where(inside[..., None], emb, h)
        return h

    def per_layer_inputs(self, ids, h0):
        """[B, L, N, P]: (norm(projection of h0) + per-layer embeddings of the
        ids) / sqrt(2); ids past the per-layer table look up row 0."""
        a = self.args
        B, L = ids.shape
        N, P = a.num_hidden_layers, a.hidden_size_per_layer_input
        table_ids = mx.where((ids >= 0) & (ids < a.vocab_size_per_layer_input), ids, 0)
        e = self.embed_tokens_per_layer(table_ids)
        e = (e * _scalar(P**0.5, e.dtype)).reshape(B, L, N, P)
        p = self.per_layer_model_projection(h0) * _scalar(a.hidden_size**-0.5, h0.dtype)
        p = self.per_layer_projection_norm(p.reshape(B, L, N, P))  # [B, L, N*P] -> [B, L, N, P]
        return (p + e.astype(p.dtype)) * _scalar(2.0**-0.5, h0.dtype)

    def __call__(self, ids, cache):
        """Under --pp (`stage`): a later stage receives the streams and the
        per-layer inputs of layers [start, N) in one message ([B, L, n *
        hidden + (N - start) * P]) and hands on those of [stop, N)."""
        a, stage, (start, stop) = self.args, self.stage, self.stage_span
        n, H, N, P = a.altup_num_inputs, a.hidden_size, a.num_hidden_layers, a.hidden_size_per_layer_input
        B, L = ids.shape
        if stage is not None:
            stage.begin()
        if stage is None or stage.first:
            h0 = self.embed(ids)
            per_layer = self.per_layer_inputs(ids, h0)
            target = mx.sqrt(mx.mean(h0 * h0, axis=-1, keepdims=True))
            # the n streams: h0 and its magnitude-matched projections, [n, B, L, hidden]
            h = mx.stack([h0] + [_magnitude_matched(p(h0), target) for p in self.altup_projections])
        else:
            streams, rest = receive_packed(stage, B, L, [n * H, (N - start) * P])
            h = streams.reshape(B, L, n, H).transpose(2, 0, 1, 3)  # [B, L, n * H] -> [n, B, L, H]
            per_layer = rest.reshape(B, L, N - start, P)
        masks = self.masks(L, cache)
        for i, (layer, kind, c) in enumerate(zip(self.stage_layers, self.stage_layer_types, cache)):
            h = layer(h, per_layer[:, :, i, :], masks[kind], c)
        if stage is not None and not stage.last:
            # [n, B, L, H] -> [B, L, n * H], beside the per-layer inputs of the later stages
            streams = h.transpose(1, 2, 0, 3).reshape(B, L, n * H)
            return send_packed(stage, [streams, per_layer[:, :, stop - start :, :].reshape(B, L, -1)])
        target = mx.sqrt(mx.mean(h[0] * h[0], axis=-1, keepdims=True))
        outs = [h[0]] + [_magnitude_matched(p(h[i + 1]), target) for i, p in enumerate(self.altup_unembed_projections)]
        return self.norm(mx.mean(mx.stack(outs), axis=0))


class Model(CausalLM):
    # shared KV stays on one stage (stage_cuts); AltUp streams and per-layer inputs travel
    pipeline_stages = True

    def __init__(self, args: ModelArgs):
        super().__init__(args, Gemma3nTextModel(args))

    def make_cache(self):
        """A KV cache per layer (of this rank's stage) computing its own KV;
        the KV-shared layers get a SharedKVCache on their source's."""
        start, stop = self.model.stage_span
        kinds = self.model.stage_layer_types
        return shared_kv_caches(kinds, self.args.sliding_window, self.args.kv_source[start:stop], start)

    def stage_send_width(self, stop: int) -> int:
        """The AltUp streams and the per-layer inputs of layers [stop, N) (Gemma3nTextModel.__call__)."""
        a = self.args
        return a.altup_num_inputs * a.hidden_size + (a.num_hidden_layers - stop) * a.hidden_size_per_layer_input

    def __call__(self, inputs, cache=None):
        # Without a cache a forward still needs one: it carries the shared layers' KV.
        cache = self.make_cache() if cache is None else cache
        logits = self.head(self.model(inputs, cache))
        cap = self.args.final_logit_softcapping
        if cap:
            logits = mx.tanh(logits / cap) * cap
        return logits

    def shard(self, group):
        for layer in self.layers:
            attn = layer.self_attn
            shard_attention(attn, group)  # a KV-shared layer has only q/o to split
            shard_mlp(layer.mlp, group)
            layer.mlp.group = group
        self.shard_head(group)

    def collectives_per_token(self) -> dict:
        """The usual ones plus one all_sum of [1, 1, 3] float32 per sparse MLP."""
        plan = super().collectives_per_token()
        n = sum(layer.mlp.sparsity > 0 and not layer.mlp.group.single for layer in self.layers)
        calls, nbytes = plan["all_sum"]
        return {**plan, "all_sum": (calls + n, nbytes + n * 3 * 4)}

    def describe_layers(self) -> list[str]:
        out = []
        for i, (kind, layer) in enumerate(zip(self.args.layer_types, self.layers)):
            attn = layer.self_attn
            what = f"sliding (window {attn.window})" if kind == SLIDING else "full"
            line = f"{i}: {what}, rope {attn.rope.describe()}"
            if attn.reads_layer is not None:
                line += f", shared-KV (reads layer {attn.reads_layer})"
            if layer.mlp.sparsity:
                line += f", activation sparsity {layer.mlp.sparsity}"
            out.append(line)
        return out

    def sanitize(self, weights: dict) -> dict:
        """Map multimodal names onto the text model; drop the vision and audio
        towers, the embedders' soft-token norms (they embed tower outputs,
        which a token-id model never has) and the k/v projections a KV-shared
        layer never uses (transformers ignores them too)."""
        shared = {i for i, src in enumerate(self.args.kv_source) if src is not None}
        out = {}
        for name, w in weights.items():
            for old, new in (
                ("model.language_model.", "model."),  # transformers multimodal
                ("language_model.model.", "model."),  # mlx-vlm conversions
                ("language_model.lm_head.", "lm_head."),
                ("embed_vision.", "model.embed_vision."),
                ("embed_audio.", "model.embed_audio."),
            ):
                if name.startswith(old):
                    name = new + name[len(old) :]
                    break
            if name.startswith(("model.vision_tower.", "model.audio_tower.", "vision_tower.", "audio_tower.")):
                continue
            if name.startswith(("model.embed_vision.soft_embedding_norm.", "model.embed_audio.soft_embedding_norm.")):
                continue
            parts = name.split(".")
            if (
                len(parts) > 4
                and parts[:2] == ["model", "layers"]
                and parts[2].isdigit()
                and int(parts[2]) in shared
                and parts[3] == "self_attn"
                and parts[4] in ("k_proj", "v_proj", "k_norm", "v_norm")
            ):
                continue
            out[name] = w
        return super().sanitize(out)
