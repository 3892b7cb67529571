"""Speculative decoding on a draft/target pair that agrees as real pairs do:
plain decoding vs --draft-model vs --prompt-lookup, on three kinds of text,
at np 1 (in this process, and mlx-lm's speculative_generate_step on the same
pair) and at np 2 (`mlxcel-dist bench --np 2`).

    python benchmarks/spec_pair.py /tmp/spec-target 3000 cuda   # the target (a GPU: ~2 min)
    cp models/gemma3-tiny/{tokenizer.json,tokenizer_config.json,chat_template.jinja} /tmp/spec-target/
    python benchmarks/spec_decode.py /tmp/spec-target [--gen 128] [--np2] [--json out.json]

Target: benchmarks/spec_pair.py's 10.0M-parameter gemma3 (8 layers, hidden
320); draft: the embedded gemma3-tiny (0.85M, 4 layers, hidden 128), both
trained on scripts/data/corpus.txt with one tokenizer. Texts (prompt, then
--gen greedy tokens, EOS ignored):

- free: the opening words of a sentence ("The sea"), the models continue;
- repeat: a passage of the corpus twice over, then its first words again
  (a summary / quote / extraction-like prompt);
- edits: code-like lines (key = value, a list of records) and the start of
  the same list with one record changed.

Each configuration runs twice (the first builds its graphs and kernels);
the second is reported: decode tok/s after the first token, drafts accepted,
and the verify forwards. The draft's own cost is measured alone (its decode
tok/s as a plain model) so that a missed goal shows which part cost it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

DRAFT = HERE.parent / "models" / "gemma3-tiny"

TEXTS = {
    "free": "The sea",
    "repeat": None,  # built from the corpus below
    "edits": ("records = [\n  {name: ana, city: lisbon, age: 31},\n  {name: bo, city: oslo, age: 44},\n"
              "  {name: cy, city: rome, age: 27},\n  {name: di, city: kyiv, age: 38},\n]\n"
              "# the same records, bo moved to bergen:\nrecords = [\n  {name: ana, city: lisbon, age: 31},\n"
              "  {name: bo, city: bergen, age: 44},\n"),
}


def repeat_text() -> str:
    corpus = (HERE.parent / "scripts" / "data" / "corpus.txt").read_text(encoding="utf-8")
    passage = [d for d in corpus.split("\n\n") if len(d) > 400][3][:420]
    return passage + "\n\n" + passage + "\n\n" + passage[:60]


def np1(target_dir: str, gen: int) -> list:
    from mlxcel_dist.bench import run_bench
    from mlxcel_dist.checkpoint.loader import load_model
    from mlxcel_dist.engine.batch_spec import BatchDrafts, DraftRows
    from mlxcel_dist.checkpoint.tokenizer import Tokenizer

    target = load_model(target_dir).model
    draft_model = load_model(DRAFT).model
    tok = Tokenizer(Path(target_dir))
    rows = []
    for kind, text in TEXTS.items():
        ids = tok.prompt_ids(text, chat=False)
        for name, drafter in [("plain", None), ("draft K=3", BatchDrafts(3, DraftRows(draft_model, 3))),
                              ("lookup K=3", BatchDrafts(3)), ("lookup K=6", BatchDrafts(6))]:
            for _ in range(2):
                r = run_bench(target, len(ids), gen, ids=ids, drafter=drafter)
            rows.append({"text": kind, "config": name, "np": 1, "prompt": len(ids), **_pick(r)})
            print(json.dumps(rows[-1]), flush=True)
    rows.append({"config": "costs", "np": 1, **costs(target, draft_model, 3)})
    print(json.dumps(rows[-1]), flush=True)
    return rows


def costs(target, draft, k: int, n: int = 20) -> dict:
    """Median ms of a target decode step (the engine's compiled block step of one id, not split),
    a target verify block of k + 1 tokens (margin k), and a draft step (margin k), after a
    100-token prompt: what a round costs, next to the tokens it yields."""
    import mlx.core as mx
    import numpy as np

    from mlxcel_dist.engine.batch import BatchEngine

    def timed(model, margin, L):
        # a row at position 100 fed L ids at the same positions each time (as a rolled-back round)
        e = BatchEngine(model, margin=margin)
        e.add(0, np.arange(5, 106))
        y, ts = mx.array([[7] * L]), []
        for i in range(n + 3):
            t = time.perf_counter()
            mx.eval(e.feed(y, [100]), e.buffers)
            ts.append(time.perf_counter() - t)
        e.remove(0)
        return 1e3 * float(np.median(ts[3:]))

    return {"target_step_ms": timed(target, 0, 1), "target_block_ms": timed(target, k, k + 1),
            "draft_step_ms": timed(draft, k, 1), "k": k}


def _pick(r: dict) -> dict:
    keys = ("decode_tok_s", "decode_ms_per_token", "gen_tokens", "drafted", "accepted", "acceptance",
            "mean_accepted", "verify_forwards")
    return {k: r[k] for k in keys if k in r}


def mlx_lm_rows(target_dir: str, gen: int) -> list:
    """mlx-lm's plain generate_step and speculative_generate_step (num_draft_tokens 3) on the pair."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step, speculative_generate_step

    from mlxcel_dist.checkpoint.tokenizer import Tokenizer

    m, _ = load(target_dir)
    d, _ = load(str(DRAFT))
    tok = Tokenizer(Path(target_dir))
    rows = []
    for kind, text in TEXTS.items():
        ids = mx.array(tok.prompt_ids(text, chat=False))
        for name, make in [("mlx-lm plain", lambda: generate_step(ids, m, max_tokens=gen)),
                           ("mlx-lm draft K=3", lambda: speculative_generate_step(ids, m, d, num_draft_tokens=3,
                                                                                  max_tokens=gen))]:
            try:
                for _ in range(2):
                    t, out, drafted = None, [], 0
                    for step in make():
                        if t is None:
                            t = time.perf_counter()
                        out.append(int(step[0]))
                        drafted += bool(step[2]) if len(step) > 2 else 0
                    dt = time.perf_counter() - t
                row = {"text": kind, "config": name, "np": 1, "decode_tok_s": (len(out) - 1) / dt,
                       "gen_tokens": len(out)}
                if "draft" in name:
                    row["accepted"] = drafted
                rows.append(row)
            except Exception as e:  # mlx-lm refusing the pair is a result too
                rows.append({"text": kind, "config": name, "np": 1, "error": f"{type(e).__name__}: {e}"})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def np2_rows(target_dir: str, gen: int) -> list:
    from mlxcel_dist.checkpoint.tokenizer import Tokenizer

    tok = Tokenizer(Path(target_dir))
    rows = []
    for kind, text in TEXTS.items():
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write(text)
        n = len(tok.prompt_ids(text, chat=False))
        for name, extra in [("plain", []), ("draft K=3", ["--draft-model", str(DRAFT)]),
                            ("lookup K=3", ["--prompt-lookup"])]:
            cmd = [sys.executable, "-m", "mlxcel_dist.cli", "bench", target_dir, "--np", "2", "--backend", "mpi",
                   "--prompt-file", f.name, "--prompt-tokens", str(n), "--gen-tokens", str(gen), "--json", *extra]
            for _ in range(2):
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            if p.returncode:
                rows.append({"text": kind, "config": name, "np": 2, "error": p.stderr.strip()[-300:]})
            else:
                rows.append({"text": kind, "config": name, "np": 2, "prompt": n,
                             **_pick(json.loads(p.stdout.splitlines()[-1]))})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--np2", action="store_true")
    ap.add_argument("--no-mlx-lm", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    TEXTS["repeat"] = repeat_text()
    rows = np1(a.target, a.gen)
    if not a.no_mlx_lm:
        rows += mlx_lm_rows(a.target, a.gen)
    if a.np2:
        rows += np2_rows(a.target, a.gen)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
