"""The Qwen3-Next / Qwen3.5 hybrid decoder, shared by qwen3_next and
qwen3_5_moe: gated DeltaNet linear-attention layers (`GatedDeltaNet`, kind
`cache.LINEAR`) beside gated full-attention layers (`GatedAttention`, kind
FULL), each followed by an MLP that is, on most layers, a routed MoE with a
sigmoid-gated shared expert (`SharedExpertMoE`). Norms are Qwen3-Next's
(1 + w) RMSNorm (layers.GemmaRMSNorm), q/k norms included.

GatedDeltaNet, per token t (x [B, L, hidden]):
- projections to q, k [Hk, Dk], v, z [Hv, Dv] and b, a [Hv] (Hv = r Hk value
  heads, each key head serving r consecutive value heads). qwen3_next
  fuses them per key head: `in_proj_qkvz` rows [q Dk | k Dk | v r Dv | z r Dv]
  for each key head, `in_proj_ba` [b r | a r]; qwen3_5_moe has `in_proj_qkv`
  (rows q of every head, then k, then v), `in_proj_z`, `in_proj_b`, `in_proj_a`;
- the q/k/v channels [q Hk Dk | k Hk Dk | v Hv Dv] through a causal depthwise
  conv (`conv1d.weight` [C, 1, K], no bias) and silu; the last K - 1 inputs
  are the conv state (`cache.DeltaNetCache`);
- beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias) (fp32);
- the delta rule in fp32 on q, k l2-normalised (eps 1e-6), q scaled by
  Dk^-0.5: S <- S exp(g_t); S <- S + k_t (beta_t (v_t - k_t S)); o_t = q_t S,
  S [Hv, Dk, Dv] per sequence, carried across chunks and decode steps;
  several tokens run as transformers' chunked form (chunks of up to 64: a UT
  transform within a chunk, its unit-lower inverse by repeated squaring
  instead of a triangular solve), one token as the plain step;
- o normed per value head and gated: w * rmsnorm(o) * silu(z) (`norm`),
  then `out_proj`.

GatedAttention: q_proj gives [q D | gate D] per head; q/k normed per head,
partial RoPE, causal attention, the output times sigmoid(gate), o_proj.

Tensor parallelism (`shard.shard_deltanet`): a rank keeps whole key-head
groups (key heads [k0, k1) and their value heads [r k0, r k1)): its rows of
the projections, conv channels, dt_bias / A_log, out_proj input columns (one
all_sum); its conv and recurrent state cover those heads only. Attention by
heads (the gate rows with their heads), MoE by expert slices with the shared
expert split alike, one all_sum per block (the shared gate replicated).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .blocks import MLP, Attention, fused_projection
from ..cache import FULL, LINEAR, DeltaNetCache, KVCache
from ..errors import UserError
from .experts import SoftmaxMoE
from .layers import GemmaRMSNorm, RMSNormFP32Scale, activation
from ..cache import layer_masks
from ..parallel.shard import shard_attention, shard_deltanet, shard_expert_mlps, shard_mlp, shard_switch_glu

__all__ = ["LINEAR", "GatedDeltaNet", "GatedAttention", "SharedExpertMoE", "HybridLayer", "make_cache"]


@mx.compile
def _delta_step(S, q, k, v, decay, beta):
    """One token of the gated delta rule, fp32: S [B, H, Dk, Dv]; q, k [B, H,
    Dk]; v [B, H, Dv]; decay = exp(g), beta [B, H] -> (o [B, H, Dv], S)."""
    S = S * decay[..., None, None]
    kv_mem = (S * k[..., :, None]).sum(axis=-2)  # [B, H, Dv]
    delta = (v - kv_mem) * beta[..., None]
    S = S + k[..., :, None] * delta[..., None, :]
    return (S * q[..., :, None]).sum(axis=-2), S


def _l2norm(x):
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + 1e-6)


CHUNK = 64  # the delta rule's prefill chunk (transformers' chunk_size)


def gated_delta_rule(q, k, v, g, beta, state=None, chunked: bool | None = None):
    """q, k [B, L, Hk, Dk], v [B, L, Hv, Dv], g, beta [B, L, Hv] -> (o [B, L,
    Hv, Dv] in v's dtype, state [B, Hv, Dk, Dv] fp32), from `state` (zeros:
    a fresh sequence). Several tokens run in chunks of up to CHUNK
    (`_chunked`, transformers' algorithm), one token as one step (`chunked`
    forces either: the same sums, in another order)."""
    B, L, Hk, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    r = Hv // Hk
    f32 = mx.float32
    q, k = _l2norm(q.astype(f32)), _l2norm(k.astype(f32))
    q = q * Dk**-0.5
    if r > 1:  # value head h reads key head h // r
        q, k = mx.repeat(q, r, axis=2), mx.repeat(k, r, axis=2)
    S = mx.zeros((B, Hv, Dk, Dv), f32) if state is None else state
    vf, g, beta = v.astype(f32), g.astype(f32), beta.astype(f32)
    if chunked if chunked is not None else L > 1:
        o, S = _chunked(q, k, vf, g, beta, S, min(CHUNK, L))
        return o.astype(v.dtype), S
    decay = mx.exp(g)
    outs = []
    for t in range(L):
        o, S = _delta_step(S, q[:, t], k[:, t], vf[:, t], decay[:, t], beta[:, t])
        outs.append(o)
    return mx.stack(outs, axis=1).astype(v.dtype), S


def _unit_lower_inverse(A):
    """(I + A)^-1 for A strictly lower triangular [..., C, C] (nilpotent:
    A^C = 0): the product of (I + M^(2^i)), M = -A, i < log2 C, i.e. the
    series sum of M^n in a few matmuls (no triangular solve on every device)."""
    C = A.shape[-1]
    eye = mx.eye(C, dtype=A.dtype)
    M = -A
    inv, p = eye + M, 2
    while p < C:
        M = M @ M
        inv = inv @ (eye + M)
        p *= 2
    return inv


def _chunked(q, k, v, g, beta, S, C: int):
    """The delta rule over chunks of C tokens (transformers'
    torch_chunk_gated_delta_rule): within a chunk its UT transform, across
    chunks the state. q, k [B, L, H, Dk] (normed, scaled), v [B, L, H, Dv],
    g, beta [B, L, H], S [B, H, Dk, Dv], all fp32 -> (o [B, L, H, Dv], S)."""
    B, L, H, Dk = k.shape
    pad = -L % C
    q, k, v = (mx.pad(x.transpose(0, 2, 1, 3), [(0, 0), (0, 0), (0, pad), (0, 0)]) for x in (q, k, v))
    g, beta = (mx.pad(x.transpose(0, 2, 1), [(0, 0), (0, 0), (0, pad)]) for x in (g, beta))  # padding: no update
    N = (L + pad) // C
    q, k, v = (x.reshape(B, H, N, C, -1) for x in (q, k, v))  # [B, H, N, C, D]
    g, beta = g.reshape(B, H, N, C), beta.reshape(B, H, N, C)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = mx.cumsum(g, axis=-1)  # [B, H, N, C]: log decay from the chunk's start
    lower = mx.tril(mx.ones((C, C), mx.bool_))
    pairwise = mx.exp(mx.where(lower, cum[..., :, None] - cum[..., None, :], -mx.inf))  # [.., i, j] decay j -> i
    ut = (k_beta @ k.swapaxes(-1, -2)) * pairwise
    intra = (q @ k.swapaxes(-1, -2)) * pairwise
    inv = _unit_lower_inverse(mx.where(mx.tril(lower, -1), ut, 0.0))
    new_values = inv @ v_beta
    k_cumdecay = inv @ (k_beta * mx.exp(cum)[..., None])
    q = q * mx.exp(cum)[..., None]
    k = k * mx.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = mx.exp(cum[..., -1])[..., None, None]  # [B, H, N, 1, 1]
    outs = []
    for i in range(N):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ S
        outs.append(q[:, :, i] @ S + intra[:, :, i] @ v_new)  # [B, H, C, Dv]
        S = S * chunk_decay[:, :, i] + k[:, :, i].swapaxes(-1, -2) @ v_new
    o = mx.stack(outs, axis=2).reshape(B, H, N * C, -1)[:, :, :L]
    return o.transpose(0, 2, 1, 3), S


class GatedRMSNorm(nn.Module):
    """Qwen3-Next's RMSNormGated: w * rmsnorm(x) (rounded to x's dtype first,
    as the reference), times silu(gate) in fp32, rounded to x's dtype."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x, gate):
        y = self.weight * mx.fast.rms_norm(x, None, self.eps)
        return (y.astype(mx.float32) * nn.silu(gate.astype(mx.float32))).astype(x.dtype)


class Conv1d(nn.Module):
    """Causal depthwise conv over [B, L, C], the checkpoint's `weight` [C, 1, K]
    (no bias), fp32 accumulation rounded once, then silu."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = mx.zeros((channels, 1, kernel))

    def __call__(self, x, state):
        """x [B, L, C], state [B, K - 1, C] (the inputs before x) -> (silu(conv)
        [B, L, C], the new state: the last K - 1 inputs)."""
        L, K = x.shape[1], self.weight.shape[-1]
        xp = mx.concatenate([state, x], axis=1)  # [B, K - 1 + L, C]
        w = self.weight[:, 0, :].T.astype(mx.float32)  # [K, C]
        xf = xp.astype(mx.float32)
        out = sum(xf[:, j : j + L, :] * w[j] for j in range(K)).astype(x.dtype)
        return nn.silu(out.astype(mx.float32)).astype(x.dtype), xp[:, L:, :]


class GatedDeltaNet(nn.Module):
    """A gated DeltaNet layer (module doc). `fused`: qwen3_next's
    in_proj_qkvz / in_proj_ba, else qwen3_5's four projections. Counts
    `total_*` are the model's, `num_k_heads` / `num_v_heads` this rank's."""

    def __init__(self, args, fused: bool):
        super().__init__()
        D = args.hidden_size
        self.total_k_heads = self.num_k_heads = Hk = args.linear_num_key_heads
        self.total_v_heads = self.num_v_heads = Hv = args.linear_num_value_heads
        if Hk < 1 or Hv % Hk:
            raise UserError(f"linear_num_value_heads {Hv} is not a multiple of linear_num_key_heads {Hk}")
        self.head_k_dim, self.head_v_dim = Dk, Dv = args.linear_key_head_dim, args.linear_value_head_dim
        self.fused = fused
        conv_dim = 2 * Hk * Dk + Hv * Dv
        if fused:
            self.in_proj_qkvz = nn.Linear(D, 2 * Hk * Dk + 2 * Hv * Dv, bias=False)
            self.in_proj_ba = nn.Linear(D, 2 * Hv, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(D, conv_dim, bias=False)
            self.in_proj_z = nn.Linear(D, Hv * Dv, bias=False)
            self.in_proj_b = nn.Linear(D, Hv, bias=False)
            self.in_proj_a = nn.Linear(D, Hv, bias=False)
        self.conv1d = Conv1d(conv_dim, args.linear_conv_kernel_dim)
        self.dt_bias = mx.ones((Hv,))
        self.A_log = mx.zeros((Hv,))
        self.norm = GatedRMSNorm(Dv, args.rms_norm_eps)
        self.out_proj = nn.Linear(Hv * Dv, D, bias=False)

    def project(self, x):
        """x [B, L, hidden] -> conv input [B, L, q | k | v channels], z [B, L,
        Hv, Dv], b, a [B, L, Hv] (this rank's heads)."""
        B, L, _ = x.shape
        Hk, Hv, Dk, Dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        r = Hv // Hk
        if self.fused:
            qkvz = self.in_proj_qkvz(x).reshape(B, L, Hk, 2 * Dk + 2 * r * Dv)  # per key head: q k v z
            ba = self.in_proj_ba(x).reshape(B, L, Hk, 2 * r)  # per key head: b a
            q, k = qkvz[..., :Dk], qkvz[..., Dk : 2 * Dk]
            v, z = qkvz[..., 2 * Dk : 2 * Dk + r * Dv], qkvz[..., 2 * Dk + r * Dv :]
            qkv = mx.concatenate([t.reshape(B, L, -1) for t in (q, k, v)], axis=-1)
            return qkv, z.reshape(B, L, Hv, Dv), ba[..., :r].reshape(B, L, Hv), ba[..., r:].reshape(B, L, Hv)
        fused = fused_projection(self, ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), "_proj_fused")
        qkv, z, b, a = fused(x) if fused is not None else (
            self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x))
        return qkv, z.reshape(B, L, Hv, Dv), b, a

    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        Hk, Hv, Dk, Dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        qkv, z, b, a = self.project(x)
        conv_state, state = cache.fetch() if cache is not None else (None, None)
        if conv_state is None:
            conv_state = mx.zeros((B, self.conv1d.weight.shape[-1] - 1, qkv.shape[-1]), qkv.dtype)
        qkv, conv_state = self.conv1d(qkv, conv_state)
        q = qkv[..., : Hk * Dk].reshape(B, L, Hk, Dk)
        k = qkv[..., Hk * Dk : 2 * Hk * Dk].reshape(B, L, Hk, Dk)
        v = qkv[..., 2 * Hk * Dk :].reshape(B, L, Hv, Dv)
        beta = mx.sigmoid(b.astype(mx.float32)).astype(b.dtype)  # torch's half sigmoid: fp32, rounded once
        g = -mx.exp(self.A_log.astype(mx.float32)) * nn.softplus(a.astype(mx.float32) + self.dt_bias)
        o, state = gated_delta_rule(q, k, v, g, beta, state)
        if cache is not None:
            cache.update(conv_state, state, L)
        o = self.norm(o, z)  # [B, L, Hv, Dv]
        return self.out_proj(o.reshape(B, L, Hv * Dv))


class GatedAttention(Attention):
    """Qwen3-Next's full attention: q_proj rows [q D | gate D] per head
    (`q_proj_width` 2 D a head, which shard_attention keeps with its head),
    q/k (1 + w) norms per head, the output times sigmoid(gate) before o_proj."""

    def __init__(self, args, rope):
        H, D = args.num_attention_heads, args.head_dim
        super().__init__(args.hidden_size, H, args.num_key_value_heads, D, scale=D**-0.5, rope=rope,
                         bias=args.attention_bias, qk_norm=lambda d: GemmaRMSNorm(d, args.rms_norm_eps))
        self.q_proj = nn.Linear(args.hidden_size, 2 * H * D, bias=args.attention_bias)
        self.q_proj_width = 2 * D

    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        fused = fused_projection(self, ("q_proj", "k_proj", "v_proj"), "_qkv_fused")
        qg, k, v = fused(x) if fused is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        qg = qg.reshape(B, L, self.num_heads, 2 * self.head_dim)  # per head: q then gate
        gate = qg[..., self.head_dim :].reshape(B, L, -1)
        q = self.q_norm(qg[..., : self.head_dim]).transpose(0, 2, 1, 3)  # [B, H, L, D]
        k = self.k_norm(k.reshape(B, L, self.num_kv_heads, self.head_dim)).transpose(0, 2, 1, 3)
        v = v.reshape(B, L, self.num_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        q, k = self.position(q, k, cache.offset if cache is not None else 0)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        o = self.attend(q, k, v, mask).transpose(0, 2, 1, 3).reshape(B, L, -1)  # [B, L, heads * D]
        return self.o_proj(o * mx.sigmoid(gate.astype(mx.float32)).astype(gate.dtype))


class SharedExpertMoE(SoftmaxMoE):
    """Softmax top-k routed experts (stacked, experts.SwitchGLU) plus a shared
    expert scaled by sigmoid(shared_expert_gate(x)); one all_sum once sharded."""

    def __init__(self, args, norm_topk_prob: bool):
        super().__init__(args, norm_topk_prob)
        D = args.hidden_size
        self.shared_expert = MLP(D, args.shared_expert_intermediate_size, activation(args.hidden_act))
        self.shared_expert_gate = nn.Linear(D, 1, bias=False)

    def __call__(self, x):
        B, L, D = x.shape
        flat = x.reshape(B * L, D)  # [N, hidden]
        y = self.routed(flat, L)
        g = self.shared_expert_gate(flat)
        shared = mx.sigmoid(g.astype(mx.float32)).astype(g.dtype) * self.shared_expert(flat)
        return self.group.all_sum(y + shared).reshape(B, L, D)


class HybridLayer(nn.Module):
    """h = x + mixer(norm(x)); out = h + mlp(norm(h)), the mixer `linear_attn`
    (a GatedDeltaNet) or `self_attn` (a GatedAttention) by the layer's kind."""

    def __init__(self, kind: str, mixer: nn.Module, mlp: nn.Module, args):
        super().__init__()
        self.kind = kind
        if kind == LINEAR:
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.mlp = mlp
        self.input_layernorm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)

    @property
    def mixer(self):
        return self.linear_attn if self.kind == LINEAR else self.self_attn

    def __call__(self, x, mask=None, cache=None):
        h = x + self.mixer(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


def check_layer_types(types: list, n: int) -> list:
    if len(types) != n:
        raise UserError(f"config layer_types has {len(types)} entries for {n} layers")
    bad = sorted(set(types) - {LINEAR, FULL})
    if bad:
        raise UserError(f"config layer_types has unsupported kinds {bad} (supported: {LINEAR}, {FULL})")
    return list(types)


def hybrid_layer_types(layer_types, n: int, interval) -> list:
    """transformers' rule: layer_types as given, else every `interval`-th layer
    (full_attention_interval, default 4) full, the others linear."""
    if layer_types is not None:
        return check_layer_types(layer_types, n)
    interval = 4 if interval is None else int(interval)
    if interval < 1:
        raise UserError(f"config full_attention_interval must be >= 1, got {interval}")
    return [LINEAR if (i + 1) % interval else FULL for i in range(n)]


def hybrid_rope(args) -> dict:
    """The attention layers' RoPE params (transformers-5 form) from either
    config form: rope_parameters, or transformers 4's rope_scaling /
    top-level rope_theta / partial_rotary_factor (default 0.25, as
    Qwen3NextConfig); mrope keys (qwen3_5: text positions are equal on every
    axis, so mrope is plain RoPE) are dropped."""
    params = dict(getattr(args, "rope_scaling", None) or args.rope_parameters or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params.pop("type", None)
    theta = getattr(args, "rope_theta", None)
    params.setdefault("rope_theta", 10_000.0 if theta is None else theta)
    factor = getattr(args, "partial_rotary_factor", None)
    params.setdefault("partial_rotary_factor", 0.25 if factor is None else factor)
    for key in ("mrope_section", "mrope_interleaved"):
        params.pop(key, None)
    return params


def make_cache(kinds: list) -> list:
    """A DeltaNetCache per linear layer, a KVCache per full one."""
    return [DeltaNetCache() if k == LINEAR else KVCache() for k in kinds]


def stack_masks(L: int, cache, kinds: list) -> dict:
    """The stack's masks (a cache-less pass asks fresh caches)."""
    return layer_masks(L, cache if cache is not None else make_cache(kinds), kinds, None)


def shard_hybrid_layers(layers, group) -> None:
    """Every hybrid layer's mixer and MLP split over `group` (module doc)."""
    for layer in layers:
        if layer.kind == LINEAR:
            shard_deltanet(layer.linear_attn, group)
        else:
            shard_attention(layer.self_attn, group)
        if isinstance(layer.mlp, SharedExpertMoE):
            shard_switch_glu(layer.mlp.switch_mlp, group)
            shard_expert_mlps([layer.mlp.shared_expert], group)
            if not group.single:
                layer.mlp.group = group
        else:
            shard_mlp(layer.mlp, group)


def moe_collectives(model, plan: dict) -> dict:
    """`plan` plus one all_sum ([1, hidden], the hidden dtype) per sharded MoE block."""
    calls, nbytes = plan["all_sum"]
    for layer in model.layers:
        if isinstance(layer.mlp, SharedExpertMoE) and not layer.mlp.group.single:
            gate = layer.mlp.gate
            calls += 1
            nbytes += model.args.hidden_size * (gate.scales if "scales" in gate else gate.weight).dtype.size
    return {**plan, "all_sum": (calls, nbytes)}


def describe(model) -> list[str]:
    out = []
    for i, layer in enumerate(model.layers):
        if layer.kind == LINEAR:
            m = layer.linear_attn
            line = (f"{i}: gated deltanet ({m.num_k_heads} key / {m.num_v_heads} value heads, conv "
                    f"{m.conv1d.weight.shape[-1]})")
        else:
            a = layer.self_attn
            line = f"{i}: full, gated, rope {a.rope.describe()}, partial {a.rope.params.get('partial_rotary_factor')}"
        if isinstance(layer.mlp, SharedExpertMoE):
            line += (f", moe {layer.mlp.switch_mlp.num_experts} experts top-{layer.mlp.top_k} + gated shared"
                     f"{layer.mlp.switch_mlp.describe()}")
        else:
            line += ", dense mlp"
        out.append(line)
    return out


def export_mlx_lm_layout(model, weights: dict) -> dict:
    """`weights` (our names and layout) in mlx-lm's converted layout, which its
    qwen3_next reads without a sanitize: conv1d.weight [C, K, 1] and every
    (1 + w) norm stored as 1 + w (computed in fp32, cast back)."""
    plus_one = {f"{path}.weight" for path, m in model.named_modules() if isinstance(m, GemmaRMSNorm)}
    out = {}
    for name, w in weights.items():
        if name.endswith("linear_attn.conv1d.weight"):
            w = w.swapaxes(1, 2)
        elif name in plus_one:
            w = (w.astype(mx.float32) + 1.0).astype(w.dtype)
        out[name] = w
    return out


def mlx_lm_norms(model, weights: dict) -> bool:
    """True for mlx-lm's layout (its sanitize moved conv1d.weight to [C, K, 1]
    and stored the (1 + w) norms as 1 + w): the model's (1 + w) norms become
    plain w-scaled ones (RMSNormFP32Scale) so the stored values are used as
    they are. A pure rename for transformers' layout (returns False)."""
    convs = [w for name, w in weights.items() if name.endswith("linear_attn.conv1d.weight") and w is not None]
    if not convs or convs[0].shape[-1] != 1:
        return False
    for _, m in model.named_modules():
        for name in ("input_layernorm", "post_attention_layernorm", "norm", "q_norm", "k_norm"):
            child = m.get(name) if isinstance(m, nn.Module) else None
            if isinstance(child, GemmaRMSNorm):
                setattr(m, name, RMSNormFP32Scale(child.weight.shape[0], child.eps))
    return True


def gate_quant_override(path: str):
    """convert's bits for the Qwen3-Next / Qwen3.5 MoE router and shared-expert
    gate: 8, as mlx-lm's `quant_predicate` for both families writes them."""
    if path.endswith("mlp.gate") or path.endswith("shared_expert_gate"):
        return {"group_size": 64, "bits": 8}
    return None
