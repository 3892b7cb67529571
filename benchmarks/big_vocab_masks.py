"""What a batch of json_schema masks costs with a real-sized vocabulary, against
the embedded 512-token tokenizer that the GPU serve benchmarks' random
checkpoints carry under a 262k-row embedding (issue 42: their masks walk a
512-token trie, so json_schema there pays almost nothing for the masks).

The big tokenizer is synthetic (no network here): the embedded byte-level BPE
grown by random merges of its tokens (at most 12 bytes) to --tokens entries,
so llguidance's token trie has the size of gemma3's. Per tokenizer: --rows
json_schema matchers (serve_load.py's schema), stepped together through
--steps steps, each row advanced by a token its own mask allows (seeded), so
the rows sit in the grammar's string, number and structural states alike;
per step one `Vocab.masks` call (one matcher after the other, llguidance's pool
of N threads, or the server's default: `grammar.mask_threads()`, half the CPUs
up to 8), ms a batch.

    python benchmarks/big_vocab_masks.py [--tokens 262144] [--rows 32] [--steps 40] [--threads 1,default] [--spread]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # serve_load's FORMATS


def grow(src: Path, tokens: int, out: Path, seed: int = 0, spread: bool = False) -> Path:
    """src's byte-level BPE tokenizer.json grown to `tokens` entries by merges
    of two existing tokens (each new token the concatenation, at most 12 bytes).
    `spread`: the ordinary tokens' ids shuffled among themselves (special ones
    kept), so short tokens sit anywhere in the id range, as in a real
    tokenizer's, not all below 512: a grammar's masks then reach the last
    words (their upload's width, sampling.live_words)."""
    spec = json.loads(src.read_text())
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    special = {t["content"] for t in spec.get("added_tokens", [])}
    pool = [t for t in vocab if t not in special]
    rng = random.Random(seed)
    while len(vocab) < tokens:
        a, b = rng.choice(pool), pool[rng.randrange(max(256, len(pool) // 4))]  # (short right sides, as BPE's)
        t = a + b
        if t in vocab or len(t) > 12:
            continue
        vocab[t] = len(vocab)
        merges.append([a, b])
        pool.append(t)
    if spread:
        ids = [vocab[t] for t in pool]
        rng.shuffle(ids)
        vocab.update(zip(pool, ids))
    out.mkdir(parents=True, exist_ok=True)
    path = out / "tokenizer.json"
    path.write_text(json.dumps(spec))
    return path


def batches(path: Path, n_vocab: int, eos: list, rows: int, steps: int, threads: int | None) -> list:
    from mlxcel_dist.engine import grammar
    from serve_load import FORMATS

    vocab = grammar.Vocab(path, n_vocab, eos, threads)
    g = grammar.json_schema(FORMATS["json_schema"]["json_schema"]["schema"])
    ms = [vocab.matcher(g) for _ in range(rows)]
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        masks = vocab.masks(ms)
        out.append(1e3 * (time.perf_counter() - t))
        for m, bits in zip(ms, masks):
            allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little")[:n_vocab])
            allowed = [int(i) for i in allowed if int(i) not in eos] or [int(i) for i in allowed]
            if allowed and m.error is None:
                m.advance(int(rng.choice(allowed)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=262144)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", default="1,default", help="comma-separated: a number, or default (the server's)")
    ap.add_argument("--spread", action="store_true", help="the grown tokenizer's ids shuffled (grow's `spread`)")
    a = ap.parse_args()
    from mlxcel_dist.checkpoint.loader import default_model_dir, read_config
    from mlxcel_dist.checkpoint.tokenizer import Tokenizer

    d = default_model_dir()
    eos = Tokenizer(d, read_config(d)).eos_ids
    t = time.perf_counter()
    big = grow(d / "tokenizer.json", a.tokens, Path(tempfile.mkdtemp(prefix="big-vocab-")), spread=a.spread)
    print(f"synthetic tokenizer of {a.tokens} tokens in {time.perf_counter() - t:.1f} s", flush=True)
    n_vocab = max(a.tokens, 262208)  # both under gemma3's embedding rows, as the GPU benchmark's checkpoint
    for name, path in (("embedded (512 tokens)", d / "tokenizer.json"), (f"synthetic ({a.tokens} tokens)", big)):
        for th in a.threads.split(","):
            got = batches(path, n_vocab, eos, a.rows, a.steps, None if th == "default" else int(th))
            got = got[1:]  # (the first builds the tokenizer's trie)
            print(f"{name:>26}, threads {th:>4}: {statistics.median(got):.2f} ms a batch of {a.rows} masks "
                  f"(p90 {sorted(got)[int(0.9 * len(got))]:.2f}, max {max(got):.2f})", flush=True)


if __name__ == "__main__":
    main()
