"""Bounded and quantized KV (--max-kv-size, --kv-bits): the options, checked
before launch, and the caches they make of a model's (`kv_caches`,
`KVOptions.apply`).
"""

from __future__ import annotations

from .conv import ConvKVCache
from .full import KVCache
from .quantized import QuantizedKVCache
from .shared import SharedKVCache
from .sliding import RotatingKVCache

KV_BITS = (2, 3, 4, 5, 6, 8)  # MLX's affine quantization
KV_GROUP_SIZES = (32, 64, 128)


def config_head_dim(args) -> int:
    """A model's head_dim from its ModelArgs (the config's, else hidden / heads)."""
    return getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads


def fitting_group_size(head_dim: int | None) -> int | None:
    """--kv-group-size when the user gave none: the largest of 128 / 64 / 32
    dividing head_dim (64 where the config has no head_dim; None: none fits)."""
    if not head_dim:
        return 64
    return next((g for g in sorted(KV_GROUP_SIZES, reverse=True) if head_dim % g == 0), None)


def check_kv_options(max_size: int | None, bits: int | None, group_size: int | None,
                     head_dim: int | None = None) -> None:
    """--max-kv-size / --kv-bits / --kv-group-size, before any rank starts
    (`head_dim`: the config's, when it has one; `group_size` None: chosen)."""
    from ..errors import UserError

    if max_size is not None and max_size < 1:
        raise UserError(f"--max-kv-size must be >= 1, got {max_size}")
    if group_size is None:
        if bits is not None and fitting_group_size(head_dim) is None:
            raise UserError(f"--kv-bits: the model's head_dim {head_dim} is not a multiple of 32 "
                            "(MLX quantizes in groups of 32, 64 or 128)")
        group_size = fitting_group_size(head_dim) or 64
    if group_size not in KV_GROUP_SIZES:
        raise UserError(f"--kv-group-size must be one of {', '.join(map(str, KV_GROUP_SIZES))}, got {group_size}")
    if bits is None:
        return
    if bits not in KV_BITS:
        raise UserError(f"--kv-bits must be one of {', '.join(map(str, KV_BITS))}, got {bits}")
    if max_size is not None:
        raise UserError("--kv-bits quantizes full-attention caches, which --max-kv-size makes rotating ones: "
                        "give one of them (mlx-lm cannot quantize a rotating cache either)")
    if head_dim and head_dim % group_size:
        fits = [str(g) for g in KV_GROUP_SIZES if head_dim % g == 0]
        hint = f": use --kv-group-size {' or '.join(fits)}" if fits else " (MLX quantizes in groups of 32, 64 or 128)"
        raise UserError(f"--kv-group-size {group_size} does not divide the model's head_dim {head_dim}{hint}")


def kv_caches(caches: list | None, max_size: int | None = None, bits: int | None = None,
              group_size: int = 64) -> list | None:
    """A model's fresh caches with --max-kv-size / --kv-bits applied.

    `max_size` N: every full-attention layer keeps the last N positions (a
    `RotatingKVCache(N)`: a sliding window of N, mlx-lm's rotating cache with
    keep=0), a sliding layer the last min(window, N); chunked layers (at most
    their chunk) and recurrent state are left as they are. `bits`: each
    full-attention `KVCache` becomes a `QuantizedKVCache`; sliding, chunked,
    shared and conv caches stay in the compute dtype (as mlx-lm, which
    quantizes only its plain KVCache). Layers reading another layer's KV are
    re-pointed at its new cache."""
    if caches is None or (max_size is None and bits is None):
        return caches

    def one(c):
        kind = type(c)
        if isinstance(c, KVCache):  # (a LatentCache too: its latent bounded as any keys)
            return RotatingKVCache(max_size) if max_size else QuantizedKVCache(bits, group_size)
        if kind is RotatingKVCache and max_size and c.max_size > max_size:
            return RotatingKVCache(max_size)
        if kind is ConvKVCache and max_size:
            c.kv = one(c.kv)
        return c

    new, out = {}, []
    for c in caches:
        if isinstance(c, SharedKVCache):
            out.append(SharedKVCache(new.get(id(c.source), c.source), c.reads_layer))
            continue
        n = one(c)
        new[id(c)] = n
        out.append(n)
    return out


class KVOptions:
    """--max-kv-size / --kv-bits / --kv-group-size as one value (`kv_caches`)."""

    def __init__(self, max_size: int | None = None, bits: int | None = None, group_size: int | None = None):
        # group_size None: `check` picks the largest of 128 / 64 / 32 dividing head_dim (`chosen`)
        self.max_size, self.bits = max_size, bits
        self.chosen = group_size is None
        self.group_size = 64 if group_size is None else group_size

    def __bool__(self) -> bool:
        return self.max_size is not None or self.bits is not None

    def check(self, head_dim: int | None = None) -> "KVOptions":
        check_kv_options(self.max_size, self.bits, None if self.chosen else self.group_size, head_dim)
        if self.chosen:
            self.group_size = fitting_group_size(head_dim) or 64
        return self

    def describe(self) -> str:
        """The --verbose line of the quantized cache (empty without --kv-bits)."""
        if self.bits is None:
            return ""
        how = " (the largest of 128/64/32 dividing head_dim; --kv-group-size sets it)" if self.chosen else ""
        return f"kv cache: {self.bits}-bit, groups of {self.group_size}{how}"

    def apply(self, model) -> None:
        """Make the model's `make_cache` (every caller's: generation, logits,
        the batch engine, the prompt cache, a pipeline stage's) return these caches."""
        if not self:
            return
        refused = model.kv_bits_refused
        if self.bits is not None and refused:
            from ..errors import UserError

            raise UserError(f"--kv-bits: {model.args.model_type} cannot take a quantized cache ({refused})")
        if self.chosen and self.bits is not None:  # (a caller that built these options without `check`)
            self.check(config_head_dim(model.args))
        make = model.make_cache
        model.make_cache = lambda: kv_caches(make(), self.max_size, self.bits, self.group_size)
        model.kv_options = self  # (harness.model_window: the modes cross N)
