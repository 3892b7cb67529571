"""`mlxcel-dist logits`: the logits of every position of a token sequence."""

from __future__ import annotations

import numpy as np

from ..engine.guard import check_tokens
from ..engine.generation import sequence_logits
from ..errors import UserError
from ..checkpoint.loader import open_model
from .common import check_out, err, pp_note, read_tokens
from .launch import checked, distribute, load_shard


def main(ctx, a) -> None:
    ids = read_tokens(a.tokens_file)
    check_out(a.out)
    ck = open_model(a.model)
    try:  # before any rank is launched, naming the file
        check_tokens(ids, ck.args.vocab_size)
        limit = ck.context_length
        if limit is not None and len(ids) > limit:
            raise UserError(f"{len(ids)} tokens, more than the model's context of {limit} (max_position_embeddings)")
    except UserError as e:
        raise UserError(f"{a.tokens_file}: {e}") from None
    kv, adapter = checked(a.model, a.load)
    group = distribute(ctx, a.launch, a.model)
    loaded = load_shard(a.model, a.load.dtype, group, a.launch.pp, kv, adapter)
    result = sequence_logits(loaded.model, ids, decode_from=a.decode_from, prefill_step=a.prefill_step)
    if group.is_root:
        try:
            np.save(a.out, result)
        except OSError as e:
            raise UserError(f"cannot write {a.out}: {e.strerror}") from None
        err(f"wrote {a.out} {list(result.shape)} float32 (np {group.size()}{pp_note(a.launch.pp, loaded.model)})")
