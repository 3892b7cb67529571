"""Around every model command's work: with more than one rank the command
re-runs itself on every rank through the launcher (`distribute`), each rank
joins the group and loads its shard (`load`); what a rank would refuse
(heads that do not split, bad weights, a cache or adapter the model cannot
take) is refused here first, once, before any rank is launched.

`launch` is the command's LaunchOptions (--np, --pp, --backend, --hostfile,
--rank-weights, --moe-split, --pp-handoff, --stall-timeout) and `load` its LoadOptions
(--max-kv-size, --kv-bits, --kv-group-size, --adapter-path, --dtype), both
declared in cli.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

from ..cluster import backends
from ..errors import UserError


def distribute(ctx: typer.Context, launch, model=None):
    """Launch ranks (and exit with the job's code) or join the group: the
    `collectives.Group` of this process (`SINGLE` when it runs alone).

    Before launching, the model is sharded on paper for every rank, so a rank
    count its heads cannot take fails here, once (with --pp: the family must
    run in stages and have a layer per stage, loader.check_stageable)."""
    np_, pp, hostfile = launch.np_, launch.pp, launch.hostfile
    weights = parse_rank_weights(launch.rank_weights)
    split = check_moe_split(launch.moe_split)
    if os.environ.get("MLXCEL_DIST_WORLD"):  # we are a launched rank
        from ..parallel import distributed
        from ..checkpoint.loader import model_present

        group = distributed.init_from_env()
        if weights is not None and not group.single:  # every rank re-runs the same argv: the same weights
            group.set_weights(weights)
        group.moe_split = split  # the same argv on every rank: the same placement
        group.pp_handoff = launch.pp_handoff  # resolved with the backend where the stages are cut
        distributed.check_cluster(group, model, model_present(model))
        return group
    if np_ < 1:
        raise UserError(f"--np must be >= 1, got {np_}")
    if pp != 1:
        from ..parallel import pipeline

        np_ = pipeline.check_pp_ranks(np_, pp)
    if weights is not None and len(weights) != np_:
        raise UserError(f"--rank-weights gives {len(weights)} weights for {np_} ranks")
    if weights is None and hostfile is not None:
        weights = hostfile_weights(ctx, hostfile, np_)
    backends.check_choice(launch.backend)
    if pp > 1 or launch.pp_handoff != "auto":
        from ..parallel import pipeline

        pipeline.handoff_mode(launch.pp_handoff, job_backend(launch.backend, hostfile), pp, np_ // pp)
    if np_ == 1 and hostfile is None:
        from ..parallel.collectives import SINGLE

        return SINGLE
    from ..cluster import launcher  # looked up at the call: tests replace launcher.launch

    check_placement(model, np_, pp, weights, split)
    env = fetch_env(model, launch, np_, pp, weights, split, ctx.params.get("adapter_path"))
    code = launcher.launch(argv_from_ctx(ctx), np_, launch.backend, str(hostfile) if hostfile else None,
                           stall_timeout=launch.stall_timeout, **({"env": env} if env else {}))
    raise typer.Exit(code)


def fetch_env(model, launch, np_: int, pp: int, weights, split: str, adapter_path=None, dry: bool = False):
    """With a hostfile (and not --no-fetch): each host without MODEL at this
    revision gets its ranks' shards (fetch.py); the ranks' environment that
    points them at their cache entries (None: every rank reads MODEL).
    `dry`: only the per-host byte counts (plan --ask-hosts), as fetch summary lines."""
    if launch.hostfile is None or not launch.fetch or model is None:
        return None
    from ..checkpoint import fetch, shardcache
    from ..cluster.hostfile import assign_ranks, read_hostfile
    from ..checkpoint.loader import open_model

    placement = assign_ranks(read_hostfile(launch.hostfile).hosts, np_)
    hosts = fetch.receiving_hosts(placement)
    if not hosts:
        return None
    ck = open_model(model)
    pieces = {r: shardcache.rank_pieces(ck, np_, r, pp, weights, split) for _, rs in hosts.values() for r in rs}
    spec, states = fetch.fetch_shards(ck, str(model), hosts, pieces, launch.shard_cache, adapter_path, dry=dry)
    lines = fetch.summary(states, dry)
    if dry:
        return lines
    for line in lines:
        print(f"mlxcel-dist: fetch {line}", file=sys.stderr, flush=True)
    return {shardcache.ENV: spec} if spec else None


def job_backend(backend: str, hostfile) -> str:
    """The backend a launch will use (`auto` resolved as the launcher will)."""
    if backend != "auto":
        return backend
    from ..cluster.hostfile import read_hostfile

    info = read_hostfile(hostfile) if hostfile is not None else None
    return backends.default_backend(info is None, info)


def argv_from_ctx(ctx: typer.Context) -> list[str]:
    """The command line that re-creates this command on each rank."""
    argv = [ctx.info_name]
    for p in ctx.command.params:
        v = ctx.params.get(p.name)
        if p.param_type_name == "argument":
            if v is not None:
                argv.append(str(v))
        elif getattr(p, "is_flag", False):
            if v and p.opts:
                argv.append(p.opts[0])
            elif v is False and p.secondary_opts:  # None: not given (an auto default)
                argv.append(p.secondary_opts[0])
        elif isinstance(v, (list, tuple)):  # repeatable option
            for item in v:
                argv.append(_opt_value(p.opts[0], item))
        elif v is not None:
            argv.append(_opt_value(p.opts[0], v))
    return argv


def _opt_value(opt: str, v) -> str:
    # --opt=VALUE: a value that starts with "-" (say --stop "-") stays a value.
    return f"{opt}={v}" if opt.startswith("--") else f"{opt}{v}"


def hostfile_weights(ctx: typer.Context, hostfile: Path, np_: int):
    """The ranks' weights from the hostfile's per-host ``weight`` (None when it
    sets none); put in the ranks' argv as --rank-weights (the ranks never read
    the hostfile)."""
    from ..cluster.hostfile import rank_weights, read_hostfile

    weights = rank_weights(read_hostfile(hostfile).hosts, np_)
    if weights is not None:
        ctx.params["rank_weights"] = ",".join(map(str, weights))
    return weights


def check_moe_split(value: Optional[str]) -> str:
    """--moe-split's value (default intermediate)."""
    from ..parallel.partition import MOE_SPLITS

    value = value or "intermediate"
    if value not in MOE_SPLITS:
        raise UserError(f"--moe-split must be one of {', '.join(MOE_SPLITS)}, got {value!r}")
    return value


def parse_rank_weights(text: Optional[str]):
    """--rank-weights "3,1,1" -> (Fraction(3), Fraction(1), Fraction(1)) (exact,
    so every rank splits alike); None when not given."""
    if text is None or text == "":
        return None
    from fractions import Fraction

    try:
        weights = tuple(Fraction(w.strip()) for w in text.split(","))
    except (ValueError, ZeroDivisionError):
        raise UserError(f"--rank-weights must be comma-separated positive numbers, got {text!r}") from None
    if any(w <= 0 for w in weights):
        raise UserError(f"--rank-weights must be positive, got {text!r}")
    return weights


def check_placement(model, np_: int, pp: int, weights, moe_split: str | None = None) -> None:
    """Before launch, on paper: the model splits over np_ ranks (with --pp:
    into pp stages, each split np_ / pp ways)."""
    from ..checkpoint.loader import check_shardable, check_stageable

    if pp > 1:
        from ..parallel.pipeline import member_weights

        check_stageable(model, pp, weights)
        T = np_ // pp
        for s in range(pp):  # each stage splits over its own ranks, by their weights
            check_shardable(model, T, member_weights(weights, s * T, pp), moe_split)
    else:
        check_shardable(model, np_, weights, moe_split)


def kv_options(model, load):
    """--max-kv-size / --kv-bits / --kv-group-size checked against the model's
    head_dim (before any rank is launched) as a cache.KVOptions."""
    from ..cache import KVOptions
    from ..cache.options import config_head_dim

    kv = KVOptions(load.max_kv_size, load.kv_bits, load.kv_group_size)
    if load.kv_bits is None:
        return kv.check()
    from ..checkpoint.loader import open_model
    from ..models import get_model_module

    ck = open_model(model)
    a = ck.args
    refused = get_model_module(a.model_type).Model.kv_bits_refused
    if refused:
        raise UserError(f"--kv-bits: {a.model_type} cannot take a quantized cache ({refused})")
    return kv.check(config_head_dim(a))


def adapter(model, adapter_path):
    """--adapter-path read and checked against the model (before any rank is
    launched; each rank reads it again)."""
    if adapter_path is None:
        return None
    from ..checkpoint.loader import build_model, open_model
    from ..nn.lora import Adapter

    adapter = Adapter(adapter_path)
    adapter.check(build_model(open_model(model).config))
    return adapter


def checked(model, load):
    """The KV options and the adapter of `load`, checked against the model."""
    return kv_options(model, load), adapter(model, load.adapter_path)


def load_shard(model, dtype, group, pp: int = 1, kv=None, adapter=None):
    """Load this rank's shard (or pipeline stage); rank 0 shows a progress bar on stderr.
    On a CUDA GPU the decode's kernels are compiled beside the load (engine/warmup.py)."""
    from ..checkpoint.loader import load_model
    from ..engine import warmup

    warmup.start(model, dtype, group.size())

    if not group.is_root:
        return load_model(model, dtype=dtype, group=group, pp=pp, kv=kv, adapter=adapter)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    console = Console(stderr=True)
    with Progress(TextColumn("loading"), BarColumn(), MofNCompleteColumn(), console=console,
                  transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("load", total=None)
        loaded = load_model(model, dtype=dtype, group=group, pp=pp, kv=kv, adapter=adapter,
                            progress=lambda i, n: bar.update(task, completed=i, total=n))
    return loaded

