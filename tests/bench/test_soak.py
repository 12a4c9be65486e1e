# SPDX-License-Identifier: Apache-2.0
"""bench/serving/soak.py against fake OpenAI servers on 127.0.0.1
(tests/helpers/soak_fake.py): a good fake passes every criterion; fakes that
misbehave (a 500, a request that never answers, growing RSS and GPU memory,
/health failing, non-greedy output, nothing refused, bad input accepted,
counters that fall or disagree, a server that never drains, no preemption, too
little load) fail exactly the criteria they should. A launched fake restarted
mid-run passes: its errors fall inside the fault window. Seeded, a few seconds
in all. The /metrics parser reads counters typed either way."""

from __future__ import annotations

import json
import os
import random
import socket
import sys

import pytest
import soak_fake
from repo_paths import BENCH
from soak_fake import FakeConfig

from bench.serving import soak

CRITERIA = {
    "requests",
    "refusals",
    "bad_input",
    "load",
    "health",
    "final",
    "server_rss",
    "gpu_memory",
    "metrics",
    "preemption",
    "greedy_reference",
}


def fake_nvidia_smi(tmp_path, step_mib: int) -> str:
    """An nvidia-smi that prints 1000 MiB for GPU 0, plus step_mib per call."""
    path = tmp_path / "nvidia-smi"
    count = tmp_path / "smi-count"
    path.write_text(
        "#!/bin/sh\n"
        f'n=$(cat "{count}" 2>/dev/null || echo 0)\n'
        f'echo $((n + 1)) > "{count}"\n'
        f'echo "0, $((1000 + n * {step_mib}))"\n'
    )
    path.chmod(0o755)
    return str(path)


def small_args(out: str, *extra: str) -> list[str]:
    return [
        "--duration", "0.8", "--requests", "60", "--concurrency", "8",
        "--max-tokens-max", "16", "--health-interval", "0.05",
        "--metrics-interval", "0.1", "--memory-interval", "0.04",
        "--progress-interval", "5", "--timeout", "2", "--warmup", "0.2",
        "--rss-growth-mib", "32", "--gpu-growth-mib", "16",
        "--refuse-fraction", "0.1", "--drain-timeout", "2", "--seed", "0",
        "--out", out, *extra,
    ]  # fmt: skip


def run_soak(
    tmp_path,
    cfg: FakeConfig,
    ref_cfg: FakeConfig | None = None,
    gpu_step: int = 0,
    extra: tuple[str, ...] = (),
) -> tuple[int, dict]:
    srv, th = soak_fake.start(cfg)
    ref, ref_th = soak_fake.start(ref_cfg or FakeConfig())
    out = str(tmp_path / "soak.json")
    argv = small_args(
        out,
        "--base-url", srv.url, "--reference-url", ref.url,
        "--server-pid", str(os.getpid()), "--expect-preemption",
        "--tree-budget", str(soak_fake.BUDGET),
        "--nvidia-smi", fake_nvidia_smi(tmp_path, gpu_step), *extra,
    )  # fmt: skip
    try:
        rc = soak.main(argv)
    finally:
        soak_fake.stop(srv, th)
        soak_fake.stop(ref, ref_th)
    with open(out) as f:
        return rc, json.load(f)


def failed(report: dict) -> set[str]:
    return {k for k, c in report["criteria"].items() if c["ok"] is False}


def test_refusals_come_at_a_fixed_period_and_take_every_kind_in_turn():
    kinds = [soak.refusal_kind(i, 0.1) for i in range(60)]
    sent = [k for k in kinds if k is not None]
    assert [i for i, k in enumerate(kinds) if k is not None] == list(range(9, 60, 10))
    assert sorted(sent) == sorted(soak.REFUSALS)
    assert all(soak.refusal_kind(i, 0.0) is None for i in range(100))


def test_good_fake_passes_every_criterion(tmp_path):
    rc, r = run_soak(tmp_path, FakeConfig())
    assert rc == 0 and r["ok"], r["criteria"]
    assert set(r["criteria"]) == CRITERIA
    assert all(c["ok"] is True for c in r["criteria"].values()), r["criteria"]
    by = r["requests"]["by_outcome"]
    assert by["completed"] > 40 and by["refused"] > 0
    assert set(by) == {"completed", "refused"}
    kinds = r["requests"]["by_kind"]
    assert {"load:chat", "load:completion", "load:long"} <= set(kinds)
    assert {k for k in kinds if k.startswith("refuse:")} == {
        f"refuse:{k}" for k in soak.REFUSALS
    }
    # Streamed refusals come as the stream's first event, the others as a 400.
    assert r["requests"]["errors_by_kind"].keys() <= {
        "http_400",
        "http_404",
        "stream_error_400",
    }
    assert r["requests"]["errors_by_kind"]["stream_error_400"] > 0
    # Every bad input, one at a time: a 4xx with a message, healthy after it.
    rows = r["bad_input"]
    assert len(rows) == len(soak.bad_cases(_ctx())) and all(x["ok"] for x in rows)
    assert all(400 <= x["http"] < 500 and x["message"] for x in rows)
    assert {x["http"] for x in rows} == {400, 404}
    g = r["greedy_reference"]
    assert g["compared"] == g["identical"] == g["eligible"] > 10
    ep = r["metrics"]["epochs"]
    assert len(ep) == 1 and ep[0]["drafts"] > 0 and ep[0]["preemptions"] > 0
    assert ep[0]["emitted_tokens"] == ep[0]["accepted"] + ep[0]["drafts"]
    assert ep[0]["generation_tokens"] >= ep[0]["client_completion_tokens"] > 0
    gpu = r["memory"]["gpu"]["series"]["gpu0/epoch0"]
    # ok needs 3 samples after the warm-up; how many more a 2-core CI machine
    # takes in the run's 0.8 s varies.
    assert gpu["ok"] and gpu["slope_mib_per_min"] == 0 and gpu["after_warmup"] >= 3
    assert len(gpu["curve"]) == gpu["samples"] >= gpu["after_warmup"]
    rss = r["memory"]["rss"]["epochs"]["0"]
    assert rss["ok"] and rss["after_warmup"] >= 3 and "slope_mib_per_min" in rss
    assert r["health"]["by_status"] == {"200": r["health"]["polls"]}


def _ctx(max_model_len: int = 256) -> soak.Context:
    return soak.Context(
        "m",
        max_model_len,
        [("def f(x):", 9)],
        [("def f(x):", 14)],
        list(range(3, 40)),
        [10, 41],
    )


def test_server_errors_non_greedy_rss_metrics_and_nothing_refused_fail(tmp_path):
    cfg = FakeConfig(
        fail_at={5, 9},  # two 500s
        no_choices_at=set(range(10, 40)),  # 200s without choices (the plain ones)
        perturb_greedy=True,  # greedy outputs differ at their 4th character
        leak_kib=2048,  # RSS grows by 2 MiB a request, 60 requests at least
        metrics_inconsistent=True,  # emitted tokens != accepted + drafts
        refuse=False,  # structured outputs and bad_words served
    )
    rc, r = run_soak(tmp_path, cfg)
    assert rc == 1 and not r["ok"]
    assert failed(r) == {
        "requests",
        "greedy_reference",
        "server_rss",
        "metrics",
        "refusals",
    }, r["criteria"]
    assert r["requests"]["by_outcome"]["server_error"] == 2
    assert r["requests"]["errors_by_kind"]["http_500"] == 2
    # No restart here, so a 200 without its choices is a failure.
    assert r["requests"]["errors_by_kind"]["missing_choices"] > 0
    assert r["requests"]["by_outcome"]["not_refused"] > 0
    g = r["greedy_reference"]
    assert g["mismatches"] and not g["near_ties"]
    assert all(
        m["first_diff_char"] == 3 and m["first_diff_token"] == 3
        for m in g["mismatches"]
    )
    assert r["memory"]["rss"]["epochs"]["0"]["growth_mib"] > 32
    assert any("emitted tokens" in p for p in r["metrics"]["problems"])


def test_hang_bad_input_health_gpu_drain_preemption_and_load_fail(tmp_path):
    offset = len(soak.bad_cases(_ctx()))  # /health polls of the bad-input phase
    cfg = FakeConfig(
        hang_at={6},  # never answers
        validate=False,  # answers bad input with 200
        health_fail=(offset + 4, offset + 7),  # three polls answer 503
        stuck_running=True,  # never drains
        preempt=False,
        metrics_backwards=True,  # every other scrape halves the counters
    )
    rc, r = run_soak(
        tmp_path, cfg, gpu_step=40,
        extra=("--timeout", "1", "--drain-timeout", "0.3", "--max-duration", "0.5",
               "--requests", "100000"),
    )  # fmt: skip
    assert rc == 1
    assert failed(r) == {
        "requests",
        "bad_input",
        "health",
        "gpu_memory",
        "final",
        "preemption",
        "metrics",
        "load",
    }, r["criteria"]
    assert r["requests"]["by_outcome"]["hang"] == 1
    assert r["requests"]["errors_by_kind"]["client_timeout"] == 1
    assert all(x["outcome"] == "accepted_bad" for x in r["bad_input"])
    assert r["health"]["by_status"]["503"] == 3
    assert "drained False" in r["criteria"]["final"]["detail"]
    assert r["memory"]["gpu"]["series"]["gpu0/epoch0"]["growth_mib"] > 16
    assert any("fell from" in p for p in r["metrics"]["problems"])


@pytest.mark.parametrize("float32", [True, False])
def test_near_ties_are_allowed_only_in_float32(tmp_path, float32):
    # Every reference token's top-2 logprobs are 1e-4 apart: a divergence
    # there is a near-tie.
    extra = ("--duration", "0.3", "--requests", "40") + (
        ("--float32",) if float32 else ()
    )
    rc, r = run_soak(
        tmp_path, FakeConfig(perturb_greedy=True), FakeConfig(tie_gap=1e-4), extra=extra
    )
    g = r["greedy_reference"]
    differ = g["compared"] - g["identical"]  # outputs of 3 characters or fewer match
    assert differ >= 5
    if float32:
        assert rc == 0 and g["ok"] and g["num_near_ties"] == differ
        assert len(g["near_ties"]) == min(differ, 50)
        assert g["near_ties"][0]["ref_top2_gap"] == pytest.approx(1e-4)
    else:
        assert rc == 1 and failed(r) == {"greedy_reference"}
        assert g["num_mismatches"] == differ
        assert len(g["mismatches"]) == min(differ, 50)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_launched_server_restarted_mid_run(tmp_path):
    # The fake answers generation requests only once --after-start has loaded
    # the pair into it (bench/pairs/load_served_pair.py), after each start.
    port = _free_port()
    out = str(tmp_path / "soak.json")
    fake = soak_fake.__file__
    cmd = f"{sys.executable} {fake} --port {port} --needs-rpc"
    load = str(BENCH / "pairs" / "load_served_pair.py")
    after = f"{sys.executable} {load} http://127.0.0.1:{port} {tmp_path}/dense-8b"
    argv = small_args(
        out, "--base-url", f"http://127.0.0.1:{port}", "--launch", cmd,
        "--server-log", str(tmp_path / "server.log"), "--restart-at", "0.4",
        "--duration", "2.4", "--fault-grace", "0.2", "--stop-grace", "2",
        "--start-timeout", "20", "--nvidia-smi", str(tmp_path / "no-nvidia-smi"),
        "--after-start", after,
    )  # fmt: skip
    assert soak.main(argv) == 0
    with open(out) as f:
        r = json.load(f)
    assert r["ok"], r["criteria"]
    ((w0, w1),) = r["faults"]["windows"]
    assert 0.4 <= w0 < w1 and r["faults"]["restarts"][0]["error"] is None
    # Two server lifetimes, each consistent on its own (counters restart at 0).
    assert [e["epoch"] for e in r["metrics"]["epochs"]] == [0, 1]
    assert all(e["drafts"] > 0 for e in r["metrics"]["epochs"])
    # Both lifetimes' counters are checked against what the clients received.
    assert all(
        e["generation_tokens"] >= e["client_completion_tokens"] > 0
        for e in r["metrics"]["epochs"]
    )
    # Errors, if any, came from the requests cut by the restart.
    by = r["requests"]["by_outcome"]
    cut = by.get("connection_error", 0) + by.get("server_error", 0)
    assert cut <= r["requests"]["in_fault_window"]
    assert r["requests"]["n_failing"] == 0
    assert r["criteria"]["gpu_memory"]["ok"] is None
    assert "not found" in r["criteria"]["gpu_memory"]["detail"]
    assert r["memory"]["rss"]["epochs"].keys() == {"0", "1"}
    # Memory samples of a server stopping or starting are not judged (the
    # report's times are rounded to 10 ms).
    for ep in r["memory"]["rss"]["epochs"].values():
        inside = [t for t, _ in ep["curve"] if w0 + 0.01 < t < w1 + 0.2 - 0.01]
        assert ep["curve"] and not inside, (inside, w0, w1)
    # The launched server is gone.
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_plans_mix_every_kind_and_depend_on_seed_and_index_only():
    args = soak.build_parser().parse_args([])
    ctx = _ctx(2048)
    plans = [soak.make_plan(i, 0, ctx, args) for i in range(3000)]
    again = soak.make_plan(1234, 0, _ctx(2048), args)
    assert again.body == plans[1234].body
    assert soak.make_plan(1234, 1, ctx, args).body != plans[1234].body
    load = [p for p in plans if p.category == "load"]
    bodies = [p.body for p in load]
    assert {p.api for p in load} == {"chat", "completion"}
    assert {p.stream for p in load} == {True, False}
    assert 0.4 < sum(p.greedy for p in load) / len(load) < 0.6
    assert any(b.get("n", 1) > 1 for b in bodies)
    assert all(b.get("n", 1) == 1 for p, b in zip(load, bodies) if p.greedy)
    # vLLM refuses prompt logprobs on a stream: only the bad input sends both.
    assert not any(b.get("stream") and "prompt_logprobs" in b for b in bodies)
    for key in (
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "seed",
        "stop",
        "stop_token_ids",
        "logprobs",
        "top_logprobs",
        "prompt_logprobs",
    ):
        assert any(key in b for b in bodies), key
    mt = [b["max_tokens"] for b in bodies]
    assert min(mt) == 1 and 900 < max(mt) <= args.max_tokens_max == 1024
    longs = [p for p in load if p.name == "long"]
    assert longs and all(
        ctx.max_model_len - 80
        <= len(p.body["prompt"]) + p.body["max_tokens"]
        <= ctx.max_model_len
        for p in longs
    )
    assert {p.name for p in plans if p.category == "refuse"} == set(soak.REFUSALS)


def test_flatness_slope_and_growth():
    rng = random.Random(0)
    flat = [(t * 0.5, 1000 + rng.uniform(-2, 2)) for t in range(100)]
    res = soak.flatness(flat, 0.0, 10.0, 8.0)
    assert res["ok"] and abs(res["growth_mib"]) < 8
    rising = [(t * 0.5, 1000 + t) for t in range(100)]  # 2 MiB/s
    res = soak.flatness(rising, 0.0, 10.0, 8.0)
    assert not res["ok"] and res["slope_mib_per_min"] == pytest.approx(120)
    assert res["growth_mib"] == pytest.approx(2 * 39.5)
    # The warm-up is left out: a rise that stops there is flat.
    ramp = [(t * 0.5, 1000 + min(t, 20) * 10) for t in range(100)]
    assert soak.flatness(ramp, 0.0, 10.0, 8.0)["ok"]
    assert soak.flatness(ramp[:22], 0.0, 10.0, 8.0)["ok"] is None


def test_first_difference_positions():
    assert soak.first_difference("abXd", "abcd") == 2
    assert soak.first_difference("ab", "abcd") == 2
    assert soak.first_difference("abcd", "abcd") is None
    assert soak.token_index(["ab", "c", "d"], 2) == 1


def test_only_loopback_servers():
    with pytest.raises(SystemExit, match="soak: only loopback"):
        soak.Endpoint("http://10.0.0.1:8000")
    with pytest.raises(SystemExit, match="needs --launch"):
        soak.main(["--restart-at", "5"])


def _scrape(**over) -> dict[str, float]:
    pp = soak.PER_POS
    s = {
        soak.DRAFTS: 10, soak.ACCEPTED: 15, soak.DRAFT_TOKENS: 40,
        f'{pp}{{position="0"}}': 8, f'{pp}{{position="1"}}': 5,
        f'{pp}{{position="2"}}': 2,
        f"{soak.AL}_count": 10, f"{soak.AL}_sum": 25,
        f'{soak.AL}_bucket{{le="1.0"}}': 2, f'{soak.AL}_bucket{{le="2.0"}}': 5,
        f'{soak.AL}_bucket{{le="3.0"}}': 8, f'{soak.AL}_bucket{{le="4.0"}}': 10,
        f'{soak.AL}_bucket{{le="+Inf"}}': 10,
        f'{soak.PER_DEPTH}{{depth="1"}}': 8, f'{soak.PER_DEPTH}{{depth="2"}}': 5,
        f'{soak.PER_DEPTH}{{depth="3"}}': 2,
        soak.BUDGET: 4, soak.DEPTH: 3, soak.GEN_TOKENS: 30,
    }  # fmt: skip
    s.update(over)
    return s


@pytest.mark.parametrize(
    "over,client,problem",
    [
        ({}, 30, None),
        ({soak.ACCEPTED: 41}, 30, "accepted 41 > draft tokens 40"),
        ({soak.DRAFT_TOKENS: 41}, 30, "x tree_budget 4"),
        ({soak.DRAFT_TOKENS: 9}, 30, "draft tokens 9 < drafts 10"),
        ({soak.ACCEPTED: 31, soak.DRAFT_TOKENS: 40}, 30, "x depth 3"),
        ({f'{soak.PER_POS}{{position="2"}}': 6}, 30, "per-position accepted counts"),
        ({f'{soak.PER_POS}{{position="0"}}': 9}, 30, "sum to 16"),
        ({f"{soak.AL}_count": 9}, 30, "_count moved 9, drafts 10"),
        ({f"{soak.AL}_sum": 26}, 30, "emitted tokens"),
        ({f'{soak.AL}_bucket{{le="2.0"}}': 1}, 30, "buckets not cumulative"),
        ({f'{soak.AL}_bucket{{le="+Inf"}}': 11}, 30, "+Inf bucket 11"),
        ({f'{soak.PER_DEPTH}{{depth="2"}}': 4}, 30, "depth 2 count 4"),
        ({soak.BUDGET: 8}, 30, "reached 8 > tree_budget 4"),
        ({}, 31, "less than the 31 completion tokens"),
    ],
)
def test_check_metrics_names_each_broken_identity(over, client, problem):
    first = {k: 0.0 for k in _scrape()} | {soak.BUDGET: 4, soak.DEPTH: 3}
    scrapes = [(0.0, 0, first), (1.0, 0, _scrape(**over))]
    r = soak.check_metrics(scrapes, {}, True, {0: client}, tree_budget=4)
    if problem is None:
        assert r["ok"] and r["epochs"][0]["tau"] == 2.5, r["problems"]
    else:
        assert not r["ok"] and any(problem in p for p in r["problems"]), r["problems"]


def test_check_metrics_monotone_per_lifetime_and_ddtree_series_required():
    a, b = _scrape(), _scrape(**{soak.DRAFTS: 9})
    r = soak.check_metrics([(0, 0, a), (1, 0, b)], {}, True, {})
    assert any(
        "spec_decode_num_drafts_total fell from 10 to 9" in p for p in r["problems"]
    )
    # A restart starts a new lifetime: counters back at 0 are no fall.
    zero = {k: 0.0 for k in a}
    r = soak.check_metrics(
        [(0, 0, zero), (1, 0, a), (2, 1, zero), (3, 1, a)], {}, True, {}
    )
    assert r["ok"] and len(r["epochs"]) == 2, r["problems"]
    plain = {soak.GEN_TOKENS: 5.0}
    r = soak.check_metrics([(0, 0, plain), (1, 0, plain)], {}, True, {})
    assert any("series missing" in p for p in r["problems"])
    assert soak.check_metrics([(0, 0, plain), (1, 0, plain)], {}, False, {})["ok"]


def test_parse_metrics_sums_engines_and_tells_cumulative_series():
    text = "\n".join(
        [
            "# TYPE vllm:spec_decode_num_drafts counter",
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 3.0',
            'vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 4.0',
            'vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9',
            "# TYPE vllm:ddtree_acceptance_length histogram",
            'vllm:ddtree_acceptance_length_bucket{engine="0",le="1.0"} 2.0',
            'vllm:ddtree_acceptance_length_bucket{engine="0",le="+Inf"} 5.0',
            'vllm:ddtree_acceptance_length_count{engine="0"} 5.0',
            'vllm:ddtree_acceptance_length_sum{engine="0"} 9.0',
            "# TYPE vllm:num_preemptions_total counter",  # as prometheus_client writes
            'vllm:num_preemptions_total{engine="0"} 6.0',
            "# TYPE vllm:num_requests_running gauge",
            'vllm:num_requests_running{engine="0"} 2.0',
            "# TYPE process_cpu_seconds counter",
            "process_cpu_seconds_total 8.0",
        ]
    )
    samples, cumulative = soak.parse_metrics(text + "\n")
    assert samples == {
        soak.DRAFTS: 7.0,
        f'{soak.AL}_bucket{{le="1.0"}}': 2.0,
        f'{soak.AL}_bucket{{le="+Inf"}}': 5.0,
        f"{soak.AL}_count": 5.0,
        f"{soak.AL}_sum": 9.0,
        soak.PREEMPTIONS: 6.0,
        soak.RUNNING: 2.0,
    }
    assert cumulative == {
        soak.DRAFTS,
        soak.PREEMPTIONS,
        f"{soak.AL}_bucket",
        f"{soak.AL}_count",
        f"{soak.AL}_sum",
    }


def test_nvidia_smi_lines_without_a_number_are_left_out(tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/bin/sh\necho "0, [N/A]"\necho "1, 512"\n')
    smi.chmod(0o755)
    assert soak.nvidia_smi(str(smi), "--query-gpu=index,memory.used") == (
        [("1", 512.0)],
        "",
    )
    rows, why = soak.nvidia_smi(str(tmp_path / "none"), "--query-gpu=index")
    assert rows == [] and why.endswith("not found")
