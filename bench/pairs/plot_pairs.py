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


def format_axes(ax, title: str) -> None:
    """Tokens/s against concurrency, both on log scales."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("tokens/s")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results")
    ap.add_argument("--out", required=True, help="PNG path")
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(a.results) as f:
        rows = [
            r
            for r in json.load(f)
            if "tok_s" in r and r.get("dtype") == a.dtype and not r.get("temperature")
        ]
    pairs = sorted({r["pair"] for r in rows})
    if not pairs:
        raise SystemExit(f"no {a.dtype} rows with tok_s in {a.results}")
    fig, axes = plt.subplots(
        1, len(pairs), figsize=(6 * len(pairs), 4.5), squeeze=False
    )
    for ax, pair in zip(axes[0], pairs):
        for method, label in LABELS.items():
            pts = sorted(
                (r["concurrency"], r["tok_s"], r.get("tau"))
                for r in rows
                if r["pair"] == pair and r["method"] == method
            )
            if pts:
                ax.plot(
                    [p[0] for p in pts], [p[1] for p in pts], marker="o", label=label
                )
            for x, y, t in pts:
                if t:
                    kw = dict(textcoords="offset points", xytext=(4, 4), fontsize=7)
                    ax.annotate(f"τ {t:.2f}", (x, y), **kw)
        format_axes(ax, f"{pair} ({a.dtype}, held-out prompts, greedy)")
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print(a.out)


if __name__ == "__main__":
    main()
