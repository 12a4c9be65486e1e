#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""One command for the DDTree benchmark matrix on a GPU host: no speculation,
the DFlash chain (K in {7, 15}) and DDTree (B in {16, 32, 64, 128, 256}) at
concurrency {1, 4, 8, 16, 32}, greedy, CUDA graphs on; one engine (process)
per configuration running every concurrency. Writes all `RESULT` rows (tok/s,
tau, per-depth acceptance, ms per step, exactness against the no-spec run)
and, with ``--breakdown``, `PROFILE` rows (GPU time per step by phase: draft /
tree build / verify / bookkeeping) to one JSON file, plus plots through
bench/plot_results.py, and prints progress.

The tinypair (``MODELS``: its directory, e.g. ``../shared/models/tinypair``):

    python3 bench/run_matrix.py --target $MODELS/target --drafter $MODELS/drafter \
        --prompts $MODELS/prompts_train.jsonl --out results/matrix

Qwen3-8B with its DFlash drafter (not run by us: we have had no real weights
on our GPU hosts):

    python3 bench/run_matrix.py --target Qwen/Qwen3-8B \
        --drafter z-lab/Qwen3-8B-DFlash-b16 --dtype bfloat16 \
        --prompts my_prompts.jsonl --n 64 --out results/qwen3-8b

8B-shaped dummy weights (verification cost against the budget; acceptance is
meaningless with random weights):

    python3 bench/run_matrix.py --target bench/configs/qwen3-8b-dummy/target \
        --drafter bench/configs/qwen3-8b-dummy/drafter --load-format dummy \
        --dtype bfloat16 --prompts P --n 16 --max-tokens 128 --out results/8b-dummy
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _rows(stdout: str, prefix: str) -> list[dict]:
    """The JSON rows of ddtree_e2e.py's ``<prefix> {json}`` lines."""
    return [
        json.loads(line[len(prefix) + 1 :])
        for line in stdout.splitlines()
        if line.startswith(prefix + " ")
    ]


def configs(a: argparse.Namespace) -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = []
    if not a.skip_none:
        out.append(("none", ["--mode", "none"]))
    for k in a.chain:
        out.append((f"dflash_k{k}", ["--mode", "dflash", "--k", str(k)]))
    for b in a.budgets:
        out.append(
            (
                f"ddtree_b{b}",
                ["--mode", "ddtree", "--budget", str(b), "--policy", a.policy],
            )
        )
    # Sampled rows (temperature > 0): the same configurations again, tagged
    # _t<T>; speed and tau only (outputs are not comparable).
    sampled = [
        (f"{tag}_t{t:g}", [*extra, "--temperature", str(t)])
        for t in a.temperatures
        if t > 0
        for tag, extra in out
    ]
    return (out if 0 in a.temperatures else []) + sampled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--prompts", nargs="+", required=True)
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--conc", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--chain", type=int, nargs="*", default=[7, 15])
    ap.add_argument("--budgets", type=int, nargs="*", default=[16, 32, 64, 128, 256])
    ap.add_argument("--policy", choices=["fixed", "batch"], default="fixed")
    ap.add_argument("--skip-none", action="store_true")
    ap.add_argument(
        "--temperatures",
        type=float,
        nargs="+",
        default=[0.0],
        help="0 = greedy (compared with no spec); e.g. 0 1 adds sampled rows",
    )
    ap.add_argument(
        "--timeout", type=int, default=900, help="seconds per configuration"
    )
    ap.add_argument("--out", required=True, help="path prefix for .json and .png")
    ap.add_argument("--dry-run", action="store_true", help="print the commands only")
    ap.add_argument(
        "--breakdown",
        nargs="*",
        default=None,
        metavar="TAG",
        help="also profile these configurations (all when given no tag) in a "
        "second process each: GPU time per step by phase (draft / tree build / "
        "verify / bookkeeping) at every concurrency; costs one more engine "
        "start per configuration",
    )
    a = ap.parse_args()

    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    tokens_dir = a.out + "-tokens"
    todo = configs(a)
    rows: list[dict] = []
    for i, (tag, extra) in enumerate(todo, 1):
        cmd = [
            sys.executable,
            os.path.join(HERE, "ddtree_e2e.py"),
            "--target",
            a.target,
            "--drafter",
            a.drafter,
            "--prompts",
            *a.prompts,
            "--n",
            str(a.n),
            "--max-tokens",
            str(a.max_tokens),
            "--dtype",
            a.dtype,
            "--load-format",
            a.load_format,
            "--conc",
            *map(str, a.conc),
            "--tag",
            tag,
            "--outdir",
            tokens_dir,
            *extra,
        ]
        if tag != "none" and not a.skip_none and "--temperature" not in extra:
            cmd += ["--ref", "none"]
        print(f"[{i}/{len(todo)}] {tag}: {' '.join(cmd)}", flush=True)
        if a.dry_run:
            continue
        os.makedirs(tokens_dir, exist_ok=True)
        t0 = time.time()
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=a.timeout, check=False
        )
        found = _rows(proc.stdout, "RESULT")
        for row in found:
            row["call"] = 0  # one matrix run: every row is comparable
            rows.append(row)
            print(
                f"    c={row['conc']:<3} tok/s={row['tok_s']:<9} tau={row['tau']} "
                f"identical={row.get('identical')}",
                flush=True,
            )
        if proc.returncode != 0:
            print(f"    FAILED (rc={proc.returncode}); last output:", flush=True)
            print("\n".join((proc.stdout + proc.stderr).splitlines()[-15:]), flush=True)
        if a.breakdown is not None and (not a.breakdown or tag in a.breakdown):
            prof = subprocess.run(
                [*cmd, "--profile", "2"],
                capture_output=True,
                text=True,
                timeout=a.timeout,
                check=False,
            )
            for row in _rows(prof.stdout, "PROFILE"):
                row.update(call=0, line="PROFILE")
                rows.append(row)
                print(
                    f"    profile c={row['conc']:<3} GPU us/step by phase "
                    f"{row.get('gpu_us_per_step_by_phase')}",
                    flush=True,
                )
            if prof.returncode != 0:
                print(f"    profile FAILED (rc={prof.returncode})", flush=True)
        print(f"    {time.time() - t0:.0f}s", flush=True)
        with open(a.out + ".json", "w") as f:
            json.dump(rows, f, indent=1)
    if a.dry_run or not rows:
        return
    subprocess.run(
        [
            sys.executable,
            os.path.join(HERE, "plot_results.py"),
            a.out + ".json",
            "--out",
            a.out,
        ],
        check=False,
    )
    print(f"wrote {a.out}.json", flush=True)


if __name__ == "__main__":
    main()
