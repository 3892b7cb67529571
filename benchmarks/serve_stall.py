"""Do running streams stall while a long prompt is admitted? (issue 39)

    python benchmarks/serve_stall.py                              # ours np 1 and np 2, 1500 and 4000 tokens
    python benchmarks/serve_stall.py --servers ours-np1 --vs /path/to/old/checkout --rounds 2
    python benchmarks/serve_stall.py --servers mlx_lm-np1         # mlx_lm.server (pip install mlx-lm)

The 24M bf16 llama of serve_load.py (random weights, the embedded
tokenizer); the streams' ids biased to printable tokens, so each is a chunk. Per server and prompt length, a round: 4 streams decode
(`--stream-tokens` each, EOS ignored, short prompts); once each has sent
`--settle` chunks, one long prompt of random text ids is sent (max_tokens 1 or
`--long-tokens`, streamed) and its time to first token taken. Each stream's gaps between
chunks: the median over the whole stream, the median with no prompt in
(before its send and after its first token), and the longest while the long
prompt was in (from its send to its first token). Reported: the worst
stream's longest / median gap ("stall x"; a long prompt's admission is much
of a stream, so its median counts mixed steps), longest / median with no
prompt in ("stall_plain_x", the stricter reading), the long prompt's time to first
token, and that time for the same prompt with nothing else running (the
server then idle), so `ttft x` = mixed / alone. Ratios are within one run,
as the machine's load moves absolute times.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from serve_load import llama_checkpoint, post_stream, started  # noqa: E402

STREAMS = 4
VERBOSE = False
LONG_TOKENS = 1  # the long prompt's max_tokens (--long-tokens)
ALONE_RUNS = 1  # prompts of the same length alone, the fastest counted (--alone-runs)


def stream(base: str, body: dict, times: list, first: list | None = None) -> None:
    """POST a streamed completion; append each text chunk's arrival time."""
    def seen(t):
        times.append(t)
        if first is not None and not first:
            first.append(t)

    post_stream(base, body, seen)


def long_ids(n: int, seed: int, vocab: int = 512) -> list:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def alone_ttft(base: str, ids: list) -> float:
    t0, first = time.perf_counter(), []
    stream(base, {"prompt": ids, "max_tokens": LONG_TOKENS, "logit_bias": printable_bias()}, [], first)
    return first[0] - t0


@functools.cache
def printable_bias() -> dict:
    """+100 on every token that is printable ASCII text on its own, so each
    stream token is a text chunk: a random model's ids are often byte pieces
    that decode to nothing yet, and the server (rightly) sends no chunk for
    them, which would read as a gap."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(HERE.parent / "models" / "gemma3-tiny" / "tokenizer.json"))
    ids = [i for i in range(tok.get_vocab_size()) if (t := tok.decode([i])) and t.isascii() and t.isprintable()]
    return {str(i): 100 for i in ids[:300]}


def one_round(base: str, n: int, seed: int, stream_tokens: int, settle: int) -> dict:
    times = [[] for _ in range(STREAMS)]
    # logprobs: every token comes as a chunk, also one whose text the detokenizer holds back
    # (counted by text alone, such runs read as gaps of up to 1 s while the steps were regular)
    body = {"max_tokens": stream_tokens, "ignore_eos": True, "temperature": 0, "logit_bias": printable_bias(),
            "logprobs": 1}
    threads = [threading.Thread(target=stream, args=(base, {**body, "prompt": f"The sea {i}"}, times[i]))
               for i in range(STREAMS)]
    for t in threads:
        t.start()
    while min(len(x) for x in times) < settle:
        time.sleep(0.01)
    ids = long_ids(n, seed)
    t0, first = time.perf_counter(), []
    stream(base, {"prompt": ids, "max_tokens": LONG_TOKENS, "logit_bias": printable_bias()}, [], first)
    t1 = first[0]
    for t in threads:
        t.join()
    worst = worst_plain = 0.0
    if VERBOSE:
        for i, x in enumerate(times):
            gaps = sorted(((b - a, a - t0, b - t0) for a, b in zip(x, x[1:])), reverse=True)[:3]
            print(f"  stream {i}: {len(x)} chunks, longest gaps (s, from, to after the send; first token at "
                  f"{t1 - t0:.2f}): {[tuple(round(v, 2) for v in g) for g in gaps]}", file=sys.stderr)
    for x in times:
        gaps = [b - a for a, b in zip(x, x[1:])]
        median = statistics.median(gaps)
        during = [b - a for a, b in zip(x, x[1:]) if b > t0 and a < t1]
        plain = [b - a for a, b in zip(x, x[1:]) if b <= t0 or a >= t1]  # no prompt in
        if during and median > 0:
            worst = max(worst, max(during) / median)
        if during and plain:
            worst_plain = max(worst_plain, max(during) / statistics.median(plain))
    medians = [statistics.median([b - a for a, b in zip(x, x[1:])]) for x in times]
    if max(len(x) for x in times) and min(x[-1] for x in times) < t1:
        print("  (a stream ended before the long prompt's first token: --stream-tokens too few)", file=sys.stderr)
    return {"stall_x": round(worst, 1), "stall_plain_x": round(worst_plain, 1), "ttft_s": round(t1 - t0, 3), "median_gap_ms": round(1000 * max(medians), 1),
            "ttft_alone_s": round(min(alone_ttft(base, long_ids(n, seed + 1000 + i)) for i in range(ALONE_RUNS)), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="ours-np1,ours-np2")
    ap.add_argument("--lengths", default="1500,4000")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--stream-tokens", type=int, default=600)
    ap.add_argument("--settle", type=int, default=20, help="chunks each stream sends before the long prompt")
    ap.add_argument("--vs", type=Path, help="another checkout of ours: its servers too, interleaved")
    ap.add_argument("--flags", default="", help="extra flags for our servers (e.g. '--max-num-batched-tokens 128')")
    ap.add_argument("--long-tokens", type=int, default=1, help="the long prompt's max_tokens (1: answered from its"
                    " prefill, no row; more: it becomes a row)")
    ap.add_argument("--alone-runs", type=int, default=1, help="the alone time: the fastest of this many prompts of"
                    " the length (a GPU builds attention graphs per new shape the first time: 15-19 ms on one H200)")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--model", type=Path, help="instead of the 24M llama")
    ap.add_argument("--verbose", action="store_true", help="each stream's longest gaps")
    a = ap.parse_args()
    global VERBOSE, LONG_TOKENS, ALONE_RUNS
    VERBOSE, LONG_TOKENS, ALONE_RUNS = a.verbose, a.long_tokens, a.alone_runs
    model = a.model or llama_checkpoint()
    log_dir = Path("/tmp/serve_stall_logs")
    log_dir.mkdir(exist_ok=True)
    roots = [HERE.parent] + ([a.vs.resolve()] if a.vs else [])
    rows = []
    for r in range(a.rounds):
        for name in a.servers.split(","):
            for root in roots:
                extra = a.flags.split() if name.startswith("ours") and root == HERE.parent else []
                with started(name, model, log_dir, root, extra=extra) as (base, _):
                    stream(base, {"prompt": "warm", "max_tokens": 4}, [])
                    alone_ttft(base, long_ids(64, 1))
                    for n in map(int, a.lengths.split(",")):
                        row = {"server": name, "root": root.name, "round": r, "prompt": n,
                               **one_round(base, n, 7 * n + r, a.stream_tokens, a.settle)}
                        row["ttft_x"] = round(row["ttft_s"] / row["ttft_alone_s"], 2)
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
