#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""DDTree's budget policy against the best alternative on the benchmark pairs,
tabulated from run_pairs.py's rows (greedy, bf16; its methods ``nospec``, the
chain, ``ddtree_measured``, ``ddtree``, ``mtp``):

    python3 -m bench.pairs.run_policy --tabulate --rows pairs.json \
        --out policy.json [--plot policy.png] [--pairs dense-8b] \
        [--policies measured,batch] [--chain-method chain_v2]

One row per pair and concurrency goes to ``--out``: ``{"pair",
"concurrency", "nospec_tok_s", "chain_tok_s", "ddtree_tok_s",
"budget_chosen", "tau"}``, where ``ddtree_*`` is the first policy of
``--policies`` (the one judged), ``tau`` its acceptance length, plus each
other policy's tokens/s and budget, both alternatives' tau and
``ddtree_over_best``: DDTree's tokens/s over max(chain, no speculation,
MTP); ``mtp_tok_s``, ``mtp_tau`` and ``mtp_k`` where the target's MTP module
ran.
"""

from __future__ import annotations

import argparse
import functools
import json

from bench import common

POLICY_METHODS = {"measured": "ddtree_measured", "batch": "ddtree"}


log = functools.partial(common.progress, "run_policy")


def tabulate(
    rows: list[dict], policies: list[str], chain_method: str = "chain"
) -> list[dict]:
    """One row per (pair, concurrency) that DDTree (``policies[0]``) ran at,
    from run_pairs rows (greedy, bf16)."""
    greedy = [
        r
        for r in rows
        if "tok_s" in r
        and r.get("dtype") == "bfloat16"
        and r.get("temperature", 0.0) == 0.0
    ]
    by_key = {(r["pair"], r["method"], r["concurrency"]): r for r in greedy}
    judged = POLICY_METHODS[policies[0]]
    out = []
    for pair, method, conc in sorted(k for k in by_key if k[1] == judged):
        tree = by_key[(pair, method, conc)]
        nospec = by_key.get((pair, "nospec", conc))
        chain = by_key.get((pair, chain_method, conc))
        row = dict(
            pair=pair,
            concurrency=conc,
            nospec_tok_s=nospec["tok_s"] if nospec else None,
            chain_tok_s=chain["tok_s"] if chain else None,
            ddtree_tok_s=tree["tok_s"],
            budget_chosen=tree.get("budget_chosen"),
            tau=tree.get("tau"),
            policy=policies[0],
            schedule=tree.get("schedule", "waves"),
            expected_tau=tree.get("expected_tau"),
            chain_tau=chain.get("tau") if chain else None,
            chain_method=chain_method,
        )
        # The target's own MTP module (run_pairs method "mtp"), where it ran:
        # one more alternative DDTree is judged against.
        mtp = by_key.get((pair, "mtp", conc))
        if mtp:
            row.update(
                mtp_tok_s=mtp["tok_s"], mtp_tau=mtp.get("tau"), mtp_k=mtp.get("k")
            )
        for other in policies[1:]:
            r = by_key.get((pair, POLICY_METHODS[other], conc))
            row[f"ddtree_{other}_tok_s"] = r["tok_s"] if r else None
            row[f"ddtree_{other}_budget"] = r.get("budget_chosen") if r else None
            row[f"ddtree_{other}_tau"] = r.get("tau") if r else None
        others = (row["nospec_tok_s"], row["chain_tok_s"], row.get("mtp_tok_s"))
        best = max((x for x in others if x), default=None)
        for key, other in (("best", best), ("chain", row["chain_tok_s"])):
            ratio = round(row["ddtree_tok_s"] / other, 3) if other else None
            row[f"ddtree_over_{key}"] = ratio
        for key in ("max_concurrency", "max_running"):
            if chain and chain.get(key) is not None:
                row[f"chain_{key}"] = chain[key]
        # Kernel compiles logged while a method's decode was timed: its
        # figure there carries a stall.
        methods = dict(ddtree=tree, nospec=nospec, chain=chain, mtp=mtp)
        compiles = {
            k: r["jit_compiles"]
            for k, r in methods.items()
            if r and r.get("jit_compiles")
        }
        if compiles:
            row["jit_compiles_while_timed"] = compiles
        out.append(row)
    return out


def plot(table: list[dict], path: str) -> None:
    """Tokens/s of each method and policy, the judged policy's budget written
    at its points."""
    from bench.pairs.plot_pairs import plot_panels

    panels = {}
    for pair in sorted({r["pair"] for r in table}):
        rows = sorted(
            (r for r in table if r["pair"] == pair), key=lambda r: r["concurrency"]
        )
        v2 = rows[0].get("chain_method") == "chain_v2"
        series = {
            "nospec_tok_s": "no speculation",
            "chain_tok_s": "DFlash chain K=15" + (", V2 runner" if v2 else ""),
            "ddtree_tok_s": f"DDTree ({rows[0]['policy']} policy)",
        } | {
            k: f"DDTree ({k[len('ddtree_') : -len('_tok_s')]} policy)"
            for k in rows[0]
            if k.startswith("ddtree_") and k.endswith("_tok_s") and k != "ddtree_tok_s"
        }

        def note(key: str, r: dict) -> str | None:
            judged = key == "ddtree_tok_s" and r.get("budget_chosen") is not None
            return f"b={r['budget_chosen']}" if judged else None

        panels[pair] = [
            (label, [(r["concurrency"], r[k], note(k, r)) for r in rows if r.get(k)])
            for k, label in series.items()
        ]
    plot_panels(panels, "{pair} (bf16, held-out prompts, greedy)", path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="the policy table (JSON)")
    common.add_options(ap, {
        "--tabulate": (False, "build --out from --rows (run_pairs.py runs the "
            "engines)"),
        "--rows": (None, "run_pairs rows"),
        "--plot": (None, "PNG of tokens/s"),
        "--pairs": ("dense-8b,hybrid-27b", None),
        "--policies": ("measured,batch", "DDTree budget policies, the first one "
            "judged"),
        "--chain-method": ("chain", "run_pairs method of the chain ('chain_v2': "
            "on the V2 runner)"),
    })  # fmt: skip
    a = ap.parse_args()
    policies = [p for p in a.policies.split(",") if p]
    unknown = set(policies) - set(POLICY_METHODS)
    if not policies or unknown:
        raise SystemExit(
            f"--policies: {sorted(unknown) or 'none'} not among {list(POLICY_METHODS)}"
        )
    if not a.tabulate or not a.rows:
        ap.error("--tabulate --rows ROWS: run bench.pairs.run_pairs for the rows")
    pairs = set(a.pairs.split(","))
    with open(a.rows) as f:
        rows = [r for r in json.load(f) if r.get("pair") in pairs]
    table = tabulate(rows, policies, a.chain_method)
    common.write_json(a.out, table)
    for r in table:
        log(
            f"{r['pair']} c={r['concurrency']}: no spec {r['nospec_tok_s']}, chain "
            f"{r['chain_tok_s']}, DDTree {r['ddtree_tok_s']} (budget "
            f"{r['budget_chosen']}, tau {r['tau']}); over the best "
            f"{r['ddtree_over_best']}; compiles {r.get('jit_compiles_while_timed')}"
        )
    if a.plot and table:
        plot(table, a.plot)
        log(f"plot: {a.plot}")


if __name__ == "__main__":
    main()
