# SPDX-License-Identifier: Apache-2.0
"""bench/step_cost.py's plan and rows, with the engine processes replaced by a
fake that prints the rows an engine would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import step_cost  # noqa: E402


def test_engines_per_shape():
    dense = step_cost.engines_for("dense-8b", [1, 8, 32], 15, [64])
    assert [(e["method"], e["runner"], e.get("budget"), e["conc"]) for e in dense] == [
        ("chain", "v2", None, [1, 8, 32]),
        ("ddtree", "v2", 15, [1, 8, 32]),
        ("ddtree", "v2", 64, [1]),
    ]
    hybrid = step_cost.engines_for("hybrid-27b", [1, 8], 15, [15, 64])
    assert [(e["method"], e["runner"], e.get("budget")) for e in hybrid] == [
        ("chain", "v2", None),
        ("ddtree", "v2", 15),
        ("ddtree", "v2", 64),
        ("chain", "v1", None),
    ]


def test_random_prompts_are_seeded_and_in_range():
    a = step_cost.random_prompts(3, 50, 1000, seed=1)
    assert a == step_cost.random_prompts(3, 50, 1000, seed=1)
    assert a != step_cost.random_prompts(3, 50, 1000, seed=2)
    assert all(16 <= t < 1000 for p in a for t in p)


# ms per step and GPU busy share of each fake engine measurement
FAKE = {
    ("chain", "v1", None): (18.0, 0.8),
    ("chain", "v2", None): (20.0, 0.75),
    ("ddtree", "v2", 15): (21.0, 0.7),
    ("ddtree", "v2", 64): (23.0, 0.65),
}


def _fake_run(cmd, stdout=None, text=None, timeout=None):
    arg, it = {}, iter(cmd[2:])
    for flag in it:
        arg[flag] = True if flag == "--engine" else next(it)
    budget = int(arg["--budget"]) if "--budget" in arg else None
    key = (arg["--method"], arg["--runner"], budget)
    if key == ("ddtree", "v2", 64) and arg["--shape"] == "dense-8b":
        return SimpleNamespace(stdout="engine died\n")
    ms, busy = FAKE[key]
    rows = [
        "ROW "
        + json.dumps(
            dict(
                shape=arg["--shape"],
                method=key[0],
                runner=key[1],
                budget=budget,
                concurrency=int(c),
                ms_per_step=ms * int(c),
                gpu_busy=busy,
            )
        )
        for c in arg["--conc"].split(",")
    ]
    return SimpleNamespace(stdout="\n".join(rows) + "\n")


def test_rows_pair_ddtree_with_the_v2_chain(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "run", _fake_run)
    out = tmp_path / "step-cost.json"
    step_cost.main(["--out", str(out), "--conc", "1,8"])
    result = json.loads(out.read_text())
    assert result["command"].startswith("python3 bench/step_cost.py --out")
    rows = {(r["shape"], r["concurrency"], r["tree_budget"]): r for r in result["rows"]}
    # dense: B = 64 died, so only the equal-token rows; hybrid: all three.
    assert sorted(rows) == [
        ("dense-8b", 1, 15),
        ("dense-8b", 8, 15),
        ("hybrid-27b", 1, 15),
        ("hybrid-27b", 1, 64),
        ("hybrid-27b", 8, 15),
    ]
    r = rows[("hybrid-27b", 8, 15)]
    assert r["equal_tokens"] is True and r["chain_runner"] == "v2"
    assert (r["chain_ms_per_step"], r["ddtree_ms_per_step"]) == (160.0, 168.0)
    assert r["ratio"] == 1.05 and r["ratio_to_chain_v1"] == round(168 / 144, 3)
    assert (r["chain_gpu_busy"], r["ddtree_gpu_busy"]) == (0.75, 0.7)
    assert rows[("hybrid-27b", 1, 64)]["equal_tokens"] is False
    assert "chain_v1_ms_per_step" not in rows[("dense-8b", 1, 15)]
    assert {"shape": "dense-8b", "error": "no rows"}.items() <= next(
        e for e in result["engines"] if "error" in e
    ).items()
