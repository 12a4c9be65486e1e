#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Plot `RESULT` rows of bench/ddtree_e2e.py runs (a JSON list, as in
bench/results/) as PNGs: tokens/s and acceptance length tau per configuration
and concurrency. Only rows of the same call (one command on the GPU host, the
`call` field) are comparable; pass --call to pick one, or several for
side-by-side panels.

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
    ap.add_argument(
        "--title", default="tinypair on one H200, float32, greedy, 256 new tokens"
    )
    a = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(a.results) as f:
        rows = json.load(f)
    if a.call:
        rows = [r for r in rows if r.get("call") in a.call]
    # PROFILE rows (run_matrix --breakdown, ddtree_e2e --profile) carry the
    # step-time breakdown; RESULT rows the throughput.
    profiles = [
        r
        for r in rows
        if r.get("line") == "PROFILE" and r.get("gpu_us_per_step_by_phase")
    ]
    rows = [r for r in rows if r.get("line", "RESULT") == "RESULT" and "tok_s" in r]
    by_conc: dict[int, list[dict]] = defaultdict(list)
    for r in rows:
        by_conc[r["conc"]].append(r)
    concs = sorted(by_conc)

    def label(r: dict) -> str:
        temp = f" T={r['temperature']:g}" if r.get("temperature") else ""
        if r["mode"] == "none":
            return "no spec" + temp
        if r["mode"] == "dflash":
            return f"DFlash K={r['k']}" + temp
        policy = " (batch)" if r.get("policy") == "batch" else ""
        return f"DDTree B={r['budget']}{policy}" + temp

    budgets = (1, 16, 32, 64, 128, 256)
    greedy = ["no spec", "DFlash K=7", "DFlash K=15"] + [
        f"DDTree B={b}{p}" for b in budgets for p in ("", " (batch)")
    ]
    temps = sorted({r.get("temperature") or 0 for r in rows})
    order = [n + (f" T={t:g}" if t else "") for t in temps for n in greedy]
    # A file of PROFILE rows only (stage breakdown) has no throughput plots.
    for metric, ylabel, fname in (
        (
            ("tok_s", "tokens/s", "tok_s"),
            ("tau", "acceptance length tau", "tau"),
        )
        if rows
        else ()
    ):
        fig, axes = plt.subplots(1, len(concs), figsize=(5 * len(concs), 3.6))
        if len(concs) == 1:
            axes = [axes]
        for ax, conc in zip(axes, concs):
            vals = {label(r): r.get(metric) for r in by_conc[conc] if r.get(metric)}
            names = [n for n in order if n in vals]
            ax.bar(names, [vals[n] for n in names], color="#4a7ab5")
            for i, n in enumerate(names):
                ax.annotate(
                    f"{vals[n]:g}", (i, vals[n]), ha="center", va="bottom", fontsize=8
                )
            ax.set_title(f"concurrency {conc}")
            ax.set_ylabel(ylabel)
            ax.tick_params(axis="x", rotation=30, labelsize=8)
        fig.suptitle(a.title, fontsize=9)
        fig.tight_layout()
        path = f"{a.out}-{fname}.png"
        fig.savefig(path, dpi=110)
        print("wrote", path)

    # Per-depth acceptance: share of draft steps whose accepted path reached
    # depth d, one line per speculative configuration.
    spec_rows = [r for r in rows if r.get("per_depth_acceptance")]
    if spec_rows:
        spec_concs = sorted({r["conc"] for r in spec_rows})
        fig, axes = plt.subplots(1, len(spec_concs), figsize=(5 * len(spec_concs), 3.6))
        if len(spec_concs) == 1:
            axes = [axes]
        for ax, conc in zip(axes, spec_concs):
            for r in sorted(
                (r for r in spec_rows if r["conc"] == conc),
                key=lambda r: order.index(label(r)) if label(r) in order else 99,
            ):
                acc = r["per_depth_acceptance"]
                ax.plot(range(1, len(acc) + 1), acc, marker=".", label=label(r))
            ax.set_title(f"concurrency {conc}")
            ax.set_xlabel("depth")
            ax.set_ylabel("accepted to this depth")
            ax.legend(fontsize=7)
        fig.suptitle(a.title, fontsize=9)
        fig.tight_layout()
        path = f"{a.out}-per_depth.png"
        fig.savefig(path, dpi=110)
        print("wrote", path)

    # Step-time breakdown: GPU time per engine step by phase, stacked.
    if profiles:
        phases = ("draft", "tree_build", "verify_and_rest", "bookkeeping")
        prof_concs = sorted({r["conc"] for r in profiles})
        fig, axes = plt.subplots(1, len(prof_concs), figsize=(5 * len(prof_concs), 3.6))
        if len(prof_concs) == 1:
            axes = [axes]
        for ax, conc in zip(axes, prof_concs):
            these = [r for r in profiles if r["conc"] == conc]
            names = [label(r) for r in these]
            bottom = [0.0] * len(these)
            for phase in phases:
                vals = [
                    max(0.0, r["gpu_us_per_step_by_phase"].get(phase, 0.0))
                    for r in these
                ]
                ax.bar(names, vals, bottom=bottom, label=phase)
                bottom = [b + v for b, v in zip(bottom, vals)]
            ax.set_title(f"concurrency {conc}")
            ax.set_ylabel("GPU us per step")
            ax.tick_params(axis="x", rotation=30, labelsize=8)
            ax.legend(fontsize=7)
        fig.suptitle(
            a.title + " (GPU kernel time; the step's wall time is longer)", fontsize=9
        )
        fig.tight_layout()
        path = f"{a.out}-breakdown.png"
        fig.savefig(path, dpi=110)
        print("wrote", path)


if __name__ == "__main__":
    main()
