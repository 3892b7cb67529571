"""Rank job for the TP tests: every fixture case in every mode, one launch.

usage (under the launcher): tp_cases.py OUT_DIR [--short] CASE_DIR[@W0,W1,...] ...
--short: the first harness.short_length tokens only. Rank 0 writes OUT_DIR/<family>__<case>.npz (one array per mode; with rank
weights after "@", as --rank-weights takes them: <family>__<case>@W0,W1.npz).
Loading the cases one after another in one job amortises process start-up.
"""

import sys
from pathlib import Path

import numpy as np

from mlxcel_dist.parallel import distributed
from mlxcel_dist.cli import parse_rank_weights
from mlxcel_dist.harness import all_mode_logits, model_window, short_length
from mlxcel_dist.checkpoint.loader import load_model


def main():
    out = Path(sys.argv[1])
    group = distributed.init_from_env()
    short = sys.argv[2:3] == ["--short"]
    for arg in sys.argv[2 + short:]:
        path, _, weights = arg.partition("@")
        d = Path(path)
        group.set_weights(parse_rank_weights(weights))
        ids = np.load(d / "reference.npz")["ids"]
        model = load_model(d, group=group).model
        if short:
            ids = ids[: short_length(model_window(model), len(ids))]
        result = all_mode_logits(model, ids)
        if group.is_root:
            np.savez(out / f"{d.parent.name}__{d.name}{'@' + weights if weights else ''}.npz", **result)


if __name__ == "__main__":
    main()
