"""`mlxcel-dist convert`: write an mlx-community-style checkpoint.

The source is loaded with our loader (any supported family, HF or MLX
format, single process), optionally cast to a dtype and quantized the way
`mlx_lm.convert -q` does (affine; every Linear and Embedding whose input
dimension is a whole number of groups), then written as MLX safetensors
(`{"format": "mlx"}` metadata; split with an index above 5 GB) with our
module names, which are the HF names after the family's `sanitize`
(multimodal towers dropped; a family's `export_for_mlx_lm(weights,
config)` rewrites them where mlx-lm reads a converted checkpoint otherwise,
e.g. qwen3_next's conv and norm layout), plus config.json carrying `quantization` and the
same object as `quantization_config`, and the tokenizer / generation files
copied. Both our loader and mlx-lm's `load` read the result. With an
adapter (`--adapter-path`, lora.py) its layers are merged into the float
weights first (`lora.fuse`), then cast and quantized as asked: mlx-lm's
`fuse --dequantize`, then `convert -q`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from ..errors import UserError
from .loader import DTYPES, load_model, open_model
from ..nn.quant import QuantParams, quantize_for_export

# Files next to the weights that a converted checkpoint keeps.
COPY_PATTERNS = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.json",
    "*.jinja",
    "generation_config.json",
)
MAX_FILE_BYTES = 5 << 30  # mlx-lm's shard size


def mlx_lm_compatible(config: dict) -> dict:
    """The config with what mlx-lm (0.32) needs to run it as we do, where its
    reading differs: gemma3 layers' kinds come from `sliding_window_pattern`
    alone (default 6; a 4-layer model then fails at cache[5]), so write the
    period of `layer_types` when the layers follow one (every P-th full). Our
    loader and transformers read `layer_types` first, so nothing else changes."""
    config = json.loads(json.dumps(config))
    for c in (config, config.get("text_config")):
        if not isinstance(c, dict) or c.get("model_type") not in ("gemma3", "gemma3_text"):
            continue
        types = c.get("layer_types")
        if not isinstance(types, list) or "full_attention" not in types:
            continue
        p = types.index("full_attention") + 1
        if all((t == "full_attention") == ((i + 1) % p == 0) for i, t in enumerate(types)):
            c["sliding_window_pattern"] = p
    return config


def _set_dtype(config: dict, name: str) -> None:
    """Record the new storage dtype wherever the config names one
    (transformers 5 `dtype`, 4 `torch_dtype`, also under text_config)."""
    found = False
    for src in (config, config.get("text_config")):
        if isinstance(src, dict):
            for key in ("dtype", "torch_dtype"):
                if key in src:
                    src[key] = name
                    found = True
    if not found:
        config["torch_dtype"] = name


def _shards(weights: dict) -> list[dict]:
    shards, cur, size = [], {}, 0
    for name in sorted(weights):
        n = weights[name].nbytes
        if cur and size + n > MAX_FILE_BYTES:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = weights[name]
        size += n
    shards.append(cur)
    return shards


def convert_checkpoint(
    model,
    out,
    *,
    quantize: bool = False,
    bits: int | None = None,
    group_size: int | None = None,
    dtype: str | None = None,
    adapter_path=None,
) -> dict:
    """Convert MODEL into OUT (which must not exist or be empty). Returns a
    summary: files written, tensors, bytes, quantization, bits per weight."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out}: output directory exists and is not empty")
    if not quantize and (bits is not None or group_size is not None):
        raise UserError("--bits / --group-size need --quantize")
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    ck = open_model(model)
    model_dir, config = ck.dir, ck.config
    if out.resolve() == model_dir.resolve():
        raise UserError("the output directory is the source checkpoint")
    if quantize and ck.quantization is not None:
        raise UserError(f"{model_dir} is already quantized")
    q = QuantParams(group_size or 64, bits or 4) if quantize else None

    adapter = None
    if adapter_path is not None:
        from .loader import build_model
        from ..nn.lora import Adapter

        adapter = Adapter(adapter_path)
        adapter.check(build_model(config))

    loaded = load_model(model_dir, dtype=dtype)
    m = loaded.model
    if adapter is not None:
        from ..nn.lora import fuse

        m.load_weights(list(fuse(dict(tree_flatten(m.parameters())), adapter).items()), strict=True)
    quantized, overrides = quantize_for_export(m, q.group_size, q.bits, q.mode) if q else ([], {})
    weights = dict(tree_flatten(m.parameters()))
    # a family whose mlx-lm reading of a converted checkpoint differs from ours says how to write it
    weights, config = m.export_for_mlx_lm(weights, config)

    new_config = mlx_lm_compatible(config)
    if dtype is not None:
        _set_dtype(new_config, dtype)
    if q is not None:
        # mlx-lm writes the same object under both keys (the HF tree reads the second).
        written = {m.mlx_lm_path(k, config): v for k, v in overrides.items()}
        new_config["quantization"] = {**q.kwargs(), **written}
        new_config["quantization_config"] = {**q.kwargs(), **written}

    out.mkdir(parents=True, exist_ok=True)
    shards = _shards(weights)
    files = []
    if len(shards) == 1:
        files.append("model.safetensors")
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for fname, shard in zip(files, shards):
        mx.save_safetensors(str(out / fname), shard, metadata={"format": "mlx"})
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(w.nbytes for w in weights.values())},
            "weight_map": {name: fname for fname, shard in zip(files, shards) for name in shard},
        }
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (out / "config.json").write_text(json.dumps(new_config, indent=2) + "\n")
    copied = []
    for pattern in COPY_PATTERNS:
        for src in sorted(model_dir.glob(pattern)):
            if src.is_file():
                shutil.copyfile(src, out / src.name)
                copied.append(src.name)

    n_weights = sum(
        (w.size * 32 // overrides.get(name[: -len(".weight")], {}).get("bits", q.bits)
         if name.endswith(".weight") and w.dtype == mx.uint32 else w.size)
        for name, w in weights.items()
        if not name.endswith((".scales", ".biases"))
    ) if q else sum(w.size for w in weights.values())
    total = sum(w.nbytes for w in weights.values())
    return {
        "out": out,
        "files": files,
        "copied": copied,
        "tensors": len(weights),
        "bytes": total,
        "quantization": q,
        "quantized_modules": quantized,
        "bits_per_weight": total * 8 / max(n_weights, 1),
    }
