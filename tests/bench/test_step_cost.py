# SPDX-License-Identifier: Apache-2.0
"""bench/engine/step_cost.py's plan and rows, with the engine processes replaced by a
fake that prints the rows an engine would."""

from __future__ import annotations

import json
import os
import subprocess
from types import SimpleNamespace

import pytest

from bench.engine import probe as engine_probe
from bench.engine import step_cost


def test_engines_per_shape():
    dense = step_cost.engines_for("dense-8b", [1, 8, 32], 15, [64])
    assert [(e["method"], e["runner"], e.get("budget"), e["conc"]) for e in dense] == [
        ("chain", "v2", None, [1, 8, 32]),
        ("ddtree", "v2", 15, [1, 8, 32]),
        ("ddtree", "v2", 64, [1]),
    ]
    hybrid = step_cost.engines_for(
        "hybrid-27b", [1, 8], 15, [15, 64], ("unified", "split")
    )
    assert [
        (e["method"], e["runner"], e.get("budget"), e.get("tree_attention"))
        for e in hybrid
    ] == [
        ("chain", "v2", None, None),
        ("ddtree", "v2", 15, "unified"),
        ("ddtree", "v2", 64, "unified"),
        ("ddtree", "v2", 15, "split"),
        ("ddtree", "v2", 64, "split"),
    ]


def test_random_prompts_are_seeded_and_in_range():
    a = step_cost.random_prompts(3, 50, 1000, seed=1)
    assert a == step_cost.random_prompts(3, 50, 1000, seed=1)
    assert a != step_cost.random_prompts(3, 50, 1000, seed=2)
    assert all(16 <= t < 1000 for p in a for t in p)


# ms per step and GPU busy share of each fake engine measurement
FAKE = {
    ("chain", None): (20.0, 0.75),
    ("ddtree", 15): (21.0, 0.7),
    ("ddtree", 64): (23.0, 0.65),
}


def _fake_run(cmd, stdout=None, stderr=None, text=None, timeout=None):
    arg, it = {}, iter(cmd[3:])
    for flag in it:
        arg[flag] = True if flag == "--engine" else next(it)
    budget = int(arg["--budget"]) if "--budget" in arg else None
    key = (arg["--method"], budget)
    mode = arg.get("--tree-attention") if key[0] == "ddtree" else None
    if key == ("ddtree", 64) and arg["--shape"] == "dense-8b":
        return SimpleNamespace(stdout="engine died\n", returncode=1)
    ms, busy = FAKE[key]
    if mode == "split":
        ms -= 1.0
    rows = [
        "ROW "
        + json.dumps(
            dict(
                shape=arg["--shape"],
                method=key[0],
                runner="v2",
                budget=budget,
                tree_attention=mode,
                concurrency=int(c),
                ms_per_step=ms * int(c),
                gpu_busy=busy,
            )
        )
        for c in arg["--conc"].split(",")
    ]
    return SimpleNamespace(stdout="\n".join(rows) + "\n", returncode=0)


def test_rows_pair_ddtree_with_the_v2_chain(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "run", _fake_run)
    out = tmp_path / "step-cost.json"
    step_cost.main(["--out", str(out), "--conc", "1,8"])
    result = json.loads(out.read_text())
    assert result["command"].startswith("python3 -m bench.engine.step_cost --out")
    rows = {
        (r["shape"], r["concurrency"], r["tree_budget"], r["tree_attention"]): r
        for r in result["rows"]
    }
    # dense: B = 64 died, so only the equal-token rows; hybrid: all three;
    # each once per tree-attention mode (both by default).
    assert sorted(rows) == sorted(
        (shape, c, b, mode)
        for mode in ("split", "unified")
        for shape, c, b in (
            ("dense-8b", 1, 15),
            ("dense-8b", 8, 15),
            ("hybrid-27b", 1, 15),
            ("hybrid-27b", 1, 64),
            ("hybrid-27b", 8, 15),
        )
    )
    r = rows[("hybrid-27b", 8, 15, "unified")]
    assert r["equal_tokens"] is True and r["chain_runner"] == "v2"
    assert (r["chain_ms_per_step"], r["ddtree_ms_per_step"]) == (160.0, 168.0)
    assert r["ratio"] == 1.05
    assert (r["chain_gpu_busy"], r["ddtree_gpu_busy"]) == (0.75, 0.7)
    # The split engines' own figures, against the same chain.
    r = rows[("hybrid-27b", 8, 15, "split")]
    assert (r["chain_ms_per_step"], r["ddtree_ms_per_step"]) == (160.0, 160.0)
    assert rows[("hybrid-27b", 1, 64, "split")]["equal_tokens"] is False
    errors = [e for e in result["engines"] if "error" in e]
    assert [(e["shape"], e["budget"], e["tree_attention"]) for e in errors] == [
        ("dense-8b", 64, "unified"),
        ("dense-8b", 64, "split"),
    ]
    assert all(e["error"] == "no rows" for e in errors)


def test_chain_engines_take_no_tree_attention_mode(monkeypatch):
    """The chain engines run without VLLM_DDTREE_TREE_ATTENTION: only the
    DDTree engines get --tree-attention."""
    calls = []

    def record(cmd, **kw):
        calls.append(cmd)
        return _fake_run(cmd, **kw)

    monkeypatch.setattr(subprocess, "run", record)
    step_cost.main(
        ["--out", os.devnull, "--shapes", "hybrid-27b", "--tree-attention", "split"]
    )
    modes = {
        c[c.index("--method") + 1]: (
            c[c.index("--tree-attention") + 1] if "--tree-attention" in c else None
        )
        for c in calls
    }
    assert modes == {"chain": None, "ddtree": "split"}


def test_timed_decode_counts_steps_from_the_draft_counter():
    """Seconds, new tokens and engine steps of one timed decode: the draft
    counter grows by one per request and step, so 3 prompts at concurrency 2
    (batches of 2 and 1 requests, 5 steps each) are 7.5 engine steps of 2."""

    class Metric(SimpleNamespace):
        pass

    class FakeLLM:
        def __init__(self):
            self.drafts = 0.0

        def get_metrics(self):
            return [Metric(name="vllm:spec_decode_num_drafts", value=self.drafts)]

        def generate(self, prompts, sp, use_tqdm=False):
            self.drafts += 5 * len(prompts)
            out = SimpleNamespace(token_ids=[1] * 6)
            return [SimpleNamespace(outputs=[out]) for _ in prompts]

    llm = FakeLLM()
    dt, toks, steps = step_cost.timed_decode(llm, [0, 1, 2], None, 2)
    assert dt >= 0 and toks == 18 and steps == 7.5


def test_gpu_sampler_summary_without_nvml():
    s = step_cost.GpuSampler.__new__(step_cost.GpuSampler)
    s.samples = [(1900, 600.0, 50, 0x4), (1800, 650.0, 55, 0x1)]
    assert s.summary() == dict(
        sm_clock_mhz=1850,
        sm_clock_min_mhz=1800,
        power_w=625.0,
        temp_max_c=55,
        throttle_reasons="0x5",
        samples=2,
    )
    s.samples = []
    assert s.summary() is None


def test_rows_compare_chain_and_ddtree_of_the_same_weights(tmp_path, monkeypatch):
    """--weights dummy,pair: each engine is passed the modes and reports rows
    for both; a DDTree row compares with the chain of its own weights, and
    the pair rows carry both taus."""
    calls = []

    def fake(cmd, stdout=None, stderr=None, text=None, timeout=None):
        calls.append(cmd)
        method = cmd[cmd.index("--method") + 1]
        modes = cmd[cmd.index("--weights") + 1].split(",")
        rows = [
            "ROW "
            + json.dumps(
                dict(
                    shape="dense-8b",
                    weights=w,
                    method=method,
                    runner="v2",
                    budget=15 if method == "ddtree" else None,
                    concurrency=8,
                    ms_per_step={
                        ("chain", "dummy"): 7.5,
                        ("chain", "pair"): 8.0,
                        ("ddtree", "dummy"): 7.9,
                        ("ddtree", "pair"): 8.1,
                    }[(method, w)],
                    tau=1.0 if w == "dummy" else {"chain": 2.8, "ddtree": 3.4}[method],
                )
            )
            for w in modes
        ]
        return SimpleNamespace(stdout="\n".join(rows) + "\n", returncode=0)

    monkeypatch.setattr(subprocess, "run", fake)
    out = tmp_path / "step-cost.json"
    step_cost.main(
        ["--out", str(out), "--shapes", "dense-8b", "--conc", "8", "--c1-budgets", "",
         "--tree-attention", "auto", "--weights", "dummy,pair"]
    )  # fmt: skip
    assert all(c[c.index("--weights") + 1] == "dummy,pair" for c in calls)
    rows = {r["weights"]: r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == ["dummy", "pair"]
    assert rows["dummy"]["ratio"] == round(7.9 / 7.5, 3)
    assert "chain_tau" not in rows["dummy"]
    assert rows["pair"]["ratio"] == round(8.1 / 8.0, 3)
    assert (rows["pair"]["chain_tau"], rows["pair"]["ddtree_tau"]) == (2.8, 3.4)


def test_rows_of_earlier_runs_without_weights_count_as_dummy():
    rows = step_cost.summarize(
        [
            dict(shape="dense-8b", method="chain", runner="v2", concurrency=1,
                 ms_per_step=6.0),
            dict(shape="dense-8b", method="ddtree", runner="v2", budget=15,
                 concurrency=1, ms_per_step=6.3),
        ],
        15,
    )  # fmt: skip
    assert [(r["weights"], r["ratio"]) for r in rows] == [("dummy", 1.05)]


def test_heldout_prompts_cut_and_repeat(tmp_path):
    (tmp_path / "prompts").mkdir()
    lines = [{"prompt_token_ids": list(range(i, i + 10))} for i in range(3)]
    (tmp_path / "prompts" / "heldout.jsonl").write_text(
        "".join(json.dumps(x) + "\n" for x in lines) + "\n"
    )
    got = step_cost.heldout_prompts(str(tmp_path), 5, 4)
    assert got == [[6, 7, 8, 9], [7, 8, 9, 10], [8, 9, 10, 11], [6, 7, 8, 9],
                   [7, 8, 9, 10]]  # fmt: skip
    # The committed pairs' prompts: enough for a c = 32 engine without repeats.
    committed = step_cost.heldout_prompts(step_cost.common.PAIR_MODELS, 128, 128)
    assert len({tuple(p) for p in committed}) == 128
    assert max(map(len, committed)) == 128 and min(map(len, committed)) > 0


def test_rows_of_an_engine_that_held_fewer_requests_are_not_compared():
    """A chain engine whose KV cache (on a hybrid target: one recurrent
    state per draft position) holds fewer requests than the concurrency ran
    smaller steps than the row's: no ratio, the reason, both tok/s."""

    def row(method, budget, c, ms, **extra):
        return dict(
            shape="hybrid-27b",
            method=method,
            runner="v2",
            budget=budget,
            concurrency=c,
            ms_per_step=ms,
            tok_s=c * 1000 / ms,
            **extra,
        )

    chain = dict(max_concurrency=21.94)
    tree = dict(max_concurrency=205.5)
    engines = [
        row("chain", None, 8, 28.0, **chain),
        row("chain", None, 32, 90.0, **chain),
        row("ddtree", 15, 8, 24.0, **tree, max_running=8),
        row("ddtree", 15, 32, 64.0, **tree, max_running=32),
    ]
    rows = {r["concurrency"]: r for r in step_cost.summarize(engines, 15)}
    assert rows[8]["ratio"] == round(24 / 28, 3) and "not_comparable" not in rows[8]
    assert rows[8]["chain_max_concurrency"] == 21.94
    assert rows[32]["ratio"] is None
    assert rows[32]["not_comparable"] == (
        "chain engine: its KV cache holds 21.94 requests of max_model_len tokens"
    )
    assert rows[32]["ddtree_max_running"] == 32
    assert rows[32]["chain_tok_s"] == pytest.approx(32 * 1000 / 90.0)


def test_capped_prefers_the_requests_seen_running():
    r = dict(concurrency=32, max_concurrency=21.9)
    assert (
        step_cost.capped(r)
        == "its KV cache holds 21.9 requests of max_model_len tokens"
    )
    # Short requests fit more than the capacity in max_model_len requests.
    assert step_cost.capped(dict(r, max_running=32)) is None
    assert (
        step_cost.capped(dict(r, max_running=22)) == "at most 22 of 32 requests running"
    )
    assert step_cost.capped(dict(concurrency=8)) is None


def test_running_probe_counts_the_schedulers_running_requests():
    """The most requests running after a step while the probe is active;
    steps outside it are not counted."""

    class Scheduler:
        def __init__(self):
            self.running = []

        def schedule(self):
            return len(self.running)

    sched = Scheduler()
    core = SimpleNamespace(scheduler=sched)
    llm = SimpleNamespace(
        llm_engine=SimpleNamespace(engine_core=SimpleNamespace(engine_core=core))
    )
    probe = engine_probe.RunningProbe(llm)
    sched.running = [1] * 30
    assert sched.schedule() == 30 and probe.max_running is None
    with probe:
        for n in (3, 5, 4):
            sched.running = [1] * n
            sched.schedule()
    sched.running = [1] * 9
    sched.schedule()
    assert probe.max_running == 5
    # Not in process: nothing to probe.
    off = engine_probe.RunningProbe(SimpleNamespace(llm_engine=SimpleNamespace()))
    with off:
        pass
    assert off.max_running is None


def test_decode_ms_per_step_leaves_the_prefill_out():
    """A 2 s decode of 40 steps whose prefill alone took 0.4 s and 1 step:
    1.6 s over 39 decode steps. With trained weights a method that decodes
    in fewer steps would otherwise carry more prefill per step."""
    assert step_cost.decode_ms_per_step(2.0, 40, 0.4, 1) == 41.026
    assert step_cost.decode_ms_per_step(2.0, 40, 0.4, 0) == 40.0
    assert step_cost.decode_ms_per_step(0.5, 1, 0.4, 1) is None


def test_rows_carry_the_decode_ratio_where_both_engines_have_it():
    """The step-cost row compares the decode steps less the prefill where
    both engine rows have them (rows of earlier runs have none)."""
    base = dict(shape="dense-8b", runner="v2", concurrency=8, weights="pair")
    chain = dict(
        base, method="chain", budget=None, ms_per_step=10.0, decode_ms_per_step=8.0
    )
    tree = dict(
        base, method="ddtree", budget=15, ms_per_step=12.0, decode_ms_per_step=8.4
    )
    row = step_cost.summarize([chain, tree], 15)[0]
    assert (row["ratio"], row["decode_ratio"]) == (1.2, 1.05)
    assert row["chain_decode_ms_per_step"] == 8.0
    old = dict(tree)
    del old["decode_ms_per_step"]
    assert step_cost.summarize([chain, old], 15)[0]["decode_ratio"] is None
