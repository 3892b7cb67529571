"""A copy of the default model's tokenizer in which the chat formats' markers
(grammar.MARKERS) are special tokens, as in the real checkpoints' vocabularies
(harmony's <|channel|>, DeepSeek's <｜tool▁calls▁begin｜>, GLM's <arg_key>, ...):
the last ids of the vocabulary are given to them, so the default model's
weights serve it unchanged."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from mlxcel_dist.checkpoint.loader import default_model_dir


def special_vocab(dst: Path, markers) -> Path:
    """A model directory at `dst` (config and tokenizer, no weights) whose
    vocabulary's last len(markers) ids are `markers`, special tokens."""
    src = default_model_dir()
    dst.mkdir(parents=True, exist_ok=True)
    for f in ("config.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / f, dst / f)
    t = json.loads((src / "tokenizer.json").read_text())
    vocab = t["model"]["vocab"]
    by_id = {i: s for s, i in vocab.items()}
    n = len(vocab)
    gone = {by_id[n - 1 - k] for k in range(len(markers))}
    # the merges that make or use the replaced tokens go: no text encodes to their ids any more
    pairs = [m if isinstance(m, list) else m.split(" ") for m in t["model"]["merges"]]
    t["model"]["merges"] = [m for m in pairs if "".join(m) not in gone and not gone & set(m)]
    for k, marker in enumerate(markers):
        i = n - 1 - k
        del vocab[by_id[i]]
        vocab[marker] = i
        t["added_tokens"].append({"id": i, "content": marker, "single_word": False, "lstrip": False,
                                  "rstrip": False, "normalized": False, "special": True})
    (dst / "tokenizer.json").write_text(json.dumps(t, ensure_ascii=False))
    return dst
