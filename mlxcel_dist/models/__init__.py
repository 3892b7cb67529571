"""Registry: HF `model_type` -> model file.

A model file named after its `model_type` (models/<model_type>.py) is found by
name; MODEL_REMAP lets other model_types share a file (e.g. a multimodal
wrapper whose text tower is another file)."""

from __future__ import annotations

import importlib
import pkgutil

from ..errors import UserError

MODEL_REMAP = {
    "kimi_k2": "deepseek_v3",  # Kimi K2 (DeepseekV3ForCausalLM with its own model_type)
    "deepseek_v32": "deepseek_v3",  # DeepSeek-V3.2: deepseek_v3 plus the lightning indexer (ModelArgs.indexed)
    "gemma3": "gemma3",  # multimodal checkpoint: its text tower
    "gemma3_text": "gemma3",
    "gemma4_text": "gemma4",  # the text-only model; "gemma4" (multimodal) is the file itself
    "gemma3n_text": "gemma3n",
    "llama4_text": "llama4",  # Llama4ForCausalLM; "llama4" (multimodal) is the file itself  # Gemma3nForCausalLM; multimodal gemma3n is the file itself
    "ministral": "mistral",  # the mistral decoder with layer_types
    "qwen3_5_moe_text": "qwen3_5_moe",  # Qwen3_5MoeForCausalLM; "qwen3_5_moe" (multimodal) is the file itself
    "step3p7": "step3p5",  # multimodal Step-3.7: its text decoder (text_config)
}
_NOT_MODELS = {"base"}


def _files() -> set[str]:
    return {m.name for m in pkgutil.iter_modules(__path__) if m.name not in _NOT_MODELS}


def supported() -> list[str]:
    # Every file serves its own model_type, plus the remapped ones.
    files = _files()
    return sorted(files | {t for t, f in MODEL_REMAP.items() if f in files})


def get_model_module(model_type):
    if not isinstance(model_type, str) or model_type not in supported():
        raise UserError(f"unsupported model_type {model_type!r} (supported: {', '.join(supported())})")
    return importlib.import_module(f".{MODEL_REMAP.get(model_type, model_type)}", __name__)
