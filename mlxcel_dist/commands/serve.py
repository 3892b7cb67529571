"""`mlxcel-dist serve`: the options checked before any rank is launched, then
serve.lifecycle.run on every rank (rank 0 listens)."""

from __future__ import annotations

import math
import os

from ..errors import UserError
from ..serve.lifecycle import listen, long_lived_env
from ..serve.pacing import STALL
from .common import pick_model
from .launch import checked, distribute, load_shard


def main(ctx, a) -> None:
    # first: MLX reads these at its first GPU evaluation (set after one, they
    # are ignored; measured); the ranks started below inherit them
    long_lived_env()
    from ..engine.guard import check_generation_options
    from ..engine.sampling import SamplingParams
    from ..serve.lifecycle import Options, run
    from ..serve.openai_schema import Defaults
    from ..checkpoint.tokenizer import Tokenizer
    from ..units import parse_size

    load, launch = a.load, a.launch
    model = pick_model(a.model, a.model_opt)
    ctx.params.update(model=model, model_opt=None)

    if not 0 <= a.port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {a.port}")
    if not 1 <= a.max_tokens_cap < 2**31:
        raise UserError(f"--max-tokens-cap must be in [1, 2^31), got {a.max_tokens_cap}")
    if a.max_request_bytes < 1:
        raise UserError(f"--max-request-bytes must be >= 1, got {a.max_request_bytes}")
    check_generation_options(max_tokens=a.max_tokens, prefill_step=a.prefill_step)
    if a.max_tokens is not None and a.max_tokens > a.max_tokens_cap:
        raise UserError(f"--max-tokens ({a.max_tokens}) must be <= --max-tokens-cap ({a.max_tokens_cap})")
    SamplingParams(temp=a.temp, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p).validate()
    if a.decode_concurrency < 1:
        raise UserError(f"--decode-concurrency must be >= 1, got {a.decode_concurrency}")
    if a.prompt_concurrency < 1:
        raise UserError(f"--prompt-concurrency must be >= 1, got {a.prompt_concurrency}")
    if a.max_num_batched_tokens is not None and a.max_num_batched_tokens < 1:
        raise UserError(f"--max-num-batched-tokens must be >= 1, got {a.max_num_batched_tokens}")
    if not 1.1 <= a.max_stall <= 100:
        raise UserError(f"--max-stall must be in [1.1, 100], got {a.max_stall:g}")
    if a.max_stall != STALL and a.max_num_batched_tokens is not None:
        raise UserError("--max-stall paces the prefill; --max-num-batched-tokens fixes it: give one of them")
    if not 1 <= a.micro_batches <= 64:
        raise UserError(f"--micro-batches must be in [1, 64], got {a.micro_batches}")
    if a.micro_batches > 1 and launch.pp <= 1:
        raise UserError("--micro-batches splits steps between pipeline stages: it needs --pp P (P >= 2)")
    if a.prompt_cache_size < 0:
        raise UserError(f"--prompt-cache-size must be >= 0, got {a.prompt_cache_size}")
    if not (math.isfinite(a.header_timeout) and 0 < a.header_timeout <= 86400):
        raise UserError(f"--header-timeout must be in (0, 86400] seconds, got {a.header_timeout}")
    from ..serve.tools import FORMATS

    if a.tool_call_parser is not None and a.tool_call_parser not in FORMATS:
        raise UserError(f"--tool-call-parser must be one of {', '.join(FORMATS)}, got {a.tool_call_parser!r}")
    from ..serve import reasoning

    if a.reasoning_parser is not None and a.reasoning_parser not in (*reasoning.FORMATS, "none"):
        raise UserError(f"--reasoning-parser must be one of {', '.join(reasoning.FORMATS)} or none, "
                        f"got {a.reasoning_parser!r}")
    names = [n for n in (a.served_model_name or []) if n.strip()]
    if a.served_model_name and len(names) != len(a.served_model_name):
        raise UserError("--served-model-name must not be empty")
    cache_bytes = None if a.prompt_cache_bytes is None else parse_size(a.prompt_cache_bytes, "--prompt-cache-bytes")
    if not os.environ.get("MLXCEL_DIST_WORLD"):  # before launch
        from .generate import check_drafting

        check_drafting(a.draft_model, a.prompt_lookup, a.num_draft_tokens, model, pp=launch.pp)
    defaults = Defaults(temp=a.temp, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p, max_tokens=a.max_tokens)
    kv, adapter = checked(model, load)
    if a.extra_eos_token and not os.environ.get("MLXCEL_DIST_WORLD"):  # an unknown token fails before launch
        from ..checkpoint.loader import open_model

        ck = open_model(model)
        Tokenizer(ck.dir, ck.config, extra_eos=a.extra_eos_token)
    group = distribute(ctx, launch, model)
    sock = listen(a.host, a.port) if group.is_root else None  # before the load: a port in use fails at once
    loaded = load_shard(model, load.dtype, group, launch.pp, kv, adapter)
    tok = Tokenizer(loaded.model_dir, loaded.config, extra_eos=a.extra_eos_token or ())
    names = names or [str(model if model is not None else loaded.model_dir.name)]
    opts = Options(max_tokens_cap=a.max_tokens_cap, max_request_bytes=a.max_request_bytes, defaults=defaults,
                   decode_concurrency=a.decode_concurrency, prompt_concurrency=a.prompt_concurrency,
                   prompt_cache_size=a.prompt_cache_size, prompt_cache_bytes=cache_bytes,
                   prefill_step=a.prefill_step, max_num_batched_tokens=a.max_num_batched_tokens, warmup=a.warmup,
                   max_stall=a.max_stall,
                   micro_batches=a.micro_batches,
                   served_names=list(dict.fromkeys(names)), header_timeout_s=a.header_timeout,
                   tool_call_parser=a.tool_call_parser, reasoning_parser=a.reasoning_parser,
                   draft_model=a.draft_model, prompt_lookup=a.prompt_lookup, num_draft_tokens=a.num_draft_tokens,
                   dtype=load.dtype)
    run(loaded.model, tok, group, opts, sock, loaded.config)
