"""A serve log's MLXCEL_DIST_STEP_LOG interval lines summed up by kind (issue
42): intervals whose steps held no constrained row ("text") against those of
mostly constrained rows ("json", over --json-rows rows a step), each host
part's range in ms a step (engine, launch, the grammar masks' wait, the masks'
worker's start and compute, upload, draw, read, rest, admissions) and the
loop thread's CPU seconds a second. Intervals of under --min-steps steps (a
server warming up) are left out.

    python benchmarks/step_log_parts.py SERVER_LOG[.gz] ... [--json-rows 25] [--min-steps 200]
"""

from __future__ import annotations

import argparse
import gzip
import re

PARTS = {"engine": "engine", "launch": "launch", "eval": "MLX's start", "wait": "grammar masks' wait",
         "start": "their worker's start", "compute": "compute", "upload": "upload", "draw": "their draw",
         "read": "read", "rest": "rest", "admissions": "admissions", "thread": "this thread"}


def intervals(path: str, json_rows: float, min_steps: int) -> dict:
    """{"text": [parts], "json": [parts]} of the file's interval lines."""
    opener = gzip.open if path.endswith(".gz") else open
    out = {"text": [], "json": []}
    with opener(path, "rt") as f:
        for line in f:
            m = re.search(r"last \d+ s: (\d+) steps", line)
            if not m or int(m.group(1)) < min_steps:
                continue
            c = re.search(r"([\d.]+) constrained rows a step", line)
            if c is None:  # (a log from before the step clock)
                continue
            rows = float(c.group(1))
            kind = "text" if rows == 0 else "json" if rows > json_rows else None
            if kind is None:
                continue
            got = {}
            for key, name in PARTS.items():
                v = re.search(r"(?<![a-z'])" + re.escape(name) + r" ([\d.]+)", line)
                if v:
                    got[key] = float(v.group(1))
            out[kind].append(got)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--json-rows", type=float, default=25.0)
    ap.add_argument("--min-steps", type=int, default=200)
    a = ap.parse_args()
    for path in a.logs:
        print(path)
        for kind, rows in intervals(path, a.json_rows, a.min_steps).items():
            if not rows:
                continue
            keys = [k for k in PARTS if all(k in r for r in rows)]
            print(f"  {kind} ({len(rows)} intervals): " +
                  ", ".join(f"{k} {min(r[k] for r in rows):.2f}-{max(r[k] for r in rows):.2f}" for k in keys))


if __name__ == "__main__":
    main()
