"""Rank job for tests/test_diffusion_gemma.py: every DiffusionGemma fixture's
canvas logits (with and without self-conditioning, after a prompt longer and
shorter than the window) and its greedy block-diffusion ids, under TP.

usage (under the launcher): diffusion_gemma_canvas.py OUT_DIR CASE_DIR [CASE_DIR ...]
Rank 0 writes OUT_DIR/<case>.npz."""

import sys
from pathlib import Path

import numpy as np

from mlxcel_dist.parallel import distributed
from mlxcel_dist.checkpoint.loader import load_model

sys.path.insert(0, str(Path(__file__).parent.parent))
from test_diffusion_gemma import canvas_outputs, greedy_ids  # noqa: E402


def main():
    out = Path(sys.argv[1])
    group = distributed.init_from_env()
    for d in map(Path, sys.argv[2:]):
        z = np.load(d / "reference.npz")
        model = load_model(d, group=group).model
        res = canvas_outputs(model, z)
        ids, passes = greedy_ids(model, z)
        res["gen_ids"], res["gen_passes"] = np.array(ids, np.int32), np.array([passes], np.int32)
        if group.is_root:
            np.savez(out / f"{d.name}.npz", **res)


if __name__ == "__main__":
    main()
