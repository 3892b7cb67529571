"""Draw docs/benchmarks.md's plots from the saved numbers.

    pip install -e ".[bench]"      # matplotlib
    python benchmarks/plot_results.py [--results benchmarks/results/recorded.json] [--out docs/img]

Reads the JSON that holds the recorded runs (benchmarks/results/recorded.json:
the numbers of docs/benchmarks-log.md) and writes one PNG per plot:

- serve_clients.png: aggregate serve throughput against concurrent clients,
  ours and mlx_lm.server, on the 2-core CPU and on one H200;
- h200_families.png: decode tok/s per family against mlx-lm on one H200;
- cpu_np2_np1.png: np 2 / np 1 decode on the 2-core CPU, run by run.

Nothing is measured here: a new run goes into the JSON first.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def serve_clients(r: dict, plt):
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "cpu", "2-core CPU, random bf16 llama 25.7M"),
                           (axes[1], "h200", "one H200 (np 2: two), 12B-shaped gemma3 bf16")):
        run = r["serve_clients"][key]
        for name, ys in run["tok_s"].items():
            ours, np2 = name.startswith("mlxcel"), "np 2" in name
            color = {(True, False): "tab:blue", (True, True): "tab:green",
                     (False, False): "tab:gray", (False, True): "tab:olive"}[ours, np2]
            ax.plot(run["clients"], ys, "-" if ours else "--", marker="o", color=color, label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(run["clients"], [str(c) for c in run["clients"]])
        ax.set_xlabel("concurrent streaming clients")
        ax.set_ylabel("aggregate tok/s")
        ax.set_title(f"{title}\n{run['date']} UTC, commit {run['commit']}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return fig


def h200_families(r: dict, plt):
    fam = r["h200_families"]["absolute"]
    names = list(fam["decode_tok_s_per_rep"])
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.38
    for k, (impl, color) in enumerate((("mlx-lm", "tab:gray"), ("ours", "tab:blue"))):
        for i, n in enumerate(names):
            reps = fam["decode_tok_s_per_rep"][n][impl]
            x = i + (k - 0.5) * width
            ax.bar(x, sum(reps) / len(reps), width, color=color, label=impl if i == 0 else None)
            ax.plot([x] * len(reps), reps, "k.", ms=4)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("decode tok/s")
    ax.set_title(f"One H200, random bf16 weights shared by both, prompt 2048, 128 greedy tokens; "
                 f"bars: mean of the reps, dots: each rep\n"
                 f"{fam['date']} UTC, commit {fam['commit']}", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    return fig


def cpu_np2_np1(r: dict, plt):
    c = r["cpu_vs_mlx_lm"]
    runs = c["runs"]
    fig, ax = plt.subplots(figsize=(9, 4))
    for key, label, dx, color in (("np2_over_np1_decode", "np 2 (mpi) / np 1", 0.0, "tab:blue"),
                                  ("np2_ring_over_np1_decode", "np 2 (ring) / np 1", 0.15, "tab:orange")):
        xs, ys, lo, hi = [], [], [], []
        for i, run in enumerate(runs):
            if key not in run:
                continue
            med, a, b = run[key]
            xs.append(i + dx)
            ys.append(med)
            lo.append(med - a if a is not None else 0)
            hi.append(b - med if b is not None else 0)
        ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", capsize=3, color=color, label=label + " (median, trial range)")
    ax.axhline(c["target_np2_over_np1"], color="tab:red", ls="--", lw=1, label="target 1.6x")
    ax.axhline(c["ceiling_np2_over_np1"], color="tab:green", ls=":", lw=1, label="ceiling on this VM, ~1.85x")
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set_xticks(range(len(runs)), [run["label"] for run in runs], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("decode speed-up over np 1")
    ax.set_ylim(0.9, 2.3)
    ax.set_title("2-core CPU, random bf16 gemma3 203.5M, compare_mlx_lm.py, one point per run", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig


PLOTS = {"serve_clients": serve_clients, "h200_families": h200_families, "cpu_np2_np1": cpu_np2_np1}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results" / "recorded.json")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = json.loads(args.results.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    for name, draw in PLOTS.items():
        fig = draw(r, plt)
        fig.tight_layout()
        path = args.out / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
