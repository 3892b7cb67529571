"""Multi-head latent attention's cache (MLA: deepseek_v3, deepseek_v32,
kimi_k2; models/deepseek_v3.py): `LatentCache`, a full KV kind whose "keys"
are the normed latent [B, 1, S, kv_lora] and whose "values" are the rotated
k_pe [B, 1, S, rope] (deepseek_v32: k_pe then the indexer's key). One head,
replicated on every rank under TP; a decode step multiplies the latent
itself (absorbed), so it is never quantized (the model refuses --kv-bits).
Every form is full.py's: static buffers [C, 1, S, kv_lora] / [C, 1, S,
rope (+ index)] by position, snapshots and trims as a KVCache's; a bounded
cache (--max-kv-size) is a sliding ring of the latent as of any keys.
"""

from __future__ import annotations

from .full import KVCache


class LatentCache(KVCache):
    """A KVCache of MLA's latent and k_pe (the module docstring)."""
