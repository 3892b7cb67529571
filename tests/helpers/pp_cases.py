"""Rank job for the pipeline tests: every fixture case in every mode, in
P stages of size / P ranks each (tensor parallel inside a stage), one launch.

usage (under the launcher): pp_cases.py OUT_DIR P [--collective] [--decode] [--short] CASE_DIR [CASE_DIR ...]
--short: the first harness.short_length tokens only.
--collective: the stages hand on by collectives (--pp-handoff collective:
no send/recv, what MLX's NCCL backend needs).
--decode: the first DECODE_TOKENS tokens only, the last DECODE_STEPS of them
decoded one at a time (compiled decode steps, as `logits --decode-from`:
a job ending so left MPI unfinalized, issue 41); written as mode "decode".
Rank 0 writes OUT_DIR/<family>__<case>.npz (one array per mode) and
OUT_DIR/<family>__<case>.stages.json (each rank's layer range and parameter
names, gathered through a file per rank).
"""

import json
import sys
from pathlib import Path

import numpy as np
from mlx.utils import tree_flatten

from mlxcel_dist.parallel import distributed
from mlxcel_dist.engine.generation import sequence_logits
from mlxcel_dist.harness import all_mode_logits, model_window, short_length
from mlxcel_dist.checkpoint.loader import load_model


DECODE_TOKENS, DECODE_STEPS = 12, 4


def main():
    out = Path(sys.argv[1])
    group = distributed.init_from_env()
    P = int(sys.argv[2])
    flags = {a for a in sys.argv[3:] if a.startswith("--")}
    group.pp_handoff = "collective" if "--collective" in flags else "auto"
    for d in (Path(a) for a in sys.argv[3:] if not a.startswith("--")):
        ids = np.load(d / ("reference.npz" if (d / "reference.npz").exists() else "mlx_lm_reference.npz"))["ids"]
        model = load_model(d, group=group, pp=P).model
        if "--short" in flags:
            ids = ids[: short_length(model_window(model), len(ids))]
        stage = model.model.stage
        names = sorted(n for n, _ in tree_flatten(model.parameters()))
        (out / f"{d.parent.name}__{d.name}.rank{group.rank()}.json").write_text(
            json.dumps({"start": stage.start, "stop": stage.stop, "index": stage.index, "member": stage.member,
                        "names": names}))
        if "--decode" in flags:
            result = {"decode": sequence_logits(model, ids[:DECODE_TOKENS], decode_from=DECODE_TOKENS - DECODE_STEPS)}
        else:
            result = all_mode_logits(model, ids)
        if group.is_root:
            np.savez(out / f"{d.parent.name}__{d.name}.npz", **result)


if __name__ == "__main__":
    main()
