"""Reference logits for --max-kv-size N: transformers (eager, fp32) over a
committed fixture checkpoint with every full-attention layer windowed at N
and every sliding layer at min(window, N), the attention a rotating cache of
N slots gives (mlx-lm's RotatingKVCache with keep=0).

transformers has no such option; its masking code takes an already prepared
4D mask as it is (a dict of them per attention kind for the families with
both kinds), so the window is given as additive [1, 1, T, T] masks to ONE
full forward pass (no cache). The script first checks the method: with N >=
T the masks are plain causal and the logits must equal the fixture's own
reference.npz.

Writes tests/fixtures/max_kv/<case>.npz: ids, logits, max_kv_size, and the
fixture it was computed on (`fixture`, relative to tests/fixtures).
Run: python scripts/fixtures_max_kv.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fixture_lib import FIXTURES, write_npz  # noqa: E402

# (fixture, N): all-full llama; gemma3 with N above its window (sliding
# layers keep theirs); qwen3 with N below it (both kinds bounded)
CASES = [("llama/gqa_fp32", 12), ("gemma3/gqa_fp32", 24), ("qwen3/sliding_fp32", 6)]


def window_mask(T: int, window: int) -> torch.Tensor:
    """Additive [1, 1, T, T]: key k visible to query q iff q - window < k <= q."""
    q = torch.arange(T)[:, None]
    k = torch.arange(T)[None, :]
    ok = (k <= q) & (k > q - window)
    return torch.where(ok, 0.0, float("-inf"))[None, None].to(torch.float32)


def logits_with(model, config: dict, ids: np.ndarray, N: int) -> np.ndarray:
    T = len(ids)
    kinds = set(config.get("layer_types") or ["full_attention"])
    masks = {"full_attention": window_mask(T, N)}
    if "sliding_attention" in kinds:
        masks["sliding_attention"] = window_mask(T, min(int(config["sliding_window"]), N))
    mask = masks if len(kinds) > 1 else masks[kinds.pop()]
    with torch.no_grad():
        out = model(torch.tensor(ids[None].astype(np.int64)), attention_mask=mask, use_cache=False)
    return out.logits[0].float().numpy()


def main() -> None:
    torch.set_num_threads(1)
    out_dir = FIXTURES / "max_kv"
    out_dir.mkdir(exist_ok=True)
    for case, N in CASES:
        d = FIXTURES / case
        config = json.loads((d / "config.json").read_text())
        model = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager", dtype=torch.float32).eval()
        with np.load(d / "reference.npz") as z:
            ids, ref = z["ids"], z["logits"]
        check = logits_with(model, config, ids, len(ids))
        err = float(np.abs(check - ref).max() / np.abs(ref).max())
        assert err < 1e-6, f"{case}: the mask method is off by {err:.2e} of the scale without a bound"
        logits = logits_with(model, config, ids, N)
        moved = float(np.abs(logits - ref).max() / np.abs(ref).max())
        name = case.replace("/", "__")
        write_npz(out_dir / f"{name}.npz", {"ids": ids.astype(np.int32), "logits": logits.astype(np.float32),
                                            "max_kv_size": np.array(N, np.int32), "fixture": np.array(case)})
        print(f"{name}: N {N}, T {len(ids)}; unbounded masks match reference.npz to {err:.1e}; "
              f"the bound moves the logits by {moved:.2f} of the scale")


if __name__ == "__main__":
    main()
