"""Sizes as people write them (serve's --prompt-cache-bytes, a hostfile's memory=)."""

import re

from .errors import UserError


def parse_size(text: str, flag: str) -> int:
    """mlx-lm's sizes: a number with an optional M, MB, G or GB (decimal units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([MG]B?)?\s*", text, re.IGNORECASE)
    if not m:
        raise UserError(f"{flag} must be a byte count like 500M or 2GB, got {text!r}")
    n = int(float(m.group(1)) * {"": 1, "M": 10**6, "G": 10**9}[(m.group(2) or "")[:1].upper()])
    if n < 1:
        raise UserError(f"{flag} must be >= 1 byte, got {text!r}")
    return n


def format_size(n: float) -> str:
    """Bytes as people read them (1000-based, as the plan and download bars print)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
