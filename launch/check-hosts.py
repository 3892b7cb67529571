#!/usr/bin/env python3
"""Check every host of a hostfile before a multi-host run.

    python launch/check-hosts.py HOSTFILE [--model PATH] [--python PATH]

For each host (OpenMPI text or MLX JSON hostfile): ssh reachable without a
password prompt (BatchMode, ConnectTimeout), the same Python / mlx /
mlxcel-dist versions as this head node, the same python path (the launcher
starts ranks with the head node's interpreter path), and, with --model, the
model directory present at the same path. Hosts that are this machine are
checked without ssh. Prints a table; exits 1 if any check fails, 2 on bad
input.

The ranks also need to reach each other (ring: the hostfile "ips"; MPI: any
interface, or --mca btl_tcp_if_include); that is not checked here.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlxcel_dist.errors import UserError  # noqa: E402
from mlxcel_dist.cluster.hostfile import read_hostfile  # noqa: E402

# Runs on each host with the rank python; prints one JSON line.
PROBE = r"""
import json, os, sys
out = {"python": sys.version.split()[0], "executable": sys.executable}
try:
    import mlx.core as mx
    out["mlx"] = getattr(mx, "__version__", "?")
except Exception as e:
    out["mlx"] = "missing (%s)" % type(e).__name__
try:
    from importlib.metadata import version
    out["mlxcel_dist"] = version("mlxcel-dist")
except Exception:
    try:
        import mlxcel_dist
        out["mlxcel_dist"] = getattr(mlxcel_dist, "__version__", "?")
    except Exception as e:
        out["mlxcel_dist"] = "missing (%s)" % type(e).__name__
model = os.environ.get("MLXCEL_CHECK_MODEL")
if model:
    out["model"] = "ok" if os.path.isdir(model) or os.path.isfile(model) else "missing"
print("MLXCEL_CHECK " + json.dumps(out))
"""


def probe(host: str, local: bool, python: str, model: str | None, timeout: float) -> dict:
    env_prefix = f"MLXCEL_CHECK_MODEL={shlex.quote(model)} " if model else ""
    remote = f"{env_prefix}{shlex.quote(python)} -c {shlex.quote(PROBE)}"
    if local:
        cmd = ["/bin/sh", "-c", remote]
    else:
        cmd = [
            os.environ.get("MLXCEL_SSH", "ssh"),
            "-o", "BatchMode=yes",
            "-o", f"ConnectTimeout={int(timeout)}",
            "-o", "LogLevel=ERROR",
            host, remote,
        ]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 30,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"error": "timed out"}
    except OSError as e:
        return {"error": f"cannot run {cmd[0]}: {e.strerror}"}
    for line in p.stdout.splitlines():
        if line.startswith("MLXCEL_CHECK "):
            return json.loads(line[len("MLXCEL_CHECK "):])
    if p.returncode == 255 and not local:
        last = (p.stderr.strip().splitlines() or ["ssh failed"])[-1]
        return {"error": last if last.startswith("ssh") else f"ssh: {last}"}
    last = (p.stderr.strip().splitlines() or [f"exit code {p.returncode}"])[-1]
    return {"ssh": "ok", "error": f"{python}: {last}"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("hostfile")
    ap.add_argument("--model", help="model path that must exist on every host")
    ap.add_argument("--python", default=sys.executable,
                    help="interpreter the ranks use (default: this one, same path everywhere)")
    ap.add_argument("--timeout", type=float, default=10.0, help="ssh ConnectTimeout seconds")
    args = ap.parse_args()
    try:
        info = read_hostfile(args.hostfile)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    model = str(Path(args.model).absolute()) if args.model else None
    head = probe("localhost", True, args.python, model, args.timeout)
    if "error" in head:
        print(f"error: the head node's own python fails: {head['error']}", file=sys.stderr)
        return 1

    cols = ["host", "ssh", "python", "mlx", "mlxcel-dist", "model", "result"]
    rows = [["(head node)", "-", head["python"], head["mlx"], head["mlxcel_dist"],
             head.get("model", "-"), "reference"]]
    failed = 0
    for h in info.hosts:
        r = probe(h.name, h.is_local, args.python, model, args.timeout)
        if "error" in r and "python" not in r:
            rows.append([h.name, "ok" if r.get("ssh") == "ok" else "FAIL", "-", "-", "-", "-",
                         r["error"]])
            failed += 1
            continue
        problems = []
        for key, label in (("python", "python"), ("mlx", "mlx"), ("mlxcel_dist", "mlxcel-dist")):
            if r.get(key) != head.get(key):
                problems.append(f"{label} {r.get(key)} != {head.get(key)}")
        if model and r.get("model") != "ok":
            problems.append(f"no {model}")
        rows.append([h.name, "local" if h.is_local else "ok", r.get("python", "?"),
                     r.get("mlx", "?"), r.get("mlxcel_dist", "?"), r.get("model", "-"),
                     "; ".join(problems) or "ok"])
        failed += bool(problems)

    widths = [max(len(str(row[i])) for row in rows + [cols]) for i in range(len(cols))]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    if failed:
        print(f"\n{failed} host(s) failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
