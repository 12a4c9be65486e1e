#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Plot bench/results/pairs.json (run_pairs.py rows): tokens/s against
concurrency for no speculation, the DFlash chain and DDTree, one panel per pair
and dtype, with tau written at each point.

    python3 -m bench.pairs.plot_pairs bench/results/pairs.json \\
        --out bench/results/pairs.png
"""

from __future__ import annotations

import argparse
import json

LABELS = {
    "nospec": "no speculation",
    "chain": "DFlash chain K=15",
    "chain_v2": "DFlash chain K=15 (V2 runner)",
    "ddtree": "DDTree",
    "ddtree_measured": "DDTree (measured budget policy)",
}


def plot_panels(panels: dict, title: str, path: str) -> None:
    """One panel per pair of ``panels`` (``{pair: [(label, [(concurrency,
    tokens/s, note or None), ...]), ...]}``): tokens/s against concurrency,
    both on log scales, each note written at its point; ``title`` formatted
    with ``pair``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False
    )
    for ax, (pair, series) in zip(axes[0], sorted(panels.items())):
        for label, pts in series:
            if pts:
                ax.plot(
                    [p[0] for p in pts], [p[1] for p in pts], marker="o", label=label
                )
            for x, y, note in pts:
                if note:
                    kw = dict(textcoords="offset points", xytext=(4, 4), fontsize=7)
                    ax.annotate(note, (x, y), **kw)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel("tokens/s")
        ax.set_title(title.format(pair=pair))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results")
    ap.add_argument("--out", required=True, help="PNG path")
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    with open(a.results) as f:
        rows = [
            r
            for r in json.load(f)
            if "tok_s" in r and r.get("dtype") == a.dtype and not r.get("temperature")
        ]
    pairs = sorted({r["pair"] for r in rows})
    if not pairs:
        raise SystemExit(f"no {a.dtype} rows with tok_s in {a.results}")
    panels = {
        pair: [
            (
                label,
                sorted(
                    (r["concurrency"], r["tok_s"], r.get("tau") and f"τ {r['tau']:.2f}")
                    for r in rows
                    if r["pair"] == pair and r["method"] == method
                ),
            )
            for method, label in LABELS.items()
        ]
        for pair in pairs
    }
    plot_panels(panels, f"{{pair}} ({a.dtype}, held-out prompts, greedy)", a.out)
    print(a.out)


if __name__ == "__main__":
    main()
