# SPDX-License-Identifier: Apache-2.0
"""bench/serve_load.py against a fake streaming OpenAI server on 127.0.0.1:
disconnect handling, reference comparison, /metrics deltas, /health.

Needs aiohttp (a vLLM dependency, so it runs in the wheel's venv)."""

import asyncio
import importlib.util
import json
import os
import socket
import sys

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load():
    spec = importlib.util.spec_from_file_location(
        "serve_load", os.path.join(ROOT, "bench", "serve_load.py")
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["serve_load"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


serve_load = _load()


def answer(prompt: str) -> list[str]:
    """The fake model's deterministic output, in stream chunks."""
    return [f"<{len(prompt)}>"] + [f" w{i}" for i in range(12)]


class FakeServer:
    def __init__(self):
        self.started = 0
        self.finished = 0
        self.aborted = 0
        self.scrapes = 0
        self.running = 0
        self.stall = 0.0

    def metrics(self) -> str:
        # Each scrape advances the counters: drafts +10, accepted +25
        # (tau 3.5), per-position and DDTree series too.
        k = self.scrapes
        self.scrapes += 1
        lab = 'engine="0",model_name="m"'
        per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
        return "\n".join(
            [
                "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding "
                "drafts.",
                "# TYPE vllm:spec_decode_num_drafts_total counter",
                f"vllm:spec_decode_num_drafts_total{{{lab}}} {10.0 * k}",
                f"vllm:spec_decode_num_drafts_created{{{lab}}} 1.7e9",
                f"vllm:spec_decode_num_accepted_tokens_total{{{lab}}} {25.0 * k}",
                f"vllm:spec_decode_num_draft_tokens_total{{{lab}}} {640.0 * k}",
                f'{per_pos}{{{lab},position="0"}} {9.0 * k}',
                f'{per_pos}{{{lab},position="1"}} {6.0 * k}',
                f"vllm:ddtree_tree_budget{{{lab}}} 64.0",
                f"vllm:ddtree_draft_depth{{{lab}}} 15.0",
                f'vllm:ddtree_acceptance_length_bucket{{{lab},le="1.0"}} {1.0 * k}',
                f"vllm:ddtree_acceptance_length_count{{{lab}}} {10.0 * k}",
                f"vllm:ddtree_acceptance_length_sum{{{lab}}} {35.0 * k}",
                f"vllm:num_requests_running{{{lab}}} {float(self.running)}",
                f"vllm:num_requests_waiting{{{lab}}} 0.0",
                "python_gc_objects_collected_total 3.0",
                "",
            ]
        )

    async def handle_stream(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["stream"] is True and body["temperature"] == 0.0
        chat = request.path.endswith("/chat/completions")
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        self.started += 1
        if self.stall:
            await asyncio.sleep(self.stall)
        self.running += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i, piece in enumerate(answer(prompt)):
                # Token i's top-2 logprobs are 0.1 * (i + 1) apart.
                top2 = [-0.1, -0.1 - 0.1 * (i + 1)]
                if chat:
                    choice = {
                        "index": 0,
                        "delta": {"content": piece},
                        "finish_reason": None,
                    }
                    if body.get("logprobs"):
                        assert body["top_logprobs"] == 2
                        choice["logprobs"] = {
                            "content": [
                                {
                                    "token": piece,
                                    "logprob": top2[0],
                                    "top_logprobs": [
                                        {"token": piece, "logprob": top2[0]},
                                        {"token": "?", "logprob": top2[1]},
                                    ],
                                }
                            ]
                        }
                else:
                    choice = {"index": 0, "text": piece, "finish_reason": None}
                    if body.get("logprobs"):
                        assert body["logprobs"] == 2
                        choice["logprobs"] = {
                            "tokens": [piece],
                            "token_logprobs": [top2[0]],
                            "top_logprobs": [{piece: top2[0], "?": top2[1]}],
                        }
                await resp.write(
                    f"data: {json.dumps({'choices': [choice]})}\n\n".encode()
                )
                await asyncio.sleep(0.01)
            await resp.write(b"data: [DONE]\n\n")
            self.finished += 1
        except (ConnectionResetError, asyncio.CancelledError):
            self.aborted += 1
            raise
        finally:
            self.running -= 1
        return resp

    def app(self) -> web.Application:
        app = web.Application()

        async def models(_):
            return web.json_response({"data": [{"id": "fake-model"}]})

        async def metrics(_):
            return web.Response(text=self.metrics())

        async def health(_):
            return web.Response(text="")

        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/completions", self.handle_stream)
        app.router.add_post("/v1/chat/completions", self.handle_stream)
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/health", health)
        return app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _with_server(fake: FakeServer, argv: list[str]) -> dict:
    runner = web.AppRunner(fake.app())
    await runner.setup()
    port = _free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        args = serve_load.build_parser().parse_args(
            ["--base-url", f"http://127.0.0.1:{port}", *argv]
        )
        result = await serve_load.run(args)
        # Let the server notice the last disconnects.
        for _ in range(100):
            if fake.started == fake.finished + fake.aborted:
                break
            await asyncio.sleep(0.02)
        return result
    finally:
        await runner.cleanup()


def test_disconnects_reference_and_metrics(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": "x" * i}) + "\n" for i in range(1, 9))
    )
    ref = tmp_path / "ref.json"
    common = [
        "--prompts",
        str(prompts),
        "--n",
        "24",
        "--concurrency",
        "8",
        "--chat-fraction",
        "0.3",
        "--timeout",
        "20",
        "--drain-timeout",
        "5",
    ]

    # Reference run: nothing disconnects, every output saved.
    fake = FakeServer()
    r0 = asyncio.run(
        _with_server(fake, [*common, "--disconnect-fraction", "0", "--save", str(ref)])
    )
    assert r0["ok"], r0
    assert r0["completed"] == 24 and r0["cancelled"] == 0 and r0["error"] == 0
    saved_json = json.loads(ref.read_text())
    saved = saved_json["outputs"]
    assert saved["completion:2"] == "".join(answer("xxx"))
    # Reference logprobs: token texts and top-1 minus top-2 gaps, both kinds.
    for key in saved:
        tokens, gaps = saved_json["logprobs"][key]
        assert "".join(tokens) == saved[key]
        assert gaps == pytest.approx([0.1 * (i + 1) for i in range(len(tokens))])
    assert any(k.startswith("chat:") for k in saved) and r0["chat"] > 0

    # DDTree-like run: half of the streams are cut mid-way.
    fake = FakeServer()
    r1 = asyncio.run(
        _with_server(
            fake,
            [
                *common,
                "--disconnect-fraction",
                "0.5",
                "--reference",
                str(ref),
                "--expect-ddtree",
            ],
        )
    )
    assert r1["ok"], r1
    assert r1["cancelled"] == r1["planned_disconnects"] > 0
    assert r1["completed"] + r1["cancelled"] == 24
    assert r1["compared"] == r1["completed"] and r1["mismatches"] == 0
    assert fake.aborted == r1["cancelled"], (fake.aborted, r1["cancelled"])
    assert r1["health"] == 200 and r1["drained"]
    # /metrics deltas: one scrape before, drain scrape(s), one after.
    d = r1["metrics_delta"]
    n = d["vllm:spec_decode_num_drafts_total"] / 10
    assert n >= 2 and d["vllm:spec_decode_num_accepted_tokens_total"] == 25 * n
    assert r1["tau"] == pytest.approx(3.5)
    assert r1["per_depth_acceptance"] == {1: 0.9, 2: 0.6}
    assert d['vllm:ddtree_acceptance_length_bucket{le="1.0"}'] == n
    assert r1["gauges"]["vllm:ddtree_tree_budget"] == 64.0
    assert r1["ddtree_moved"] and r1["spec_decode_moved"]
    assert not any("_created" in k or "python_gc" in k for k in d)


def test_mismatch_and_missing_ddtree_fail(tmp_path):
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"outputs": {"completion:0": "something else"}}))
    fake = FakeServer()
    fake.metrics = lambda: "vllm:num_requests_running 0\n"  # no spec decoding at all
    r = asyncio.run(
        _with_server(
            fake,
            [
                "--n",
                "3",
                "--chat-fraction",
                "0",
                "--disconnect-fraction",
                "0",
                "--reference",
                str(ref),
                "--expect-ddtree",
            ],
        )
    )
    assert not r["ok"]
    assert r["mismatches"] == 1 and r["mismatch_keys"] == ["completion:0"]
    assert not r["ddtree_moved"] and r["tau"] is None


@pytest.mark.parametrize("gap,near_tie", [(1e-5, True), (0.5, False)])
def test_divergence_at_a_near_tie_is_reported_not_failed(tmp_path, gap, near_tie):
    # The reference took "X" at its 4th token where the server says " w2":
    # a divergence at a reference gap of 1e-5 is a float32 near-tie, one at
    # 0.5 is a real error.
    pieces = answer("p")
    ref_pieces = pieces[:3] + ["X"] + pieces[4:]
    gaps = [1.0] * len(pieces)
    gaps[3] = gap
    ref = tmp_path / "ref.json"
    ref.write_text(
        json.dumps(
            {
                "outputs": {"completion:0": "".join(ref_pieces)},
                "logprobs": {"completion:0": [ref_pieces, gaps]},
            }
        )
    )
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "p"}) + "\n")
    argv = [
        "--prompts",
        str(prompts),
        "--n",
        "1",
        "--chat-fraction",
        "0",
        "--disconnect-fraction",
        "0",
        "--reference",
        str(ref),
        "--drain-timeout",
        "5",
    ]
    r = asyncio.run(_with_server(FakeServer(), argv))
    assert r["compared"] == 1 and r["identical"] == 0
    if near_tie:
        assert r["ok"], r
        assert r["mismatches"] == 0
        assert r["near_tie_divergences"] == {"completion:0": 1e-5}
        # --exact: near-ties fail too.
        r = asyncio.run(_with_server(FakeServer(), [*argv, "--exact"]))
        assert not r["ok"]
    else:
        assert not r["ok"]
        assert r["mismatches"] == 1 and not r["near_tie_divergences"]


def test_divergence_gap_maps_characters_to_tokens():
    tokens, gaps = ["ab", "c", "de"], [0.5, 0.25, 0.125]
    assert serve_load.divergence_gap("abXde", "abcde", tokens, gaps) == 0.25
    assert serve_load.divergence_gap("aX", "abcde", tokens, gaps) == 0.5
    assert serve_load.divergence_gap("abcdeZ", "abcde", tokens, gaps) is None
    assert serve_load.divergence_gap("abcd", "abcde", tokens, gaps) == 0.125


def test_divergence_at_a_token_boundary_counts_the_token_before_it():
    # The reference wrote "(t" + "):"; ours "(typ...": the same characters up
    # to "(t", but ours may have parted at the token "(t" itself (a near-tie
    # there), so the boundary's two gaps count and the smaller one decides.
    tokens, gaps = ["x", "(t", "):"], [3.0, 0.001, 1.5]
    assert serve_load.divergence_gap("x(typ, s)", "x(t):", tokens, gaps) == 0.001
    # Inside a token, only that token's gap counts.
    assert serve_load.divergence_gap("x(z", "x(t):", tokens, gaps) == 0.001
    tokens, gaps = ["x", "(t", "):"], [3.0, 2.0, 1.5]
    assert serve_load.divergence_gap("x(t)!", "x(t):", tokens, gaps) == 1.5
    # At the first token there is no token before it.
    assert serve_load.divergence_gap("y", "x(t):", tokens, gaps) == 3.0


def test_errors_and_timeouts_are_failures():
    fake = FakeServer()
    fake.stall = 5.0  # longer than the per-request timeout
    r = asyncio.run(
        _with_server(
            fake,
            [
                "--n",
                "2",
                "--chat-fraction",
                "0",
                "--timeout",
                "0.5",
                "--drain-timeout",
                "1",
            ],
        )
    )
    assert not r["ok"] and r["timeout"] == 2 and r["first_errors"]


def test_only_loopback_servers():
    with pytest.raises(SystemExit, match="loopback"):
        serve_load.check_loopback("http://10.0.0.1:8000")
    with pytest.raises(SystemExit, match="loopback"):
        serve_load.check_loopback("https://example.com")
    assert (
        serve_load.check_loopback("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    )


def test_parse_prometheus_sums_engines_and_keeps_labels():
    text = (
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 3\n'
        'vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 4\n'
        "vllm:ddtree_num_accepted_tokens_per_depth_total"
        '{depth="2",engine="0",model_name="m"} 5\n'
        "vllm:other 9\n"
    )
    m = serve_load.parse_prometheus(text)
    assert m == {
        "vllm:spec_decode_num_drafts_total": 7.0,
        'vllm:ddtree_num_accepted_tokens_per_depth_total{depth="2"}': 5.0,
    }


def test_unreachable_server_is_a_clean_failure():
    args = serve_load.build_parser().parse_args(
        ["--base-url", f"http://127.0.0.1:{_free_port()}", "--n", "2"]
    )
    r = asyncio.run(serve_load.run(args))
    assert r["ok"] is False and "v1/models" in r["first_errors"][0]
