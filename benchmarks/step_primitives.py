"""Primitives of one single-token decode step, per layer and by kind: ours
(the engine's split one-row step, and the whole-graph step) vs
mlx-lm's model on the same weights and config. CPU, tiny shapes, seconds.

    python benchmarks/step_primitives.py [--families llama,qwen3,mistral,gemma3,gpt_oss] [--dtype bfloat16]
                                         [--layers 2] [--unfused] [--json]

Why: MLX 0.32's CUDA backend spends ~7 us of host encode per primitive, and a
decode step is host-bound on an H200 (docs/benchmarks.md, issues 18 and 19),
so a step's primitive count is its cost there.

Method (what is counted, and how it is made honest on a CPU-only build):

- The step's lazy graph is built (never evaluated) and read back with
  `mx.export_to_dot`; each primitive application is counted once (a
  multi-output primitive is one kernel). Ours: the one-row step as the engine
  runs it, i.e. its compiled segments (`mx.compile`d: elementwise ops appear
  fused into one `Compiled` node each, as the GPU runs them) plus the eager
  attention calls between them ("split"), and the single compiled graph
  with masked attention ("whole"). mlx-lm: `model(y, cache)` for one token,
  eager as `generate_step` runs it (its `mx.compile`d helpers such as swiglu
  fused likewise). The KV caches hold `--prompt` tokens of zeros (no
  prefill is run: only shapes matter).
- mx.fast ops: on a CPU build `RMSNorm`/`LayerNorm`/`RoPE`/`ScaledDotProductAttention`
  always take their fallback (a decomposition into many primitives), while
  MLX CUDA runs one kernel each. So for the count, `mx.fast.rms_norm`,
  `layer_norm`, `rope` and `scaled_dot_product_attention` are replaced by
  stand-ins that build what mlx/fast.cpp builds on a GPU stream: the same
  input casts (`rms_norm` casts x and w to their promoted dtype first: an
  `AsType` node when they differ) and one opaque node (an `mx.depends`,
  which compile does not fuse) for the kernel. SDPA with an array mask
  keeps the real fallback (MLX CUDA takes no array mask in its fused
  kernels, so it runs that decomposition too); without one (or "causal")
  it is one fused node (cuDNN or the vector kernel on CUDA). The stand-ins
  are tallied by kind as they are built and shown by name (`fast.rms_norm`
  ...); the tally is checked against the graph's `Depends` nodes.
- gpt_oss on a CPU build takes the fp32 detour of `gpt_oss.gather_mm`
  (CPU gather_mm is fp32-only); the count forces the GPU branch
  (`gpt_oss.native_gather_mm`).
- Per layer = (count with 2L layers - count with L layers) / L; "fixed" =
  the rest (embedding, final norm, head, the step's own ops). Layer kinds
  alternate sliding / full where the family has both (period 2), so L even
  gives whole periods.
- "kernels" leaves out the pure view primitives (reshape, transpose,
  slice, broadcast, expand/squeeze, (un)flatten, as_strided, stop_gradient,
  depends' inputs are never views): on CUDA those launch nothing, but each
  is still a primitive the host evaluates. "CUDA launches (est.)" adds the
  kernels a primitive launches beyond its first where MLX 0.32's CUDA code
  is known to (`EXTRA_LAUNCHES`: DynamicSliceUpdate computes its offset in a
  kernel of its own, mlx/backend/gpu/primitives.cpp + cuda/slicing.cpp).
- SDPA "fused" follows MLX CUDA's graph-time rule for one query: no array
  mask and head_dim 64/96/128 (the vector kernel; cuDNN is chosen later, at
  eval). Other head dims (gemma3's 256) take the fallback on CUDA, mlx-lm's
  and ours alike: the stand-in then builds the real fallback too.

- Ours fuses q/k/v (blocks.Attention) and gate/up (blocks.MLP) into one
  matmul each (blocks.FUSE_PROJECTIONS): 3 kernels less per layer than
  separate projections (llama/mistral 17 -> 14, qwen3 19 -> 16, gemma3
  39 -> 36 in the split step, bfloat16). `--unfused` adds a column with
  the switch off.

What it does not see: copies a GPU kernel makes internally (e.g. a
non-contiguous input made contiguous inside RMSNorm's eval_gpu), kernel
durations, and whether a Compiled node is one CUDA kernel (it is, in MLX
0.32). It counts graphs, not time.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import os
import re
import sys

import mlx.core as mx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpu_compare as G  # noqa: E402  (configs, build_ours, build_mlx_lm)

VIEWS = {"Reshape", "Transpose", "Slice", "Squeeze", "ExpandDims", "Broadcast", "Flatten", "Unflatten",
         "AsStrided", "StopGradient", "Split"}
# primitives MLX CUDA runs as more than one kernel (0.32: DynamicSlice(Update)
# first computes its offset from the position array in a kernel of its own)
EXTRA_LAUNCHES = {"DynamicSliceUpdate": 1, "DynamicSlice": 1}
# tiny widths; each family keeps its real head_dim (it decides MLX CUDA's SDPA kernel)
TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab_size=1024)
FAMILY_NAMES = ["llama", "qwen3", "mistral", "gemma3", "gpt_oss"]
# MoE families counted with `--families qwen3_moe` (issue 42's shape at tiny widths: 128 experts top-8;
# decode routes 8 (token, expert) rows, under mlx-lm's sort threshold of 64)
MOE = {"qwen3_moe": dict(model_type="qwen3_moe", num_experts=128, num_experts_per_tok=8, moe_intermediate_size=128,
                         norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], head_dim=128,
                         rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         max_position_embeddings=4096, use_sliding_window=False, sliding_window=None)}


def tiny_config(family: str, n_layers: int) -> dict:
    """The family's gpu_compare config at tiny widths, n_layers layers
    (sliding/full alternating where the family has both)."""
    if family == "gemma3":
        cfg = G.config(dict(G.SMALL, **TINY, head_dim=G.GEMMA3_12B["head_dim"], num_hidden_layers=n_layers,
                            sliding_window=32))
        cfg["sliding_window_pattern"] = 2
        return cfg
    if family in MOE:
        return dict(MOE[family], **TINY, num_hidden_layers=n_layers)
    cfg = dict(G.FAMILIES[family], **TINY, num_hidden_layers=n_layers)
    if family == "gpt_oss":
        cfg.update(num_local_experts=8, num_experts_per_tok=4, experts_per_token=4, sliding_window=32,
                   intermediate_size=256, layer_types=["sliding_attention", "full_attention"] * (n_layers // 2))
    return cfg


# --------------------------------------------------------------------------- GPU-form stand-ins
class FastStandIns:
    """Replace mx.fast's fused ops by what MLX builds for them on a GPU stream:
    the same input casts, then one opaque node. Tallies the nodes by kind."""

    def __init__(self):
        self.tally = collections.Counter()
        self.orig = {}

    @staticmethod
    def _promoted(*arrays):
        out = mx.array(0, arrays[0].dtype)
        for a in arrays[1:]:
            out = out + mx.array(0, a.dtype)  # lazy, never evaluated or exported: only its dtype
        return out.dtype

    def _node(self, kind, main, deps):
        self.tally[kind] += 1
        deps = [d for d in deps if d is not None] or [mx.array(0, main.dtype)]
        return mx.depends([main], deps)[0]

    def rms_norm(self, x, weight, eps, *, stream=None):
        t = self._promoted(x, weight) if weight is not None else x.dtype
        w = weight.astype(t) if weight is not None else None
        return self._node("fast.rms_norm", x.astype(t), [w])

    def layer_norm(self, x, weight, bias, eps, *, stream=None):
        parts = [a for a in (x, weight, bias) if a is not None]
        t = self._promoted(*parts)
        return self._node("fast.layer_norm", x.astype(t),
                          [weight.astype(t) if weight is not None else None, bias.astype(t) if bias is not None else None])

    def rope(self, a, dims, *, traditional, base, scale, offset, freqs=None, stream=None):
        off = offset if isinstance(offset, mx.array) else None  # a Python int is a constant
        if off is not None and off.dtype.size != 4:
            off = off.astype(mx.int32)
        return self._node("fast.rope", a, [off, freqs.astype(mx.float32) if freqs is not None else None])

    def sdpa(self, q, k, v, *, scale, mask=None, sinks=None, stream=None, **kw):
        D, L = q.shape[-1], q.shape[2]
        vector_ok = D == v.shape[-1] and D in (64, 96, 128) and L < 4
        if isinstance(mask, mx.array) or (L == 1 and not vector_ok):
            # MLX CUDA: no fused kernel with an array mask, nor (decode, decided while the
            # graph is built) for a head_dim the vector kernel lacks -> the real fallback
            self.tally["sdpa fallback"] += 1
            return self.orig["scaled_dot_product_attention"](q, k, v, scale=scale, mask=mask, sinks=sinks, **kw)
        t = self._promoted(q, k, v)
        assert k.shape[-1] == v.shape[-1], "stand-in assumes Dv == D"
        s = sinks.astype(t) if sinks is not None else None
        return self._node("fast.sdpa", q.astype(t), [k.astype(t), v.astype(t), s])

    @contextlib.contextmanager
    def active(self):
        names = {"rms_norm": self.rms_norm, "layer_norm": self.layer_norm, "rope": self.rope,
                 "scaled_dot_product_attention": self.sdpa}
        for n, f in names.items():
            self.orig[n] = getattr(mx.fast, n)
            setattr(mx.fast, n, f)
        try:
            yield self
        finally:
            for n, f in self.orig.items():
                setattr(mx.fast, n, f)


# --------------------------------------------------------------------------- unfused projections
@contextlib.contextmanager
def unfused_projections():
    """For `--unfused`: blocks.FUSE_PROJECTIONS and experts.FUSE_GATE_UP off,
    i.e. q/k/v and gate/up as separate matmuls / gathers (the layout before
    the fused projections)."""
    from mlxcel_dist.nn import blocks, experts

    was = blocks.FUSE_PROJECTIONS, experts.FUSE_GATE_UP
    blocks.FUSE_PROJECTIONS = experts.FUSE_GATE_UP = False
    try:
        yield
    finally:
        blocks.FUSE_PROJECTIONS, experts.FUSE_GATE_UP = was


# --------------------------------------------------------------------------- counting
def count_graph(outputs, tally) -> collections.Counter:
    buf = io.StringIO()
    mx.export_to_dot(buf, outputs)
    # one node line per primitive application (export_to_dot visits a multi-output
    # primitive once; a compiled function called N times shares its primitive
    # objects between the calls, so ids repeat and are not deduplicated)
    nodes = re.findall(r'\{ \d+ \[label ="([^"]*)"', buf.getvalue())
    c = collections.Counter("Compiled" if n.startswith("Compiled") else n for n in nodes)
    deps = c.pop("Depends", 0)
    stand = sum(v for k, v in tally.items() if k.startswith("fast."))
    if deps != stand:
        raise RuntimeError(f"{deps} Depends nodes in the graph but {stand} stand-ins built (CSE or a real depends?)")
    for k, v in tally.items():
        if k.startswith("fast."):
            c[k] += v
    return c


def _zeros_kv(n_kv, P, D, dtype):
    return mx.zeros((1, n_kv, P, D), dtype), mx.zeros((1, n_kv, P, D), dtype)


def count_ours(cfg, weights_dtype, P, split, unfused=False):
    import numpy as np

    from mlxcel_dist.engine.batch import BatchEngine
    from mlxcel_dist.models import gpt_oss
    from mlxcel_dist.engine.prefill import Admission

    model, _ = build(cfg, weights_dtype)
    a = model.args
    cache = model.make_cache()
    for c in cache:
        c.update_and_fetch(*_zeros_kv(a.num_key_value_heads, P, a.head_dim, weights_dtype))
    mx.eval([c.state for c in cache])
    e = BatchEngine(model)  # the engine's one-row step, split or whole-graph
    if not split:
        e.split = False
    ids = np.ones(P + 1, np.int32)
    e._decide(ids[:1])
    e.place_prefilled(Admission("count", ids, P, None, 0, None, 2), cache)
    mx.eval(list(e.buffers.values()))  # the static buffers as a real step finds them
    gpt_oss_native = gpt_oss.native_gather_mm
    gpt_oss.native_gather_mm = lambda x: True  # what the GPU runs (CPU: an fp32 detour)
    try:
        with (unfused_projections() if unfused else contextlib.nullcontext()), FastStandIns().active() as fs:
            out = e.steps.forward_rows(mx.array([1], mx.int32))[1][0]
            return count_graph([out, *e.buffers.values()], fs.tally), e.splits(1)
    finally:
        gpt_oss.native_gather_mm = gpt_oss_native


def count_mlx_lm(cfg, weights_dtype, P):
    from mlx_lm.models.cache import make_prompt_cache

    ours, weights = build(cfg, weights_dtype)
    model = quantized(G.build_mlx_lm(cfg, weights))
    a = ours.args
    cache = make_prompt_cache(model)
    for c in cache:
        c.update_and_fetch(*_zeros_kv(a.num_key_value_heads, P, a.head_dim, weights_dtype))
    mx.eval([c.state for c in cache])
    with FastStandIns().active() as fs:
        out = model(mx.array([[1]]), cache)[0, -1]
        extra = [x for c in cache for x in (c.keys, c.values)]
        return count_graph([out, *extra], fs.tally)


_BUILT = {}
BITS = None  # --bits: both models nn.quantize'd (group 64), as mlx_lm.convert -q does


def quantized(model):
    if BITS is not None:
        import mlx.nn as nn

        nn.quantize(model, group_size=64, bits=BITS)
        mx.eval(model.parameters())
    return model


def build(cfg, dtype):
    key = (json.dumps(cfg, sort_keys=True), str(dtype))
    if key not in _BUILT:
        model, weights = G.build_ours(cfg)
        if dtype != mx.bfloat16:
            weights = [(n, w.astype(dtype)) for n, w in weights]
            model.load_weights(weights)
        quantized(model)
        _BUILT.clear()
        _BUILT[key] = (model, weights)
    return _BUILT[key]


def per_layer(counter_of, family, L):
    """(per-layer Counter, fixed Counter) from counts at L and 2L layers."""
    c1, c2 = counter_of(tiny_config(family, L)), counter_of(tiny_config(family, 2 * L))
    kinds = set(c1) | set(c2)
    layer = collections.Counter({k: (c2[k] - c1[k]) / L for k in kinds})
    fixed = collections.Counter({k: c1[k] - L * layer[k] for k in kinds})
    return +layer, +fixed


def summarize(family, dtype, P, L, unfused=False):
    cols = {}
    split_used = {}
    runs = [("ours split", True, False), ("ours whole", False, False)]
    if unfused:
        runs.append(("ours split, unfused q/k/v + gate/up", True, True))
    for name, split, unf in runs:
        def f(cfg, split=split, name=name, unf=unf):
            c, used = count_ours(cfg, dtype, P, split, unf)
            split_used[name] = used
            return c
        cols[name] = per_layer(f, family, L)
    try:
        cols["mlx-lm"] = per_layer(lambda cfg: count_mlx_lm(cfg, dtype, P), family, L)
    except Exception as e:  # noqa: BLE001 - still print ours
        print(f"# {family}: mlx-lm failed: {type(e).__name__}: {e}", file=sys.stderr)
    if not split_used.get("ours split"):
        print(f"# {family}: no split step (split_decode off): 'ours split' is the whole graph", file=sys.stderr)
    return cols


def fmt(x):
    return str(int(x)) if float(x).is_integer() else f"{x:.1f}"


def table(family, cols):
    names = list(cols)
    kinds = sorted(set().union(*[set(cols[n][0]) | set(cols[n][1]) for n in names]),
                   key=lambda k: (k in VIEWS, k))
    lines = [f"## {family}: primitives of one decode step, per layer (fixed part in brackets)",
             "| kind | " + " | ".join(names) + " |", "| --- |" + " ---: |" * len(names)]
    for k in kinds:
        cells = [f"{fmt(cols[n][0][k])} [{fmt(cols[n][1][k])}]" for n in names]
        lines.append(f"| {k}{' (view)' if k in VIEWS else ''} | " + " | ".join(cells) + " |")
    rows = (("all primitives", lambda k: 1),
            ("kernels (no views)", lambda k: k not in VIEWS),
            ("CUDA launches (est.)", lambda k: (k not in VIEWS) * (1 + EXTRA_LAUNCHES.get(k, 0))))
    for label, weight in rows:
        cells = []
        for n in names:
            lay, fix = cols[n]
            cells.append(f"**{fmt(sum(v * weight(k) for k, v in lay.items()))}** "
                         f"[{fmt(sum(v * weight(k) for k, v in fix.items()))}]")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=",".join(FAMILY_NAMES))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--prompt", type=int, default=40, help="tokens already in the cache (past the window of 32)")
    ap.add_argument("--layers", type=int, default=2, help="L: per layer = (count(2L) - count(L)) / L")
    ap.add_argument("--json", action="store_true", help="one JSON line per family instead of tables")
    ap.add_argument("--bits", type=int, default=None, help="quantize both models (group 64) to this many bits")
    ap.add_argument("--unfused", action="store_true",
                    help="also count the split step with blocks.FUSE_PROJECTIONS off (q/k/v, gate/up as separate matmuls)")
    a = ap.parse_args()
    mx.set_default_device(mx.cpu)
    G._stub_transformers()
    dtype = getattr(mx, a.dtype)
    global BITS
    BITS = a.bits
    for fam in a.families.split(","):
        cols = summarize(fam, dtype, a.prompt, a.layers, a.unfused)
        if a.json:
            print(json.dumps({"family": fam, "dtype": a.dtype,
                              **{n: {"per_layer": dict(c[0]), "fixed": dict(c[1])} for n, c in cols.items()}}))
        else:
            print(table(fam, cols) + "\n", flush=True)


if __name__ == "__main__":
    main()
