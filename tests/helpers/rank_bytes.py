"""Rank job: load a model sharded and report what this rank read and holds.

usage (under the launcher): rank_bytes.py MODEL_DIR OUT_DIR
Each rank writes OUT_DIR/rank<r>.json with bytes read from the checkpoint and
bytes of parameters held.
"""

import json
import sys
from pathlib import Path

from mlx.utils import tree_flatten

from mlxcel_dist.parallel import distributed
from mlxcel_dist.checkpoint import weights
from mlxcel_dist.checkpoint.loader import load_model


def main():
    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    group = distributed.init_from_env()
    m = load_model(model_dir, group=group).model
    held = sum(v.nbytes for _, v in tree_flatten(m.parameters()))
    r = group.rank()
    (out / f"rank{r}.json").write_text(json.dumps({"read": weights.bytes_read, "held": held}))


if __name__ == "__main__":
    main()
