"""A header-only checkpoint: config.json and one model.safetensors whose
header lists every tensor our model of that config holds (names, shapes,
dtypes; MLX-quantized as `quantization` says, mlx-lm's rules: every Linear,
Embedding and expert stack whose input width the group size divides) and
whose data is a hole (a sparse file of the full size: the loader's
truncation check passes, no byte is written). What `plan` needs for a model
too large to download (docs/benchmarks.md, "plan for MoE").

    from header_ckpt import write_header_only
    write_header_only(dir, config, quantization={"group_size": 64, "bits": 8})
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "uint32": "U32"}


def write_header_only(dest, config: dict, quantization: dict | None = None) -> Path:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from mlxcel_dist.models import get_model_module

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    mod = get_model_module(config["model_type"])
    model = mod.Model(mod.ModelArgs.from_dict(config))
    dtype = getattr(mx, config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    if quantization:
        g = quantization["group_size"]
        nn.quantize(model, g, quantization["bits"],
                    class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % g == 0)
        config = {**config, "quantization": quantization, "quantization_config": quantization}
    header, offset = {}, 0
    for name, p in tree_flatten(model.parameters()):
        dt = p.dtype if p.dtype == mx.uint32 else dtype  # scales and biases in the compute dtype
        size = p.size * dt.size
        header[name] = {"dtype": DTYPES[str(dt).split(".")[-1]], "shape": list(p.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "mlx"}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(dest / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)  # a hole: the tensors' bytes are never written
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    return dest
