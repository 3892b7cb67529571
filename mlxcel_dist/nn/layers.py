"""Small building blocks shared by model files (norms, activations).

Norms compute in float32 and cast back, as the reference does, so bf16
checkpoints round at the same points. mx.fast's norms return the promoted
dtype of input and weight, so a bf16 input is passed as is with an fp32
weight: mx.fast casts it to fp32 itself (an AsType node in mlx/fast.cpp: on
a GPU a kernel of its own unless mx.compile fuses it with its neighbours, as
in the decode steps; docs/benchmarks-log.md counts them in prefill). Gemma's
1 + w (fp32) is computed once per weight array, not per call (it is not a
parameter: the name starts with _).
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import mlx.nn as nn


def joinable_params(layers: list, types: tuple) -> tuple | None:
    """The parameter names that one matmul over `layers` concatenates, or None
    when they cannot run as one: all the same type, one of `types`, the same
    dtypes, bias on all or none, for quantized the same bits / group size /
    mode and scale biases on all or none."""
    if any(l is None for l in layers):
        return None
    t = type(layers[0])
    if t not in types or any(type(l) is not t for l in layers[1:]):
        return None
    has_bias = "bias" in layers[0]
    if any(("bias" in l) != has_bias for l in layers):
        return None
    names = ["weight"]
    if "scales" in layers[0]:  # quantized
        q = lambda l: (l.bits, l.group_size, l.mode, l.get("biases") is not None)  # noqa: E731
        if any(q(l) != q(layers[0]) for l in layers[1:]):
            return None
        names += ["scales"] + ["biases"] * (layers[0].get("biases") is not None)
    names += ["bias"] * has_bias
    for n in names:
        if any(l[n].dtype != layers[0][n].dtype or l[n].ndim != layers[0][n].ndim for l in layers):
            return None
    return tuple(names)


def joined_rows(module: nn.Module, layers: list, key: str, params_of, axis: int = 0):
    """The arrays of `layers` (same-shaped projections of one input) joined
    along their output rows `axis`, for one matmul: (joined arrays, rows of
    each layer, parameter names), or None when `params_of(layers)` (the names
    to join) says they cannot be.

    Memory does not double: the concatenation is built once (and evaluated)
    and stored under `key` (an underscore name, never a parameter); each
    layer's own parameters are then replaced by row slices of it (views of
    the same buffer), so parameter names and shapes stay the checkpoint's and
    the separate buffers are freed. Built on first use, so after sharding
    (per-rank shapes); rebuilt when any source array is replaced (a second
    load, shard() after a forward), as `_fp32_weight` does: the cache
    remembers the arrays it made the views into."""
    cached = module.get(key)
    if cached is not None:
        srcs, fused, rows, params, layers0 = cached
        if all(a is b for a, b in zip(layers, layers0)) and all(
            l[p] is s for l, ls in zip(layers, srcs) for p, s in zip(params, ls)
        ):
            return fused, rows, params
        module[key] = None  # stale: drop the old buffer before building anew
    params = params_of(layers)
    if params is None:
        return None
    fused = tuple(mx.concatenate([l[p] for l in layers], axis=axis) for p in params)
    rows = tuple(l["weight"].shape[axis] for l in layers)
    srcs, start, lead = [], 0, (slice(None),) * axis
    for l, r in zip(layers, rows):
        views = tuple(f[lead + (slice(start, start + r),)] for f in fused)
        for p, v in zip(params, views):
            l[p] = v
        srcs.append(views)
        start += r
    mx.eval(fused, srcs)  # the views now share the fused buffers; the old ones are free
    module[key] = (tuple(srcs), fused, rows, params, tuple(layers))
    return fused, rows, params


def _fp32_weight(module: nn.Module, plus_one: bool = False, name: str = "weight") -> mx.array:
    """The module's weight in fp32 (1 + w for Gemma), computed once per weight
    array rather than as two extra kernels per call. Cached under a name that
    starts with "_", which MLX never counts as a parameter."""
    w = module[name]
    key = f"_{name}_fp32"
    cached = module.get(key)
    if cached is None or module.get(f"_{name}_src") is not w:
        cached = w.astype(mx.float32)
        if plus_one:
            cached = 1.0 + cached
        module[key] = cached
        module[f"_{name}_src"] = w
    return cached


class RMSNorm(nn.Module):
    """Llama-style: normalise in fp32, cast to the input dtype, then scale by w
    (fp32: exactly that; half: one kernel that rounds w * x_hat once, as
    mlx-lm, instead of the reference's two roundings)."""

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        if x.dtype != mx.float32 and x.dtype == self.weight.dtype:
            # half: one fused kernel, w * x_hat rounded once (the reference
            # rounds x_hat, then the product: within half a unit of it)
            return mx.fast.rms_norm(x, self.weight, self.eps)
        y = mx.fast.rms_norm(x, None, self.eps)  # fp32 inside, rounded once to x's dtype
        return self.weight * y


class GemmaRMSNorm(nn.Module):
    """Gemma-style: scale by (1 + w), all in fp32, then cast to the input dtype."""

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, _fp32_weight(self, plus_one=True), self.eps).astype(x.dtype)


@mx.compile
def gelu_tanh(x: mx.array) -> mx.array:
    """transformers' gelu_pytorch_tanh / gelu_new (compiled: one fused kernel
    instead of eight; the same ops in the same dtype)."""
    return 0.5 * x * (1.0 + mx.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


ACTIVATIONS = {
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_new": gelu_tanh,
    "gelu": nn.gelu,
    "silu": nn.silu,
    "swish": nn.silu,
}


@functools.lru_cache(maxsize=None)
def gated_fp32(act):
    """act(g) * u with the activation in fp32, rounded once to u's dtype, as
    torch's kernels do for half inputs; compiled into one kernel (the casts,
    the activation and the product are all elementwise)."""

    @mx.compile
    def f(g: mx.array, u: mx.array) -> mx.array:
        return act(g.astype(mx.float32)).astype(u.dtype) * u

    return f


def activation(name: str):
    from ..errors import UserError

    if name not in ACTIVATIONS:
        raise UserError(f"unsupported activation {name!r} (supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


class RMSNormFP32Scale(nn.Module):
    """OLMo-2/3 style: normalise and scale by w in fp32, then cast
    ((w * x_hat).to(dtype), unlike Llama's w * x_hat.to(dtype))."""

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, _fp32_weight(self), self.eps).astype(x.dtype)


class LayerNorm(nn.Module):
    """Mean/variance LayerNorm in fp32, then cast; `bias=False` gives cohere's
    weight-only form."""

    def __init__(self, dims: int, eps: float = 1e-5, bias: bool = False):
        super().__init__()
        self.weight = mx.ones((dims,))
        if bias:
            self.bias = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        b = _fp32_weight(self, name="bias") if "bias" in self else None
        return mx.fast.layer_norm(x, _fp32_weight(self), b, self.eps).astype(x.dtype)
