"""Rank job for the quantized TP tests: load each quantized checkpoint sharded
and compute its logits in every feeding mode, one launch for all cases.

usage (under the launcher): quantized_cases.py OUT_DIR CASE_DIR IDS [CASE_DIR IDS ...]
IDS is an .npz with `ids`. Rank 0 writes OUT_DIR/<i>.npz (one array per mode)
for the i-th case, and every rank writes OUT_DIR/<i>.rank<r>.json: the layer
types it built and the checkpoint bytes it read.
"""

import json
import sys
from pathlib import Path

import numpy as np

from mlxcel_dist.parallel import distributed
from mlxcel_dist.checkpoint import weights
from mlxcel_dist.harness import all_mode_logits
from mlxcel_dist.checkpoint.loader import load_model


def main():
    out = Path(sys.argv[1])
    group = distributed.init_from_env()
    r = group.rank()
    args = sys.argv[2:]
    for i, (d, ids_file) in enumerate(zip(args[::2], args[1::2])):
        ids = np.load(ids_file)["ids"]
        before = weights.bytes_read
        model = load_model(d, group=group).model
        read = weights.bytes_read - before
        layer = model.layers[0]
        kinds = {name: type(getattr(layer.self_attn, name)).__name__ for name in ("q_proj", "o_proj")}
        kinds.update({name: type(getattr(layer.mlp, name)).__name__ for name in ("up_proj", "down_proj")})
        kinds["embed_tokens"] = type(model.model.embed_tokens).__name__
        (out / f"{i}.rank{r}.json").write_text(json.dumps({"kinds": kinds, "read": read}))
        result = all_mode_logits(model, ids)
        if r == 0:
            np.savez(out / f"{i}.npz", **result)


if __name__ == "__main__":
    main()
