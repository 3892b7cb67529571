"""How fast a worker thread computes a batch's grammar masks while another
thread runs Python (the GIL held), by the GIL's switch interval (issue 42: the
engine's masks computed ahead on the vocabulary's worker thread, beside the
stepping thread).

    python benchmarks/gil_masks.py [--rows 32] [--intervals-ms 5,0.5]

Per switch interval and llguidance path (1: one matcher after the other, as on
a 2-core host; 2: llguidance's pool, as on a larger one): the masks of --rows
json_schema matchers alone (ms a batch), then the batches the worker finishes
in 1 s beside a pure-Python loop on the main thread, and that loop's speed
against alone.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # serve_load's FORMATS


def count(seconds: float) -> int:
    t, c = time.perf_counter(), 0
    while time.perf_counter() - t < seconds:
        c += 1
    return c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--intervals-ms", default="5,0.5")
    a = ap.parse_args()
    from mlxcel_dist.checkpoint.loader import default_model_dir, read_config
    from mlxcel_dist.checkpoint.tokenizer import Tokenizer
    from mlxcel_dist.engine import grammar
    from serve_load import FORMATS

    d = default_model_dir()
    cfg = read_config(d)
    vocab = grammar.Vocab(d / "tokenizer.json", cfg.get("vocab_size") or cfg["text_config"]["vocab_size"],
                          Tokenizer(d, cfg).eos_ids)
    ms = [vocab.matcher(grammar.json_schema(FORMATS["json_schema"]["json_schema"]["schema"])) for _ in range(a.rows)]
    for interval in (float(x) / 1e3 for x in a.intervals_ms.split(",")):
        sys.setswitchinterval(interval)
        for threads in (1, 2):
            vocab.threads = threads
            t = time.perf_counter()
            for _ in range(20):
                vocab.masks(ms)
            alone = (time.perf_counter() - t) / 20 * 1e3
            stop, done = threading.Event(), [0]

            def work():
                while not stop.is_set():
                    vocab.masks(ms)
                    done[0] += 1

            time.sleep(0.5)  # (llguidance's pool threads spin a while after a batch)
            base = count(1.0)
            th = threading.Thread(target=work)
            th.start()
            beside = count(1.0)
            stop.set()
            th.join()
            print(f"switch {interval * 1e3:g} ms, {'one matcher after the other' if threads == 1 else 'pool'}: "
                  f"{alone:.2f} ms a batch alone; beside a Python loop {done[0]} batches in 1 s, "
                  f"the loop at {beside / base:.2f} of alone", flush=True)


if __name__ == "__main__":
    main()
