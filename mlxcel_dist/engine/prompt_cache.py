"""Prompt cache: a new request reuses the keys/values of the longest cached
prefix of its prompt (multi-turn chat resends the conversation), so only the
rest is prefilled.

An entry is the KV of exactly `tokens` (a prompt, or a prompt plus the reply
generated for it): per layer, a full layer's keys/values of every position,
a sliding layer's of the last min(len, window) positions (all a next token
can see: a rotated cache cannot be cut back past its window, so an entry is
only ever reused whole, as the prefix it is). Layers that read another
layer's KV (SharedKVCache) store nothing. Lookup takes the longest entry
that is a proper prefix of the new prompt (at least one token is left to
feed). Entries are evicted least recently used first, beyond `max_entries`
or `max_bytes`. What a layer keeps is its cache kind's answer (`cacheable`,
`kept()`, `restore_kept()`; a row's: `entry()`): keys/values, or for a state
(DeltaNetCache, RecurrentCache) a `cache.Snapshot` of its state after exactly
`tokens`, restored as it was, so such an entry is only ever reused whole;
baichuan_m1 (its conv state rides on its KV layers) is not cached. A --kv-bits
layer keeps its quantized keys/values (`cache.QuantizedKV`s, sliced alike).

Under TP every rank keeps its own cache of its own shards; the ranks make
the same calls in the same order, so they hit and evict alike.
"""

from __future__ import annotations

from collections import OrderedDict

import mlx.core as mx

from ..cache import QuantizedKV, Snapshot  # (Snapshot: batch.py's entries)

DEFAULT_MAX_ENTRIES = 10  # mlx-lm's --prompt-cache-size default
DEFAULT_MAX_BYTES = 2**63  # mlx-lm's --prompt-cache-bytes default: no limit


def _arrays(kv) -> list:
    """An entry's arrays (a Snapshot's, or its keys' and values' parts)."""
    if isinstance(kv, Snapshot):
        return kv.arrays
    return [y for x in kv for y in (x.parts if isinstance(x, QuantizedKV) else (x,))]


class PromptCache:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.entries: OrderedDict = OrderedDict()  # tuple(tokens) -> [(keys, values) | None per layer]
        self.nbytes = 0
        self.hits = self.misses = 0
        self.trimmable = False  # every layer full: an entry's first tokens can be reused alone

    @staticmethod
    def cacheable(cache) -> bool:
        return bool(cache) and all(c.cacheable for c in cache)

    def store(self, tokens, cache) -> None:
        """Keep `cache`'s keys/values (a state cache's snapshot) of exactly
        `tokens` (the cache has seen them all; a state that has seen more,
        e.g. a step in flight, cannot be cut back: nothing is kept)."""
        if not self.cacheable(cache) or any(c.reads_layer is None and c.offset != len(tokens) for c in cache):
            return
        layers = [c.kept() for c in cache]
        self.store_layers(tokens, layers, [c.window for c in cache])

    def store_layers(self, tokens, layers: list, windows: list) -> None:
        """Keep per-layer (keys, values) held for `tokens`, oldest first (None:
        a layer that reads another's KV); `windows` per layer (None: full)."""
        tokens = tuple(int(t) for t in tokens)
        if not tokens or self.max_entries < 1:
            return
        kept = []
        for kv, window in zip(layers, windows):
            if kv is None or isinstance(kv, Snapshot):
                kept.append(kv)
                continue
            k, v = kv
            n = min(len(tokens), window) if window else len(tokens)
            if k.shape[2] < n:
                return  # it holds less than the entry needs
            kept.append((k[..., k.shape[2] - n :, :], v[..., v.shape[2] - n :, :]))
        # every layer full (no window, no state): an entry's first tokens can be reused alone
        self.trimmable = all(w is None for w in windows) and not any(isinstance(kv, Snapshot) for kv in kept)
        layers = kept
        mx.eval([x for kv in layers if kv is not None for x in _arrays(kv)])
        size = sum(x.nbytes for kv in layers if kv is not None for x in _arrays(kv))
        if size > self.max_bytes:
            return
        if tokens in self.entries:
            self._drop(tokens)
        self.entries[tokens] = (layers, size)
        self.nbytes += size
        while len(self.entries) > self.max_entries or self.nbytes > self.max_bytes:
            self._drop(next(iter(self.entries)))

    def _drop(self, key) -> None:
        _, size = self.entries.pop(key)
        self.nbytes -= size

    def lookup(self, prompt, make_cache) -> tuple[int, list | None]:
        """(k, caches holding the first k tokens of `prompt`) for the longest
        usable cached prefix (k < len(prompt)), or (0, None). An entry is
        usable whole when it is a prefix of the prompt; a model with full
        layers only can also use the part of an entry it shares with the
        prompt (full layers can be cut back; sliding ones cannot)."""
        prompt = tuple(int(t) for t in prompt)
        best, best_k = None, 0
        for key in self.entries:
            if len(key) < len(prompt) and prompt[: len(key)] == key:
                k = len(key)
            elif self.trimmable:
                k = _common(key, prompt, len(prompt) - 1)
            else:
                continue
            if k > best_k:
                best, best_k = key, k
        if best is None:
            self.misses += 1
            return 0, None
        self.hits += 1
        self.entries.move_to_end(best)
        layers, _ = self.entries[best]
        cache = make_cache()
        for c, kv in zip(cache, layers):
            c.restore_kept(kv, best_k)  # a state's: whole entries only (not trimmable), after best_k tokens
        return best_k, cache


def _common(a: tuple, b: tuple, limit: int) -> int:
    """Length of the common prefix of a and b, at most `limit`."""
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
