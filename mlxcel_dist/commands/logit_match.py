"""`mlxcel-dist logit-match`: N-rank logits against one process's and a
reference's in every feeding mode; `modes` is the job its ranks run."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import typer

from ..engine.guard import check_tokens
from ..errors import UserError
from ..harness import all_mode_logits, compare, default_tokens, model_window, rel_tol_for
from ..checkpoint.loader import load_model, open_model
from .common import err, pick_model, pp_note, read_tokens
from .launch import (check_moe_split, check_placement, checked, distribute, fetch_env, hostfile_weights, job_backend,
                     load_shard, parse_rank_weights)


def main(ctx, a) -> None:
    model = pick_model(a.model, a.model_opt)
    np_, pp, hostfile = a.launch.np_, a.launch.pp, a.launch.hostfile
    if np_ < 1:
        raise UserError(f"--np must be >= 1, got {np_}")
    if pp != 1:  # --np's default (2) is tensor parallelism's: with --pp alone, one rank per stage
        from ..parallel import pipeline

        given = ctx.get_parameter_source("np_").name not in ("DEFAULT", "DEFAULT_MAP")
        np_ = pipeline.check_pp_ranks(np_ if given else 1, pp)
    model_dir = open_model(model).dir
    kv, adapter = checked(model_dir, a.load)
    single = load_model(model_dir, dtype=a.load.dtype, kv=kv, adapter=adapter)
    m = single.model
    ref = None
    if a.reference is not None:
        ref = _read_reference(a.reference)
    if a.tokens_file is not None:
        ids = read_tokens(a.tokens_file)
    elif ref is not None:
        ids = ref["ids"]
    else:
        ids = default_tokens(m.args.vocab_size, model_window(m))
    if ref is not None and (len(ref["ids"]) != len(ids) or (ref["ids"] != ids).any()):
        raise UserError("--tokens-file ids differ from the reference's ids")
    ids = check_tokens(ids, m.args.vocab_size)
    dtype_name = str(np.dtype("float32")) if single.dtype is None else str(single.dtype).split(".")[-1]
    tol = rel_tol_for(dtype_name)
    err(f"logit-match: {model_dir.name}, {len(ids)} tokens, window {model_window(m)}, {dtype_name}, np {np_}{pp_note(pp)}")
    ours = all_mode_logits(m, ids)
    tp = None
    if np_ > 1 or hostfile is not None:
        tp = _ranks_logits(ctx, a, model_dir, ids, np_)
    rows = []
    run = f"pp{pp}" if pp > 1 else f"np{np_}"
    for mode, logits in ours.items():
        if tp is not None:
            rows.append((mode, f"{run} vs np1", compare(tp[mode], logits, tol)))
        if ref is not None:
            rows.append((mode, "np1 vs reference", compare(logits, ref["logits"], tol)))
            if tp is not None:
                rows.append((mode, f"{run} vs reference", compare(tp[mode], ref["logits"], tol)))
    if not rows:
        raise UserError("nothing to compare: use --np >= 2 (or --pp >= 2) and/or --reference")
    print(f"{'mode':24} {'comparison':20} {'max|diff|':>10} {'mean|diff|':>10} {'rel':>9} {'top1':>6} {'KL':>9}  ok")
    for mode, what, r in rows:
        print(f"{mode:24} {what:20} {r['max']:10.3e} {r['mean']:10.3e} {r['rel']:9.2e} {r['top1']:6.3f} "
              f"{r['kl']:9.2e}  {'yes' if r['ok'] else 'NO'}")
    bad = [r for r in rows if not r[2]["ok"]]
    print(f"tolerance: max|diff| <= {tol:.2e} x logit scale; {len(rows) - len(bad)}/{len(rows)} comparisons match")
    if bad:
        raise typer.Exit(1)


def _ranks_logits(ctx, a, model_dir: Path, ids, np_: int) -> dict:
    """Every mode's logits from np_ ranks: `modes` launched on them."""
    from ..cluster import launcher

    load, launch = a.load, a.launch
    with tempfile.TemporaryDirectory(prefix="mlxcel-match-") as tmp:
        out = Path(tmp).resolve() / "tp.npz"
        argv = ["modes", str(model_dir.resolve()), "--tokens", ",".join(map(str, ids.tolist())), "--out", str(out)]
        if load.dtype:
            argv += ["--dtype", load.dtype]
        if load.max_kv_size is not None:
            argv += ["--max-kv-size", str(load.max_kv_size)]
        if load.kv_bits is not None:
            argv += ["--kv-bits", str(load.kv_bits)]
            argv += ["--kv-group-size", str(load.kv_group_size)] if load.kv_group_size is not None else []
        if load.adapter_path is not None:
            argv += ["--adapter-path", str(Path(load.adapter_path).resolve())]
        split = check_moe_split(launch.moe_split)
        argv += ["--moe-split", split]
        if launch.pp > 1:
            from ..parallel import pipeline

            argv += ["--pp", str(launch.pp), "--pp-handoff", launch.pp_handoff]
            pipeline.handoff_mode(launch.pp_handoff, job_backend(launch.backend, launch.hostfile), launch.pp,
                                  np_ // launch.pp)
        weights = parse_rank_weights(launch.rank_weights)
        if weights is None and launch.hostfile is not None:
            weights = hostfile_weights(ctx, launch.hostfile, np_)
        if weights is not None:
            if len(weights) != np_:
                raise UserError(f"--rank-weights gives {len(weights)} weights for {np_} ranks")
            argv += ["--rank-weights", ",".join(map(str, weights))]
        check_placement(model_dir, np_, launch.pp, weights, split)
        env = fetch_env(str(model_dir.resolve()), launch, np_, launch.pp, weights, split,
                        None if load.adapter_path is None else str(Path(load.adapter_path).resolve()))
        code = launcher.launch(argv, np_, launch.backend, str(launch.hostfile) if launch.hostfile else None,
                               stall_timeout=launch.stall_timeout, **({"env": env} if env else {}))
        if code != 0:
            raise UserError(f"the {np_}-rank run failed (exit code {code})")
        with np.load(out) as z:
            return {k: z[k] for k in z.files}


def _read_reference(path: Path) -> dict:
    if not path.exists():
        raise UserError(f"{path}: no such reference file")
    try:
        with np.load(path, allow_pickle=False) as z:
            if "ids" not in z.files or "logits" not in z.files:
                raise UserError(f"{path}: a reference npz needs 'ids' and 'logits'")
            return {"ids": z["ids"], "logits": z["logits"]}
    except (ValueError, OSError) as e:
        raise UserError(f"{path}: not an npz file ({e})") from None


def modes(ctx, a) -> None:
    """The ranks' job: one sequence's logits in every mode, rank 0 writes the npz."""
    try:
        ids = np.array([int(t) for t in a.tokens.split(",")], np.int64)
    except ValueError:
        raise UserError("--tokens must be comma-separated integers") from None
    kv, adapter = checked(a.model, a.load)
    group = distribute(ctx, a.launch, a.model)
    loaded = load_shard(a.model, a.load.dtype, group, a.launch.pp, kv, adapter)
    result = all_mode_logits(loaded.model, ids)
    if group.is_root:
        np.savez(a.out, **result)
