"""gpt-oss (`gpt_oss`): GQA attention with learned per-head sinks, sliding
window on alternate layers, yarn RoPE, and a top-k mixture-of-experts MLP.

Hidden states [B, L, hidden]; q [B, n_heads, L, head_dim], k/v [B,
n_kv_heads, L, head_dim] (per-rank counts under tensor parallelism); sinks
[n_heads]. q/k/v/o all carry biases. Norms are RMSNorm scaled by w in fp32
(transformers keeps them in fp32), pre-attention and pre-MLP only.

MoE (per layer, names as transformers saves an unquantized checkpoint):
- router: linear with bias, [E, hidden] + [E]; the top-k logits per token are
  softmaxed (top-k first, then softmax over those k);
- experts.gate_up_proj [E, hidden, 2I] (x @ W, not W.T), with gate and up
  INTERLEAVED along the last axis: gate_j = column 2j, up_j = column 2j+1;
  experts.gate_up_proj_bias [E, 2I];
- experts.down_proj [E, I, hidden], experts.down_proj_bias [E, hidden];
- clamped SwiGLU: gate = min(gate, limit), up = clip(up, -limit, limit),
  out = (up + 1) * gate * sigmoid(alpha * gate).
MXFP4 checkpoints (`*_blocks` / `*_scales` expert tensors) are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..nn.blocks import Attention, PreNormBlock
from ..parallel.collectives import SINGLE
from ..errors import UserError
from ..nn.layers import RMSNormFP32Scale
from ..nn.rope import RoPE
from ..parallel.shard import shard_attention, shard_moe
from .base import (
    SLIDING,
    BaseModelArgs,
    CausalLM,
    DecoderStack,
    derive_layer_types,
    describe_layers,
)

# transformers' GptOssConfig default when a config gives no rope at all.
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
DEFAULT_THETA = 150_000.0


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = "gpt_oss"
    vocab_size: int = 201088
    hidden_size: int = 2880
    intermediate_size: int = 2880
    num_hidden_layers: int = 36
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int | None = 64
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    sliding_window: int | None = 128
    layer_types: list | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    original_max_position_embeddings: int | None = None
    max_position_embeddings: int = 131072
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_bias: bool = True
    tie_word_embeddings: bool = False

    @classmethod
    def from_dict(cls, params: dict):
        params = dict(params)
        # transformers' attribute_map alias; openai's config also carries
        # experts_per_token next to num_experts_per_tok.
        if "num_local_experts" not in params and "num_experts" in params:
            params["num_local_experts"] = params["num_experts"]
        if "num_experts_per_tok" not in params and "experts_per_token" in params:
            params["num_experts_per_tok"] = params["experts_per_token"]
        return super().from_dict(params)

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise UserError(
                f"gpt_oss: num_experts_per_tok {self.num_experts_per_tok} must be in 1..{self.num_local_experts} "
                "(num_local_experts)"
            )
        # transformers' default without layer_types: even layers sliding, odd full.
        self.layer_types = derive_layer_types(self.layer_types, self.num_hidden_layers, self.sliding_window, 2)
        self.rope = self._rope()

    def _rope(self) -> dict:
        # One RoPE for all layers; with no rope config at all, GptOssConfig's
        # yarn default (not plain RoPE) and theta 150000.
        theta = self.rope_theta if self.rope_theta is not None else DEFAULT_THETA
        return self.one_rope(default=DEFAULT_ROPE, theta=theta)


def clamped_swiglu(gate_up: mx.array, alpha: float, limit: float) -> mx.array:
    """[..., 2I] interleaved (gate_0, up_0, gate_1, up_1, ...) -> [..., I].
    In fp32, cast once (as blocks.MLP)."""
    x = gate_up.astype(mx.float32)
    gate, up = x[..., ::2], x[..., 1::2]
    gate = mx.minimum(gate, limit)  # clamped above only
    up = mx.clip(up, -limit, limit)
    glu = gate * mx.sigmoid(gate * alpha)
    return ((up + 1) * glu).astype(gate_up.dtype)


def native_gather_mm(x: mx.array) -> bool:
    """Whether mx.gather_mm takes x's dtype as it is on this device (the GPU,
    or fp32; the CPU's is fp32-only). benchmarks/step_primitives.py forces
    True to count the GPU's graph on a CPU."""
    return x.dtype == mx.float32 or mx.default_device() == mx.gpu


def gather_mm(x: mx.array, w: mx.array, indices: mx.array) -> mx.array:
    """x [..., 1, K] @ w[indices] ([E, K, M] gathered per row) -> [..., 1, M].

    MLX's CPU gather_mm is float32-only (0.32): there, half-precision inputs
    are multiplied in fp32 and rounded once, as a half matmul with fp32
    accumulation does (and as torch's bf16 CPU matmul does). Only the routed
    experts are cast when the rows route to fewer (expert, row) pairs than
    there are experts (decode: k of E), not the whole [E, K, M] tensor."""
    if native_gather_mm(x):
        return mx.gather_mm(x, w, rhs_indices=indices)
    x32 = x.astype(mx.float32)
    if indices.size < w.shape[0]:
        # [..., k, K, M]: the routed experts' weights, gathered, then cast
        return (x32 @ w[indices].astype(mx.float32)).astype(x.dtype)
    return mx.gather_mm(x32, w.astype(mx.float32), rhs_indices=indices).astype(x.dtype)


def dense_mm(x: mx.array, w: mx.array) -> mx.array:
    """x [R, K] @ w [K, M] (one expert's matrix) -> [R, M], with
    `gather_mm`'s dtype rule: in x's dtype where gather_mm takes it natively
    (the GPU, or fp32), else multiplied in fp32 and rounded once (the CPU
    with half weights: as `gather_mm` there, so both paths round alike)."""
    if native_gather_mm(x):
        return x @ w
    return (x.astype(mx.float32) @ w.astype(mx.float32)).astype(x.dtype)


class Experts(nn.Module):
    """E experts applied to the k experts each token was routed to.

    The work is tokens * k expert products, never tokens * E, in one of two
    ways with the same results (bit for bit on the CPU in fp32,
    tests/test_moe.py):
    - gathered (decode, short inputs): `mx.gather_mm`, each (token, expert)
      row multiplied by its expert's matrix (on MLX CUDA one matrix-vector
      product per row, re-reading the expert's weights for each);
    - grouped (`grouped=True`, prefill: `use_grouped`): the rows sorted by
      expert and each expert's rows multiplied as one dense block by its
      matrix (`_grouped`), so an expert's weights are read once per block.
    Under tensor parallelism (`shard.shard_moe`) this rank holds intermediate
    slice [r*I/N, (r+1)*I/N) of every expert, so the partial down projections
    are summed over ranks (`group`) before the down bias is added, once.
    (No quantized experts: the checkpoints' MXFP4 experts are refused,
    `Model.sanitize`, and quant.py quantizes Linear/Embedding modules only.)
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, alpha: float, limit: float):
        super().__init__()
        self.num_experts = num_experts
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = mx.zeros((num_experts, hidden_size, 2 * intermediate_size))
        self.gate_up_proj_bias = mx.zeros((num_experts, 2 * intermediate_size))
        self.down_proj = mx.zeros((num_experts, intermediate_size, hidden_size))
        self.down_proj_bias = mx.zeros((num_experts, hidden_size))
        self.group = SINGLE  # shard_moe sets the job's group when the intermediate dim is split

    def __call__(self, x, indices, weights, grouped: bool = False):
        # x [N, hidden]; indices [N, k] expert ids; weights [N, k] routing weights
        if grouped:
            out = self._grouped(x, indices)
        else:
            xe = x[:, None, None, :]  # [N, 1, 1, hidden]: one row per (token, chosen expert)
            gu = gather_mm(xe, self.gate_up_proj, indices)  # [N, k, 1, 2I]
            gu = gu + self.gate_up_proj_bias[indices][:, :, None, :]
            h = clamped_swiglu(gu, self.alpha, self.limit)  # [N, k, 1, I]
            out = gather_mm(h, self.down_proj, indices).squeeze(-2)  # [N, k, hidden]
        w = weights[..., None].astype(out.dtype)  # [N, k, 1]
        y = (out * w).sum(axis=1)  # [N, hidden]
        y = self.group.all_sum(y)  # partial sums of this rank's slice of each expert
        return y + (self.down_proj_bias[indices] * w).sum(axis=1)

    def relayout(self) -> None:
        """Keep the expert matrices in mlx-lm's SwitchLinear layout: each
        stored as [E, out, in] row-major, the parameter being its transposed
        view, so `gate_up_proj` / `down_proj` keep transformers' names, shapes
        ([E, in, out]) and values, but `mx.gather_mm(x, self.gate_up_proj,
        ...)` is mlx-lm's `mx.gather_mm(x, weight.swapaxes(-1, -2), ...)`
        stride for stride (MLX 0.32 CUDA: a transposed rhs takes gather_mv
        for one row per (token, expert), the kernel mlx-lm's decode runs),
        and the grouped path's `x @ self.gate_up_proj[e]` multiplies by the
        transposed view of a row-major [out, in] matrix, as nn.Linear's
        `x @ W.T` does. Done once per loaded (or sharded) array
        (`Model.load_weights`)."""
        for name in ("gate_up_proj", "down_proj"):
            w = self[name]
            if self.get(f"_{name}_relaid") is w:
                continue
            w = mx.contiguous(w.swapaxes(-1, -2)).swapaxes(-1, -2)
            self[name] = w
            self[f"_{name}_relaid"] = w  # "_": never a parameter

    def _grouped(self, x, indices):
        """The gathered path's products with the (token, expert) rows grouped
        by expert: [N, k, hidden], in token order.

        The N*k rows are sorted by expert (on the device, stably: the key
        expert * N*k + row is unique), each expert's contiguous block of rows
        goes through plain matmuls with its matrices (`self.gate_up_proj[e]`:
        a view, no copy), and the rows are put back in token order (inverse
        permutation). The gate/up bias, the clamped SwiGLU and the dtype
        rules are the gathered path's, applied to the same rows (elementwise,
        so the row order changes nothing), and the combine with the routing
        weights is the caller's, unchanged.

        ONE HOST SYNC PER CALL (per MoE layer of a prefill): the per-expert
        row counts are read to the host to cut the blocks (the graph up to
        this layer's router is evaluated there). Never used inside
        mx.compile (decode steps are [B, 1]: `use_grouped` keeps them
        gathered). Under tensor parallelism the routing is replicated, so
        every rank reads the same counts and runs the same matmuls on its
        slice of the experts. (MLX 0.32.4 CUDA's `gather_mm(...,
        sorted_indices=True)`, mlx-lm's way to do this in one kernel, gives
        wrong results on the H200: benchmarks/gather_check.py.)"""
        N, k = indices.shape
        R, E = N * k, self.num_experts
        flat = indices.flatten()
        key_dtype = mx.uint32 if E * R < 2**32 else mx.uint64
        key = flat.astype(key_dtype) * R + mx.arange(R, dtype=key_dtype)  # unique: any sort is stable
        order = mx.argsort(key)
        inv_order = mx.argsort(order)
        counts = (flat[:, None] == mx.arange(E, dtype=flat.dtype)).sum(axis=0)  # [E] rows per expert
        counts = counts.tolist()  # the host sync (see above)
        ids = flat[order]  # [R] expert of each sorted row
        xs = x[order // k]  # [R, hidden]: the token of each sorted row
        blocks, start = [], 0
        for e, n in enumerate(counts):
            if n:
                blocks.append((e, start, start + n))
                start += n
        gu = mx.concatenate([dense_mm(xs[a:b], self.gate_up_proj[e]) for e, a, b in blocks])  # [R, 2I]
        gu = gu + self.gate_up_proj_bias[ids]
        h = clamped_swiglu(gu, self.alpha, self.limit)  # [R, I]
        out = mx.concatenate([dense_mm(h[a:b], self.down_proj[e]) for e, a, b in blocks])  # [R, hidden]
        return out[inv_order].reshape(N, k, -1)


# (token, expert) rows from which a prefill's experts run grouped by expert
# (`Experts._grouped`: dense matmuls per expert, one host sync per MoE layer)
# instead of gathered (`gather_mm`, one matrix-vector product per row on the
# GPU). None: always gathered. Decode steps (one token per sequence, run
# inside mx.compile) stay gathered whatever this is (`use_grouped`).
GROUP_ROWS = 64


def use_grouped(rows: int, seq_len: int) -> bool:
    """Whether an MoE block over `rows` (token, expert) rows of sequences of
    `seq_len` tokens runs grouped: prefill (seq_len > 1) from GROUP_ROWS
    rows. A decode step ([B, 1], possibly many rows in a batch) never does:
    it runs inside mx.compile, where the grouped path's host read of the
    per-expert counts is impossible."""
    return GROUP_ROWS is not None and seq_len > 1 and rows >= GROUP_ROWS


class MoE(nn.Module):
    """transformers' GptOssMLP: router -> top-k -> softmax over the k -> experts."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.router = nn.Linear(args.hidden_size, args.num_local_experts, bias=True)
        self.experts = Experts(
            args.num_local_experts, args.hidden_size, args.intermediate_size, args.swiglu_alpha, args.swiglu_limit
        )

    def __call__(self, x):
        B, L, D = x.shape
        x = x.reshape(B * L, D)  # [N, hidden]
        logits = self.router(x)  # [N, E]
        k = self.top_k
        # The k largest logits (their order does not matter: the softmax and
        # the sum over experts are order-free).
        idx = mx.argpartition(-logits, kth=k - 1, axis=-1)[:, :k]  # [N, k]
        top = mx.take_along_axis(logits, idx, axis=-1)
        w = mx.softmax(top.astype(mx.float32), axis=-1).astype(logits.dtype)  # [N, k]
        return self.experts(x, idx, w, grouped=use_grouped(idx.size, L)).reshape(B, L, D)


class DecoderLayer(PreNormBlock):
    def __init__(self, args: ModelArgs, layer_idx: int):
        kind = args.layer_types[layer_idx]
        self_attn = Attention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            scale=args.head_dim**-0.5,
            window=args.sliding_window if kind == SLIDING else None,
            rope=RoPE(args.head_dim, args.rope, args.max_position_embeddings),
            bias=args.attention_bias,
            sinks=True,
        )
        mlp = MoE(args)
        super().__init__(self_attn, mlp, args.hidden_size, lambda d: RMSNormFP32Scale(d, args.rms_norm_eps))


class GptOssModel(DecoderStack):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNormFP32Scale(args.hidden_size, args.rms_norm_eps)


class Model(CausalLM):
    pipeline_stages = True  # a DecoderStack of independent layers: runs in --pp stages (pipeline.py)

    split_decode = True  # the engine's one-row step (decode.SplitSegments) may run its layers' pre/attend/post split

    def __init__(self, args: ModelArgs):
        super().__init__(args, GptOssModel(args))

    def load_weights(self, file_or_weights, strict: bool = True):
        """nn.Module's (strict names and shapes as given), then each layer's
        experts in mlx-lm's memory layout (`Experts.relayout`: the same
        parameter names, shapes and values), one layer at a time so that
        the old and new copies of one layer only are alive together."""
        super().load_weights(file_or_weights, strict=strict)
        for layer in self.layers:
            layer.mlp.experts.relayout()
            mx.eval(layer.mlp.experts.parameters())
        return self

    def describe_layers(self) -> list[str]:
        a = self.args
        moe = f", moe {a.num_local_experts} experts top-{a.num_experts_per_tok}, attention sinks"
        return [line + moe for line in describe_layers(self)]

    def sanitize(self, weights: dict) -> dict:
        """Refuse MXFP4 expert tensors; drop a stored copy of a tied head."""
        quantized = sorted(n for n in weights if n.endswith(("_blocks", "_scales")))
        if quantized:
            raise UserError(
                f"gpt_oss: MXFP4-quantized checkpoints are not supported yet (found {quantized[0]}); "
                "use a dequantized (bf16/fp32) checkpoint"
            )
        return super().sanitize(weights)

    def shard(self, group):
        for layer in self.layers:
            shard_attention(layer.self_attn, group)
            shard_moe(layer.mlp, group)
        self.shard_head(group)

    def collectives_per_token(self) -> dict:
        """The usual ones plus, per sharded MoE block, the experts' partial
        sums ([1, hidden] in the experts' dtype)."""
        plan = super().collectives_per_token()
        calls, nbytes = plan["all_sum"]
        for layer in self.layers:
            ex = layer.mlp.experts
            if not ex.group.single:
                calls += 1
                nbytes += ex.down_proj.shape[-1] * ex.down_proj.dtype.size
        return {**plan, "all_sum": (calls, nbytes)}
