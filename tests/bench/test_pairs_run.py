# SPDX-License-Identifier: Apache-2.0
"""bench/pairs/run_pairs.py's bookkeeping: which prompts each concurrency decodes
and how outputs are compared with no speculation."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

from repo_paths import BENCH_RESULTS

from bench import common
from bench.pairs import run_pairs


def test_prompts_per_concurrency():
    prompts = [[i] for i in range(100)]
    assert run_pairs.prompts_for(1, prompts, 6) == prompts[:6]
    assert run_pairs.prompts_for(8, prompts, 6) == prompts[:32]  # 4 batches of 8
    assert run_pairs.prompts_for(32, prompts, 6) == prompts  # capped at all
    # At least min_prompts for c > 1 (longer windows at 2 and 4 requests).
    assert (
        run_pairs.prompts_for(2, prompts, 6, per_client=3, min_prompts=24)
        == (prompts[:24])
    )
    assert (
        run_pairs.prompts_for(16, prompts, 6, per_client=3, min_prompts=24)
        == (prompts[:48])
    )
    assert run_pairs.prompts_for(1, prompts, 6, min_prompts=24) == prompts[:6]


def test_compare_counts_equal_outputs(tmp_path):
    def save(method, toks):
        path = tmp_path / f"tokens_dense-8b_float32_{method}_c8.json"
        path.write_text(json.dumps(toks))

    save("nospec", [[1, 2, 3], [4, 5], [6]])
    save("ddtree", [[1, 2, 3], [4, 9], [6]])
    assert run_pairs.compare_outputs(
        str(tmp_path), "dense-8b", "float32", "ddtree", 8, "nospec"
    ) == dict(identical_to_nospec="2/3")
    assert (
        run_pairs.compare_outputs(
            str(tmp_path), "dense-8b", "float32", "chain", 8, "nospec"
        )
        is None
    )


def test_top2_gap_reads_the_two_best_ranks():
    def lp(rank, logprob):
        return SimpleNamespace(rank=rank, logprob=logprob)

    # The position's own token (rank 5) beside the top two.
    assert common.top2_gap({3: lp(5, -4.0), 7: lp(1, -0.5), 8: lp(2, -0.75)}) == 0.25
    assert common.top2_gap({7: lp(1, -0.5)}) == math.inf
    assert common.top2_gap(None) == math.inf


def test_float32_divergences_are_judged_by_the_reference_gap(tmp_path):
    """Each differing output's first differing token, looked up in the
    reference's scores: below the bound a near-tie, else a mismatch; a
    16-bit row records the gaps and judges none."""

    def save(dtype, kind, method, obj):
        path = tmp_path / f"{kind}_dense-8b_{dtype}_{method}_c8.json"
        path.write_text(json.dumps(obj))

    ref = [[1, 2, 3], [4, 5, 6], [7, 8], [9]]
    got = [[1, 2, 3], [4, 9, 9], [7, 5], [9, 1]]
    gaps = [[0.5, 0.5, 0.5], [0.9, 0.004, 0.3], [0.2, 0.03], [0.7]]
    for dtype in ("float32", "bfloat16"):
        save(dtype, "tokens", "nospec", ref)
        save(dtype, "tokens", "ddtree", got)
        save(dtype, "gaps", "nospec", gaps)
    f32 = run_pairs.compare_outputs(
        str(tmp_path), "dense-8b", "float32", "ddtree", 8, "nospec"
    )
    # Prompt 1 differs at a near-tie, prompt 2 where the top two were 0.03
    # apart, prompt 3 runs past the reference's end (no gap there).
    assert f32 == dict(
        identical_to_nospec="1/4",
        divergence_gaps=[0.004, 0.03, None],
        near_ties_to_nospec=1,
        mismatches_to_nospec=2,
    )
    bf16 = run_pairs.compare_outputs(
        str(tmp_path), "dense-8b", "bfloat16", "ddtree", 8, "nospec"
    )
    assert bf16 == dict(identical_to_nospec="1/4", divergence_gaps=[0.004, 0.03, None])
    # No scores (an earlier run's reference): the count alone.
    (tmp_path / "gaps_dense-8b_float32_nospec_c8.json").unlink()
    assert run_pairs.compare_outputs(
        str(tmp_path), "dense-8b", "float32", "ddtree", 8, "nospec"
    ) == dict(identical_to_nospec="1/4")


def test_first_divergence():
    assert common.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert common.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert common.first_divergence([1, 2], [1, 2, 3]) == 2
    assert common.first_divergence([], [4]) == 0


def test_committed_results_have_the_rows_the_yardstick_needs():
    """bench/results/pairs.json: every measured row carries the fields readers
    compare on, and each pair has its embedding check."""
    rows = json.loads((BENCH_RESULTS / "pairs.json").read_text())
    measured = [r for r in rows if "tok_s" in r]
    assert measured
    for r in measured:
        assert {"pair", "dtype", "method", "concurrency", "tok_s", "tau"} <= set(r)
        if r["method"] in ("chain", "chain_v2", "ddtree"):
            assert r["tau"] > 1
            if r.get("temperature", 0.0) == 0.0:
                assert r["identical_to_nospec"] is not None
    embedded = {r["pair"] for r in rows if "embedding_max_abs_logit_diff" in r}
    assert embedded == {"dense-8b", "hybrid-27b"}
    assert all(
        r["embedding_max_abs_logit_diff"] <= 1e-3
        for r in rows
        if "embedding_max_abs_logit_diff" in r
    )


def test_annotate_compares_greedy_rows_only(tmp_path):
    def save(method, toks):
        path = tmp_path / f"tokens_dense-8b_bfloat16_{method}_c1.json"
        path.write_text(json.dumps(toks))

    save("nospec", [[1, 2], [3]])
    save("ddtree", [[1, 2], [4]])
    save("small", [[1, 2], [3]])
    base = dict(pair="dense-8b", dtype="bfloat16", concurrency=1)
    rows = [
        dict(base, method="nospec", temperature=0.0),
        dict(base, method="ddtree", temperature=0.0),
        dict(base, method="ddtree", temperature=1.0),
        dict(base, method="chain"),  # rows of earlier runs carry no temperature
        {"pair": "dense-8b", "embedding_max_abs_logit_diff": 1e-5},
        # a row of an earlier run whose token files are elsewhere keeps its count
        dict(base, method="chain_v2", identical_to_nospec="5/6"),
        dict(base, pair="hybrid-27b", method="nospec", identical_to_small="4/4"),
    ]
    run_pairs.annotate(rows, str(tmp_path))
    assert rows[0]["identical_to_small"] == "2/2"
    assert rows[1]["identical_to_nospec"] == "1/2"
    assert "identical_to_nospec" not in rows[2]
    assert rows[3]["identical_to_nospec"] is None  # no chain tokens saved
    assert len(rows[4]) == 2
    assert rows[5]["identical_to_nospec"] == "5/6"
    assert rows[6]["identical_to_small"] == "4/4"


def test_ddtree_readings_take_the_budget_at_the_end_and_tau_over_the_run():
    before = dict(budget=64.0, expected_tau=4.1, tree_requests=10.0, emitted=40.0)
    after = dict(budget=32.0, expected_tau=3.5, tree_requests=30.0, emitted=100.0)
    got = run_pairs.ddtree_step_readings(before, after)
    assert got == dict(budget_chosen=32, expected_tau=3.5, tree_tau=3.0)
    # No speculation chosen: no tree step counted, no expectation set.
    none = run_pairs.ddtree_step_readings(
        dict(budget=0.0, tree_requests=5.0), dict(budget=0.0, tree_requests=5.0)
    )
    assert none == dict(budget_chosen=0, expected_tau=None, tree_tau=None)
    # An engine without the series.
    assert run_pairs.ddtree_step_readings({}, {})["budget_chosen"] is None


def test_measured_step_costs_are_read_from_the_policys_cache(tmp_path):
    """The rows carry the step costs the engine's policy timed: the newest
    cache file written by the policy's own writer for this drafter and dtype."""
    import os

    from vllm.v1.spec_decode.ddtree import step_costs as sc

    assert run_pairs.measured_step_costs(str(tmp_path), "/d", "bfloat16") is None

    def save(name, drafter, dtype, ms, mtime):
        fields = {"drafter": drafter, "dtype": f"torch.{dtype}", "budgets": [0, 15]}
        path = str(tmp_path / "ddtree" / "step_costs" / f"{name}.json")
        target = {(1, 1): ms * 1e-3, (1, 16): 2 * ms * 1e-3}
        sc.save_cached_costs(path, fields, target, {1: 1e-3})
        os.utime(path, (mtime, mtime))

    save("old", "/d", "bfloat16", 5.0, 1000)
    save("new", "/d", "bfloat16", 6.0, 2000)
    save("other-drafter", "/e", "bfloat16", 7.0, 3000)
    save("float32", "/d", "float32", 8.0, 3000)
    (tmp_path / "ddtree" / "step_costs" / "broken.json").write_text("{")
    got = run_pairs.measured_step_costs(str(tmp_path), "/d", "bfloat16")
    assert got == dict(
        budgets=[0, 15], target=[[1, 1, 6.0], [1, 16, 12.0]], drafter=[[1, 1.0]]
    )
    assert run_pairs.measured_step_costs(str(tmp_path), "/d", "float32")["target"] == [
        [1, 1, 8.0],
        [1, 16, 16.0],
    ]


def test_policy_table_judges_the_first_policy_against_the_best_alternative():
    from bench.pairs import run_policy

    def row(method, conc, tok_s, **kw):
        return dict(
            pair="dense-8b",
            dtype="bfloat16",
            temperature=0.0,
            method=method,
            concurrency=conc,
            tok_s=tok_s,
            **kw,
        )

    rows = [
        row("nospec", 1, 100.0, tau=None),
        row("chain", 1, 300.0, tau=3.0, max_running=1),
        row("ddtree_measured", 1, 360.0, tau=4.0, budget_chosen=64),
        row("ddtree", 1, 330.0, tau=4.2, budget_chosen=64),
        row("nospec", 32, 4000.0, tau=None),
        row("chain", 32, 3500.0, tau=2.8),
        row("ddtree_measured", 32, 3960.0, tau=None, budget_chosen=0),
        # other dtypes, temperatures and pairs stay out
        dict(row("ddtree_measured", 8, 1.0), dtype="float32"),
        dict(row("ddtree_measured", 4, 1.0), temperature=1.0),
        {"pair": "dense-8b", "embedding_max_abs_logit_diff": 1e-5},
    ]
    table = run_policy.tabulate(rows, ["measured", "batch"])
    assert [r["concurrency"] for r in table] == [1, 32]
    c1, c32 = table
    assert (c1["nospec_tok_s"], c1["chain_tok_s"], c1["ddtree_tok_s"]) == (
        100.0,
        300.0,
        360.0,
    )
    assert c1["budget_chosen"] == 64 and c1["tau"] == 4.0
    assert c1["ddtree_over_best"] == 1.2 and c1["chain_max_running"] == 1
    assert (c1["ddtree_batch_tok_s"], c1["ddtree_batch_tau"]) == (330.0, 4.2)
    assert c32["ddtree_over_best"] == 0.99 and c32["budget_chosen"] == 0
    assert c32["ddtree_batch_tok_s"] is None
    # The batch policy judged instead: only the concurrencies it ran.
    assert [r["concurrency"] for r in run_policy.tabulate(rows, ["batch"])] == [1]
    assert "mtp_tok_s" not in c1
    # The target's MTP module where it ran: one more alternative.
    mtp_rows = rows + [row("mtp", 1, 400.0, tau=2.9, k=3)]
    c1 = run_policy.tabulate(mtp_rows, ["measured", "batch"])[0]
    assert (c1["mtp_tok_s"], c1["mtp_tau"], c1["mtp_k"]) == (400.0, 2.9, 3)
    assert c1["ddtree_over_best"] == 0.9 and c1["ddtree_over_chain"] == 1.2


class _FakeEngine:
    """Every step each request in flight emits ``per_step[i]`` tokens (its
    own id), until it has ``length``; the clock advances 1 per step."""

    def __init__(self, per_step, length):
        self.per_step, self.length = per_step, length
        self.in_flight: dict[str, int] = {}
        self.most_in_flight = 0
        self.now = 0.0

    def add_request(self, request_id, prompt, params):
        assert params == "delta"
        self.in_flight[request_id] = 0
        self.most_in_flight = max(self.most_in_flight, len(self.in_flight))

    def step(self):
        from types import SimpleNamespace

        self.now += 1.0
        outs = []
        for rid, done in list(self.in_flight.items()):
            i = int(rid.rsplit("-", 1)[1])
            n = min(self.per_step[i], self.length - done)
            self.in_flight[rid] = done + n
            finished = done + n == self.length
            if finished:
                del self.in_flight[rid]
            outs.append(
                SimpleNamespace(
                    request_id=rid,
                    finished=finished,
                    outputs=[SimpleNamespace(token_ids=[i] * n)],
                )
            )
        return outs


def test_continuous_decoding_keeps_c_requests_in_flight():
    # Requests accept 1, 2 or 4 tokens per step; 12 tokens each.
    per_step = [1, 2, 4] * 4
    engine = _FakeEngine(per_step, 12)
    tokens, window_tokens, window_s = run_pairs.decode_continuous(
        engine, [None] * 12, ["delta"] * 12, 3, "c3-t0", lambda: engine.now
    )
    assert tokens == [[i] * 12 for i in range(12)]
    assert engine.most_in_flight == 3 and not engine.in_flight
    # The window runs from the first end (step 3: the 4-per-step request)
    # to the last request's entry, with 3 in flight all along: each step
    # then emits as many tokens as the three requests in flight accept.
    assert window_s > 0 and window_tokens > 0
    assert 3 * 1 <= window_tokens / window_s <= 3 * 4
    # Fewer requests than the concurrency: no steady window.
    engine = _FakeEngine([1, 1], 4)
    _, tok, sec = run_pairs.decode_continuous(
        engine, [None] * 2, ["delta"] * 2, 4, "c4-t0", lambda: engine.now
    )
    assert tok is None and sec is None


def test_window_hooks_bracket_the_steady_window_and_steps_are_counted():
    engine = _FakeEngine([1, 2, 4] * 4, 12)
    counted = run_pairs._CountedSteps(engine)
    marks = []

    def on_window(opened):
        marks.append((opened, engine.now, counted.steps, counted.joined))

    _, window_tokens, window_s = run_pairs.decode_continuous(
        counted, [None] * 12, ["delta"] * 12, 3, "c3-t0", lambda: engine.now, on_window
    )
    # Opened once, then closed once, at the window's own clock readings.
    assert [m[0] for m in marks] == [True, False]
    (_, t0, s0, j0), (_, t1, s1, j1) = marks
    assert t1 - t0 == window_s
    # Every step went through the counter: the fake clock ticks once a step.
    assert s1 - s0 == t1 - t0 and counted.steps == engine.now
    # 12 requests joined in all, 3 before the window, the last one at its end.
    assert counted.joined == 12 and j0 == 3 and j1 == 12


def _counted_decode(**counted_kwargs):
    """12 requests, 3 in flight, through `_CountedSteps` with its window
    hooks: (engine, counted, steady window seconds)."""
    engine = _FakeEngine([1, 2, 4] * 4, 12)
    counted = run_pairs._CountedSteps(engine, **counted_kwargs)
    _, _, window_s = run_pairs.decode_continuous(
        counted,
        [None] * 12,
        ["delta"] * 12,
        3,
        "c3-t0",
        lambda: engine.now,
        counted.mark_window,
    )
    return engine, counted, window_s


def test_steady_window_per_engine_step():
    """The timed rows' per-step figures of the steady window: its wall time
    per engine step that emitted tokens, and the requests that did in each
    (3 in flight all along here, one step per tick of the fake clock)."""
    engine, counted, window_s = _counted_decode()
    stats = run_pairs.window_step_stats(counted.window_marks, window_s)
    assert stats["window_engine_steps"] == window_s
    assert stats["ms_per_engine_step"] == 1000.0
    assert stats["requests_per_engine_step"] == 3.0
    assert counted.busy_steps == engine.now and counted.outputs > 0
    # Fewer requests than the concurrency: no steady window, no figures.
    engine = _FakeEngine([1, 1], 4)
    counted = run_pairs._CountedSteps(engine)
    run_pairs.decode_continuous(
        counted,
        [None] * 2,
        ["delta"] * 2,
        4,
        "c4-t0",
        lambda: engine.now,
        counted.mark_window,
    )
    assert run_pairs.window_step_stats(counted.window_marks, None) == {}
    assert run_pairs.window_step_stats({True: (5, 10, 3), False: (9, 18, 5)}, 2.0) == {
        "window_engine_steps": 4,
        "ms_per_engine_step": 500.0,
        "requests_per_engine_step": 2.0,
        "joined_per_engine_step": 0.5,
    }
    assert run_pairs.window_joined({True: (5, 10, 3), False: (9, 18, 5)}) == 2
    assert run_pairs.window_joined({True: (5, 10, 3)}) is None


def test_engine_command_passes_the_profile_flag():
    ap = run_pairs.argparse.ArgumentParser()
    run_pairs.add_engine_options(ap)
    ap.add_argument("--out", default="x.json")
    ap.add_argument("--workdir", default="w")
    a = ap.parse_args(["--prompts", "p.jsonl"])
    assert "--profile" not in run_pairs.engine_command(
        a, "dense-8b", "bf16", "chain", "16"
    )
    a = ap.parse_args(["--prompts", "p.jsonl", "--profile"])
    assert "--profile" in run_pairs.engine_command(a, "dense-8b", "bf16", "chain", "16")


def test_engine_command_passes_max_num_seqs_and_enforce_eager():
    ap = run_pairs.argparse.ArgumentParser()
    run_pairs.add_engine_options(ap)
    ap.add_argument("--out", default="x.json")
    ap.add_argument("--workdir", default="w")
    a = ap.parse_args(["--prompts", "p.jsonl", "--max-num-seqs", "64"])
    cmd = run_pairs.engine_command(a, "dense-8b", "bf16", "ddtree", "1")
    i = cmd.index("--max-num-seqs")
    assert cmd[i + 1] == "64"
    assert "--enforce-eager" not in cmd
    eager = ap.parse_args(["--prompts", "p.jsonl", "--enforce-eager"])
    assert "--enforce-eager" in run_pairs.engine_command(
        eager, "dense-8b", "bf16", "ddtree", "1"
    )
    engine = run_pairs.argparse.ArgumentParser()
    run_pairs.add_engine_options(engine)
    for flag in ("--out", "--workdir", "--pair", "--dtype", "--method", "--conc"):
        engine.add_argument(flag)
    engine.add_argument("--engine", action="store_true")
    parsed = engine.parse_args(cmd[3:])
    assert parsed.max_num_seqs == 64
    kw = common.engine_kwargs(parsed, "t", "bfloat16", 64, False)
    assert kw["max_num_seqs"] == 64 and kw["enforce_eager"] is False


def test_profile_rows_are_not_compared(tmp_path):
    row = dict(
        pair="dense-8b",
        dtype="bfloat16",
        method="chain",
        temperature=0.0,
        concurrency=16,
        profile={},
    )
    for m in ("nospec", "chain"):
        (tmp_path / f"tokens_dense-8b_bfloat16_{m}_c16.json").write_text("[[1]]")
    run_pairs.annotate([row], str(tmp_path))
    assert "identical_to_nospec" not in row


def test_kernel_compiles_are_matched_to_the_timed_decodes():
    """The engine log's JIT monitor lines (an earlier window, the warm-up
    between two concurrencies, two inside the second one) against each
    row's timed interval."""
    log_lines = [
        "(EngineCore pid=1) INFO 12-04 00:56:09 [core.py:340] init engine",
        "(EngineCore pid=1) WARNING 12-04 00:56:10 [jit_monitor.py:135] Triton "
        "kernel JIT compilation during inference: _prepare_dflash_inputs_kernel. "
        "This causes a latency spike; consider extending warmup",
        "(EngineCore pid=1) WARNING 12-04 00:56:25 [jit_monitor.py:135] Triton "
        "kernel JIT compilation during inference: kernel_unified_attention "
        "(constexprs={...}). This causes a latency spike",
        "(EngineCore pid=1) WARNING 12-04 00:56:28 [jit_monitor.py:135] Triton "
        "kernel JIT compilation during inference: _tree_attention_kernel. This",
        "(EngineCore pid=1) WARNING 12-04 00:56:31 [jit_monitor.py:135] Triton "
        "kernel JIT compilation during inference: _vocab_stats_kernel. This",
    ]
    rows = [
        dict(concurrency=8, timed_from="12-04 00:56:20", timed_to="12-04 00:56:24"),
        dict(concurrency=16, timed_from="12-04 00:56:26", timed_to="12-04 00:56:31"),
        dict(concurrency=16, profile={}),
    ]
    run_pairs.jit_compiles_in(log_lines, rows)
    assert rows[0]["jit_compiles"] == []
    assert rows[1]["jit_compiles"] == ["_tree_attention_kernel", "_vocab_stats_kernel"]
    assert "jit_compiles" not in rows[2]


def test_rows_carry_the_engine_s_kv_cache_size():
    """The last KV-cache size line of vLLM (the extensible cache logs where it
    extended to) on every row of the engine; no line, no field."""
    log_lines = [
        "(EngineCore pid=1) INFO 12-06 14:40:00 [kv_cache_utils.py:1168] GPU KV "
        "cache size: 1,152 tokens, Maximum concurrency for 1,024 tokens per "
        "request: 1.12x",
        "(EngineCore pid=1) INFO 12-06 14:40:49 [kv_cache_utils.py:1168] GPU KV "
        "cache size: 5,575 tokens, Maximum concurrency for 1,024 tokens per "
        "request: 5.44x",
    ]
    rows = [dict(concurrency=1), dict(concurrency=8)]
    run_pairs.kv_cache_tokens_in(log_lines, rows)
    assert [r["kv_cache_tokens"] for r in rows] == [5575, 5575]
    bare = [dict(concurrency=1)]
    run_pairs.kv_cache_tokens_in(log_lines[:0], bare)
    assert "kv_cache_tokens" not in bare[0]


def test_spec_readings_give_tau_nodes_per_step_and_acceptance_by_position():
    """The spec-decode counters as `LLM.get_metrics` gives them (the per-position one a
    vector), read before and after a decode: tau, the draft tokens verified
    per request-step (a tree's nodes) and the share of request-steps that
    accepted a token at each position, trailing unreached positions left
    out; an interval without drafts gives none."""
    from types import SimpleNamespace as M

    def llm(accepted, drafts, draft_tokens, per_pos):
        metrics = [
            M(name="vllm:spec_decode_num_accepted_tokens", value=accepted),
            M(name="vllm:spec_decode_num_drafts", value=drafts),
            M(name="vllm:spec_decode_num_draft_tokens", value=draft_tokens),
            M(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=per_pos),
            M(name="vllm:num_requests_running", value=3),
        ]
        return M(get_metrics=lambda: metrics)

    before = common.spec_decode_counters(llm(10, 4, 256, [4, 3, 2, 1, 0, 0]))
    assert common.spec_counters(llm(10, 4, 256, [])) == (10, 4)
    assert before == dict(
        accepted=10, drafts=4, draft_tokens=256, per_pos=[4, 3, 2, 1, 0, 0]
    )
    after = common.spec_decode_counters(llm(40, 14, 896, [14, 11, 8, 5, 2, 0]))
    assert common.spec_readings(before, after) == dict(
        tau=4.0,
        draft_tokens_per_draft=64.0,
        accepted_by_position=[1.0, 0.8, 0.6, 0.4, 0.2],
    )
    # No engine counters yet (vLLM's first reading), then drafts.
    empty = common.spec_decode_counters(M(get_metrics=lambda: []))
    assert empty == dict(accepted=0.0, drafts=0.0, draft_tokens=0.0, per_pos=[])
    got = common.spec_readings(empty, after)
    assert got["tau"] == round(1 + 40 / 14, 3)
    assert got["accepted_by_position"][0] == 1.0
    assert common.spec_readings(after, after) == dict(
        tau=None, draft_tokens_per_draft=None, accepted_by_position=None
    )


def test_policy_table_flags_kernel_compiles_while_timed():
    from bench.pairs import run_policy

    def row(method, tok_s, compiles):
        return dict(
            pair="dense-8b",
            dtype="bfloat16",
            temperature=0.0,
            method=method,
            concurrency=16,
            tok_s=tok_s,
            jit_compiles=compiles,
        )

    rows = [
        row("nospec", 100.0, []),
        row("chain", 150.0, []),
        row("ddtree_measured", 140.0, ["_tree_attention_kernel"]),
    ]
    (table,) = run_policy.tabulate(rows, ["measured"])
    assert table["jit_compiles_while_timed"] == {"ddtree": ["_tree_attention_kernel"]}
    rows[2]["jit_compiles"] = []
    (table,) = run_policy.tabulate(rows, ["measured"])
    assert "jit_compiles_while_timed" not in table


class _Params:
    def __init__(self, max_tokens=256):
        self.max_tokens = max_tokens

    def clone(self):
        return _Params(self.max_tokens)


class _FakeWarmEngine:
    """One token per step for each request in flight, until its
    ``max_tokens``; records what each request got and when it joined."""

    def __init__(self):
        self.in_flight: dict[str, list] = {}
        self.most_in_flight = 0
        self.joined_mid_flight = 0
        self.added: list[tuple[str, object, int]] = []

    def add_request(self, request_id, prompt, params):
        if any(0 < done < limit for done, limit in self.in_flight.values()):
            self.joined_mid_flight += 1
        self.in_flight[request_id] = [0, params.max_tokens]
        self.added.append((request_id, prompt, params.max_tokens))
        self.most_in_flight = max(self.most_in_flight, len(self.in_flight))

    def step(self):
        from types import SimpleNamespace

        outs = []
        for rid, state in list(self.in_flight.items()):
            state[0] += 1
            finished = state[0] == state[1]
            if finished:
                del self.in_flight[rid]
            outs.append(
                SimpleNamespace(
                    request_id=rid,
                    finished=finished,
                    outputs=[SimpleNamespace(token_ids=[0])],
                )
            )
        return outs


def test_warm_up_runs_2c_staggered_requests_c_in_flight():
    from types import SimpleNamespace

    engine = _FakeWarmEngine()
    llm = SimpleNamespace(llm_engine=engine)
    params = _Params()
    run_pairs.warm_up(llm, ["p0", "p1", "p2"], params, 4, 32, "warm-c4-t0")
    assert len(engine.added) == 8 and not engine.in_flight
    assert engine.most_in_flight == 4
    assert [p for _, p, _ in engine.added] == ["p0", "p1", "p2"] * 2 + ["p0", "p1"]
    limits = [m for _, _, m in engine.added]
    assert limits == [4, 8, 12, 16, 20, 24, 28, 32]
    # Finishes are staggered, so later requests join while others run.
    assert engine.joined_mid_flight >= 4
    assert params.max_tokens == 256  # the timed decode's parameters untouched
    assert all(rid.startswith("warm-c4-t0-") for rid, _, _ in engine.added)


def test_cycled_prompts_repeat_the_list():
    prompts = [[i] for i in range(5)]
    assert run_pairs.prompts_for(4, prompts, 6, cycle=True) == [
        [i % 5] for i in range(16)
    ]
    assert run_pairs.prompts_for(1, prompts, 3, cycle=True) == prompts[:3]
    # 8 per client: twice the prompts, cycled; c = 1 still takes c1.
    eight = run_pairs.prompts_for(4, prompts, 3, cycle=True, per_client=8)
    assert len(eight) == 32 and eight[: len(prompts)] == prompts
    assert (
        run_pairs.prompts_for(1, prompts, 3, cycle=True, per_client=8) == (prompts[:3])
    )


def test_committed_policy_table_has_the_rows_the_policy_is_judged_by():
    """bench/results/policy.json: one row per pair and concurrency with the
    three methods' tokens/s side by side, the budget chosen and tau."""
    rows = json.loads((BENCH_RESULTS / "policy.json").read_text())
    assert rows
    keys = {"pair", "concurrency", "nospec_tok_s", "chain_tok_s", "ddtree_tok_s"}
    for r in rows:
        assert keys | {"budget_chosen", "tau"} <= set(r)
        assert all(r[k] > 0 for k in ("nospec_tok_s", "chain_tok_s", "ddtree_tok_s"))
        best = max(r["nospec_tok_s"], r["chain_tok_s"])
        assert r["ddtree_over_best"] == round(r["ddtree_tok_s"] / best, 3)
    assert len({(r["pair"], r["concurrency"]) for r in rows}) == len(rows)


def test_prompts_are_cut_to_their_last_tokens_and_the_cut_passed_on(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [list(range(n)) for n in (5, 200, 160, 400)]
    path.write_text("".join(json.dumps({"prompt_token_ids": r}) + "\n" for r in rows))
    assert common.load_prompts(str(path), 0) == rows
    cut = common.load_prompts(str(path), 160)
    assert cut == [list(range(40, 200)), list(range(160)), list(range(240, 400))]
    ap = run_pairs.argparse.ArgumentParser()
    run_pairs.add_engine_options(ap)
    ap.add_argument("--out", default="x.json")
    ap.add_argument("--workdir", default="w")
    a = ap.parse_args(["--prompts", "p.jsonl"])
    assert a.prompt_tokens == 160
    cmd = run_pairs.engine_command(a, "dense-8b", "bfloat16", "chain", "1")
    assert cmd[cmd.index("--prompt-tokens") + 1] == "160"


def test_steady_window_step_times_and_their_spread():
    """Each busy step inside the steady window is timed from the previous
    busy step's return; the spread shows slow steps (prefill chunks mixed
    in) apart from the rest."""
    ticks = iter(range(10**6))
    _, counted, _ = _counted_decode(clock=lambda: float(next(ticks)))
    opened, closed = counted.window_marks[True], counted.window_marks[False]
    # One interval per busy step in the window (the clock ticks once a call).
    assert len(counted.window_step_seconds) == closed[0] - opened[0]
    assert set(counted.window_step_seconds) == {1.0}
    # 18 steps of 25 ms and 2 of 150 ms (a prefill chunk each).
    spread = run_pairs.step_time_spread([0.025] * 18 + [0.15] * 2)
    assert spread["step_ms_percentiles"]["p50"] == 25.0
    assert spread["step_ms_percentiles"]["max"] == 150.0
    assert spread["step_ms_percentiles"]["p99"] == 150.0
    assert spread["step_ms_percentiles"]["p90"] == 37.5
    assert spread["slow_steps_share"] == 0.1
    assert spread["slow_steps_time_share"] == round(0.3 / 0.75, 3)
    assert spread["slow_step_ms"] == 150.0
    assert "ms_over_median_per_join" not in spread
    # The same steps with 4 joins: 2 x 125 ms over the median, per join.
    joins = run_pairs.step_time_spread([0.025] * 18 + [0.15] * 2, joined=4)
    assert joins["ms_over_median_per_join"] == 62.5
    assert run_pairs.step_time_spread([0.025] * 18 + [0.15] * 2, joined=0) == spread
    uniform = run_pairs.step_time_spread([0.02] * 10)
    assert uniform["slow_steps_share"] == 0.0 and uniform["slow_step_ms"] is None
    assert run_pairs.step_time_spread([0.02]) == {}
