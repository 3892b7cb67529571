"""Per-layer caches: one module per kind, each holding every form of it.

Every kind follows `base.LayerCache`: its eager form (what a prompt is fed
through: `mask(L)`, `update_and_fetch`, `offset`, `window`), its static
form (the engine's compiled rows, one row being generate's: `static_form`,
`held()`, `buffer_names(i)`, `row_view(...)`, `prefill_view(...)`) and how
it is kept (`snapshot()` / `restore_snapshot()`, `can_trim(n)` / `trim(n)`,
the prompt cache's `kept()` / `restore_kept()` / `entry()`). The engine,
decode.py and the prompt cache ask the cache object; none switches on kinds.

| module | kind | eager | static (rows / prefill rows) | kept |
| --- | --- | --- | --- | --- |
| full.py | full KV | KVCache | StaticCache, RowCache, PrefillCache | snapshot, trim |
| sliding.py | sliding ring | RotatingKVCache | full.py's, window slots | snapshot; trim while nothing dropped |
| chunked.py | chunked (llama4) | ChunkedKVCache | full.py's, chunk slots | as sliding |
| shared.py | reads another layer's KV | SharedKVCache | the same over the source's | nothing of its own |
| quantized.py | --kv-bits | QuantizedKVCache | QuantizedStaticCache, QuantizedRowCache, QuantizedPrefillCache | snapshot, trim |
| latent.py | MLA latent (deepseek) | LatentCache | full.py's, one head | as full |
| state.py | a state (base) | StateCache | StaticState | snapshot whole |
| recurrent.py | RG-LRU | RecurrentCache | StaticState | as state |
| deltanet.py | DeltaNet | DeltaNetCache | StaticState | as state |
| conv.py | KV + conv state (baichuan_m1) | ConvKVCache | StaticConvKV | snapshot whole |
| prefix_view.py | read-only view (diffusion) | PrefixViewCache | none | none |

Keys and values are [B, kv_heads, S, head_dim] (kv_heads per rank under
TP). Adding a kind: one module here (a `LayerCache` subclass answering the
three forms), exported below, plus the model that makes it.
"""

from .base import CHUNKED, FULL, LAYER_KINDS, LINEAR, RECURRENT, SLIDING, EveryKeyHeld, LayerCache, Snapshot
from .chunked import ChunkedKVCache
from .conv import ConvKVCache, StaticConvKV
from .deltanet import DeltaNetCache
from .full import KVCache, KVKind, PrefillCache, RowCache, StaticCache, ring_slots
from .latent import LatentCache
from .layers import layer_masks, make_layer_caches
from .options import KV_BITS, KV_GROUP_SIZES, KVOptions, check_kv_options, kv_caches
from .prefix_view import PrefixViewCache
from .quantized import (QuantizedKV, QuantizedKVCache, QuantizedPrefillCache, QuantizedRowCache,
                        QuantizedStaticCache, quantize_kv)
from .recurrent import RecurrentCache
from .shared import SharedKVCache
from .sliding import RotatingKVCache
from .state import StateCache, StaticState

__all__ = [
    "CHUNKED", "FULL", "LAYER_KINDS", "LINEAR", "RECURRENT", "SLIDING", "EveryKeyHeld", "LayerCache", "Snapshot",
    "ChunkedKVCache", "ConvKVCache", "StaticConvKV", "DeltaNetCache", "KVCache", "KVKind", "PrefillCache",
    "RowCache", "StaticCache", "ring_slots", "LatentCache", "layer_masks", "make_layer_caches", "KV_BITS",
    "KV_GROUP_SIZES", "KVOptions", "check_kv_options", "kv_caches", "PrefixViewCache", "QuantizedKV",
    "QuantizedKVCache", "QuantizedPrefillCache", "QuantizedRowCache", "QuantizedStaticCache", "quantize_kv",
    "RecurrentCache", "SharedKVCache", "RotatingKVCache", "StateCache", "StaticState",
]
