"""Grammar engines for constrained decoding, side by side: llguidance,
xgrammar, outlines-core on one tokenizer.json.

Per engine: import time, tokenizer set-up, grammar compile (a JSON schema),
then the per-token work of a decode step replayed over a valid answer's
tokens (mask for the next token, then consume the token): mean and p99 us,
for one matcher and for 8 at once (the engine's batch call where it has one,
else a loop). The answer is the schema's document tokenized by the
tokenizer itself, so every engine walks the same ids.

    python benchmarks/grammar_engines.py models/gemma3-tiny/tokenizer.json [more tokenizer.json ...]

An engine that is not installed is skipped (pip install llguidance xgrammar
outlines-core; xgrammar pulls torch + transformers). Each engine runs in its
own process, so import times are cold.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "city": {"enum": ["Paris", "Lima", "Oslo"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["street", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "city", "tags", "address"],
    "additionalProperties": False,
}
DOC = {"name": "Ada Lovelace of the sea", "age": 36, "city": "Oslo", "tags": ["math", "poetry", "sea"],
       "address": {"street": "12 Harbour Road", "zip": "0150"}}
ROWS = 8


def _stats(us: list) -> str:
    us = sorted(us)
    return f"p50 {us[len(us) // 2]:7.1f} us  p90 {us[int(0.9 * (len(us) - 1))]:7.1f} us"


def run_llguidance(path: str, doc: str, ids: list) -> dict:
    t = time.perf_counter()
    import llguidance
    import llguidance.numpy as lln
    out = {"import_s": time.perf_counter() - t}
    t = time.perf_counter()
    tok = llguidance.LLTokenizer(open(path).read())
    out["tokenizer_s"] = time.perf_counter() - t
    t = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    ms = [llguidance.LLMatcher(tok, grammar) for _ in range(ROWS)]
    out["compile_s"] = (time.perf_counter() - t) / ROWS
    assert not ms[0].is_error(), ms[0].get_error()
    bm = lln.allocate_token_bitmask(ROWS, tok.vocab_size)
    one, loop, par = [], [], []
    ex = llguidance.LLExecutor()
    for tid in ids:
        t = time.perf_counter()
        lln.fill_next_token_bitmask(ms[0], bm, 0)
        one.append((time.perf_counter() - t) * 1e6)
        assert (bm[0, tid // 32] >> (tid % 32)) & 1, "the answer's token is masked"
        t = time.perf_counter()
        for i, m in enumerate(ms):
            lln.fill_next_token_bitmask(m, bm, i)
        loop.append((time.perf_counter() - t) * 1e6)
        t = time.perf_counter()
        lln.fill_next_token_bitmask_par(ex, [(m, i) for i, m in enumerate(ms)], bm)
        par.append((time.perf_counter() - t) * 1e6)
        for m in ms:
            assert m.consume_token(tid), m.get_error()
    out["one"], out["loop"], out["batch"] = _stats(one), _stats(loop), _stats(par)
    return out


def run_xgrammar(path: str, doc: str, ids: list) -> dict:
    t = time.perf_counter()
    import xgrammar as xg
    from transformers import PreTrainedTokenizerFast
    out = {"import_s": time.perf_counter() - t}
    t = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_file=path)
    info = xg.TokenizerInfo.from_huggingface(hf)
    compiler = xg.GrammarCompiler(info)
    out["tokenizer_s"] = time.perf_counter() - t
    t = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    out["compile_s"] = time.perf_counter() - t
    ms = [xg.GrammarMatcher(compiled) for _ in range(ROWS)]
    bm = xg.allocate_token_bitmask(ROWS, info.vocab_size)
    batch = xg.BatchGrammarMatcher()
    one, par = [], []
    loop = []
    for tid in ids:
        t = time.perf_counter()
        ms[0].fill_next_token_bitmask(bm, 0)
        one.append((time.perf_counter() - t) * 1e6)
        assert (int(bm[0, tid // 32]) >> (tid % 32)) & 1, "the answer's token is masked"
        t = time.perf_counter()
        for i, m in enumerate(ms):
            m.fill_next_token_bitmask(bm, i)
        loop.append((time.perf_counter() - t) * 1e6)
        t = time.perf_counter()
        batch.batch_fill_next_token_bitmask(ms, bm)
        par.append((time.perf_counter() - t) * 1e6)
        for m in ms:
            assert m.accept_token(tid)
    out["one"], out["loop"], out["batch"] = _stats(one), _stats(loop), _stats(par)
    return out


def _byte_vocab(path: str) -> tuple:
    """token bytes -> ids of a byte-level BPE tokenizer.json, and its EOS-like id."""
    spec = json.loads(open(path).read())
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    dec = {chr(c): b for b, c in zip(bs, cs)}
    special = {t["id"] for t in spec.get("added_tokens", [])}
    vocab = {}
    for s, i in spec["model"]["vocab"].items():
        if i in special:
            continue
        vocab.setdefault(bytes(dec[c] for c in s), []).append(i)
    return vocab, min(special) if special else 0


def run_outlines(path: str, doc: str, ids: list) -> dict:
    t = time.perf_counter()
    import numpy as np
    import outlines_core as oc
    from outlines_core.json_schema import build_regex_from_schema
    out = {"import_s": time.perf_counter() - t}
    t = time.perf_counter()
    vocab, eos = _byte_vocab(path)
    voc = oc.Vocabulary(eos, vocab)
    out["tokenizer_s"] = time.perf_counter() - t
    t = time.perf_counter()
    regex = build_regex_from_schema(json.dumps(SCHEMA))
    index = oc.Index(regex, voc)
    out["compile_s"] = time.perf_counter() - t
    ms = [oc.Guide(index) for _ in range(ROWS)]
    V = max(i for v in vocab.values() for i in v) + 1
    bm = np.zeros((ROWS, (V + 31) // 32), np.int32)
    one, par = [], []
    for tid in ids:
        t = time.perf_counter()
        ms[0].write_mask_into(bm[0].ctypes.data, bm.shape[1], 4)
        one.append((time.perf_counter() - t) * 1e6)
        assert (int(bm[0, tid // 32]) >> (tid % 32)) & 1, "the answer's token is masked"
        t = time.perf_counter()
        for i, m in enumerate(ms):  # no batch call: one after another
            m.write_mask_into(bm[i].ctypes.data, bm.shape[1], 4)
        par.append((time.perf_counter() - t) * 1e6)
        for m in ms:
            m.advance(tid)
    out["one"], out["loop"], out["batch"] = _stats(one), _stats(par), "(no batch call)"
    return out


ENGINES = {"llguidance": run_llguidance, "xgrammar": run_xgrammar, "outlines-core": run_outlines}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        engine, path = sys.argv[2], sys.argv[3]
        from tokenizers import Tokenizer
        doc = json.dumps(DOC, separators=(",", ":"))
        ids = Tokenizer.from_file(path).encode(doc, add_special_tokens=False).ids
        try:
            print(json.dumps(ENGINES[engine](path, doc, ids)))
        except ImportError as e:
            print(json.dumps({"skipped": str(e)}))
        return
    for path in sys.argv[1:]:
        vocab = json.loads(open(path).read())["model"]["vocab"]
        print(f"{path}: {len(vocab)} tokens; schema answer {len(json.dumps(DOC, separators=(',', ':')))} bytes;"
              f" batch = {ROWS} matchers")
        for engine in ENGINES:
            r = subprocess.run([sys.executable, __file__, "--one", engine, path], capture_output=True, text=True)
            if r.returncode:
                print(f"  {engine:14s} failed: {r.stderr.strip().splitlines()[-1]}")
                continue
            res = json.loads(r.stdout.strip().splitlines()[-1])
            if "skipped" in res:
                print(f"  {engine:14s} skipped ({res['skipped']})")
                continue
            print(f"  {engine:14s} import {res['import_s']:5.2f} s  tokenizer {res['tokenizer_s']:6.3f} s"
                  f"  compile {res['compile_s'] * 1e3:8.1f} ms\n  {'':14s} mask per token: 1 row {res['one']}\n"
                  f"  {'':14s} {ROWS} rows in a loop {res['loop']}\n  {'':14s} {ROWS} rows batch call {res['batch']}")


if __name__ == "__main__":
    main()
