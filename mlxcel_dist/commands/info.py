"""`mlxcel-dist info`: a checkpoint's config summary, context length,
per-layer attention kind, parameters and bytes per rank."""

from __future__ import annotations

import numpy as np
from mlx.utils import tree_flatten

from ..errors import UserError
from ..checkpoint.loader import build_model, check_shardable, open_model
from ..plan import rank_plans
from .common import pick_model


def main(ctx, a) -> None:
    ck = open_model(pick_model(a.model, a.model_opt))
    np_ = a.np_
    if np_ < 1:
        raise UserError(f"--np must be >= 1, got {np_}")
    check_shardable(ck, np_)
    ranks = rank_plans(ck, np_)  # on paper, as the ranks shard it
    model_dir, config = ck.dir, ck.config
    m = build_model(config)
    args = m.args
    refs = m.sanitize(dict(ck.refs))
    # The model as built (unquantized, lazy: nothing is read) has the logical
    # shapes; stored packed 4-bit words or scales would miscount them.
    n_params = sum(int(np.prod(p.shape)) for _, p in tree_flatten(m.parameters()))
    dtypes = sorted({r.dtype for r in refs.values()})
    print(f"model       {model_dir}")
    print(f"model_type  {config.get('model_type')} -> {args.model_type}")
    print(f"parameters  {n_params:,} ({', '.join(dtypes)})")
    print(f"hidden      {args.hidden_size}, intermediate {args.intermediate_size}, vocab {args.vocab_size}")
    print(f"heads       {args.num_attention_heads} q, {args.num_key_value_heads} kv, head_dim {args.head_dim}")
    print(f"layers      {args.num_hidden_layers}")
    print(f"context     {ck.context_length or 'not set'} tokens (max_position_embeddings)")
    for line in m.describe_layers():
        print(f"  {line}")
    shared = " (tensor parallel: replicated tensors counted on every rank)" if np_ > 1 else ""
    print(f"per rank    np {np_}{shared}")
    for rp in ranks:
        print(f"  rank {rp.rank:<3} {rp.params:,} parameters, {rp.bytes:,} bytes ({rp.bytes / 2**20:.2f} MiB)")
