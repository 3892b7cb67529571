"""`mlxcel-dist plan`: what a placement gives each rank and costs per token,
from the checkpoint's headers only (no tensor data is read).

Each rank's model is built and sharded on paper (`Group.planned`, the
same sharding the ranks apply), so its layers, heads, MLP columns and
vocabulary rows are the loader's, and its memory is the bytes of exactly the
slices it would read. Per generated token: the collectives of one
single-token forward (`bench.plan_collectives`, the model contract) and a
predicted decode time from a simple model (docs/launching.md, "plan"):

    t = bytes a token reads per rank / decode bandwidth + host time per token
        + layers x host time per layer + collectives x (link latency + payload / link bandwidth)

The bytes a token reads (`read_shares`) are not all it holds: of a routed
MoE layer's experts it reads top-k of E (in expectation, under either
--moe-split; under experts the slowest rank sets a layer's time, so a
stage counts the expected largest share of the k on one rank:
`busiest_reads`), of an embedding table one row (unless it is also the head),
and besides the weights its layers' KV cache over the context (`--context`:
2 x positions x kv heads x head_dim a full layer, a sliding one at most its
window, latent attention's [kv_lora_rank + rope dim] a position).
With --pp the stages run in turn for one stream: each stage's time is its
slowest rank's reads plus its layers' host time; the hand-offs between them
are the ones a launch on --backend with --pp-handoff would make
(`handoff_route`: sends, or collectives.HandOff's all_gathers).

The bandwidth and both host times are measured on this machine when plan
runs (`machine_bandwidth`: MLX's matrix-vector product, what decode does;
`machine_host_costs`: our own generation loop on a tiny model) unless given
(--bandwidth, --host-us-per-layer / --host-ms-per-token, a hostfile's
per-host host_us_per_layer=).
"""

from __future__ import annotations

import functools
import math
import os
import re
import time
from dataclasses import dataclass


from .parallel.collectives import Group
from .errors import UserError
from .checkpoint.weights import stored_bytes

# Link constants: (latency per collective s, bandwidth B/s, source).
LINKS = {
    "loopback": (75e-6, 2e9, "ring all_sum in a decode step on the 2-core dev VM: 73 us (docs/launching.md)"),
    "tb5": (30e-6, 6e9, "Thunderbolt 5 RDMA (JACCL): ~30 us and ~6 GB/s per all-reduce, MLX's distributed docs"),
    "10gbe": (100e-6, 1e9, "10 Gigabit Ethernet over TCP: ~100 us and ~1 GB/s"),
}


@dataclass
class RankPlan:
    rank: int
    weight: object
    heads: tuple | None  # (q start, q stop, kv heads held)
    columns: tuple | None  # MLP intermediate (start, stop) of the first MLP
    vocab: tuple | None  # head rows (start, stop), or None when not split
    bytes: int
    layers: tuple | None = None  # (start, stop) of its pipeline stage; None: all layers (tensor parallel)
    experts: tuple | None = None  # whole routed experts (start, stop) held under --moe-split experts
    params: int = 0  # logical parameters held (a quantized weight counts its unpacked elements)
    reads: int = 0  # weight bytes a decoded token reads (routed experts top-k of E, an embedding row)
    cache_reads: int = 0  # KV cache bytes a decoded token reads over the plan's context
    routed: tuple = ()  # --moe-split experts: per routed layer (k, E, experts held, their bytes held)


def _ranges_of(plan: dict, suffix: str):
    for name in sorted(plan):
        if name.endswith(suffix):
            return plan[name]
    return None


def read_shares(m) -> dict:
    """Parameter name -> the share of its bytes one decoded token reads
    (absent: all of them): a routed expert stack's (`experts.SwitchLinear`,
    gpt_oss's `Experts`) top_k / num_experts of its layer, an embedding
    table's one row of its rows (unless this rank's head reads it whole: a
    tied head). A layer's routing is its module with an int `top_k`."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from .nn.experts import QuantizedSwitchLinear, SwitchGLU, SwitchLinear

    shares = {}
    stage = m.stage
    head_from_embedding = "lm_head" not in m and (stage is None or stage.last)
    for name, mod in m.named_modules():
        if isinstance(mod, (nn.Embedding, nn.QuantizedEmbedding)):
            if head_from_embedding and name == "model.embed_tokens":
                continue
            rows = mod.weight.shape[0]
            for leaf, _ in tree_flatten(mod.parameters()):
                shares[f"{name}.{leaf}"] = 1 / rows
    for i, layer in enumerate(m.model.layers):
        mods = dict(layer.named_modules())
        k = next((x.top_k for x in mods.values() if type(getattr(x, "top_k", None)) is int), None)
        if k is None:
            continue
        for name, mod in mods.items():
            E = getattr(mod, "num_experts", None)
            if type(E) is not int or E < 1:
                continue
            for leaf, _ in tree_flatten(mod.parameters()):
                full = f"{name}.{leaf}" if name else leaf
                owner = mods.get(full.rpartition(".")[0])
                # a SwitchGLU's stacks are its SwitchLinears (it may hold its router too: step3p5);
                # another expert module (gpt_oss's Experts) holds its stacks itself
                if isinstance(owner, (SwitchLinear, QuantizedSwitchLinear)) or (
                        owner is mod and not isinstance(mod, SwitchGLU)):
                    shares[f"model.layers.{i}.{full}"] = min(1.0, k / E)
        listed = {}  # experts as a list of MLPs (mellum, exaone_moe): experts.<j>.*
        for leaf, _ in tree_flatten(layer.parameters()):
            j = re.search(r"(?:^|\.)experts\.(\d+)\.", leaf)
            if j:
                listed[leaf] = j.group(1)
        for leaf in listed:
            shares[f"model.layers.{i}.{leaf}"] = min(1.0, k / len(set(listed.values())))
    return shares


def cache_read_bytes(m, context: int, itemsize: int) -> int:
    """KV cache bytes one decoded token reads on this rank over `context`
    cached positions: per held layer, a `num_kv_heads` / `head_dim` attention
    2 x min(context, its window) x kv heads x head_dim, latent attention
    (`kv_lora_rank`, `rope_dim`) context x (rank + rope dim); recurrent and
    linear layers' fixed states are not counted."""
    total = 0
    for layer in m.model.layers:
        for _, mod in layer.named_modules():
            if isinstance(getattr(mod, "kv_lora_rank", None), int):
                total += context * (mod.kv_lora_rank + int(getattr(mod, "rope_dim", 0) or 0)) * itemsize
                break
            if isinstance(getattr(mod, "num_kv_heads", None), int) and isinstance(getattr(mod, "head_dim", None), int):
                window = getattr(mod, "window", None)
                span = context if not window else min(context, int(window))
                total += 2 * span * mod.num_kv_heads * mod.head_dim * itemsize
                break
    return total


def _rank_plan(ck, n: int, r: int, weights, pp: int = 1, moe_split: str | None = None,
               context: int = 0) -> tuple[RankPlan, object]:
    from .parallel.shard import collect_plan

    m, refs = ck.build()
    layers = None
    if pp > 1:  # the loader's own cut (loader.cut_stage) and split inside the stage, on paper
        from .checkpoint.loader import cut_stage
        from .parallel.pipeline import member_weights

        cut_stage(m, refs, Group.planned(n, r, weights), pp, None)
        layers = (m.model.stage.start, m.model.stage.stop)
        T = n // pp
        if T > 1:
            m.shard(Group.planned(T, r % T, member_weights(weights, r, pp), moe_split))
    elif n > 1:
        m.shard(Group.planned(n, r, weights, moe_split))
    plan = collect_plan(m)
    from mlx.utils import tree_flatten

    total = params = reads = 0
    owners = dict(m.named_modules())
    shares = read_shares(m)
    for name, p in tree_flatten(m.parameters()):
        ref = refs[name]
        axis, ranges = plan.get(name, (None, None))
        held = stored_bytes(ref, ref.sliced_shape(axis, ranges))
        total += held
        reads += held * shares.get(name, 1.0)
        params += _logical_size(owners.get(name.rpartition(".")[0]), name.rpartition(".")[2], p)
    routed = []
    for name, mod in m.named_modules():
        if getattr(mod, "expert_range", None) is not None:  # whole experts on this rank (experts.SwitchGLU)
            stacks = [n for n in shares if n.startswith(name + ".")]
            b = sum(stored_bytes(refs[n], refs[n].sliced_shape(*plan.get(n, (None, None)))) for n in stacks)
            k = round(shares[stacks[0]] * mod.num_experts) if stacks else 0
            routed.append((k, mod.num_experts, mod.expert_range[1] - mod.expert_range[0], b))
    itemsize = m.stage.dtype.size if m.stage is not None else _float_size(ck)
    cache = cache_read_bytes(m, context, itemsize) if context else 0
    heads = None
    attn = next((mod for _, mod in m.named_modules() if hasattr(mod, "total_num_heads")), None)
    if attn is not None:
        # q_b_proj: latent attention's per-head q rows (deepseek_v3 with a q LoRA)
        q = _ranges_of(plan, "self_attn.q_proj.weight") or _ranges_of(plan, "self_attn.q_b_proj.weight")
        hd = getattr(attn, "q_proj_width", None) or getattr(attn, "head_dim", None)  # q rows a head
        start = q[1][0][0] // hd if q and hd else 0
        heads = (start, start + attn.num_heads, attn.num_kv_heads)
    cols = _ranges_of(plan, "mlp.down_proj.weight")
    vocab = m._head_rows
    t = r % (n // pp)  # this rank's place in its stage (r itself without pipeline stages)
    held = [x.expert_range for _, x in m.named_modules() if hasattr(x, "expert_range")]
    return RankPlan(r, weights[r] if weights else 1, heads, cols[1][0] if cols else None,
                    vocab[t] if vocab else None, total, layers, held[0] if held else None, params,
                    int(reads), cache, tuple(routed)), m


@functools.cache
def expected_busiest(k: int, held: tuple, nbytes: tuple) -> float:
    """E[max over ranks of X_r x nbytes_r] where a token's `k` experts are
    drawn uniformly without repeats from the experts, rank r holding
    `held[r]` of them (X multivariate hypergeometric): what the slowest rank
    of a layer reads of its experts, when ranks hold whole experts."""
    total = math.comb(sum(held), k)

    def walk(r: int, left: int, p: int, worst: float) -> float:
        if r == len(held):
            return p * worst if left == 0 else 0.0
        return sum(walk(r + 1, left - x, p * math.comb(held[r], x), max(worst, x * nbytes[r]))
                   for x in range(min(left, held[r]) + 1))

    return walk(0, k, 1, 0.0) / total


def busiest_reads(g: list) -> float:
    """The bytes a token reads on the slowest of tensor-parallel ranks `g`
    (RankPlans): each rank's reads count a routed layer's experts at their
    mean, k x held / E; under --moe-split experts a layer waits for the rank
    that got the most of its k (`expected_busiest`, routing taken as
    uniform), so that rank's expected share replaces the mean."""
    if not g[0].routed:
        return max(rp.reads + rp.cache_reads for rp in g)
    rest = max(rp.reads + rp.cache_reads - sum(k * b / E for k, E, _, b in rp.routed) for rp in g)
    worst = 0.0
    for layer in zip(*(rp.routed for rp in g)):
        k = layer[0][0]
        worst += expected_busiest(k, tuple(c for _, _, c, _ in layer), tuple(b / c if c else 0.0 for _, _, c, b in layer))
    return rest + worst


def _float_size(ck) -> int:
    """The compute dtype's bytes (a quantized checkpoint's: its scales' float dtype, else 2)."""
    size = getattr(ck.dtype, "size", None)
    return size if size in (2, 4) else 2


def _logical_size(owner, leaf: str, p) -> int:
    """Elements of parameter `leaf` of module `owner` as the model computes
    with them: an MLX-quantized layer's packed uint32 words hold 32 / bits
    weights each, and its scales and biases are no parameters of the model."""
    if owner is not None and hasattr(owner, "bits") and "scales" in owner:
        if leaf in ("scales", "biases"):
            return 0
        if leaf == "weight":
            return p.size * 32 // owner.bits
    return p.size


def rank_plans(ck, n: int, weights=None, pp: int = 1, moe_split: str | None = None) -> list[RankPlan]:
    """Each rank's share of `ck` on `n` ranks, sharded on paper as the ranks shard it."""
    return [_rank_plan(ck, n, r, weights, pp, moe_split)[0] for r in range(n)]


def moe_placement(m, ranks) -> str | None:
    """plan's line on the routed experts' placement (None: no stacked routed experts)."""
    if not any(hasattr(x, "expert_range") for _, x in m.named_modules()):  # an experts.SwitchGLU
        return None
    if any(rp.experts is not None for rp in ranks):
        held = ", ".join(f"rank {rp.rank} {_span(rp.experts)}" for rp in ranks)
        return f"routed experts: whole experts per rank (--moe-split experts): {held}; router replicated"
    return ("routed experts: every expert split by its intermediate dimension (--moe-split intermediate); "
            "router replicated")


def machine_bandwidth(dtype=None, quant=None) -> float:
    """The rate (B/s) at which MLX streams weights through a matrix-vector
    product here: a 4096 x 4096 matrix in `dtype` (default float32), or
    quantized as `quant` (quant.QuantParams: its packed bytes), times one
    row, best of 5 (a decode step reads every weight once that way)."""
    import mlx.core as mx

    w = mx.random.normal((4096, 4096)).astype(dtype or mx.float32)
    x = mx.random.normal((1, 4096)).astype(w.dtype)
    if quant is not None:
        parts = mx.quantize(w, **quant.kwargs())
        nbytes = sum(a.nbytes for a in parts if a is not None)
        product = lambda: mx.quantized_matmul(x, *parts, transpose=True, **quant.kwargs())  # noqa: E731
    else:
        nbytes = w.nbytes
        product = lambda: x @ w.T  # noqa: E731
    mx.eval(w, x)
    mx.eval(product())
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        mx.eval(product())
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def _tiny_llama(layers: int):
    from .models.llama import Model, ModelArgs

    return Model(ModelArgs(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096))


def decode_primitives(m) -> int | None:
    """The primitives in the graph of one decoded token of model `m` (its
    parameters swapped for zero-stride stand-ins, so nothing is read or
    allocated; the graph is built, never run), or None where the model will
    not build one so. Host time a token grows with them."""
    import tempfile

    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    try:
        stand_ins = [(n, mx.broadcast_to(mx.zeros((), p.dtype), p.shape)) for n, p in tree_flatten(m.parameters())]
        m.update(tree_unflatten(stand_ins))
        mx.eval(m.parameters())
        out = m(mx.zeros((1, 1), mx.int32), m.make_cache())
        with tempfile.TemporaryDirectory() as tmp:
            mx.export_to_dot(f"{tmp}/g.dot", out)
            with open(f"{tmp}/g.dot") as f:
                return sum("shape=rectangle" in line for line in f)
    except Exception:  # noqa: BLE001 - a family that needs more than ids to decode: no count
        return None


@functools.cache
def layer_kernel_ratio(ck) -> float:
    """A layer of `ck`'s model against the tiny llama's layer that
    `machine_host_costs` times, in decode primitives (1.0 where uncounted):
    a MoE layer's routing, a latent-attention layer's or an indexer's extra
    kernels cost host time the llama layer does not."""
    one, five = decode_primitives(_tiny_llama(1)), decode_primitives(_tiny_llama(5))
    m, _ = ck.build(with_refs=False)
    total = decode_primitives(m)
    layers = int(ck.args.num_hidden_layers)
    if None in (one, five, total) or five <= one or not layers:
        return 1.0
    per = (five - one) / 4
    return max(0.5, (total - (one - per)) / layers / per)


@functools.cache
def machine_host_costs(tokens: int = 40, split: bool = True) -> tuple[float, float]:
    """(per token, per layer) host seconds of this machine's generation loop
    (sampling, the host read, the agreement check; each layer's kernels): a
    tiny llama (hidden 64, weights negligible) with 1 and 5 layers, greedy
    through generation.Generation (the engine's one row), best of 3 runs each
    in turn, its decode steps `split` (decode.SplitSegments: a compiled
    segment a layer, the attention between them) or one compiled graph a
    step, as the planned model's run (`decode.splittable`); measured once a
    process."""
    import mlx.core as mx

    from .engine.generation import Generation

    def model(layers: int):
        m = _tiny_llama(layers)
        m.split_decode = split
        mx.eval(m.parameters())
        return m

    def per_token(m) -> float:
        gen = Generation(m, list(range(8)), tokens)
        for _ in gen:
            pass
        stats = gen.finish()
        return stats.decode_s / max(1, stats.generated - 1)

    # the two in turn, best of 3 each: a burst of other work on the box hits one run, not one model's all
    # (the slope of two bests amplifies a disturbed one)
    ms = [model(1), model(5)]
    one, five = (min(runs) for runs in zip(*[[per_token(m) for m in ms] for _ in range(3)]))
    layer = max(0.0, (five - one) / 4)
    return max(0.0, one - layer), layer


def machine_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


HANDOFF_OP = "all_gather (hand-off)"  # plan's name for a collective hand-off (bench counts it as an all_gather)


def handoff_route(backend: str | None, requested: str, P: int, T: int) -> tuple[str, bool]:
    """How a launch on `backend` hands on between its `P` stages
    (`pipeline.handoff_mode`: the launch's own rule and refusals): ("send" or
    "collective", whether the collective hops run over split groups (the
    backend splits: MPI) rather than the whole job). `backend` None: on
    paper, send/recv."""
    from .cluster import backends
    from .parallel.pipeline import handoff_mode

    mode = handoff_mode(requested, backend, P, T)
    return mode, mode == "collective" and backend is not None and backends.get(backend).splits


def _pipeline_collectives(ck, model, pp: int, stops: list, route=("send", False), T: int = 1) -> tuple[dict, dict]:
    """Per token under --pp: what each stage but the last hands on (the
    hidden state [1, 1, H], or what the family hands on with it:
    `stage_send_width`), the last stage's logits all_summed to every rank
    ([1, 1, V] in the hidden dtype: pipeline.Stage.logits) and the agreement
    check. A hand-off is a send, or under `route` "collective" an all_gather
    (collectives.HandOff) of the sender's [1, 1, W] with the others' zeros,
    counted as bench counts it (the rank's own W); for the time (second
    dict: messages, bytes on the wire) it is a ring all_gather's n - 1 steps
    of W each, n its group's ranks: stage k's last and stage k + 1's T where
    groups split, else the job's (at n = 2 a send's cost)."""
    size = model.model.stage.dtype.size
    sent = sum(model.stage_send_width(stop) for stop in stops[:-1]) * size
    v = int(ck.args.vocab_size) * size
    coll = {"all_sum": (2, v + pp * 3 * 4)}
    if route[0] == "send":
        return {"send": (pp - 1, sent), **coll}, {}
    hop_ranks = T + 1 if route[1] else pp * T
    return {HANDOFF_OP: (pp - 1, sent), **coll}, {HANDOFF_OP: ((pp - 1) * (hop_ranks - 1), (hop_ranks - 1) * sent)}


def _stage_sums(stage_models: list, T: int, split: bool = False) -> tuple[str, tuple]:
    """Per token, the all_sums inside the stages, over all stages in turn:
    chains of 2 (T - 1) point-to-point messages (collectives.ChainGroup), or
    where the stages hand on by collectives over split groups one MLX
    all_sum over the stage's ranks (collectives.SplitGroup). (name, (calls, bytes))."""
    calls = nbytes = 0
    for m in stage_models:
        c, b = m.collectives_per_token().get("all_sum", (0, 0))
        c, b = c - 1, b - int(m.args.vocab_size) * m.model.stage.dtype.size  # less the logits' (the job's)
        calls += c
        nbytes += b
    if split:
        return "all_sum inside stages", (calls, nbytes)
    return "p2p inside stages", (calls * 2 * (T - 1), nbytes * 2 * (T - 1))


def _route_line(backend: str | None, requested: str, route: tuple, T: int) -> str:
    """plan's line on how the stages hand on, as the launch would."""
    on = f"backend {backend}" if backend else "on paper"
    asked = f"--pp-handoff {requested}"
    if route[0] == "send":
        inside = "; inside a stage: all_sums as chains of sends" if T > 1 else ""
        return f"pipeline hand-offs: send/recv ({on}, {asked}){inside}"
    why = "no send/recv" if requested == "auto" else asked
    if route[1]:
        return (f"pipeline hand-offs: an all_gather over each hop's ranks ({on} splits groups; {why}); "
                "inside a stage: all_sums over its split group")
    return f"pipeline hand-offs: an all_gather over the whole job, every rank in every hop ({on}: {why})"


def make_plan(ck, n: int, weights=None, link: str = "loopback", bandwidth: float | None = None,
              memory: list | None = None, pp: int = 1, moe_split: str | None = None,
              host_token: float | None = None, host_layer=None, context: int = 0, backend: str | None = None,
              pp_handoff: str = "auto") -> dict:
    """The placement of `ck` on `n` ranks (`pp` > 1: n = pp pipeline
    stages): per rank its share, bytes held and bytes a decoded token reads
    (`context` cached positions), per token the collectives and a predicted
    decode time (stages run one after another for one stream, each as slow
    as its slowest rank). `memory`: each rank's bytes available (None: this
    machine's, shared by its ranks); a rank that would not fit is a
    UserError naming it. `bandwidth` (B/s), `host_token` (seconds of host
    time a token) and `host_layer` (seconds a layer: one number, or one per
    rank with None for "not said"): measured here when not given."""
    from .bench import plan_collectives

    if link not in LINKS:
        raise UserError(f"--link must be one of {', '.join(LINKS)}, got {link!r}")
    if context < 0:
        raise UserError(f"--context must be >= 0 tokens, got {context}")
    ranks, model, firsts = [], None, []
    T = n // pp
    for r in range(n):
        rp, m = _rank_plan(ck, n, r, weights, pp, moe_split, context)
        ranks.append(rp)
        model = model or m
        if r % T == 0:
            firsts.append(m)
    wire, route = {}, None
    if pp > 1:
        route = handoff_route(backend, pp_handoff, pp, T)
        coll, wire = _pipeline_collectives(ck, model, pp, [rp.layers[1] for rp in ranks[::T]], route, T)
        if T > 1:
            name, sums = _stage_sums(firsts, T, route[1])
            coll[name] = sums
    else:
        coll = plan_collectives(model, check_every=1, size=n)
    lat, link_bw, source = LINKS[link]
    q = ck.quantization
    if not isinstance(host_layer, (list, tuple)):
        host_layer = [host_layer] * n
    measured = {"bandwidth": bandwidth is None, "host": host_token is None,
                "host per layer": all(x is None for x in host_layer)}
    bw = bandwidth or machine_bandwidth(ck.dtype, q.default if q is not None else None)
    from .engine.decode import splittable

    split = splittable(model)  # the step kind it decodes with: a split llama layer costs more host time
    here = machine_host_costs(split=split) if host_token is None or None in host_layer else (None, None)
    per_token = here[0] if host_token is None else host_token
    ratio = layer_kernel_ratio(ck) if None in host_layer else 1.0  # a measured llama layer, scaled to this model's
    layer_s = [here[1] * ratio if x is None else x for x in host_layer]
    layers = int(ck.args.num_hidden_layers)
    calls = sum(wire.get(op, cb)[0] for op, cb in coll.items())  # messages
    payload = sum(wire.get(op, cb)[1] for op, cb in coll.items())  # bytes on the wire
    stages = []  # one stream: the stages in turn, each as slow as its slowest rank (tensor parallel: one stage)
    groups = [ranks[s * T : (s + 1) * T] for s in range(pp)] if pp > 1 else [ranks]
    for g in groups:
        span = (g[0].layers[1] - g[0].layers[0]) if g[0].layers else layers
        reads = busiest_reads(g)
        stages.append({"layers": g[0].layers, "reads": reads, "read_s": reads / bw,
                       "host_s": span * max(layer_s[rp.rank] for rp in g)})
    compute = per_token + sum(st["read_s"] + st["host_s"] for st in stages)
    comm = (calls * lat + payload / link_bw) if n > 1 else 0.0
    if memory is None:
        total = machine_memory()
        memory = [total // n if total else None] * n
    for rp, avail in zip(ranks, memory):
        if avail is not None and rp.bytes > avail:
            raise UserError(f"rank {rp.rank} needs {_size(rp.bytes)} of weights, more than its {_size(avail)} "
                            "of memory (use more ranks, or --rank-weights / the hosts' memory= to shift shares)")
    return {"ranks": ranks, "collectives": coll, "link": (link, lat, link_bw, source), "bandwidth": bw,
            "host": (per_token, max(layer_s)), "layers": layers, "compute_s": compute, "comm_s": comm,
            "token_s": compute + comm, "pp": pp, "moe": moe_placement(model, ranks), "stages": stages,
            "context": context, "measured": measured, "layer_ratio": ratio, "split_step": split,
            "handoff": _route_line(backend, pp_handoff, route, T) if route else None}


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def _span(t) -> str:
    return "-" if t is None else f"[{t[0]}, {t[1]})"


def format_plan(p: dict) -> list[str]:
    if p["pp"] > 1:
        P, T = p["pp"], len(p["ranks"]) // p["pp"]
        out = [f"{'rank':>4}  {'stage':>5}  {'stage layers':>14}" + (f"  {'heads (q; kv)':>16}" if T > 1 else "")
               + "  weights"]
        for rp in p["ranks"]:
            s = rp.rank // T
            extra = (" + embedding" if s == 0 else "") + (" + norm, head" if s == P - 1 else "")
            heads = "" if T == 1 else "  " + ("-" if rp.heads is None else f"[{rp.heads[0]}, {rp.heads[1]}); {rp.heads[2]}").rjust(16)
            out.append(f"{rp.rank:>4}  {s:>5}  {_span(rp.layers):>14}{heads}  {rp.bytes / 1e6:,.1f} MB{extra}")
        each = "one rank each" if T == 1 else f"{T} tensor-parallel ranks each"
        by = "parameter bytes" if all(rp.weight == 1 for rp in p["ranks"]) else "parameter bytes / rank weights"
        out.append(f"layers: {p['layers']} in {P} pipeline stages ({each}), by {by}")
    else:
        out = [f"{'rank':>4}  {'weight':>6}  {'heads (q; kv)':>16}  {'MLP columns':>14}  {'vocab rows':>14}  weights"]
        for rp in p["ranks"]:
            heads = "-" if rp.heads is None else f"[{rp.heads[0]}, {rp.heads[1]}); {rp.heads[2]}"
            out.append(f"{rp.rank:>4}  {str(rp.weight):>6}  {heads:>16}  {_span(rp.columns):>14}  "
                       f"{_span(rp.vocab):>14}  {rp.bytes / 1e6:,.1f} MB")
        out.append(f"layers: all {p['layers']} on every rank (tensor parallel)")
    if p.get("moe"):
        out.append(p["moe"])
    link, lat, bw, source = p["link"]
    per_tok = ", ".join(f"{c:g} {op} ({b:,.0f} B)" for op, (c, b) in p["collectives"].items() if c)
    out.append(f"per token: {per_tok or 'no collective'}")
    if p.get("handoff"):
        out.append(p["handoff"])
    tok, lay = p["host"]
    held = max(rp.bytes for rp in p["ranks"])
    reads = max(rp.reads for rp in p["ranks"])
    kv = max(rp.cache_reads for rp in p["ranks"])
    out.append(f"a token reads: {_size(reads)} of weights on the busiest rank (of {_size(held)} held"
               + ("; routed experts top-k of E, an embedding row" if reads < held else "")
               + f"), {_size(kv)} of KV cache at --context {p['context']}")
    if p["ranks"][0].routed and p["pp"] == 1:
        out.append(f"whole experts per rank: a layer waits for the rank that got the most of its top-k "
                   f"(uniform routing): {_size(p['stages'][0]['reads'])} a token on the slowest, expected")
    if p["pp"] > 1:
        for s, st in enumerate(p["stages"]):
            out.append(f"stage {s} {_span(st['layers'])}: {1000 * (st['read_s'] + st['host_s']):.2f} ms "
                       f"(reads {_size(st['reads'])}: {1000 * st['read_s']:.2f} ms; host {1000 * st['host_s']:.2f} ms)")
    m = p["measured"]
    said = {k: "measured here" if v else "given" for k, v in m.items()}
    if m["host per layer"]:
        step = "split steps" if p.get("split_step") else "one graph a step"
        said["host per layer"] = (f"measured here: a llama layer's ({step}, as this model decodes) x "
                                  f"{p['layer_ratio']:.2f} (this model's kernels a layer)")
    out.append(f"predicted decode: {1000 * p['token_s']:.2f} ms/token ({1 / p['token_s']:.1f} tok/s): compute "
               f"{1000 * p['compute_s']:.2f} ms (reads at {p['bandwidth'] / 1e9:.1f} GB/s, {said['bandwidth']}; host "
               f"{1e3 * tok:.2f} ms a token, {said['host']}, + {1e6 * lay:.0f} us a layer (the slowest rank's), {said['host per layer']}), "
               f"collectives {1000 * p['comm_s']:.2f} ms over {link} ({lat * 1e6:.0f} us, {bw / 1e9:g} GB/s: {source})")
    return out
