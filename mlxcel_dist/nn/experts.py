"""Stacked routed experts that run only the chosen experts (mlx-lm's
`switch_mlp` layout): the one implementation every MoE family with stacked
experts uses (qwen3_moe, glm4_moe, deepseek_v3, minimax_m2, llama4, step3p5,
gemma4, diffusion_gemma).

`SwitchLinear` is one projection of every expert, `weight` [E, out, in]
(`QuantizedSwitchLinear` once quantized: the packed [E, out, in * bits / 32]
weight and [E, out, in / group_size] scales / biases, exactly what
mlx_lm.convert writes). `SwitchGLU` holds gate_proj / up_proj [E, I, hidden]
(or, `fused`, transformers' `gate_up_proj` [E, 2I, hidden]: gate rows then up
rows) and down_proj [E, hidden, I]. Each (token, chosen expert) row is
multiplied by its expert's weights with `mx.gather_mm` / `mx.gather_qmm`:
static shapes, so decode steps compile. How the k outputs are combined is
the family's reference's (`combine`), so logits round as it rounds.

Checkpoints with one key per expert (`mlp.experts.N.gate_proj.weight`, what
transformers' save_pretrained writes for qwen3_moe / glm4_moe) are stacked
lazily by `stack_expert_refs` in a family's sanitize: a `StackedRef` reads
only the experts (axis 0) or the intermediate slice (axis 1 / 2) a rank needs.

Placement (`shard.shard_switch_glu`, `--moe-split`): "intermediate" slices
every expert's I; "experts" gives rank r the whole experts [e0, e1)
(`expert_range`): routed rows of experts elsewhere get weight zero and a
clamped local index, so shapes stay static and the one all_sum of the block
adds the ranks' disjoint contributions.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..parallel.collectives import SINGLE
from .layers import activation, gated_fp32, joinable_params, joined_rows
from ..checkpoint.weights import JoinedRef


# (token, expert) rows from which a prefill runs grouped by expert (`SwitchGLU._grouped`:
# dense matmuls per expert block, one host sync per MoE layer) instead of gathered
# (one matrix-vector product per row, re-reading the expert's weights per row on a GPU).
# None: always gathered. Decode steps (inside mx.compile) always gather (`use_grouped`).
GROUP_ROWS = 64
# How such a prefill runs, by whether the experts are quantized: "grouped" (`SwitchGLU._grouped`),
# "sorted" (`SwitchGLU._sorted`: gathered on rows sorted by expert, no host sync), "gather" (as a
# decode step) or "by rows" (`prefill_form`). MLX CUDA's gather_mm does one matrix-vector product
# per row (gpt_oss 0.09x), so unquantized experts group; its gather_qmm runs gathered rows as one
# tiled product (and ignores sorted_indices): there quantized experts gather a short prefill and
# group a long one.
PREFILL = {True: "by rows", False: "grouped"}
# Quantized experts on a CUDA GPU group from this many (token, expert) rows per expert on
# average (a whole 2,048-token chunk at top-8 of 128 experts); below it, and on other devices,
# they gather. On one H200 (MLX 0.32.4, issue 42's 4-bit qwen3_moe shape), one forward of a
# prompt not seen before: 1,024 tokens 265 ms gathered, 295-321 grouped; 2,048 525 / 328-406;
# 4,096 1,045 / 465-525 (a prompt seen before flatters grouped: its blocks' sizes repeat and
# MLX CUDA reuses the graphs it built for them). End to end a 2,047-token chunk only tied.
QUANT_GROUP_PER_EXPERT = 128
# MLX CUDA's quantized matmul JIT-compiles one kernel per row tile (16, 32 or 64: the next
# power of two of the rows, clamped), each 30-40 s on a fresh machine. Gathered prefill and
# decode use the 16- and 64-row ones; a grouped expert block of 17-32 rows would add the
# 32-row one (a 4,096-token prompt's first run: 149-157 s grouped against 109-110 gathered
# and mlx-lm's 111, one H200): such blocks run padded to this many rows (the 64-row tile).
QUANT_PAD_ROWS = (17, 32, 33)  # (from, to, padded to)


# Separate gate_proj / up_proj stacks run as one gather on their joined rows
# (`SwitchGLU._joined_gate_up`); off: two gathers (tests compare both).
FUSE_GATE_UP = True


def _joinable(layers: list):
    return joinable_params(layers, (SwitchLinear, QuantizedSwitchLinear))


def top_k(scores: mx.array, k: int, ascending: bool = False) -> mx.array:
    """The indices [N, k] of each row's k largest scores [N, E] (no negation:
    one kernel fewer than argpartition(-scores)); `ascending`: sorted by
    expert id, the order SwitchGLU's "index_add" combine adds in (it then
    skips its own argsort and the two gathers that apply it), else in no order."""
    idx = mx.argpartition(scores, kth=-k, axis=-1)[..., -k:]
    return mx.sort(idx, axis=-1) if ascending else idx


def softmax_top_k(logits: mx.array, k: int, renormalise: bool, ascending: bool = False) -> tuple[mx.array, mx.array]:
    """The softmax router's choice: logits [N, E] -> (indices [N, k], their
    fp32 probabilities [N, k], renormalised to sum 1 when asked). The k are
    in ascending expert order when asked (`top_k`), else in no order."""
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    idx = top_k(probs, k, ascending)
    w = mx.take_along_axis(probs, idx, axis=-1)
    return idx, (w / w.sum(axis=-1, keepdims=True) if renormalise else w)


def on_cuda() -> bool:
    cuda = getattr(mx, "cuda", None)  # (a build without CUDA may lack the module)
    return mx.default_device() == mx.gpu and cuda is not None and cuda.is_available()


def prefill_form(quantized: bool, rows: int, num_experts: int) -> str:
    """How a grouped-eligible block of `rows` (token, expert) rows over
    `num_experts` experts runs (`PREFILL`): "grouped", "sorted" or "gather"."""
    form = PREFILL[quantized]
    if form != "by rows":
        return form
    return "grouped" if on_cuda() and rows >= QUANT_GROUP_PER_EXPERT * num_experts else "gather"


def block_rows(n: int, pad: bool) -> int:
    """The rows a grouped expert block of `n` rows runs as; `pad` (quantized
    experts on a CUDA GPU): padded where MLX CUDA would compile a quantized
    kernel for its size alone (`QUANT_PAD_ROWS`)."""
    lo, hi, to = QUANT_PAD_ROWS
    return to if pad and lo <= n <= hi else n


def use_grouped(rows: int, seq_len: int) -> bool:
    """A block over `rows` (token, expert) rows of `seq_len`-token sequences
    runs grouped: prefill (seq_len > 1) from GROUP_ROWS rows; never a [B, 1]
    decode step (compiled: no host read of the per-expert counts there)."""
    return GROUP_ROWS is not None and seq_len > 1 and rows >= GROUP_ROWS


class SoftmaxMoE(nn.Module):
    """Stacked routed experts (`SwitchGLU`) behind a softmax top-k router
    (`gate`), summed over `group` once (shard_switch_glu splits them):
    qwen3_moe's block; deltanet.SharedExpertMoE adds a shared expert."""

    def __init__(self, args, norm_topk_prob: bool):
        super().__init__()
        self.top_k, self.norm_topk_prob = args.num_experts_per_tok, norm_topk_prob
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.num_experts,
                                    gated_fp32(activation(args.hidden_act)))
        self.group = SINGLE  # the job's group once the experts are split (shard)

    def route(self, x):
        """x [N, hidden] -> (indices [N, k] ascending, weights [N, k] in x's dtype)."""
        logits = self.gate(x)  # [N, E], hidden dtype as the reference
        idx, w = softmax_top_k(logits, self.top_k, self.norm_topk_prob, ascending=True)  # index_add's order
        return idx, w.astype(logits.dtype)

    def routed(self, flat, L: int):
        """The routed experts' output for rows `flat` [N, hidden] of L-token sequences (this rank's part)."""
        idx, w = self.route(flat)
        return self.switch_mlp(flat, idx, w, grouped=use_grouped(idx.size, L), ascending=True)

    def __call__(self, x):
        B, L, D = x.shape
        return self.group.all_sum(self.routed(x.reshape(B * L, D), L)).reshape(B, L, D)


def _dense(x: mx.array, layer: nn.Module, e: int) -> mx.array:
    """x [R, in] @ expert e's [out, in].T of a (Quantized)SwitchLinear, with
    the gathered path's dtype rule (half on the CPU: fp32 products, rounded once)."""
    if isinstance(layer, QuantizedSwitchLinear):
        b = layer.get("biases")
        return mx.quantized_matmul(x, layer["weight"][e], layer["scales"][e], None if b is None else b[e],
                                   transpose=True, group_size=layer.group_size, bits=layer.bits, mode=layer.mode)
    w = layer.weight[e]
    if x.dtype == mx.float32 or mx.default_device() == mx.gpu:
        return x @ w.T
    return (x.astype(mx.float32) @ w.T.astype(mx.float32)).astype(x.dtype)


def gather_mm(x: mx.array, w: mx.array, idx: mx.array) -> mx.array:
    """x [..., 1, in] @ w[idx].T for w [E, out, in] -> [..., 1, out]. Half
    inputs on the CPU (MLX's CPU gather_mm is fp32-only) multiply in fp32 and
    round once (torch's half matmul: fp32 accumulation): only the chosen
    experts are upcast when they are fewer than E (a decode step), not the
    whole stack."""
    wt = w.swapaxes(-1, -2)  # [E, in, out]
    if x.dtype == mx.float32 or mx.default_device() == mx.gpu:
        return mx.gather_mm(x, wt, rhs_indices=idx)
    x32 = x.astype(mx.float32)
    if idx.size < w.shape[0]:
        return (x32 @ wt[idx].astype(mx.float32)).astype(x.dtype)  # [..., k, in, out] gathered first
    return mx.gather_mm(x32, wt.astype(mx.float32), rhs_indices=idx).astype(x.dtype)


class SwitchLinear(nn.Module):
    """One projection of every expert: weight [E, out, in]."""

    def __init__(self, num_experts: int, in_dims: int, out_dims: int):
        super().__init__()
        self.weight = mx.zeros((num_experts, out_dims, in_dims))

    @classmethod
    def of(cls, weight: mx.array) -> "SwitchLinear":
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.weight = weight
        return layer

    def __call__(self, x, idx, sorted_indices: bool = False):
        return gather_mm(x, self.weight, idx)  # (never sorted_indices: MLX 0.32.4 CUDA's is wrong)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine", **_):
        """nn.quantize's hook: these weights quantized (at load, before any is
        read, a lazy placeholder the loader then replaces; in `convert`, the
        loaded ones)."""
        return QuantizedSwitchLinear.from_weight(self.weight, group_size, bits, mode)


class QuantizedSwitchLinear(nn.Module):
    """SwitchLinear MLX-quantized: weight uint32 [E, out, in * bits / 32],
    scales (and affine biases) [E, out, in / group_size]."""

    def __init__(self, num_experts: int, in_dims: int, out_dims: int, group_size: int, bits: int, mode: str):
        super().__init__()
        self._set(mx.zeros((num_experts, out_dims, in_dims)), group_size, bits, mode)

    @classmethod
    def from_weight(cls, weight: mx.array, group_size: int, bits: int, mode: str) -> "QuantizedSwitchLinear":
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._set(weight, group_size, bits, mode)
        return layer

    @classmethod
    def of(cls, weight, scales, biases, group_size: int, bits: int, mode: str) -> "QuantizedSwitchLinear":
        """Around arrays already quantized."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.group_size, layer.bits, layer.mode = group_size, bits, mode
        layer.weight, layer.scales, layer.biases = weight, scales, biases
        return layer

    def _set(self, weight, group_size: int, bits: int, mode: str) -> None:
        self.group_size, self.bits, self.mode = group_size, bits, mode
        w, *sb = mx.quantize(weight, group_size, bits, mode=mode)
        self.weight, self.scales = w, sb[0]
        self.biases = sb[1] if len(sb) > 1 else None

    def __call__(self, x, idx, sorted_indices: bool = False):
        return mx.gather_qmm(x, self["weight"], self["scales"], self.get("biases"), rhs_indices=idx, transpose=True,
                             group_size=self.group_size, bits=self.bits, mode=self.mode, sorted_indices=sorted_indices)


# How a token's k expert outputs become one, as each family's reference does it:
# "index_add": each output times its weight (promoted as torch does), rounded to x's
#   dtype, added in ascending expert order (transformers' index_add over the experts hit);
# "sum": each output times its (fp32) weight in fp32, rounded to x's dtype, summed in
#   routed order (a sum over the k axis);
# "inputs": the inputs scaled by the weights (x's dtype) before the experts, the
#   outputs summed (llama4).
COMBINES = ("index_add", "sum", "inputs")


class SwitchGLU(nn.Module):
    """Routed gated experts over stacked weights: out = sum_k w_k *
    down_e(glu(gate_e x, up_e x)). `glu(gate, up)` is the gated activation
    (e.g. layers.gated_fp32(silu)); `fused`: one `gate_up_proj` [E, 2I, hidden]
    (gate rows, then up rows) instead of gate_proj / up_proj; `combine`: one
    of COMBINES. `expert_range` (e0, e1): the experts this rank holds under
    expert placement (None: all, each possibly an intermediate slice)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, glu, fused: bool = False,
                 combine: str = "index_add"):
        super().__init__()
        if combine not in COMBINES:
            raise ValueError(f"combine must be one of {COMBINES}, got {combine!r}")
        self.num_experts, self.fused, self.combine = num_experts, fused, combine
        if fused:
            self.gate_up_proj = SwitchLinear(num_experts, hidden_size, 2 * intermediate_size)
        else:
            self.gate_proj = SwitchLinear(num_experts, hidden_size, intermediate_size)
            self.up_proj = SwitchLinear(num_experts, hidden_size, intermediate_size)
        self.down_proj = SwitchLinear(num_experts, intermediate_size, hidden_size)
        self.glu = glu
        self.expert_range = None

    def _hidden(self, x, proj):
        """glu of the gate and up projections; `proj(layer, x)` applies one."""
        gate_up = self.gate_up_proj if self.fused else self._joined_gate_up()
        if gate_up is not None:
            gu = proj(gate_up, x)  # [..., 2I]
            half = gu.shape[-1] // 2
            return self.glu(gu[..., :half], gu[..., half:])
        return self.glu(proj(self.gate_proj, x), proj(self.up_proj, x))

    def _joined_gate_up(self):
        """gate_proj and up_proj as one stack [E, 2I, in] (`layers.joined_rows`
        along axis 1: the HF-named stacks become views of it), so the two run
        as one gather: a GatherQMM (and the copy of its broadcast row indices
        MLX CUDA makes) fewer per MoE layer; None when FUSE_GATE_UP is off or
        they differ in kind."""
        if not FUSE_GATE_UP:
            return None
        got = joined_rows(self, [self.get("gate_proj"), self.get("up_proj")], "_gate_up", _joinable, axis=1)
        if got is None:
            return None
        arrays, _, params = got
        p = dict(zip(params, arrays))
        if "scales" not in p:
            return SwitchLinear.of(p["weight"])
        g = self.gate_proj
        return QuantizedSwitchLinear.of(p["weight"], p["scales"], p.get("biases"), g.group_size, g.bits, g.mode)

    def __call__(self, x, idx, w, grouped: bool = False, ascending: bool = False):
        """x [N, hidden], idx [N, k] (global expert ids), w [N, k] -> [N, hidden],
        combined as `combine` says. `grouped` (a prefill, `use_grouped`): the
        rows run as `prefill_form` says for these experts (unquantized: per
        expert block, `_grouped`, skipping the experts this rank does not
        hold; quantized: so from enough rows an expert on a CUDA GPU, else
        gathered). `ascending`: idx is already in ascending expert
        order per row (`top_k(..., ascending=True)`)."""
        if self.combine == "index_add" and not ascending:
            order = mx.argsort(idx, axis=-1)
            idx, w = mx.take_along_axis(idx, order, axis=-1), mx.take_along_axis(w, order, axis=-1)
        scale = w if self.combine == "inputs" else None
        quantized = isinstance(self.down_proj, QuantizedSwitchLinear)
        mode = prefill_form(quantized, idx.size, self.num_experts) if grouped else "gather"
        if mode == "grouped":
            out = self._grouped(x, idx, scale)
        else:
            local = idx
            if self.expert_range is not None:
                e0, e1 = self.expert_range
                w = mx.where((idx >= e0) & (idx < e1), w, mx.zeros_like(w))  # another rank's expert: 0 here
                local = mx.clip(idx - e0, 0, e1 - e0 - 1)
            if self.combine == "inputs":  # (another rank's expert: zero inputs, so exactly zero out: glu(0, 0) = 0)
                xe = (x[:, None, :] * w[..., None])[:, :, None, :]  # [N, k, 1, hidden]: the scaled inputs
            else:
                xe = x[:, None, None, :]  # [N, 1, 1, hidden]: one row per (token, chosen expert)
            out = self._sorted(xe, local) if mode == "sorted" else self._gathered(xe, local)
        if self.combine == "inputs":
            return out.sum(axis=1)  # the reference sums every expert's output (exact zeros off the k)
        if self.combine == "sum":
            return (out.astype(mx.float32) * w[..., None]).astype(x.dtype).sum(axis=1)
        # expert output times its weight (promoted as torch does), rounded to x's dtype, added
        # in ascending expert order (one split: a view primitive, not k slices)
        y, *rest = mx.split((out * w[..., None]).astype(x.dtype), out.shape[1], axis=1)
        for part in rest:
            y = y + part
        return y.squeeze(1)

    def _gathered(self, xe, idx):
        """xe [N, 1 or k, 1, hidden] through each row's expert idx [N, k] -> [N, k, hidden]."""
        h = self._hidden(xe, lambda layer, v: layer(v, idx))  # [N, k, 1, I]
        return self.down_proj(h, idx).squeeze(-2)

    def _sorted(self, xe, idx):
        """`_gathered` with the N*k rows sorted by expert first (mlx-lm's
        `_gather_sort`: neighbouring rows read the same expert's weights) and
        put back after; no host sync. Quantized experts only: MLX 0.32.4 CUDA's
        gather_mm with sorted_indices is wrong (benchmarks/gather_check.py),
        its gather_qmm ignores the flag."""
        N, k = idx.shape
        flat = idx.flatten()
        order = mx.argsort(flat)
        rows = xe.reshape(-1, 1, xe.shape[-1])  # [N or N*k, 1, hidden]
        xs = rows[order // k] if xe.shape[1] == 1 else rows[order]
        ids = flat[order]
        h = self._hidden(xs, lambda layer, v: layer(v, ids, sorted_indices=True))  # [R, 1, I]
        out = self.down_proj(h, ids, sorted_indices=True)  # [R, 1, hidden]
        return out[mx.argsort(order)].reshape(N, k, -1)

    def _grouped(self, x, idx, scale=None):
        """The gathered products with the N*k (token, expert) rows sorted by
        expert: each expert's block through dense matmuls (its weights read
        once per block), rows of experts held elsewhere left zero, then back
        in token order: [N, k, hidden]; `scale` [N, k]: each row's input
        scaled first ("inputs"). ONE HOST SYNC per call (the per-expert row
        counts cut the blocks); routing is replicated, so every rank reads
        the same counts."""
        N, k = idx.shape
        R, E = N * k, self.num_experts
        flat = idx.flatten()
        key = flat.astype(mx.uint32 if E * R < 2**32 else mx.uint64) * R + mx.arange(R)  # unique: a stable sort
        order = mx.argsort(key)
        counts = (flat[:, None] == mx.arange(E, dtype=flat.dtype)).sum(axis=0).tolist()  # the host sync
        xs = x[order // k]  # [R, hidden]: the token of each sorted row
        if scale is not None:
            xs = xs * scale.flatten()[order][:, None]
        e0, e1 = self.expert_range or (0, E)
        pad = isinstance(self.down_proj, QuantizedSwitchLinear) and on_cuda()
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n and e0 <= e < e1:
                v, m = xs[start : start + n], block_rows(n, pad)
                if m > n:  # zero rows: each row's product is its own
                    v = mx.concatenate([v, mx.zeros((m - n, v.shape[-1]), v.dtype)])
                h = self._hidden(v, lambda layer, u: _dense(u, layer, e - e0))  # [m, I]
                outs.append(_dense(h, self.down_proj, e - e0)[:n])  # [n, hidden]
            elif n:
                outs.append(mx.zeros((n, x.shape[-1]), x.dtype))  # another rank's expert
            start += n
        return mx.concatenate(outs)[mx.argsort(order)].reshape(N, k, -1)

    def describe(self) -> str:
        return "" if self.expert_range is None else f" (experts {self.expert_range[0]}-{self.expert_range[1] - 1} here)"


class StackedRef(JoinedRef):
    """Per-expert checkpoint tensors [out, in] read as one [E, out, in]
    tensor (weights.JoinedRef, stacked: a TensorRef's interface), so a rank
    reads only its experts or its slice of each."""

    def __init__(self, refs: list):
        super().__init__(refs, stack=True)


def stack_expert_refs(weights: dict, num_experts: int, src: str = ".mlp.experts.", dst: str = ".mlp.switch_mlp.") -> dict:
    """sanitize helper: `<layer>{src}N.<proj>.<param>` for N in 0..E-1 becomes
    `<layer>{dst}<proj>.<param>`, a StackedRef (None when the values are None:
    names only). Other names pass through; a layer storing some experts but not
    all keeps its per-expert names (the strict load then names them)."""
    groups, out = {}, {}
    for name, ref in weights.items():
        head, sep, tail = name.partition(src)
        expert, _, rest = tail.partition(".")
        if sep and expert.isdigit() and rest:
            groups.setdefault((head, rest), {})[int(expert)] = (name, ref)
        else:
            out[name] = ref
    for (head, rest), by_expert in groups.items():
        if sorted(by_expert) != list(range(num_experts)):
            out.update(dict(by_expert.values()))
            continue
        refs = [by_expert[e][1] for e in range(num_experts)]
        out[f"{head}{dst}{rest}"] = None if refs[0] is None else StackedRef(refs)
    return out
