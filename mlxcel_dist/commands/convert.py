"""`mlxcel-dist convert`: write an mlx-community-style checkpoint
(convert.convert_checkpoint) and say which rank counts split it."""

from __future__ import annotations

from ..checkpoint.convert import convert_checkpoint
from ..errors import UserError
from ..checkpoint.loader import check_shardable
from .common import err


def main(ctx, a) -> None:
    s = convert_checkpoint(a.model, a.out, quantize=a.quantize, bits=a.bits, group_size=a.group_size,
                           dtype=a.dtype, adapter_path=a.adapter_path)
    q = s["quantization"]
    what = (
        f"{q.describe()}, {len(s['quantized_modules'])} layers quantized, {s['bits_per_weight']:.2f} bits per weight"
        if q
        else "not quantized"
    )
    err(f"wrote {a.out}: {', '.join(s['files'])} ({s['tensors']} tensors, {s['bytes'] / 2**20:.1f} MiB), {what}")
    if s["copied"]:
        err(f"copied {', '.join(s['copied'])}")
    splits = []
    for n in (2, 3, 4, 8):
        try:
            check_shardable(a.out, n)
            splits.append(str(n))
        except UserError:
            pass
    err(f"tensor-parallel rank counts that split it (of 2, 3, 4, 8): {', '.join(splits) or 'none'}")
