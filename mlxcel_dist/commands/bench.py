"""`mlxcel-dist bench`: prefill/decode speed, time to first token, peak
memory per rank (bench.run_bench), as a table or one JSON line."""

from __future__ import annotations

import json
import os
import time

from ..bench import check_lengths, format_table, run_bench
from ..engine.guard import check_generation_options
from ..errors import UserError
from .common import pick_model
from .generate import check_drafting, make_drafter
from .launch import checked, distribute, load_shard


def main(ctx, a) -> None:
    load, launch = a.load, a.launch
    model = pick_model(a.model, a.model_opt)
    ctx.params.update(model=model, model_opt=None)
    check_lengths(a.prompt_tokens, a.gen_tokens)
    check_generation_options(check_every=a.check_every, prefill_step=a.prefill_step)
    if a.prompt_file is not None and not a.prompt_file.is_file():
        raise UserError(f"{a.prompt_file}: no such prompt file")
    if not os.environ.get("MLXCEL_DIST_WORLD"):
        check_drafting(a.draft_model, a.prompt_lookup, a.num_draft_tokens, model, pp=launch.pp)
    kv, adapter = checked(model, load)
    group = distribute(ctx, launch, model)
    t0 = time.perf_counter()
    loaded = load_shard(model, load.dtype, group, launch.pp, kv, adapter)
    load_s = time.perf_counter() - t0
    drafter = make_drafter(a.draft_model, a.prompt_lookup, a.num_draft_tokens, load.dtype, a.compiled, a.prefill_step)
    ids = None
    if a.prompt_file is not None:
        from ..checkpoint.tokenizer import Tokenizer

        text = a.prompt_file.read_text(encoding="utf-8")
        ids = Tokenizer(loaded.model_dir, loaded.config).prompt_ids(text, chat=False)[:a.prompt_tokens]
    result = run_bench(loaded.model, a.prompt_tokens, a.gen_tokens, group=group, prefill_step=a.prefill_step,
                       seed=a.seed, check_every=a.check_every, warmup=a.warmup, compiled=a.compiled,
                       drafter=drafter, ids=ids)
    if group.is_root:
        result = {"model": str(loaded.model_dir), "backend": os.environ.get("MLXCEL_DIST_BACKEND", "none"),
                  "load_s": load_s, "pp": launch.pp, **result}
        if a.as_json:
            print(json.dumps(result), flush=True)
        else:
            print(f"model  {result['model']} (backend {result['backend']})")
            print(format_table(result), flush=True)
