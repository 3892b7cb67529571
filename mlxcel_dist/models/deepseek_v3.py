"""DeepSeek-V3 / R1 / V3.1 and Kimi K2 (`deepseek_v3`; `kimi_k2` configs
map here), as transformers 5.24's DeepseekV3ForCausalLM runs them, and
DeepSeek-V3.2 (`deepseek_v32`, DeepseekV32ForCausalLM: the same model plus a
lightning indexer per layer, below).

Hidden states [B, L, hidden]. Multi-head latent attention (MLA) per layer:
- q: `q_a_proj` -> `q_a_layernorm` -> `q_b_proj` (q_lora_rank set) or one
  `q_proj`, giving [B, H, L, qk_nope + qk_rope] per head;
- `kv_a_proj_with_mqa` x -> latent [kv_lora_rank] (normed by
  `kv_a_layernorm`) and one shared k_pe [qk_rope_head_dim] (MQA-like);
  `kv_b_proj` latent -> per head k_nope [qk_nope] and v [v_head_dim];
- RoPE on q_pe and k_pe only (dims qk_rope_head_dim), interleaved pairs
  when `rope_interleave` (transformers' default; it de-interleaves the
  output, we keep pairs in place: the same q.k, both sides permuted alike);
- scores scaled by (qk_nope + qk_rope)^-0.5, times mscale^2 with mscale =
  0.1 * mscale_all_dim * ln(factor) + 1 for a non-default RoPE with
  `mscale_all_dim` (transformers' yarn_apply_mscale); yarn's own
  attention factor mscale/mscale_all_dim scales cos and sin (rope.py).
What the cache keeps (`LATENT_CACHE`: a cache.LatentCache, cache/latent.py,
or a plain KVCache; the static buffers and the batch engine take both as
they are):
- per-head: K = [k_nope, k_pe] [B, H, S, qk_nope + qk_rope] and
  V [B, H, S, v_head_dim], H * (nope + rope + v) values per token and layer
  (this rank's heads under TP), attention as the reference computes it;
- latent (default: 576 values a token and layer for DeepSeek-V3 on every
  rank, where per-head needs 40960 / N; benchmarks/deepseek_v3_cache.py):
  the normed latent [B, 1, S, kv_lora] as "keys" and the rotated
  k_pe [B, 1, S, rope] as "values", kv_lora + rope values per token and
  layer on every rank (replicated under TP). A prefill chunk expands every
  cached position through kv_b_proj (as transformers does from its latent
  cache); a decode step runs absorbed: q_nope W_uk scores the latent
  directly, the rope scores enter SDPA as an additive mask (k = v = latent,
  one KV head), and the weighted latent is expanded once by W_uv (a
  quantized kv_b_proj dequantized for it).

MLP: dense SwiGLU for layers i < first_k_dense_replace or i % moe_layer_freq
!= 0 (DeepSeek's own rule; transformers 5.24 ignores moe_layer_freq, which
every released checkpoint has at 1); else MoE:
- router `mlp.gate.weight` [E, hidden], fp32, `noaux_tc`: scores = sigmoid;
  `mlp.gate.e_score_correction_bias` [E] is added only to CHOOSE: groups
  (n_group) ranked by the sum of their two best biased scores, the best
  topk_group kept, then the top-k biased scores among them; the weights are
  the chosen unbiased scores, renormalised (norm_topk_prob, + 1e-20), times
  routed_scaling_factor;
- routed experts stacked (mlx-lm's `mlp.switch_mlp.{gate,up,down}_proj`,
  [E, I, hidden] / [E, hidden, I], `experts.SwitchGLU`); only the k chosen
  run (`mx.gather_mm`);
  each product times its fp32 weight, rounded to the hidden dtype, summed in
  ascending expert order (the reference's index_add); transformers' per-expert
  keys `mlp.experts.N.*` are stacked lazily by sanitize (a rank reads only
  its slice);
- `mlp.shared_experts` (I * n_shared_experts) on every token, added.

Tensor parallelism: rank r holds a contiguous range of heads (uneven counts
fine): q_b_proj / q_proj rows, kv_b_proj rows and o_proj columns of its
heads; q_a_proj, kv_a_proj_with_mqa and their norms replicated (every rank
computes the latent). Its per-head cache holds its heads' K/V only (1/N of
the per-head cache); the latent cache is whole on every rank. Dense MLPs
split by columns; routed experts split on their intermediate dimension or
as whole experts per rank (`--moe-split`, `shard.shard_switch_glu`), shared
experts on their intermediate dimension (`shard.shard_expert_mlps`), the
router replicated, one all_sum per MoE block.
MTP layers (`model.layers.N.*`, N >= num_hidden_layers) are dropped.

deepseek_v32 (DeepSeek Sparse Attention; transformers 5.24's
DeepseekV32Indexer): each layer's `self_attn.indexer` scores every visible
key for each query and only its `index_topk` best stay visible to MLA:
- q = `wq_b`(q_a_layernorm's output) [B, L, index_n_heads, index_head_dim],
  k = `k_norm`(`wk` x) (a LayerNorm with bias) [B, L, index_head_dim], one
  key per token shared by the index heads; RoPE (the model's frequencies,
  half-split, not interleaved) on their first qk_rope_head_dim features;
- score(q, t) = sum_h w_h * relu(q_h . k_t) * index_head_dim^-0.5 with
  w = `weights_proj`(x) * index_n_heads^-0.5, all in fp32 (as the
  reference, whose weights_proj stays fp32 in a bf16 model);
- the causally masked keys score -inf, the top min(index_topk, keys) are
  selected, and MLA attends the visible selected keys (the masked ones a
  query selects when it sees fewer than index_topk stay masked). A query
  that sees at most index_topk keys sees them all: no selection runs while
  a forward's key axis is that short. A decode step gathers its chosen keys
  from the latent cache and attends those index_topk only (absorbed); a
  prefill chunk masks the others.
The index keys are cached with the latent: the cache's "values" are
[k_pe, index key] [B, 1, S, rope + index_head_dim], so a token and layer
cost kv_lora + rope + index_head_dim values on every rank (704 for
DeepSeek-V3.2); decode.py, the batch engine and the prompt cache take it as
it is. deepseek_v32 always keeps the latent cache (LATENT_CACHE is
deepseek_v3's choice) and its MLA RoPE is always interleaved, as
transformers' (no rope_interleave key). Under TP the indexer is replicated
(its projections whole on every rank): every rank computes the same scores
from the same replicated inputs, so every rank selects the same keys with
no collective (splitting its heads would need an all_sum of [B, L, S]
scores per layer, which grows with the context).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..nn.attention import causal_attention
from ..cache import KVCache, LatentCache
from ..nn.blocks import MLP, PreNormBlock
from ..parallel.collectives import SINGLE
from ..errors import UserError
from ..nn.experts import SwitchGLU, top_k, use_grouped
from ..nn.layers import LayerNorm, RMSNorm, activation, gated_fp32
from ..nn.masks import CAUSAL, create_causal_mask
from ..nn.rope import RoPE
from ..parallel.shard import shard_expert_mlps, shard_latent_attention, shard_mlp, shard_switch_glu
from ..checkpoint.mla_split import ArrayRef, DequantizedRef, kv_b_proj
from ..checkpoint.weights import join
from .base import FULL, BaseModelArgs, CausalLM, DecoderStack, describe_layers

DENSE, SPARSE = "dense", "sparse"
# What the cache keeps (module doc): True, the latent and k_pe (kv_lora + rope
# values per token, on every rank), decode steps absorbed; False, per-head K/V
# (the reference's order of operations, H * (nope + rope + v) values / N a rank).
LATENT_CACHE = True
LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers' RMSNorm default, not rms_norm_eps
INDEXED = "deepseek_v32"  # the model_type whose layers carry a lightning indexer
INDEX_NORM_EPS = 1e-6  # the indexer's k_norm (transformers' DeepseekV32Indexer)


@dataclass
class ModelArgs(BaseModelArgs):
    # Defaults are transformers' DeepseekV3Config defaults.
    model_type: str = "deepseek_v3"
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    num_key_value_heads: int | None = None  # MLA: every head has its own k/v; unused
    n_shared_experts: int | None = 1
    n_routed_experts: int | None = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int | None = 8
    topk_group: int | None = 4
    num_experts_per_tok: int | None = 8
    first_k_dense_replace: int = 3
    moe_layer_freq: int = 1
    norm_topk_prob: bool = True
    topk_method: str = "noaux_tc"
    scoring_func: str = "sigmoid"
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None  # the transformers-4 form, read as transformers 5 does
    rope_parameters: dict | None = None
    rope_interleave: bool = True
    attention_bias: bool = False
    # deepseek_v32 only (DeepseekV32Config's defaults)
    index_topk: int = 2048
    index_n_heads: int = 64
    index_head_dim: int = 128
    mlp_layer_types: list | None = None  # deepseek_v32's configs write it (transformers 5)

    def __post_init__(self):
        n = self.num_hidden_layers
        self.layer_types = [FULL] * n  # MLA everywhere, no window
        self.indexed = self.model_type == INDEXED
        if self.indexed:
            self._check_indexer()
            self.rope_interleave = True  # transformers' DeepseekV32Attention: always interleaved
        if self.mlp_layer_types is not None:
            self._check_mlp_layer_types()
        else:
            self.mlp_layer_types = [SPARSE if self._sparse(i) else DENSE for i in range(n)]
        if SPARSE in self.mlp_layer_types:
            self._check_routing()
        self.rope = self.one_rope()
        self.q_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads  # as transformers: every head its own k/v

    @property
    def head_dim(self) -> int:
        """The per-head q/k width (what `info` shows; config.json's own
        `head_dim` is transformers' alias of qk_rope_head_dim, not read)."""
        return self.q_head_dim

    def _sparse(self, i: int) -> bool:
        freq = self.moe_layer_freq
        if not isinstance(freq, int) or freq < 1:
            raise UserError(f"{self.model_type} config moe_layer_freq must be a positive integer, got {freq!r}")
        return self.n_routed_experts is not None and i >= self.first_k_dense_replace and i % freq == 0

    def _check_mlp_layer_types(self):
        kinds, n = self.mlp_layer_types, self.num_hidden_layers
        if len(kinds) != n or set(kinds) - {DENSE, SPARSE}:
            raise UserError(f"{self.model_type} config mlp_layer_types must be {n} of {DENSE!r} / {SPARSE!r}")
        if SPARSE in kinds and self.n_routed_experts is None:
            raise UserError(f"{self.model_type} config has sparse mlp_layer_types but no n_routed_experts")
        self.mlp_layer_types = list(kinds)

    def _check_indexer(self):
        t = self.model_type
        if self.q_lora_rank is None:
            raise UserError(f"{t}: q_lora_rank must be set (the indexer's queries read the q latent)")
        if self.index_topk < 1 or self.index_n_heads < 1:
            raise UserError(f"{t}: index_topk and index_n_heads must be positive")
        if not self.qk_rope_head_dim <= self.index_head_dim:
            raise UserError(f"{t}: index_head_dim {self.index_head_dim} must hold qk_rope_head_dim "
                            f"{self.qk_rope_head_dim} (its rotated part)")

    def _check_routing(self):
        t = self.model_type
        E, G, k = self.n_routed_experts, self.n_group or 1, self.num_experts_per_tok
        if self.topk_method != "noaux_tc" or self.scoring_func != "sigmoid":
            raise UserError(f"{t}: only topk_method noaux_tc with sigmoid scores is supported, got "
                            f"{self.topk_method!r} / {self.scoring_func!r}")
        if k is None or not 1 <= k <= E:
            raise UserError(f"{t}: num_experts_per_tok {k} must be in 1..{E}")
        if G < 1 or E % G or E // G < 2:
            raise UserError(f"{t}: n_group {G} must split n_routed_experts {E} into groups of at least 2")
        if not 1 <= (self.topk_group or 1) <= G:
            raise UserError(f"{t}: topk_group {self.topk_group} must be in 1..{G} (n_group)")
        if k > (self.topk_group or 1) * (E // G):
            raise UserError(f"{t}: num_experts_per_tok exceeds the experts of the topk_group groups")
        if not self.n_shared_experts:
            raise UserError(f"{t}: n_shared_experts must be at least 1 (transformers always builds them)")

    @property
    def softmax_scale(self) -> float:
        """transformers' yarn_apply_mscale: q_head_dim^-0.5 times mscale^2."""
        scale = self.q_head_dim**-0.5
        p = self.rope
        if p.get("rope_type", "default") != "default" and p.get("mscale_all_dim"):
            factor = float(p["factor"])
            m = 1.0 if factor <= 1 else 0.1 * float(p["mscale_all_dim"]) * math.log(factor) + 1.0
            scale = scale * m * m
        return scale


class Indexer(nn.Module):
    """deepseek_v32's lightning indexer (module doc): which `topk` of the
    visible keys each query's MLA attends. Replicated under TP."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        D, Di, H = args.hidden_size, args.index_head_dim, args.index_n_heads
        self.n_heads, self.head_dim, self.topk = H, Di, args.index_topk
        self.rope_dim = args.qk_rope_head_dim
        self.scale = Di**-0.5
        self.rope = RoPE(self.rope_dim, args.rope, args.max_position_embeddings)  # half-split, unlike MLA's
        self.wq_b = nn.Linear(args.q_lora_rank, H * Di, bias=False)
        self.wk = nn.Linear(D, Di, bias=False)
        self.k_norm = LayerNorm(Di, INDEX_NORM_EPS, bias=True)
        self.weights_proj = nn.Linear(D, H, bias=False)

    def _rotate(self, x, offset):
        """RoPE on the first rope_dim features only (yarn's factor scales those alone)."""
        return mx.concatenate([self.rope(x[..., : self.rope_dim], offset), x[..., self.rope_dim :]], axis=-1)

    def keys(self, x, offset):
        """This forward's index keys: x [B, L, hidden] -> [B, 1, L, index_head_dim]."""
        return self._rotate(self.k_norm(self.wk(x))[:, None], offset)

    def select(self, x, q_latent, keys, visible, offset):
        """The keys each query keeps: indices [B, 1, L, topk] into the key
        axis (its best index scores, the invisible keys scoring -inf), or None
        when no query has more than `topk` keys (all of them). x [B, L,
        hidden], q_latent [B, L, q_lora], keys [B, 1, S, index_head_dim]
        (every key, cached ones first), `visible` bool broadcastable to
        [B, 1, L, S] (None: every key)."""
        B, L, _ = x.shape
        if keys.shape[2] <= self.topk:
            return None
        q = self.wq_b(q_latent).reshape(B, L, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)  # [B, Hi, L, Di]
        q = self._rotate(q, offset)
        f32 = mx.float32
        scores = mx.maximum((q.astype(f32) @ keys.astype(f32).swapaxes(-1, -2)) * self.scale, 0)  # [B, Hi, L, S]
        w = self.weights_proj(x.astype(f32)).astype(f32) * self.n_heads**-0.5  # [B, L, Hi], fp32 as the reference
        index = (w[:, :, None, :] @ scores.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)  # [B, L, 1, S] -> [B, 1, L, S]
        if visible is not None:
            index = mx.where(visible, index, -mx.inf)
        return mx.argpartition(-index, kth=self.topk - 1, axis=-1)[..., : self.topk]


def chosen_mask(top, visible, S: int):
    """bool [B, 1, L, S]: the visible keys among the chosen `top` [B, 1, L, k]
    (a query that sees fewer than k keys also chose invisible ones)."""
    chosen = mx.put_along_axis(mx.zeros((*top.shape[:-1], S), mx.bool_), top, mx.array(True), axis=-1)
    return chosen if visible is None else chosen & visible


def take_keys(a, top):
    """a [B, 1, S, D] at one query's chosen keys top [B, 1, 1, k] -> [B, 1, k, D]."""
    idx = top[:, :, 0, :, None]  # [B, 1, k, 1]
    return mx.take_along_axis(a, mx.broadcast_to(idx, (*idx.shape[:-1], a.shape[-1])), axis=2)


class LatentAttention(nn.Module):
    """MLA with per-head K/V in the cache (module doc). Attribute contract of
    `shard.shard_latent_attention`: `total_num_heads` / `num_heads` (this
    rank's), `q_head_dim`, `kv_head_dim` (k_nope + v rows of kv_b_proj per
    head), `v_head_dim`; q_proj or q_b_proj, kv_b_proj, o_proj."""

    def __init__(self, args: ModelArgs, rope: RoPE):
        super().__init__()
        H, D = args.num_attention_heads, args.hidden_size
        self.total_num_heads = self.num_heads = H
        self.nope, self.rope_dim, self.v_head_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.q_head_dim = self.head_dim = args.q_head_dim
        self.kv_head_dim = self.nope + self.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        self.scale = args.softmax_scale
        self.rope = rope
        self.window = None  # full attention (describe_layers)
        self.latent_cache = LATENT_CACHE
        bias = args.attention_bias
        if args.q_lora_rank is None:
            self.q_proj = nn.Linear(D, H * self.q_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(D, args.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(args.q_lora_rank, H * self.q_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, H * self.kv_head_dim, bias=False)
        self.o_proj = nn.Linear(H * self.v_head_dim, D, bias=bias)
        if args.indexed:
            self.indexer = Indexer(args)
            self.latent_cache = True  # the index keys are cached beside k_pe (module doc)

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads  # each head its own k/v in the cache (plan, info)

    @property
    def total_num_kv_heads(self) -> int:
        return self.total_num_heads

    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        H = self.num_heads
        q_latent = None if "q_proj" in self else self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_proj(x) if q_latent is None else self.q_b_proj(q_latent)
        q = q.reshape(B, L, H, self.q_head_dim).transpose(0, 2, 1, 3)  # [B, H, L, nope + rope]
        q_nope, q_pe = q[..., : self.nope], q[..., self.nope :]
        ckv = self.kv_a_proj_with_mqa(x)  # [B, L, kv_lora + rope]
        latent = self.kv_a_layernorm(ckv[..., : self.kv_lora_rank])
        k_pe = ckv[..., self.kv_lora_rank :][:, None]  # [B, 1, L, rope]: one k_pe shared by every head
        offset = cache.offset if cache is not None else 0
        q_pe, k_pe = self.rope(q_pe, offset), self.rope(k_pe, offset)
        if self.latent_cache:
            # the cache keeps latent [B, 1, S, kv_lora] as "keys" and k_pe [B, 1, S, rope] as "values"
            # (with an indexer, [k_pe, index key] [B, 1, S, rope + index_head_dim])
            latent = latent[:, None]
            indexer = self.get("indexer")
            values = k_pe if indexer is None else mx.concatenate([k_pe, indexer.keys(x, offset)], axis=-1)
            if cache is not None:
                latent, values = cache.update_and_fetch(latent, values)
            k_pe, top = values[..., : self.rope_dim], None
            if indexer is not None:
                S = latent.shape[2]
                causal = mask == CAUSAL if isinstance(mask, str) else (mask is None and L > 1)
                visible = create_causal_mask(L, S - L) if causal else mask  # None: one query, every key
                top = indexer.select(x, q_latent, values[..., self.rope_dim :], visible, offset)
            if L == 1:
                if top is not None:  # attend the chosen keys only: topk of them, not S
                    latent, k_pe = take_keys(latent, top), take_keys(k_pe, top)
                    mask = None if visible is None else mx.take_along_axis(
                        mx.broadcast_to(visible, (*top.shape[:-1], S)), top, axis=-1)  # [B, 1, 1, k]
                o = self._absorbed(q_nope, q_pe, latent, k_pe, mask)
                return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))
            if top is not None:
                mask = chosen_mask(top, visible, S)
            k, v = self._expand(latent[:, 0], k_pe)
        else:
            k, v = self._expand(latent, k_pe)
            if cache is not None:
                k, v = cache.update_and_fetch(k, v)
        q = mx.concatenate([q_nope, q_pe], axis=-1)
        o = causal_attention(q, k, v, self.scale, mask=mask)  # [B, H, L, v]
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def _expand(self, latent, k_pe):
        """latent [B, S, kv_lora], k_pe [B, 1, S, rope] -> per-head K [B, H,
        S, nope + rope], V [B, H, S, v] (kv_b_proj on every position)."""
        B, S, _ = latent.shape
        H = self.num_heads
        kv = self.kv_b_proj(latent).reshape(B, S, H, self.kv_head_dim).transpose(0, 2, 1, 3)  # [B, H, S, nope + v]
        k_nope, v = kv[..., : self.nope], kv[..., self.nope :]
        return mx.concatenate([k_nope, mx.broadcast_to(k_pe, (B, H, S, self.rope_dim))], axis=-1), v

    def _absorbed(self, q_nope, q_pe, latent, k_pe, mask):
        """One query per row against the latent cache, kv_b_proj absorbed:
        q_nope W_uk scores the latent directly (q_nope.k_nope = (q_nope W_uk).latent)
        and the weighted latent is expanded once by W_uv: [B, H, 1, v]. The
        rope part enters as an additive mask of SDPA (k = v = latent, one
        KV head shared by every query head)."""
        H = self.num_heads
        p = self.kv_b_proj
        w = p.weight
        if "scales" in p:  # quantized: the weights as its matmul sees them (one dequantize a step, of this rank's rows)
            w = mx.dequantize(w, p.scales, p.get("biases"), group_size=p.group_size, bits=p.bits, mode=p.mode)
        w = w.astype(q_nope.dtype).reshape(H, self.kv_head_dim, self.kv_lora_rank)  # [H, nope + v, kv_lora]
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]
        q_abs = q_nope @ w_uk  # [B, H, 1, nope] @ [H, nope, kv_lora] -> [B, H, 1, kv_lora]
        pe = (q_pe @ k_pe.swapaxes(-1, -2)) * self.scale  # [B, H, 1, S]
        if isinstance(mask, mx.array):  # static buffers: the written slots (a bool row per batch row)
            pe = mx.where(mask, pe, mx.array(mx.finfo(pe.dtype).min, pe.dtype))
        o = mx.fast.scaled_dot_product_attention(q_abs, latent, latent, scale=self.scale, mask=pe)  # [B, H, 1, kv_lora]
        return o @ w_uv.swapaxes(-1, -2)  # [B, H, 1, kv_lora] @ [H, kv_lora, v]


class MoEGate(nn.Module):
    """noaux_tc router: x [N, hidden] -> (indices [N, k], weights [N, k] fp32)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        E = args.n_routed_experts
        self.top_k, self.n_group, self.topk_group = args.num_experts_per_tok, args.n_group or 1, args.topk_group or 1
        self.norm_topk_prob, self.routed_scaling_factor = args.norm_topk_prob, args.routed_scaling_factor
        self.weight = mx.zeros((E, args.hidden_size))
        self.e_score_correction_bias = mx.zeros((E,))

    def __call__(self, x):
        scores = mx.sigmoid(x.astype(mx.float32) @ self.weight.astype(mx.float32).T)  # [N, E], fp32 as the reference
        choice = scores + self.e_score_correction_bias.astype(mx.float32)
        N, E = choice.shape
        G = self.n_group
        if self.topk_group < G:
            # [N, G, E/G]: a group's score is the sum of its two best (order-free)
            best2 = mx.topk(choice.reshape(N, G, E // G), 2, axis=-1).sum(axis=-1)  # [N, G]
            keep = mx.argpartition(-best2, kth=self.topk_group - 1, axis=-1)[:, : self.topk_group]
            mask = mx.put_along_axis(mx.zeros((N, G), dtype=mx.bool_), keep, mx.array(True), axis=-1)
            choice = mx.where(mx.repeat(mask, E // G, axis=-1), choice, -mx.inf)
        k = self.top_k
        idx = top_k(choice, k, ascending=True)  # [N, k], ascending experts: the reference's summation order
        w = mx.take_along_axis(scores, idx, axis=-1)  # the unbiased scores
        if self.norm_topk_prob:
            w = w / (w.sum(axis=-1, keepdims=True) + 1e-20)
        return idx, w * self.routed_scaling_factor


class MoE(nn.Module):
    """Router, routed experts and shared experts; one all_sum once sharded."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        act = activation(args.hidden_act)
        I = args.moe_intermediate_size
        self.gate = MoEGate(args)
        self.switch_mlp = SwitchGLU(args.hidden_size, I, args.n_routed_experts, gated_fp32(act))
        self.shared_experts = MLP(args.hidden_size, I * args.n_shared_experts, act)
        self.group = SINGLE  # the job's group once the experts are split (shard)

    def __call__(self, x):
        B, L, D = x.shape
        xf = x.reshape(B * L, D)  # [N, hidden]
        idx, w = self.gate(xf)
        y = self.switch_mlp(xf, idx, w, grouped=use_grouped(idx.size, L), ascending=True).reshape(B, L, D)
        y = y + self.shared_experts(x)
        return self.group.all_sum(y)  # this rank's intermediate slice of every expert


class DecoderLayer(PreNormBlock):
    def __init__(self, args: ModelArgs, rope: RoPE, i: int):
        if args.mlp_layer_types[i] == SPARSE:
            mlp = MoE(args)
        else:
            mlp = MLP(args.hidden_size, args.intermediate_size, activation(args.hidden_act))
        super().__init__(LatentAttention(args, rope), mlp, args.hidden_size, lambda d: RMSNorm(d, args.rms_norm_eps))


class DeepseekV3Model(DecoderStack):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        rope = RoPE(args.qk_rope_head_dim, args.rope, args.max_position_embeddings, traditional=args.rope_interleave)
        self.layers = [DecoderLayer(args, rope, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Model(CausalLM):
    pipeline_stages = True  # a DecoderStack of independent layers: runs in --pp stages (pipeline.py)
    # what --kv-bits would quantize is read by this file's own matmuls, not attention.causal_attention
    kv_bits_refused = "its MLA cache holds a latent that the absorbed decode multiplies itself"

    def __init__(self, args: ModelArgs):
        super().__init__(args, DeepseekV3Model(args))

    def make_cache(self):
        """One cache per layer this rank runs: a LatentCache where the layer keeps the latent."""
        return [LatentCache() if layer.self_attn.latent_cache else KVCache() for layer in self.layers]

    def describe_layers(self) -> list[str]:
        a = self.args
        attn = (f", MLA {a.num_attention_heads} heads (q_lora {a.q_lora_rank}, kv_lora {a.kv_lora_rank}, "
                f"nope/rope/v {a.qk_nope_head_dim}/{a.qk_rope_head_dim}/{a.v_head_dim})")
        if a.indexed:
            attn += f", indexer top-{a.index_topk} keys ({a.index_n_heads} heads x {a.index_head_dim})"
        moe = (f", moe {a.n_routed_experts} experts top-{a.num_experts_per_tok} "
               f"(groups {a.topk_group}/{a.n_group}) + {a.n_shared_experts} shared")
        return [line + attn + (moe if kind == SPARSE else ", dense mlp")
                for line, kind in zip(describe_layers(self), a.mlp_layer_types)]

    def sanitize(self, weights: dict) -> dict:
        """Drop MTP layers (N >= num_hidden_layers) and saved RoPE buffers;
        rebuild kv_b_proj from mlx-lm's `embed_q` / `unembed_out` (quantized
        ones dequantized: mlx-lm quantizes them when their input dims are whole
        groups, e.g. kv_lora 512, so kv_b_proj is then a float Linear);
        stack per-expert `mlp.experts.N.<proj>.weight` into
        `mlp.switch_mlp.<proj>.weight` (lazily); the correction bias under
        either name (`mlp.gate.e_score_correction_bias` as the hub stores it,
        or `mlp.e_score_correction_bias`)."""
        n, E = self.args.num_hidden_layers, self.args.n_routed_experts
        out, experts = {}, {}
        ins = {"embed_q": self.args.qk_nope_head_dim, "unembed_out": self.args.kv_lora_rank}

        def split_weight(name):  # mlx-lm's embed_q / unembed_out, dequantized when stored quantized
            w = weights.get(name)
            base = name[: -len(".weight")]
            if w is None or base + ".scales" not in weights:
                return w
            wrap = (lambda a: ArrayRef(a) if isinstance(a, mx.array) else a)
            biases = weights.get(base + ".biases")
            return DequantizedRef(wrap(w), wrap(weights[base + ".scales"]), None if biases is None else wrap(biases),
                                   ins[base.rsplit(".", 1)[1]])

        for name, w in weights.items():
            parts = name.split(".")
            if name.endswith("rotary_emb.inv_freq") or (
                parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= n
            ):
                continue
            name = name.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")
            stem, _, leaf = name.rpartition(".")
            if stem.endswith(".self_attn.unembed_out") and stem.replace("unembed_out", "embed_q") + ".weight" in weights:
                continue  # joined with embed_q (its scales / biases too, dequantized)
            if stem.endswith(".self_attn.embed_q") and stem.replace("embed_q", "unembed_out") + ".weight" in weights:
                if leaf == "weight":
                    base = stem[: -len("embed_q")]
                    out[base + "kv_b_proj.weight"] = kv_b_proj(split_weight(name),
                                                                split_weight(base + "unembed_out.weight"))
                continue
            head, sep, tail = name.partition(".mlp.experts.")
            e, _, rest = tail.partition(".")
            if sep and e.isdigit():
                experts.setdefault((head, rest), {})[int(e)] = (name, w)
            else:
                out[name] = w
        for (head, rest), by in experts.items():
            if sorted(by) != list(range(E or 0)):
                out.update(dict(by.values()))  # not every expert: the strict load names them
                continue
            out[f"{head}.mlp.switch_mlp.{rest}"] = join([by[e][1] for e in range(E)], stack=True)  # lazy: a rank's slice
        return super().sanitize(out)

    def shard(self, group):
        for layer in self.layers:
            shard_latent_attention(layer.self_attn, group)
            if isinstance(layer.mlp, MoE):
                shard_switch_glu(layer.mlp.switch_mlp, group)
                shard_expert_mlps([layer.mlp.shared_experts], group)
                if not group.single:
                    layer.mlp.group = group
            else:
                shard_mlp(layer.mlp, group)
        self.shard_head(group)

    def collectives_per_token(self) -> dict:
        """The usual ones plus one all_sum ([1, hidden], the hidden dtype) per
        sharded MoE block (routed and shared experts together)."""
        plan = super().collectives_per_token()
        calls, nbytes = plan["all_sum"]
        for layer in self.layers:
            if isinstance(layer.mlp, MoE) and not layer.mlp.group.single:
                down = layer.mlp.shared_experts.down_proj
                calls += 1
                nbytes += self.args.hidden_size * (down.scales if "scales" in down else down.weight).dtype.size
        return {**plan, "all_sum": (calls, nbytes)}
