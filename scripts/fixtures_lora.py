"""LoRA / DoRA adapters trained by mlx-lm on the embedded default model, and
mlx-lm's logits with each (what `--adapter-path` must reproduce).

For every case: `mlx_lm lora --train` for a few iterations on a few lines of
text (a YAML config gives rank, scale and, for some cases, the layer keys),
then the adapter's two files (adapter_config.json, with its local paths made
relative, and adapters.safetensors) go to tests/fixtures/lora/<case>/ and
`mlx_lm.load(model, adapter_path=...)`'s logits of fixed ids (one forward,
no cache, float32) to mlx_lm_logits.npz: `ids`, `logits`, `base` (the same
ids without the adapter, so a test can see that the adapter moves them) and
`logits_as_shipped`.

mlx-lm's gemma3 rounds the embedding scale sqrt(hidden_size) to bfloat16
(11.3125 for the default model's 11.3137, transformers keeps it in the
weights' dtype): that alone puts its plain logits 1.7e-4 of the scale from
transformers' and ours. `logits` and `base` therefore come from mlx-lm's
own forward given the embeddings (`input_embeddings`) pre-multiplied by
sqrt(H) / bf16(sqrt(H)), which makes its scaling exact and leaves the
adapter as the only thing compared; `logits_as_shipped` is its plain call.
CI has no mlx-lm: the committed logits are its reference there.

Run: python scripts/fixtures_lora.py [--logits-only]   (needs mlx-lm; training
takes minutes on 2 cores; --logits-only recomputes the logits of the
committed adapters)
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "gemma3-tiny"
OUT = ROOT / "tests" / "fixtures" / "lora"
sys.path.insert(0, str(ROOT / "scripts"))
from fixture_lib import write_npz  # noqa: E402

LINES = [
    "The boat is red. The boat is red. The boat is red and the sea is green.",
    "Every boat on the green sea is red, and every red boat sails at dawn.",
    "Red boats, green sea: the harbour wakes and the red boats go out.",
    "A red boat and a green sea make the morning bright for the sailors.",
]
# (case, fine_tune_type, num_layers, lora_parameters)
CASES = [
    ("lora_last2", "lora", 2, {"rank": 4, "scale": 20.0, "dropout": 0.0}),
    ("dora_keys", "dora", -1, {"rank": 2, "scale": 10.0, "dropout": 0.0,
                               "keys": ["self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.down_proj"]}),
]


def train(tmp: Path, case: str, kind: str, num_layers: int, params: dict) -> Path:
    data = tmp / "data"
    data.mkdir(exist_ok=True)
    for split, n in (("train", 4), ("valid", 2)):
        (data / f"{split}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in LINES[:n]))
    cfg = tmp / f"{case}.yaml"
    cfg.write_text(json.dumps({"lora_parameters": params}))  # JSON is YAML
    adapter = tmp / case
    subprocess.run([sys.executable, "-m", "mlx_lm", "lora", "--model", str(MODEL), "--train", "--data", str(data),
                    "--fine-tune-type", kind, "--num-layers", str(num_layers), "--iters", "30", "--batch-size", "2",
                    "--learning-rate", "5e-3", "--steps-per-eval", "1000", "--val-batches", "1", "--seed", "0",
                    "--adapter-path", str(adapter), "-c", str(cfg)], check=True)
    return adapter


def exact_logits(model, ids):
    """mlx-lm's forward with the embedding scale made exact (see the docstring)."""
    import mlx.core as mx

    H = model.args.hidden_size
    fix = H**0.5 / float(mx.array(H**0.5, mx.bfloat16).astype(mx.float32))
    x = mx.array(ids)[None]
    emb = model.model.embed_tokens(x) * fix
    return np.array(model(x, input_embeddings=emb)[0].astype(mx.float32))


def relative_paths(config_file: Path) -> None:
    cfg = json.loads(config_file.read_text())
    for k in ("adapter_path", "config", "data"):
        cfg[k] = Path(cfg[k]).name
    cfg["model"] = str(MODEL.relative_to(ROOT))
    config_file.write_text(json.dumps(cfg, indent=4))


def main() -> None:
    import mlx.core as mx
    from mlx_lm import load

    ids = np.random.default_rng(0).integers(3, 512, 40).astype(np.int32)
    base_model, _ = load(str(MODEL))
    base = exact_logits(base_model, ids)
    with tempfile.TemporaryDirectory() as t:
        for case, kind, num_layers, params in CASES:
            dest = OUT / case
            if "--logits-only" not in sys.argv:
                adapter = train(Path(t), case, kind, num_layers, params)
                shutil.rmtree(dest, ignore_errors=True)
                dest.mkdir(parents=True)
                for f in ("adapter_config.json", "adapters.safetensors"):
                    shutil.copy(adapter / f, dest / f)
                relative_paths(dest / "adapter_config.json")
            model, _ = load(str(MODEL), adapter_path=str(dest))
            logits = exact_logits(model, ids)
            shipped = np.array(model(mx.array(ids)[None])[0].astype(mx.float32))
            write_npz(dest / "mlx_lm_logits.npz", {"ids": ids, "logits": logits, "base": base,
                                                   "logits_as_shipped": shipped})
            moved = float(np.abs(logits - base).max() / np.abs(base).max())
            rounding = float(np.abs(logits - shipped).max() / np.abs(base).max())
            print(f"{case}: the adapter moves mlx-lm's logits by {moved:.3f} of the scale; its bf16 embedding "
                  f"scale moves them by {rounding:.1e}")


if __name__ == "__main__":
    main()
