#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Offline tau of trained benchmark pairs on held-out prompts, at temperature 0
and 1: the DFlash chain (K = 15) and DDTree at budgets 16 / 64 / 256, replayed
as vLLM verifies them (acceptance.py), without vLLM.

    python3 -m bench.pairs.offline_tau [--models bench/pairs/models] \\
        [--pairs dense-8b,hybrid-27b] [--temperatures 0,1] [--prompts 48] \\
        [--seed 0] [--out bench/results/pairs.json]

Runs on the CPU (a few minutes per pair and temperature) or a GPU. Prints one
``TAU {json}`` line per (pair, temperature); with ``--out`` it replaces that
pair's ``offline_heldout_tau_t<T>`` row in the file (run_pairs.py's rows).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
import types

from bench import common

log = functools.partial(common.progress, "offline_tau")


def row_key(temperature: float) -> str:
    return f"offline_heldout_tau_t{temperature:g}"


def merge_rows(rows: list[dict], new: list[dict]) -> list[dict]:
    """``rows`` with each of ``new`` replacing the row of the same pair and
    key (appended when there is none)."""
    out = list(rows)
    for n in new:
        key = next(k for k in n if k.startswith("offline_heldout_tau_t"))
        out = [r for r in out if not (r.get("pair") == n["pair"] and key in r)]
        out.append(n)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=common.PAIR_MODELS)
    ap.add_argument("--pairs", default="dense-8b,hybrid-27b")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0, help="of the sampled continuations")
    ap.add_argument("--out", default=None, help="JSON rows to update (pairs.json)")
    ap.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help="cut each prompt to its last N tokens (default: train.py's "
        "EVAL_PROMPT_LEN, 160: with 256 new tokens inside the 512-token "
        "windows the pairs were trained on)",
    )
    ap.add_argument(
        "--min-prompt-tokens",
        type=int,
        default=None,
        help="only prompts at least this long (default: --prompt-tokens), so "
        "that runs at several --prompt-tokens can share their prompts",
    )
    ap.add_argument("--cpu", action="store_true")
    a = ap.parse_args(argv)

    import torch

    from bench.pairs import pair_configs as pc
    from bench.pairs import train

    device = torch.device("cuda" if torch.cuda.is_available() and not a.cpu else "cpu")
    new: list[dict] = []
    for pair in a.pairs.split(","):
        model, drafter = train.load_trained_pair(a.models, pair, device)
        for t in (float(x) for x in a.temperatures.split(",") if x):
            t0 = time.time()
            res = train.evaluate(
                types.SimpleNamespace(smoke=False),
                model,
                drafter,
                os.path.join(a.models, "prompts", "heldout.jsonl"),
                device,
                a.prompts,
                temperature=t,
                seed=a.seed,
                prompt_tokens=a.prompt_tokens or train.EVAL_PROMPT_LEN,
                min_prompt_tokens=a.min_prompt_tokens,
            )
            res.update(
                seed=a.seed,
                device=device.type,
                torch=torch.__version__,
                drafter_id=pc.weights_id(a.models, pair),
            )
            row = {"pair": pair, row_key(t): res}
            common.emit("TAU", row)
            log(f"{pair} T={t:g}: {res} ({time.time() - t0:.0f} s on {device})")
            new.append(row)
    if a.out:
        rows = []
        if os.path.exists(a.out):
            with open(a.out) as f:
                rows = json.load(f)
        common.write_json(a.out, merge_rows(rows, new))


if __name__ == "__main__":
    main()
