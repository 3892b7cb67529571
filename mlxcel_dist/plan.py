"""`mlxcel-dist plan`: what a placement gives each rank and costs per token,
from the checkpoint's headers only (no tensor data is read).

Each rank's model is built and sharded on paper (`Group.planned`, the
same sharding the ranks apply), so its layers, heads, MLP columns and
vocabulary rows are the loader's, and its memory is the bytes of exactly the
slices it would read. Per generated token: the collectives of one
single-token forward (`bench.plan_collectives`, the model contract) and a
predicted decode time from a simple model (docs/launching.md, "plan"):

    t = weight bytes per rank / memory bandwidth + layers x host time per layer
        + collectives x (link latency + payload / link bandwidth)
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from .collectives import Group
from .errors import UserError
from .weights import stored_bytes

# Link constants: (latency per collective s, bandwidth B/s, source).
LINKS = {
    "loopback": (75e-6, 2e9, "ring all_sum in a decode step on the 2-core dev VM: 73 us (docs/launching.md)"),
    "tb5": (30e-6, 6e9, "Thunderbolt 5 RDMA (JACCL): ~30 us and ~6 GB/s per all-reduce, MLX's distributed docs"),
    "10gbe": (100e-6, 1e9, "10 Gigabit Ethernet over TCP: ~100 us and ~1 GB/s"),
}
HOST_LAYER_S = 150e-6  # host time per layer of a compiled CPU decode step (fit on the dev VM: docs/launching.md)


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


def _ranges_of(plan: dict, suffix: str):
    for name in sorted(plan):
        if name.endswith(suffix):
            return plan[name]
    return None


def _rank_plan(ck, n: int, r: int, weights, pp: int = 1, moe_split: str | None = None) -> tuple[RankPlan, object]:
    from .shard import collect_plan

    m, refs = ck.build()
    layers = None
    if pp > 1:  # the loader's own cut (loader.cut_stage) and split inside the stage, on paper
        from .loader import cut_stage

        cut_stage(m, refs, Group.planned(n, r), pp, None)
        layers = (m.model.stage.start, m.model.stage.stop)
        T = n // pp
        if T > 1:
            m.shard(Group.planned(T, r % T, None, moe_split))
    elif n > 1:
        m.shard(Group.planned(n, r, weights, moe_split))
    plan = collect_plan(m)
    from mlx.utils import tree_flatten

    total = 0
    for name, _ in tree_flatten(m.parameters()):
        ref = refs[name]
        axis, ranges = plan.get(name, (None, None))
        total += stored_bytes(ref, ref.sliced_shape(axis, ranges))
    heads = None
    attn = next((mod for _, mod in m.named_modules() if hasattr(mod, "total_num_heads")), None)
    if attn is not None:
        q = _ranges_of(plan, "self_attn.q_proj.weight")
        hd = getattr(attn, "head_dim", None)
        start = q[1][0][0] // hd if q and hd else 0
        heads = (start, start + attn.num_heads, attn.num_kv_heads)
    cols = _ranges_of(plan, "mlp.down_proj.weight")
    vocab = getattr(m, "_head_rows", None)
    t = r % (n // pp)  # this rank's place in its stage (r itself without pipeline stages)
    held = [x.expert_range for _, x in m.named_modules() if hasattr(x, "expert_range")]
    return RankPlan(r, weights[r] if weights else 1, heads, cols[1][0] if cols else None,
                    vocab[t] if vocab else None, total, layers, held[0] if held else None), m


def moe_placement(m, ranks) -> str | None:
    """plan's line on the routed experts' placement (None: no stacked routed experts)."""
    if not any(hasattr(x, "expert_range") for _, x in m.named_modules()):  # experts.SwitchGLU, step3p5's MoE
        return None
    if any(rp.experts is not None for rp in ranks):
        held = ", ".join(f"rank {rp.rank} {_span(rp.experts)}" for rp in ranks)
        return f"routed experts: whole experts per rank (--moe-split experts): {held}; router replicated"
    return ("routed experts: every expert split by its intermediate dimension (--moe-split intermediate); "
            "router replicated")


def machine_bandwidth() -> float:
    """This machine's memory bandwidth for streaming reads (B/s): a 64 MB
    float32 sum, best of 3 (decode reads every weight once per token)."""
    a = np.ones(16 << 20, np.float32)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return a.nbytes / best


def machine_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def _pipeline_collectives(ck, model, pp: int, stops: list) -> dict:
    """Per token under --pp: what each stage but the last sends on (the
    hidden state [1, 1, H], or what the family hands on with it:
    `stage_send_width`), the last stage's logits all_summed to every rank
    ([1, 1, V] in the hidden dtype: pipeline.Stage.logits) and the agreement check."""
    size = model.model.stage.dtype.size
    sent = sum(model.stage_send_width(stop) for stop in stops[:-1]) * size
    v = int(ck.args.vocab_size) * size
    return {"send": (pp - 1, sent), "all_sum": (2, v + pp * 3 * 4)}


def _stage_sums(stage_models: list, T: int) -> tuple:
    """Per token, the all_sums inside the stages (T ranks each: chains of
    2 (T - 1) point-to-point messages, collectives.ChainGroup), over all
    stages in turn: (messages, bytes)."""
    calls = nbytes = 0
    for m in stage_models:
        c, b = m.collectives_per_token().get("all_sum", (0, 0))
        c, b = c - 1, b - int(m.args.vocab_size) * m.model.stage.dtype.size  # less the logits' (the job's)
        calls += c * 2 * (T - 1)
        nbytes += b * 2 * (T - 1)
    return calls, nbytes


def make_plan(ck, n: int, weights=None, link: str = "loopback", bandwidth: float | None = None,
              memory: list | None = None, pp: int = 1, moe_split: str | None = None) -> dict:
    """The placement of `ck` on `n` ranks (`pp` > 1: n = pp pipeline
    stages): per rank its share and bytes, per token the collectives and a
    predicted decode time (stages run one after another for one stream).
    `memory`: each rank's bytes available (None: this machine's, shared by
    its ranks); a rank that would not fit is a UserError naming it."""
    from .bench import plan_collectives

    if link not in LINKS:
        raise UserError(f"--link must be one of {', '.join(LINKS)}, got {link!r}")
    ranks, model, firsts = [], None, []
    T = n // pp
    for r in range(n):
        rp, m = _rank_plan(ck, n, r, weights, pp, moe_split)
        ranks.append(rp)
        model = model or m
        if r % T == 0:
            firsts.append(m)
    if pp > 1:
        coll = _pipeline_collectives(ck, model, pp, [rp.layers[1] for rp in ranks[::T]])
        if T > 1:
            coll["p2p inside stages"] = _stage_sums(firsts, T)
    else:
        coll = plan_collectives(model, check_every=1, size=n)
    lat, link_bw, source = LINKS[link]
    bw = bandwidth or machine_bandwidth()
    layers = int(ck.args.num_hidden_layers)
    calls = sum(c for c, _ in coll.values())
    payload = sum(b for _, b in coll.values())
    if pp > 1:  # one stream: the stages in turn (each as fast as its largest rank)
        compute = sum(max(rp.bytes for rp in ranks[s * T : (s + 1) * T]) for s in range(pp)) / bw \
            + layers * HOST_LAYER_S
    else:
        compute = max(rp.bytes for rp in ranks) / bw + layers * HOST_LAYER_S
    comm = (calls * lat + payload / link_bw) if n > 1 else 0.0
    if memory is None:
        total = machine_memory()
        memory = [total // n if total else None] * n
    for rp, avail in zip(ranks, memory):
        if avail is not None and rp.bytes > avail:
            raise UserError(f"rank {rp.rank} needs {_size(rp.bytes)} of weights, more than its {_size(avail)} "
                            "of memory (use more ranks, or --rank-weights / the hosts' memory= to shift shares)")
    return {"ranks": ranks, "collectives": coll, "link": (link, lat, link_bw, source), "bandwidth": bw,
            "layers": layers, "compute_s": compute, "comm_s": comm, "token_s": compute + comm, "pp": pp,
            "moe": moe_placement(model, ranks)}


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
        out.append(f"layers: {p['layers']} in {P} pipeline stages ({each}), by parameter bytes")
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
    out.append(f"predicted decode: {1000 * p['token_s']:.2f} ms/token ({1 / p['token_s']:.1f} tok/s): compute "
               f"{1000 * p['compute_s']:.2f} ms (memory {p['bandwidth'] / 1e9:.1f} GB/s), collectives "
               f"{1000 * p['comm_s']:.2f} ms over {link} ({lat * 1e6:.0f} us, {bw / 1e9:g} GB/s: {source})")
    return out
