"""Rank job for tests/test_moe_experts.py: MoE cases under a routed-expert
placement, one launch.

usage (under the launcher): moe_cases.py OUT_DIR CASE_DIR@SPLIT[@W0,W1,...] ...
For case i, rank 0 writes OUT_DIR/<i>.npz (one array per mode, the ids of the
case's reference.npz, else mlx_lm_reference.npz) and every rank r writes
OUT_DIR/<i>.rank<r>.json: the first routed-experts module's expert_range and
gate (or fused gate_up) weight shape (experts.SwitchGLU).
"""

import json
import sys
from pathlib import Path

import numpy as np

from mlxcel_dist.parallel import distributed
from mlxcel_dist.cli import parse_rank_weights
from mlxcel_dist.harness import all_mode_logits
from mlxcel_dist.checkpoint.loader import load_model


def main():
    out = Path(sys.argv[1])
    group = distributed.init_from_env()
    for i, arg in enumerate(sys.argv[2:]):
        path, split, w = (arg.split("@") + [""])[:3]
        d = Path(path)
        group.set_weights(parse_rank_weights(w))
        group.moe_split = split
        ref = d / "reference.npz" if (d / "reference.npz").exists() else d / "mlx_lm_reference.npz"
        model = load_model(d, group=group).model
        sw = next(m for _, m in model.named_modules() if hasattr(m, "expert_range"))  # an experts.SwitchGLU
        gate = sw.gate_up_proj if sw.fused else sw.gate_proj
        info = {"expert_range": sw.expert_range, "gate_shape": list(gate.weight.shape)}
        (out / f"{i}.rank{group.rank()}.json").write_text(json.dumps(info))
        result = all_mode_logits(model, np.load(ref)["ids"])
        if group.is_root:
            np.savez(out / f"{i}.npz", **result)


if __name__ == "__main__":
    main()
