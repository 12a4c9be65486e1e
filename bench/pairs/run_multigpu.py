#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""DDTree inside vLLM's tensor and pipeline parallelism, on the benchmark pairs
at their production shapes (needs a host with as many GPUs as the largest
``--tp``):

    python3 -m bench.pairs.run_multigpu --out bench/results/multigpu.json \\
        [--tp 2,4] [--pp 2] [--pairs dense-8b,hybrid-27b] \\
        [--conc 1,8,32] [--float32-conc 1,8]

Per pair, each engine in its own process (run_pairs.py's engine):
- float32, TP = 1, no speculation: the reference outputs;
- float32, each TP size: no speculation and DDTree, each output compared with
  the TP = 1 reference (``identical_to_tp1_nospec``: equal outputs / outputs;
  float32 near-ties are the only expected differences);
- bfloat16, each TP size: the DFlash chain (K = ``--chain-k``) and DDTree at
  each concurrency, tokens/s, tau, ms per step and, on DDTree's rows,
  ``step_cost_ratio`` (its ms per step over the chain's at the same TP size and
  concurrency) and ``tok_s_over_chain``;
- each ``--pp`` size on the dense pair: DDTree at that pipeline-parallel size.
  DDTree refuses pipeline parallelism at startup; the row records whether the
  engine was refused and the one-line reason it gave (``refused``), or its
  numbers if it ran.

Rows go to ``--out`` after every engine (a cut run keeps what finished);
engines' stderr goes to ``<workdir>/<pair>_<dtype>_<method>_tp<N>_pp<M>.log``.
NCCL's NVLink multicast stays off (``NCCL_NVLS_ENABLE=0`` unless already set).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from bench import common
from bench.pairs import pair_configs as pc
from bench.pairs import run_pairs

log = run_pairs.log


def plan_engines(
    pairs: list[str], tps: list[int], pps: list[int]
) -> list[tuple[str, str, str, int, int]]:
    """(pair, dtype, method, tp, pp) in run order: the TP = 1 reference first."""
    plan = []
    for pair in pairs:
        plan.append((pair, "float32", "nospec", 1, 1))
        for tp in tps:
            plan += [(pair, "float32", m, tp, 1) for m in ("nospec", "ddtree")]
            plan += [(pair, "bfloat16", m, tp, 1) for m in ("chain", "ddtree")]
        if pc.pair(pair)["kind"] == "dense":
            plan += [(pair, "bfloat16", "ddtree", 1, pp) for pp in pps]
    return plan


def engine_workdir(workdir: str, tp: int, pp: int) -> str:
    path = os.path.join(workdir, f"tp{tp}_pp{pp}")
    os.makedirs(path, exist_ok=True)
    return path


def refusal_line(stderr_tail: str) -> str | None:
    """The one-line startup refusal in an engine's stderr, or None: DDTree's
    refusals are ``ValueError``s whose message starts with "DDTree" (printed as
    ``ValueError: DDTree ...``, or ``Value error, DDTree ...`` inside a config
    validation error)."""
    for line in reversed(stderr_tail.splitlines()):
        i = line.find("DDTree")
        if i >= 0 and "error" in line[:i].lower():
            return line[i:].strip()
    return None


def annotate(rows: list[dict], workdir: str) -> None:
    """Add the comparisons: float32 outputs against TP = 1 no speculation, and
    DDTree's bf16 step cost and tokens/s against the chain's."""
    ref_dir = engine_workdir(workdir, 1, 1)
    for r in rows:
        if "concurrency" not in r:
            continue
        tp, pp = r["tp"], r["pp"]
        if r["dtype"] == "float32" and (tp, pp) != (1, 1):
            ref = os.path.join(
                ref_dir, f"tokens_{r['pair']}_float32_nospec_c{r['concurrency']}.json"
            )
            got = os.path.join(
                engine_workdir(workdir, tp, pp),
                f"tokens_{r['pair']}_float32_{r['method']}_c{r['concurrency']}.json",
            )
            r["identical_to_tp1_nospec"] = _same(ref, got)
        if r["method"] == "ddtree" and r["dtype"] == "bfloat16":
            chain = next(
                (
                    c
                    for c in rows
                    if c.get("method") == "chain"
                    and c.get("pair") == r["pair"]
                    and c.get("dtype") == "bfloat16"
                    and (c.get("tp"), c.get("pp")) == (tp, pp)
                    and c.get("concurrency") == r["concurrency"]
                    and c.get("temperature", 0.0) == r.get("temperature", 0.0)
                ),
                None,
            )
            if chain is not None:
                r["step_cost_ratio"] = round(r["ms_per_step"] / chain["ms_per_step"], 3)
                r["tok_s_over_chain"] = round(r["tok_s"] / chain["tok_s"], 3)


def _same(ref_path: str, got_path: str) -> str | None:
    if not (os.path.exists(ref_path) and os.path.exists(got_path)):
        return None
    with open(ref_path) as f:
        ref = json.load(f)
    with open(got_path) as f:
        got = json.load(f)
    return f"{sum(x == y for x, y in zip(ref, got))}/{len(got)}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON rows (rewritten per engine)")
    ap.add_argument("--pairs", default=",".join(pc.PAIRS))
    ap.add_argument("--tp", default="2", help="tensor-parallel sizes, e.g. 2,4")
    ap.add_argument("--pp", default="2", help="pipeline-parallel sizes ('' for none)")
    ap.add_argument("--conc", default="1,8,32")
    ap.add_argument("--float32-conc", default="1,8")
    run_pairs.add_engine_options(ap)
    ap.add_argument("--workdir", default=None, help="default: next to --out")
    a = ap.parse_args(argv)
    a.prompts = a.prompts or os.path.join(a.models, "prompts", "heldout.jsonl")
    a.workdir = a.workdir or os.path.join(
        os.path.dirname(os.path.abspath(a.out)), "multigpu-tokens"
    )
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    extra = json.loads(a.llm_kwargs) if a.llm_kwargs else {}
    tps = [int(t) for t in a.tp.split(",") if t]
    pps = [int(p) for p in a.pp.split(",") if p]
    plan = plan_engines(a.pairs.split(","), tps, pps)
    rows: list[dict] = []
    t_all = time.time()
    for k, (pair, dtype, method, tp, pp) in enumerate(plan):
        conc = a.float32_conc if dtype == "float32" else a.conc
        log(
            f"engine {k + 1}/{len(plan)}: {pair} {dtype} {method} TP={tp} PP={pp} "
            f"at c={conc} ({time.time() - t_all:.0f} s so far)"
        )
        workdir = engine_workdir(a.workdir, tp, pp)
        kwargs = dict(extra, tensor_parallel_size=tp, pipeline_parallel_size=pp)
        cmd = run_pairs.engine_command(
            a, pair, dtype, method, conc, workdir=workdir, llm_kwargs=json.dumps(kwargs)
        )
        stderr_path = os.path.join(
            a.workdir, f"{pair}_{dtype}_{method}_tp{tp}_pp{pp}.log"
        )
        t = time.time()
        new, rc, tail, _ = common.run_engine_process(
            cmd, a.engine_timeout, stderr_path=stderr_path
        )
        for r in new:
            r.update(tp=tp, pp=pp)
        if rc != 0:
            reason = refusal_line(tail)
            log(
                f"engine ended with {rc} after {time.time() - t:.0f} s: "
                f"{reason or 'see ' + stderr_path}"
            )
            row = dict(pair=pair, dtype=dtype, method=method, tp=tp, pp=pp)
            if reason:
                row["refused"] = reason
            else:
                row["error"] = str(rc)
                row["stderr_tail"] = tail[-1000:]
            new.append(row)
        rows += new
        annotate(rows, a.workdir)
        common.write_json(a.out, rows)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
