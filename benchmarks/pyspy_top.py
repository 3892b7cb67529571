"""The functions a `py-spy record -f raw` profile spends its samples in,
self and inclusive, as fractions of the samples (idle threads' waits left
out unless --idle), so two profiles of one process (early and late in a
server's life) can be put side by side.

    python benchmarks/pyspy_top.py early.txt late.txt [--top 30]
"""

from __future__ import annotations

import argparse
from collections import Counter

WAITS = ("Condition.wait", "Queue.get", "EpollSelector.select", "_worker", "Event.wait", "Thread.join",
         "select.select", "sleep")


def frames(line: str) -> tuple[list[str], int]:
    stack, n = line.rstrip("\n").rsplit(" ", 1)
    return [f.split(" (")[0] + " " + f.rsplit("(", 1)[-1].split(":")[0].rsplit("/", 1)[-1] for f in stack.split(";")], int(n)


def profile(path: str, idle: bool) -> tuple[Counter, Counter, int]:
    own, incl, total = Counter(), Counter(), 0
    for line in open(path):
        if not line.strip():
            continue
        fs, n = frames(line)
        if not idle and any(w in fs[-1] for w in WAITS):
            continue
        total += n
        own[fs[-1]] += n
        for f in set(fs):
            incl[f] += n
    return own, incl, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--idle", action="store_true")
    a = ap.parse_args()
    profs = [profile(f, a.idle) for f in a.files]
    for what, i in (("self", 0), ("inclusive", 1)):
        keys = Counter()
        for p in profs:
            for k, v in p[i].items():
                keys[k] += v / max(p[2], 1)
        print(f"{what}: " + "  ".join(f"{f} ({p[2]} samples)" for f, p in zip(a.files, profs)))
        for k, _ in keys.most_common(a.top):
            print("  " + "  ".join(f"{p[i][k] / max(p[2], 1):6.3f}" for p in profs) + f"  {k}")


if __name__ == "__main__":
    main()
