"""`mlxcel-dist plan`: each rank's share and memory and a predicted decode
time, from the checkpoint's headers only (plan.make_plan)."""

from __future__ import annotations

from ..cluster import backends
from ..errors import UserError
from ..checkpoint.loader import open_model
from ..plan import format_plan, make_plan
from .common import pick_model
from .launch import check_moe_split, check_placement, job_backend, parse_rank_weights


def main(ctx, a) -> None:
    ck = open_model(pick_model(a.model, a.model_opt))
    np_, pp, link = a.np_, a.pp, a.link
    weights = parse_rank_weights(a.rank_weights)
    memory = None
    for name, v in (("--host-us-per-layer", a.host_us_per_layer), ("--host-ms-per-token", a.host_ms_per_token)):
        if v is not None and not 0 <= v < float("inf"):
            raise UserError(f"{name} must be >= 0, got {v}")
    host_layer = None if a.host_us_per_layer is None else a.host_us_per_layer * 1e-6
    if a.hostfile is not None:
        from ..cluster.hostfile import rank_host_layer, rank_memory, rank_weights as host_weights, read_hostfile

        hosts = read_hostfile(a.hostfile).hosts
        np_ = np_ if np_ > 1 else sum(h.slots for h in hosts)
        weights = weights or host_weights(hosts, np_)
        memory = rank_memory(hosts, np_)
        if all(m is None for m in memory):
            memory = None
        if host_layer is None:  # the flag, when given, is every host's
            host_layer = rank_host_layer(hosts, np_)
        if link == "loopback":
            link = "10gbe"
    if np_ < 1:
        raise UserError(f"--np must be >= 1, got {np_}")
    if weights is not None and len(weights) != np_:
        raise UserError(f"--rank-weights gives {len(weights)} weights for {np_} ranks")
    if pp > 1:
        from ..parallel.pipeline import check_pp_ranks

        np_ = check_pp_ranks(np_, pp)
    split = check_moe_split(a.moe_split)
    check_placement(ck, np_, pp, weights, split)
    backends.check_choice(a.backend)
    backend = job_backend(a.backend, a.hostfile) if pp > 1 else None  # the launch's backend: its hand-offs
    p = make_plan(ck, np_, weights, link, None if a.bandwidth is None else a.bandwidth * 1e9, memory, pp, split,
                  None if a.host_ms_per_token is None else a.host_ms_per_token * 1e-3, host_layer, a.context,
                  backend, a.pp_handoff)
    print(f"{ck.dir}: {np_} rank(s)")
    for line in format_plan(p):
        print(line)
    if a.hostfile is not None:
        for line in _fetch_lines(a, ck, np_, pp, weights, split):
            print(line)


def _fetch_lines(a, ck, np_: int, pp: int, weights, split) -> list[str]:
    """Per other host, the bytes a launch would send it (fetch.py): asked
    (--ask-hosts), or the most it could be (its ranks' shards)."""
    from types import SimpleNamespace

    from ..checkpoint import fetch, shardcache
    from ..cluster.hostfile import assign_ranks, read_hostfile
    from ..units import format_size
    from .launch import fetch_env

    model = pick_model(a.model, a.model_opt)
    if model is None:  # the embedded default: every host has it
        return []
    if a.ask_hosts:
        launch = SimpleNamespace(hostfile=a.hostfile, fetch=True, shard_cache=a.shard_cache)
        lines = fetch_env(model, launch, np_, pp, weights, split, dry=True) or []
        return [f"fetch {line}" for line in lines]
    hosts = fetch.receiving_hosts(assign_ranks(read_hostfile(a.hostfile).hosts, np_))
    out = []
    for name, (_, ranks) in hosts.items():
        pieces = {p.key: p for r in ranks for p in shardcache.rank_pieces(ck, np_, r, pp, weights, split)}
        n = sum(p.nbytes for p in pieces.values())
        out.append(f"fetch {name}: at most {format_size(n)} ({n} bytes: its ranks' shards; nothing if it holds "
                   "MODEL at this revision or has them cached; --ask-hosts asks it)")
    return out
