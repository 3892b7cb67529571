"""OLMo 3 (`olmo3`).

Hidden states [B, L, hidden]; q_proj output [B, L, n_heads * head_dim], then q
[B, n_heads, L, head_dim], k/v [B, n_kv_heads, L, head_dim] (per-rank counts
under tensor parallelism). Post-norm blocks (no input norm: the attention and
SwiGLU MLP outputs are RMS-normalised before joining the residual). q and k
are RMS-normalised over the WHOLE projection (all heads at once) before the
head reshape. Three sliding-window layers per full one; sliding layers use
plain RoPE, full layers the configured scaling (e.g. yarn).

Tensor parallelism: the q/k norm statistic spans heads that live on different
ranks, so each rank sums the squares of its own heads and one extra all_sum of
[B, L, 2] per layer gives every rank the exact totals; the norm weights are
sliced with their heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..nn.blocks import MLP, Attention
from ..parallel.collectives import SINGLE
from ..errors import UserError
from ..nn.layers import RMSNormFP32Scale, activation
from ..nn.rope import RoPE
from ..parallel.partition import head_partition, slot_ranges
from ..parallel.shard import rank_heads, shard_head_vector
from .base import FULL, SLIDING, BaseModelArgs, CausalLM, DecoderStack, derive_layer_types, single_rope_params

# Olmo3Config.default_theta: the RoPE base when the config names none.
DEFAULT_THETA = 500_000.0
# transformers' Olmo3Config: without layer_types, every 4th layer is full.
LEGACY_PATTERN = 4


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = "olmo3"
    vocab_size: int = 50304
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    sliding_window: int | None = 4096
    layer_types: list | None = None
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.layer_types = derive_layer_types(
            self.layer_types, self.num_hidden_layers, self.sliding_window, LEGACY_PATTERN
        )
        self.rope = self._rope_per_kind()

    def _rope_per_kind(self) -> dict:
        # transformers 5: rope_parameters per layer kind. transformers 4 (4.57):
        # sliding layers plain RoPE with rope_theta, full layers rope_scaling +
        # rope_theta. (transformers 5 reading a 4-form config gives sliding
        # layers 500000 whatever rope_theta says; real checkpoints use 500000.)
        rp = self.rope_parameters
        theta = DEFAULT_THETA if self.rope_theta is None else self.rope_theta
        if rp and (FULL in rp or SLIDING in rp):
            full, sliding = rp.get(FULL) or {}, rp.get(SLIDING) or {}
        elif rp:
            raise UserError(
                "olmo3 config rope_parameters must be given per layer kind (full_attention, sliding_attention)"
            )
        else:
            full, sliding = self.rope_scaling or {}, {}
        mp = self.max_position_embeddings
        return {
            FULL: single_rope_params(full, None, theta, mp),
            SLIDING: single_rope_params(sliding, None, theta, mp),
        }


class Olmo3Attention(Attention):
    """Attention whose q/k RMSNorm spans the whole projection; `norm_group`
    (set by Model.shard) makes that statistic global across ranks."""

    def __init__(self, args: ModelArgs, kind: str):
        super().__init__(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            scale=args.head_dim**-0.5,
            window=args.sliding_window if kind == SLIDING else None,
            rope=RoPE(args.head_dim, args.rope[kind], args.max_position_embeddings),
            bias=args.attention_bias,
        )
        self.q_norm = RMSNormFP32Scale(args.num_attention_heads * args.head_dim, args.rms_norm_eps)
        self.k_norm = RMSNormFP32Scale(args.num_key_value_heads * args.head_dim, args.rms_norm_eps)
        self.norm_group = SINGLE  # Model.shard sets the job's group
        self.kv_replicas = 1  # ranks holding each KV head (> 1 when KV heads are replicated evenly)
        self._kv_owned = None  # [kv slots * D] 0/1: which held KV heads this rank's sum counts (uneven)

    def _whole_norm(self, q, k):
        # Reference: (w * x * rsqrt(mean(x^2) + eps)).to(dtype) over all heads, in fp32.
        qf, kf = q.astype(mx.float32), k.astype(mx.float32)
        # Sums of squares of this rank's heads: [B, L, 2] (q, k). A KV head
        # held by several ranks (or twice on one) counts once: only the slot
        # that owns it adds (times 1 or 0, exact).
        kk = kf * kf if self._kv_owned is None else kf * kf * self._kv_owned
        ssq = mx.concatenate([(qf * qf).sum(-1, keepdims=True), kk.sum(-1, keepdims=True)], axis=-1)
        ssq = self.norm_group.all_sum(ssq)
        D = self.head_dim
        count = mx.array([self.total_num_heads * D, self.total_num_kv_heads * D * self.kv_replicas], mx.float32)
        inv = mx.rsqrt(ssq / count + self.q_norm.eps)
        q = (self.q_norm.weight.astype(mx.float32) * (qf * inv[..., :1])).astype(q.dtype)
        k = (self.k_norm.weight.astype(mx.float32) * (kf * inv[..., 1:])).astype(k.dtype)
        return q, k

    def project(self, x):
        B, L, _ = x.shape
        q, k = self._whole_norm(self.q_proj(x), self.k_proj(x))
        # [B, L, heads * D] -> [B, heads, L, D]
        q = q.reshape(B, L, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)
        k = k.reshape(B, L, self.num_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.num_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        return q, k, v


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.self_attn = Olmo3Attention(args, args.layer_types[layer_idx])
        self.mlp = MLP(args.hidden_size, args.intermediate_size, activation(args.hidden_act))
        self.post_attention_layernorm = RMSNormFP32Scale(args.hidden_size, args.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNormFP32Scale(args.hidden_size, args.rms_norm_eps)

    def __call__(self, x, mask=None, cache=None):
        h = x + self.post_attention_layernorm(self.self_attn(x, mask, cache))
        return h + self.post_feedforward_layernorm(self.mlp(h))


class Olmo3Model(DecoderStack):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNormFP32Scale(args.hidden_size, args.rms_norm_eps)


class Model(CausalLM):
    pipeline_stages = True  # plain DecoderStack: runs in --pp stages (pipeline.py)

    def __init__(self, args: ModelArgs):
        super().__init__(args, Olmo3Model(args))

    def shard(self, group):
        super().shard(group)
        if group.single:
            return
        n, r = group.size(), group.rank()
        for layer in self.layers:
            attn = layer.self_attn
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
        """The usual ones plus, per layer, the q/k sums of squares ([1, 1, 2] float32)."""
        plan = super().collectives_per_token()
        n = sum(not layer.self_attn.norm_group.single for layer in self.layers)
        calls, nbytes = plan["all_sum"]
        return {**plan, "all_sum": (calls + n, nbytes + n * 2 * 4)}
