# SPDX-License-Identifier: Apache-2.0
"""bench/pairs/run_multigpu.py's plan and bookkeeping, with engine processes
replaced by a fake that prints rows, writes token files and refuses PP > 1 the
way DDTree does."""

from __future__ import annotations

import json
from pathlib import Path

from bench import common
from bench.pairs import run_multigpu

REFUSAL = (
    "DDTree does not support pipeline parallelism (pipeline_parallel_size=2): "
    "only the last stage verifies the tree"
)


def test_plan_runs_the_reference_first_and_pp_on_dense_only():
    plan = run_multigpu.plan_engines(["dense-8b", "hybrid-27b"], [2, 4], [2])
    assert plan[0] == ("dense-8b", "float32", "nospec", 1, 1)
    assert ("dense-8b", "bfloat16", "ddtree", 1, 2) in plan
    assert not [p for p in plan if p[0] == "hybrid-27b" and p[4] > 1]
    for pair in ("dense-8b", "hybrid-27b"):
        ref = plan.index((pair, "float32", "nospec", 1, 1))
        for tp in (2, 4):
            for m in ("nospec", "ddtree"):
                assert plan.index((pair, "float32", m, tp, 1)) > ref
            for m in ("chain", "ddtree"):
                assert (pair, "bfloat16", m, tp, 1) in plan


def test_refusal_line_finds_the_one_line_reason():
    tail = "INFO x\nTraceback ...\nValueError: " + REFUSAL + "\n"
    assert run_multigpu.refusal_line(tail) == REFUSAL
    pydantic = "  Value error, " + REFUSAL + " [type=value_error]"
    assert run_multigpu.refusal_line(pydantic).startswith("DDTree does not")
    assert run_multigpu.refusal_line("INFO DDTree tree speculative decoding") is None
    assert run_multigpu.refusal_line("RuntimeError: CUDA out of memory") is None


def _fake_engine(cmd, timeout, stderr_path=None):
    """Rows as run_pairs' engine prints them; DDTree at TP 2 differs from the
    reference on one float32 output, and PP > 1 is refused."""
    arg = {}
    it = iter(cmd[4:])
    for flag in it:
        if flag.startswith("--"):
            arg[flag] = next(it)
    kwargs = json.loads(arg["--llm-kwargs"])
    tp, pp = kwargs["tensor_parallel_size"], kwargs["pipeline_parallel_size"]
    pair, dtype, method = arg["--pair"], arg["--dtype"], arg["--method"]
    if pp > 1:
        Path(stderr_path).write_text("Traceback\nValueError: " + REFUSAL + "\n")
        return [], 1, "Traceback\nValueError: " + REFUSAL + "\n", []
    rows = []
    for conc in map(int, arg["--conc"].split(",")):
        toks = [[1, 2, 3], [4, 5, 6]]
        if method == "ddtree" and dtype == "float32" and tp == 2:
            toks[1] = [4, 5, 7]
        Path(
            arg["--workdir"], f"tokens_{pair}_{dtype}_{method}_c{conc}.json"
        ).write_text(json.dumps(toks))
        ms = {"chain": 10.0, "ddtree": 11.0}.get(method, 5.0)
        rows.append(
            dict(
                pair=pair,
                dtype=dtype,
                method=method,
                concurrency=conc,
                tok_s=300.0 if method == "ddtree" else 250.0,
                tau=4.0,
                ms_per_step=ms,
            )
        )
    Path(stderr_path).write_text("INFO started\n")
    return rows, 0, "INFO started\n", []


def test_rows_compare_with_tp1_and_chain(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "run_engine_process", _fake_engine)
    out = tmp_path / "multigpu.json"
    run_multigpu.main(
        ["--out", str(out), "--pairs", "dense-8b", "--tp", "2", "--pp", "2"]
    )
    rows = json.loads(out.read_text())
    refused = [r for r in rows if r.get("pp") == 2]
    assert len(refused) == 1 and refused[0]["refused"] == REFUSAL
    f32 = {
        (r["method"], r["tp"], r["concurrency"]): r["identical_to_tp1_nospec"]
        for r in rows
        if r.get("dtype") == "float32" and r["tp"] == 2
    }
    assert f32 == {
        ("nospec", 2, 1): "2/2",
        ("nospec", 2, 8): "2/2",
        ("ddtree", 2, 1): "1/2",
        ("ddtree", 2, 8): "1/2",
    }
    tree = [
        r
        for r in rows
        if r["dtype"] == "bfloat16" and r["method"] == "ddtree" and r["pp"] == 1
    ]
    assert [r["concurrency"] for r in tree] == [1, 8, 32]
    assert all(r["step_cost_ratio"] == 1.1 for r in tree)
    assert all(r["tok_s_over_chain"] == 1.2 for r in tree)
    assert not [
        r for r in rows if r.get("method") == "chain" and "step_cost_ratio" in r
    ]
