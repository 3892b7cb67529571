"""Registry: HF `model_type` -> model file. One file per architecture; a remap
entry lets several model_types share one file (e.g. multimodal wrappers)."""

from __future__ import annotations

import importlib

from ..errors import UserError

MODEL_REMAP = {
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",  # multimodal checkpoint: its text tower
}


def supported() -> list[str]:
    return sorted(MODEL_REMAP)


def get_model_module(model_type: str | None):
    if model_type not in MODEL_REMAP:
        raise UserError(
            f"unsupported model_type {model_type!r} (supported: {', '.join(supported())})"
        )
    return importlib.import_module(f".{MODEL_REMAP[model_type]}", __name__)
