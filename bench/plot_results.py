#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Plot `RESULT` rows of bench/ddtree_e2e.py runs (a JSON list, as in
bench/results/) as PNGs: tokens/s and acceptance length tau per configuration
and concurrency. Only rows of the same device call are comparable; pass
--call to pick one (the `call` field), or several for side-by-side panels.

    python3 bench/plot_results.py bench/results/2026-11-29-h200-tinypair.json \
        --call 7 8 --out bench/results/2026-11-29-h200-tinypair
"""

import argparse
import json
from collections import defaultdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results")
    ap.add_argument("--call", type=int, nargs="*", default=None)
    ap.add_argument("--out", required=True, help="PNG path prefix")
    a = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(a.results) as f:
        rows = json.load(f)
    if a.call:
        rows = [r for r in rows if r.get("call") in a.call]
    by_conc: dict[int, list[dict]] = defaultdict(list)
    for r in rows:
        by_conc[r["conc"]].append(r)
    concs = sorted(by_conc)

    def label(r: dict) -> str:
        if r["mode"] == "none":
            return "no spec"
        if r["mode"] == "dflash":
            return f"DFlash K={r['k']}"
        policy = " (batch)" if r.get("policy") == "batch" else ""
        return f"DDTree B={r['budget']}{policy}"

    budgets = (1, 16, 32, 64, 128, 256)
    order = ["no spec", "DFlash K=7", "DFlash K=15"] + [
        f"DDTree B={b}{p}" for b in budgets for p in ("", " (batch)")
    ]
    for metric, ylabel, fname in (
        ("tok_s", "tokens/s", "tok_s"),
        ("tau", "acceptance length tau", "tau"),
    ):
        fig, axes = plt.subplots(1, len(concs), figsize=(5 * len(concs), 3.6))
        if len(concs) == 1:
            axes = [axes]
        for ax, conc in zip(axes, concs):
            vals = {label(r): r.get(metric) for r in by_conc[conc] if r.get(metric)}
            names = [n for n in order if n in vals]
            ax.bar(names, [vals[n] for n in names], color="#4a7ab5")
            for i, n in enumerate(names):
                ax.annotate(f"{vals[n]:g}", (i, vals[n]), ha="center", va="bottom", fontsize=8)
            ax.set_title(f"concurrency {conc}")
            ax.set_ylabel(ylabel)
            ax.tick_params(axis="x", rotation=30, labelsize=8)
        fig.suptitle("tinypair on one H200, float32, greedy, 256 new tokens", fontsize=9)
        fig.tight_layout()
        path = f"{a.out}-{fname}.png"
        fig.savefig(path, dpi=110)
        print("wrote", path)


if __name__ == "__main__":
    main()
