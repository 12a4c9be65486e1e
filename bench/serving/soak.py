#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Bounded soak and bad-input check of a DDTree ``vllm serve`` (loopback only).

    python3 -m bench.serving.soak --base-url http://127.0.0.1:8000 \\
        --prompts P.jsonl --reference-url http://127.0.0.1:8001 --float32 \\
        [--launch "vllm serve ..." --restart-at 300] [--server-pid PID]

Phases, each bounded in time:

1. discovery: the model and ``max_model_len`` from ``/v1/models``, prompt
   lengths and a few stop token ids from ``/tokenize``;
2. bad input, one request at a time: malformed JSON, a non-JSON content type,
   wrong types, out-of-range sampling parameters, an empty prompt, prompts
   over the context length, an unknown model. Each must get a 4xx with a
   message and ``/health`` must answer 200 right after it;
3. load, until ``--duration`` seconds have passed and ``--requests`` requests
   were sent (at most ``--max-duration``), from ``--concurrency`` clients: chat
   and completions, streaming and not, greedy and sampled (temperature, top-p,
   top-k, min-p, presence / frequency / repetition penalties, seeds), ``n`` > 1,
   logprobs and prompt logprobs, stop strings and stop token ids,
   ``max_tokens`` 1 .. ``--max-tokens-max``, prompts of token ids within a few
   tokens of ``max_model_len`` (``--long-fraction``), ``--abort-fraction`` of
   the requests closed by the client at a random point (after some stream
   chunks, or after a random delay, 0 included), bad inputs mixed in
   (``--bad-fraction``) and the requests DDTree refuses (``--refuse-fraction``:
   structured outputs as ``structured_outputs`` json / regex / choice or
   ``response_format`` json_schema / json_object, and ``bad_words``). vLLM
   0.26.0 has no ``guided_json`` field any more (an unknown field is ignored),
   so it is not sent. A refusal is a 4xx whose message says "DDTree does not
   support structured outputs" or "DDTree does not support bad_words"; a
   streaming request gets it as the stream's first event (``{"error": {...,
   "code": 400}}``: vLLM has sent its 200 by the time the engine refuses).
   Meanwhile ``/health`` is polled every ``--health-interval`` seconds,
   ``/metrics`` scraped every ``--metrics-interval``, the GPU memory of the
   server's processes (``nvidia-smi --query-compute-apps``; each GPU's total
   with ``--gpu-memory device`` or where nvidia-smi does not list them, as
   in another PID namespace) and the server's RSS (the
   launched process or ``--server-pid``, with all its descendants: the API
   server and its engine-core processes) sampled every ``--memory-interval``;
   with ``--launch`` and ``--restart-at`` the server is stopped and started
   again once (an injected-fault window, from the stop to ``--fault-grace``
   seconds after it answers again and ``--after-start`` has run);
4. drain (``vllm:num_requests_running`` and ``_waiting`` back to 0), one
   short request, ``/health``;
5. with ``--reference-url`` (a server without speculation, same model): every
   completed, non-aborted greedy request outside a fault window is sent again
   there (not streamed, with top-2 logprobs) and its outputs compared.

Every request has a client-side timeout (``--timeout``); one that runs past
it is the outcome ``hang``. Pass criteria, printed at the end (exit status 1
when one fails; a criterion without its input is skipped and says so):

- requests: every load request completed or was aborted by us; no hang, no
  4xx, no 5xx and no connection error except inside a fault window;
- load: ``--requests`` sent and ``--duration`` reached;
- refusals: every refused kind got its 4xx and message, none was served;
- bad_input: every bad input got a 4xx with a message (and, in phase 2, a
  healthy server right after it);
- health: every ``/health`` poll outside a fault window answered 200;
- final: drained, the short request completed, ``/health`` 200;
- gpu_memory, server_rss: after ``--warmup`` seconds (per server lifetime)
  the least-squares slope of the samples times their span stays within
  ``--gpu-growth-mib`` / ``--rss-growth-mib``; the curve and slope go into
  the report;
- greedy_reference: every compared output equals the reference's; with
  ``--float32`` a divergence at a token where the reference's top-2
  logprobs are within ``--tie-tolerance`` is a near-tie (reported, not a
  failure); mismatches are reported with their first differing position
  and the request's sampling parameters. Greedy requests with penalties
  part at ties of the penalized logits, so start the reference with
  ``--logprobs-mode processed_logprobs`` (its logprobs then come after the
  penalties; with the default raw logprobs such a tie looks like a wide gap);
- metrics: per server lifetime, every counter and histogram series is
  monotone between scrapes, and over the run (with DDTree) drafts moved,
  accepted <= draft tokens, draft tokens between drafts and drafts x
  ``--tree-budget`` (when given), accepted <= drafts x draft depth, the
  per-position counts fall with the position and sum to the accepted
  tokens, ``vllm:ddtree_acceptance_length``
  counts one observation per draft and sums to accepted + drafts (emitted
  tokens), its buckets are cumulative, the per-depth series equal the
  per-position ones, and ``vllm:generation_tokens`` covers the completion
  tokens the clients were sent;
- preemption (``--expect-preemption``): ``vllm:num_preemptions`` moved.
  KV-cache pressure comes from the server's flags, e.g.
  ``--num-gpu-blocks-override`` of a few ``max_model_len`` worth of blocks
  with long prompts (README, "Soak").

Progress: one line to stderr every ``--progress-interval`` seconds. The full
report goes to ``--out`` (default ``bench/results/<date>-soak-<pair>.json``),
one ``RESULT {json}`` line (criteria) to stdout.

HTTP through httpx (a vLLM dependency).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import functools
import json
import math
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import httpx
import psutil

from bench.common import REPO, check_loopback, percentiles, progress

REFUSE_STRUCTURED = "DDTree does not support structured outputs"
REFUSE_BAD_WORDS = "DDTree does not support bad_words"
STOP_STRINGS = ("\n\n", "return", ")", "\ndef ", ":")
STOP_TEXTS = ("\n", ")", ":", " the")  # their last token ids stop requests

DRAFTS = "vllm:spec_decode_num_drafts_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
AL = "vllm:ddtree_acceptance_length"
PER_DEPTH = "vllm:ddtree_num_accepted_tokens_per_depth_total"
BUDGET = "vllm:ddtree_tree_budget"
DEPTH = "vllm:ddtree_draft_depth"
GEN_TOKENS = "vllm:generation_tokens_total"
PREEMPTIONS = "vllm:num_preemptions_total"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"

# Outcomes that are fine (per kind of request), and the ones allowed only
# inside an injected-fault window.
CLEAN = {"load": {"completed", "aborted"}, "refuse": {"refused"}, "bad": {"rejected"}}
FAULT_ONLY = {"server_error", "connection_error"}
# A 200 with fewer choices than asked: what vLLM's API server answers for a
# request its shutdown aborted before every choice had output. Inside a
# restart's window it is the fault's doing; anywhere else it fails.
FAULT_ONLY_KINDS = {"missing_choices"}


log = functools.partial(progress, "soak")

_SAMPLE_RE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)"
)
_LABEL_RE = re.compile(r'(?P<key>[a-zA-Z_][a-zA-Z0-9_]*)="(?P<val>(?:[^"\\]|\\.)*)"')
# Per-engine labels, summed away.
DROP_LABELS = {"model_name", "engine"}


def parse_prometheus(text: str, prefixes: tuple[str, ...]) -> dict[str, float]:
    """Samples of the Prometheus text format whose name starts with one of
    ``prefixes``, keyed ``name{label="v",...}`` without the per-engine labels
    (summed over engines). ``_created`` samples are skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = None if line.startswith("#") else _SAMPLE_RE.match(line)
        if m is None:
            continue
        name = m.group("name")
        if not name.startswith(prefixes) or name.endswith("_created"):
            continue
        labels = sorted(
            (lm.group("key"), lm.group("val"))
            for lm in _LABEL_RE.finditer(m.group("labels") or "")
            if lm.group("key") not in DROP_LABELS
        )
        key = name + (
            "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}" if labels else ""
        )
        with contextlib.suppress(ValueError):
            out[key] = out.get(key, 0.0) + float(m.group("value"))
    return out


def load_prompts(path: str | None) -> list[str]:
    if not path:
        return [f"def function_{i}(x):\n    " for i in range(16)]
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    prompts = [r["prompt"] if isinstance(r, dict) else str(r) for r in rows]
    if not prompts:
        raise SystemExit(f"soak: no prompts in {path}")
    return prompts


# ------------------------------------------------------------- HTTP client
class Endpoint:
    """A loopback server; each request on its own connection, so that a
    client that gives up closes its connection as a real one does."""

    def __init__(self, base_url: str):
        self.base_url = check_loopback(base_url, "soak")
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:  # inside the running loop
            self._client = httpx.AsyncClient(
                base_url=self.base_url,
                timeout=None,
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
            )
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def call(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        timeout: float = 10.0,
    ) -> tuple[int, bytes]:
        """(status, body); status 0 when there was no answer in time or no
        connection."""
        headers = {"content-type": "application/json"} if body is not None else None
        try:
            r = await asyncio.wait_for(
                self.client.request(method, path, content=body, headers=headers),
                timeout,
            )
        except (asyncio.TimeoutError, httpx.HTTPError, OSError):
            return 0, b""
        return r.status_code, r.content

    async def json(self, method: str, path: str, payload=None, timeout=10.0):
        body = None if payload is None else json.dumps(payload).encode()
        status, data = await self.call(method, path, body, timeout)
        if status == 0:
            raise RuntimeError(f"{method} {self.base_url}{path}: no answer")
        if status != 200:
            raise RuntimeError(f"{method} {path}: HTTP {status}: {data[:200]!r}")
        return json.loads(data)


def error_message(body: bytes) -> str:
    """The message of an error response body (OpenAI ``error.message``,
    FastAPI ``detail``), or "" when there is none."""
    try:
        payload = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:500]
    if isinstance(payload, dict):
        err = payload.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:500]
        for key in ("detail", "message", "error"):
            if payload.get(key):
                return str(payload[key])[:500]
    return ""


# ------------------------------------------------------------------ plans
@dataclass
class Plan:
    id: int
    category: str  # "load" | "refuse" | "bad"
    name: str  # load: "chat" / "completion" / "long"; else the case's name
    api: str  # "completion" | "chat"
    body: dict | None
    stream: bool = False
    raw: bytes | None = None  # bad input sent as is
    content_type: str = "application/json"
    greedy: bool = False
    n: int = 1
    abort_chunks: int | None = None
    abort_s: float | None = None
    expect_msg: str | None = None

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.api == "chat" else "/v1/completions"

    def payload(self) -> bytes:
        return self.raw if self.raw is not None else json.dumps(self.body).encode()


@dataclass
class Context:
    model: str
    max_model_len: int
    completion_prompts: list[tuple[str, int]]  # (text, prompt tokens)
    chat_prompts: list[tuple[str, int]]
    long_tokens: list[int]  # token ids to cut long prompts from
    stop_token_ids: list[int]
    bad: list = field(default_factory=list)  # bad_cases(self), built once


def _loguniform_int(rng: random.Random, lo: int, hi: int) -> int:
    return int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))) if hi > lo else lo


def _long_prompt(ctx: Context, length: int) -> list[int]:
    toks = ctx.long_tokens
    return [toks[i % len(toks)] for i in range(length)]


def bad_cases(ctx: Context) -> list[tuple[str, str, dict | bytes, str]]:
    """(name, api, body: a dict or raw bytes, content type). Each must get a
    4xx with a message."""
    m = ctx.model
    base = {"model": m, "prompt": ctx.completion_prompts[0][0], "max_tokens": 4}
    chat = {
        "model": m,
        "messages": [{"role": "user", "content": ctx.chat_prompts[0][0]}],
        "max_tokens": 4,
    }
    over = ctx.max_model_len + 16
    text, ntok = ctx.completion_prompts[0]
    over_text = text * (over // max(ntok, 1) + 2)
    j = "application/json"
    return [
        (
            "malformed_json",
            "completion",
            b'{"model": "' + m.encode() + b'", "prompt',
            j,
        ),
        ("body_not_json", "completion", b"prompt=hello&max_tokens=4", j),
        (
            "content_type_not_json",
            "completion",
            json.dumps(base).encode(),
            "text/plain",
        ),
        ("max_tokens_wrong_type", "completion", {**base, "max_tokens": "ten"}, j),
        ("prompt_wrong_type", "completion", {**base, "prompt": {"text": "x"}}, j),
        ("messages_wrong_type", "chat", {**chat, "messages": "hello"}, j),
        ("temperature_wrong_type", "chat", {**chat, "temperature": "hot"}, j),
        ("seed_wrong_type", "completion", {**base, "seed": "abc"}, j),
        ("temperature_negative", "completion", {**base, "temperature": -0.5}, j),
        ("temperature_above_2", "chat", {**chat, "temperature": 3.0}, j),
        ("top_p_zero", "completion", {**base, "temperature": 1.0, "top_p": 0.0}, j),
        ("top_p_above_1", "chat", {**chat, "temperature": 1.0, "top_p": 1.5}, j),
        ("top_k_below_minus_1", "completion", {**base, "top_k": -5}, j),
        ("min_p_above_1", "completion", {**base, "min_p": 1.5}, j),
        ("presence_penalty_above_2", "completion", {**base, "presence_penalty": 3}, j),
        ("frequency_penalty_below_2", "chat", {**chat, "frequency_penalty": -3}, j),
        ("repetition_penalty_zero", "completion", {**base, "repetition_penalty": 0}, j),
        ("n_zero", "completion", {**base, "temperature": 1.0, "n": 0}, j),
        ("greedy_n_above_1", "completion", {**base, "temperature": 0.0, "n": 2}, j),
        ("max_tokens_negative", "completion", {**base, "max_tokens": -1}, j),
        ("logprobs_above_max", "completion", {**base, "logprobs": 1000}, j),
        ("stop_empty_string", "completion", {**base, "stop": [""]}, j),
        ("prompt_empty", "completion", {**base, "prompt": ""}, j),
        ("prompt_token_negative", "completion", {**base, "prompt": [5, -1, 7]}, j),
        (
            "prompt_over_context_tokens",
            "completion",
            {**base, "prompt": _long_prompt(ctx, over)},
            j,
        ),
        ("prompt_over_context_text", "completion", {**base, "prompt": over_text}, j),
        ("model_unknown", "completion", {**base, "model": "no-such-model"}, j),
        (
            "stream_temperature_negative",
            "completion",
            {**base, "temperature": -1.0, "stream": True},
            j,
        ),
        (
            "stream_prompt_logprobs",
            "completion",
            {**base, "prompt_logprobs": 1, "stream": True},
            j,
        ),
    ]


def _bad_plan(i: int, case) -> Plan:
    name, api, body, ctype = case
    raw = body if isinstance(body, bytes) else None
    stream = isinstance(body, dict) and body.get("stream") is True
    return Plan(
        i,
        "bad",
        name,
        api,
        body if isinstance(body, dict) else None,
        stream=stream,
        raw=raw,
        content_type=ctype,
    )


REFUSALS = (
    "structured_outputs_json",
    "structured_outputs_regex",
    "structured_outputs_choice",
    "response_format_json_schema",
    "response_format_json_object",
    "bad_words",
)
_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["name"],
}


def _refusal_fields(kind: str) -> dict:
    if kind == "structured_outputs_json":
        return {"structured_outputs": {"json": _SCHEMA}}
    if kind == "structured_outputs_regex":
        return {"structured_outputs": {"regex": "[a-z]{3,8}"}}
    if kind == "structured_outputs_choice":
        return {"structured_outputs": {"choice": ["yes", "no"]}}
    if kind == "response_format_json_schema":
        return {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "thing", "schema": _SCHEMA},
            }
        }
    if kind == "response_format_json_object":
        return {"response_format": {"type": "json_object"}}
    return {"bad_words": ["return", " the"]}


def make_plan(i: int, seed: int, ctx: Context, a: argparse.Namespace) -> Plan:
    """Request ``i`` of the load, drawn from ``seed`` and ``i`` alone (the same
    requests whatever the concurrency and timing)."""
    rng = random.Random(seed * 1_000_003 + i)
    r = rng.random()
    if r < a.bad_fraction:
        if not ctx.bad:
            ctx.bad = bad_cases(ctx)
        return _bad_plan(i, ctx.bad[rng.randrange(len(ctx.bad))])
    refusing = r < a.bad_fraction + a.refuse_fraction and a.expect_ddtree
    long_prompt = not refusing and rng.random() < a.long_fraction
    api = "chat" if not long_prompt and rng.random() < a.chat_fraction else "completion"
    stream = rng.random() < a.stream_fraction
    greedy = refusing or rng.random() < a.greedy_fraction
    body: dict = {"model": ctx.model}
    if long_prompt:
        max_tokens = rng.randint(1, 64)
        n_prompt = ctx.max_model_len - max_tokens - rng.randint(0, 16)
        body["prompt"] = _long_prompt(ctx, max(1, n_prompt))
    else:
        prompts = ctx.chat_prompts if api == "chat" else ctx.completion_prompts
        text, n_prompt = prompts[rng.randrange(len(prompts))]
        if api == "chat":
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        max_tokens = min(
            _loguniform_int(rng, 1, a.max_tokens_max), ctx.max_model_len - n_prompt
        )
    body["max_tokens"] = max(1, max_tokens)
    n = 1
    if greedy:
        body["temperature"] = 0.0
        if rng.random() < 0.3:
            body["repetition_penalty"] = round(rng.uniform(1.05, 1.3), 3)
            body["presence_penalty"] = round(rng.uniform(-1.0, 1.0), 3)
            body["frequency_penalty"] = round(rng.uniform(-1.0, 1.0), 3)
    else:
        body["temperature"] = round(rng.uniform(0.2, 1.5), 3)
        if rng.random() < 0.5:
            body["top_p"] = round(rng.uniform(0.5, 1.0), 3)
        if rng.random() < 0.4:
            body["top_k"] = rng.choice([1, 5, 20, 100])
        if rng.random() < 0.3:
            body["min_p"] = round(rng.uniform(0.01, 0.2), 3)
        if rng.random() < 0.3:
            body["presence_penalty"] = round(rng.uniform(-1.5, 1.5), 3)
        if rng.random() < 0.3:
            body["frequency_penalty"] = round(rng.uniform(-1.5, 1.5), 3)
        if rng.random() < 0.3:
            body["repetition_penalty"] = round(rng.uniform(0.9, 1.3), 3)
        if rng.random() < a.n_fraction:
            n = rng.randint(2, 4)
            body["n"] = n
    if rng.random() < 0.5:
        body["seed"] = rng.randrange(1 << 31)
    if rng.random() < 0.25:
        body["stop"] = rng.sample(STOP_STRINGS, rng.randint(1, 2))
    if ctx.stop_token_ids and rng.random() < 0.2:
        body["stop_token_ids"] = [rng.choice(ctx.stop_token_ids)]
    if rng.random() < 0.25:
        k = rng.randint(0, 5)
        if api == "chat":
            body.update(logprobs=True, top_logprobs=k)
        else:
            body["logprobs"] = k
    if not long_prompt and rng.random() < 0.1 and not stream:
        # Not on the long prompts (a full-vocabulary row per prompt token),
        # and not streamed: vLLM refuses prompt logprobs with stream=True
        # (a bad input of its own below).
        body["prompt_logprobs"] = rng.randint(0, 3)
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    if refusing:
        kind = REFUSALS[rng.randrange(len(REFUSALS))]
        body.update(_refusal_fields(kind))
        body["max_tokens"] = min(body["max_tokens"], 32)
        msg = REFUSE_BAD_WORDS if kind == "bad_words" else REFUSE_STRUCTURED
        return Plan(i, "refuse", kind, api, body, stream, expect_msg=msg, greedy=True)
    plan = Plan(
        i, "load", "long" if long_prompt else api, api, body, stream, greedy=greedy, n=n
    )
    if rng.random() < a.abort_fraction:
        if stream and rng.random() < 0.6:
            plan.abort_chunks = rng.randint(1, 40)
        else:
            plan.abort_s = 0.0 if rng.random() < 0.2 else rng.uniform(0, a.abort_max_s)
    return plan


# --------------------------------------------------------------- outcomes
@dataclass
class Outcome:
    id: int
    category: str
    name: str
    api: str
    stream: bool
    greedy: bool
    status: str = "pending"
    http: int | None = None
    error_kind: str | None = None
    error: str | None = None
    t_start: float = 0.0
    t_end: float = 0.0
    ttft: float | None = None
    texts: dict[int, str] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)
    completion_tokens: int | None = None
    epoch: int = 0
    in_fault: bool = False

    @property
    def latency(self) -> float:
        return self.t_end - self.t_start

    def brief(self) -> dict:
        return {
            "id": self.id,
            "category": self.category,
            "name": self.name,
            "api": self.api,
            "stream": self.stream,
            "status": self.status,
            "http": self.http,
            "error_kind": self.error_kind,
            "error": self.error,
            "t_start": round(self.t_start, 3),
            "latency_s": round(self.latency, 3),
            "in_fault_window": self.in_fault,
        }


def classify_error(out: Outcome, plan: Plan, code: int, msg: str, where: str) -> None:
    out.error = msg[:300] or None
    out.error_kind = f"{where}_{code}"
    if 400 <= code < 500:
        if plan.category == "refuse":
            if plan.expect_msg and plan.expect_msg in msg:
                out.status = "refused"
            else:
                out.status = "client_error"
                out.error_kind += "_wrong_refusal"
        elif plan.category == "bad":
            out.status = "rejected" if msg else "client_error"
            if not msg:
                out.error_kind += "_without_message"
        else:
            out.status = "client_error"
    elif code >= 500:
        out.status = "server_error"
    else:
        out.status = "bad_response"


def served(out: Outcome, plan: Plan) -> None:
    """A 2xx answer with the whole output: what it means for this plan."""
    if plan.category == "refuse":
        out.status, out.error_kind = "not_refused", "served_refused_kind"
    elif plan.category == "bad":
        out.status, out.error_kind = "accepted_bad", "served_bad_input"
    elif len(out.texts) != plan.n:
        out.status, out.error_kind = "bad_response", "missing_choices"
        out.error = f"{len(out.texts)} choices, expected {plan.n}"
    else:
        out.status = "completed"


def _choice_text(api: str, c: dict, stream: bool) -> str:
    if api == "chat":
        return (c.get("delta" if stream else "message") or {}).get("content") or ""
    return c.get("text") or ""


def _top2_gap(logprobs: list[float]) -> float:
    vals = sorted(logprobs, reverse=True)
    return vals[0] - vals[1] if len(vals) > 1 else float("inf")


def choice_logprobs(api: str, c: dict) -> list[tuple[str, float]]:
    """(token text, top-1 minus top-2 logprob) of each token of a choice."""
    lp = c.get("logprobs") or {}
    if api == "chat":
        return [
            (
                e.get("token", ""),
                _top2_gap([t["logprob"] for t in e.get("top_logprobs") or []]),
            )
            for e in lp.get("content") or []
        ]
    return [
        (tok, _top2_gap(list((top or {}).values())))
        for tok, top in zip(lp.get("tokens") or [], lp.get("top_logprobs") or [])
    ]


def divergence_gap(
    text: str, ref_text: str, ref_tokens: list[str], ref_gaps: list[float]
) -> float | None:
    """The reference's top-1 minus top-2 logprob at the token where ``text``
    first differs from ``ref_text`` (None when that token is unknown). Where
    the first differing character starts a reference token, ours may have
    parted one token earlier (a longer or shorter token spelling the same
    characters so far): the smaller gap of the two counts."""
    i = first_difference(text, ref_text)
    i = min(len(text), len(ref_text)) if i is None else i
    pos = 0
    prev_gap = None
    for tok, gap in zip(ref_tokens, ref_gaps):
        start = pos
        pos += len(tok)
        if pos > i:
            return min(gap, prev_gap) if start == i and prev_gap is not None else gap
        prev_gap = gap
    return None


async def read_stream(resp: httpx.Response, out: Outcome, plan: Plan, t0: float):
    chunks = 0
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            served(out, plan)
            return
        payload = json.loads(data)
        err = payload.get("error")
        if err is not None:
            code = int(err.get("code") or 500) if isinstance(err, dict) else 500
            msg = err.get("message", "") if isinstance(err, dict) else str(err)
            classify_error(out, plan, code, str(msg), "stream_error")
            return
        for c in payload.get("choices") or []:
            idx = int(c.get("index", 0))
            text = _choice_text(plan.api, c, True)
            if text and out.ttft is None:
                out.ttft = time.monotonic() - t0
            out.texts[idx] = out.texts.get(idx, "") + text
            if c.get("finish_reason"):
                out.finish[idx] = c["finish_reason"]
        usage = payload.get("usage")
        if usage:
            out.completion_tokens = usage.get("completion_tokens")
        chunks += 1
        if plan.abort_chunks is not None and chunks >= plan.abort_chunks:
            out.status = "aborted"
            return
    out.status, out.error_kind = "connection_error", "stream_ended_without_done"


async def run_plan(ep: Endpoint, plan: Plan, timeout: float, clock) -> Outcome:
    out = Outcome(plan.id, plan.category, plan.name, plan.api, plan.stream, plan.greedy)
    out.t_start = clock()
    t0 = time.monotonic()
    sent = asyncio.Event()

    async def trace(event: str, info: dict) -> None:
        if event.endswith("send_request_body.complete"):
            sent.set()

    async def receive() -> None:
        async with ep.client.stream(
            "POST",
            plan.path,
            content=plan.payload(),
            headers={"content-type": plan.content_type},
            extensions={"trace": trace},
        ) as resp:
            out.http = resp.status_code
            if resp.status_code != 200:
                body = await resp.aread()
                classify_error(out, plan, resp.status_code, error_message(body), "http")
                return
            if plan.stream:
                if "text/event-stream" not in resp.headers.get("content-type", ""):
                    out.status, out.error_kind = "bad_response", "not_an_event_stream"
                    out.error = resp.headers.get("content-type")
                    return
                await read_stream(resp, out, plan, t0)
                return
            payload = json.loads(await resp.aread())
        for c in payload.get("choices") or []:
            out.texts[int(c.get("index", 0))] = _choice_text(plan.api, c, False)
            out.finish[int(c.get("index", 0))] = c.get("finish_reason")
        out.completion_tokens = (payload.get("usage") or {}).get("completion_tokens")
        served(out, plan)

    async def give_up() -> None:
        # A client that gives up this long after sending (0: at once).
        await sent.wait()
        await asyncio.sleep(plan.abort_s)

    async def go() -> None:
        if plan.abort_s is None:
            await receive()
            return
        tasks = [asyncio.ensure_future(receive()), asyncio.ensure_future(give_up())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if tasks[0].done():
                tasks[0].result()
            else:
                out.status = "aborted"
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    try:
        await asyncio.wait_for(go(), timeout)
    except asyncio.TimeoutError:
        out.status, out.error_kind = "hang", "client_timeout"
        out.error = f"no complete answer within {timeout:g}s"
    except (httpx.TransportError, OSError) as e:
        out.status = "connection_error"
        out.error_kind = type(e).__name__
        out.error = str(e)[:300]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        out.status, out.error_kind = "bad_response", type(e).__name__
        out.error = str(e)[:300]
    out.t_end = clock()
    return out


# ----------------------------------------------------------------- server
def process_tree(pid: int) -> tuple[set[int] | None, float | None]:
    """``pid`` and all its descendants (vLLM's API server and engine cores)
    and their RSS in MiB; (None, None) when ``pid`` is gone."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None, None
    pids, total = set(), 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss / 2**20
            pids.add(p.pid)
    return (pids, total) if pid in pids else (None, None)


def nvidia_smi_rows(
    cmd: str, query: str, gpus: str | None
) -> tuple[list[list[str]] | None, str]:
    """The comma-separated fields of each line nvidia-smi prints for
    ``query`` (e.g. ``--query-gpu=index,memory.used``), or None and why not."""
    argv = [cmd, query, "--format=csv,noheader,nounits"]
    if gpus:
        argv += ["-i", gpus]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=15)
    except FileNotFoundError:
        return None, f"{cmd} not found"
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{cmd}: {type(e).__name__}"
    if p.returncode != 0:
        return None, f"{cmd} exited {p.returncode}: {p.stderr.strip()[:200]}"
    return [[x.strip() for x in line.split(",")] for line in p.stdout.splitlines()], ""


def gpu_memory_mib(cmd: str, gpus: str | None) -> tuple[dict[str, float] | None, str]:
    """Memory used per GPU index from nvidia-smi, or None and why not."""
    rows, why = nvidia_smi_rows(cmd, "--query-gpu=index,memory.used", gpus)
    if rows is None:
        return None, why
    out = {}
    for parts in rows:
        if len(parts) == 2:
            with contextlib.suppress(ValueError):
                out[parts[0]] = float(parts[1])
    return (out, "") if out else (None, f"{cmd} printed no memory.used")


def server_gpu_memory_mib(
    cmd: str, gpus: str | None, pids: set[int]
) -> tuple[float | None, str]:
    """GPU memory held by the processes in ``pids`` (all GPUs), from
    nvidia-smi's compute-apps list; None and why when it lists none of them
    (e.g. nvidia-smi in another PID namespace)."""
    rows, why = nvidia_smi_rows(cmd, "--query-compute-apps=pid,used_memory", gpus)
    if rows is None:
        return None, why
    total, found = 0.0, False
    for parts in rows:
        if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) in pids:
            with contextlib.suppress(ValueError):
                total += float(parts[1])
                found = True
    if not found:
        return None, f"{cmd} lists no process of the server"
    return total, ""


class LaunchedServer:
    """The server command of ``--launch``, in its own session (process group)
    so that stopping it stops the engine processes it started."""

    def __init__(self, cmd: str, log_path: str, after_start: str | None):
        self.argv = shlex.split(cmd)
        self.log_path = log_path
        self.after_start = after_start
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> None:
        logf = open(self.log_path, "ab")  # noqa: SIM115 (handed to the child)
        self.proc = subprocess.Popen(
            self.argv,
            stdout=logf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        logf.close()

    async def wait_ready(self, ep: Endpoint, timeout: float) -> str | None:
        """None once /health answers 200 and --after-start succeeded, else
        what went wrong."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is None or self.proc.poll() is not None:
                rc = None if self.proc is None else self.proc.returncode
                return f"server exited during startup (rc {rc}); see {self.log_path}"
            status, _ = await ep.call("GET", "/health", timeout=5)
            if status == 200:
                break
            if time.monotonic() > deadline:
                return f"server not healthy after {timeout:g}s; see {self.log_path}"
            await asyncio.sleep(0.2)
        if self.after_start:
            left = max(1.0, deadline - time.monotonic())
            proc = await asyncio.create_subprocess_exec(*shlex.split(self.after_start))
            try:
                rc = await asyncio.wait_for(proc.wait(), left)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
                return f"--after-start still running after {left:.0f}s"
            if rc != 0:
                return f"--after-start exited {rc}"
        return None

    async def stop(self, grace: float = 30.0) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# --------------------------------------------------------------- analysis
def flatness(
    samples: list[tuple[float, float]], start: float, warmup: float, tol: float
) -> dict:
    """Least-squares slope of the samples after ``start + warmup`` and the
    growth it implies over their span; ``ok`` when it is within ``tol``."""
    post = [(t, v) for t, v in samples if t >= start + warmup]
    res: dict = {
        "samples": len(samples),
        "after_warmup": len(post),
        "curve": [[round(t, 2), round(v, 1)] for t, v in samples],
    }
    if len(post) < 3:
        res.update(ok=None, reason="fewer than 3 samples after the warm-up")
        return res
    n = len(post)
    mt = sum(t for t, _ in post) / n
    mv = sum(v for _, v in post) / n
    var = sum((t - mt) ** 2 for t, _ in post)
    slope = sum((t - mt) * (v - mv) for t, v in post) / var if var else 0.0
    span = post[-1][0] - post[0][0]
    growth = slope * span
    res.update(
        ok=growth <= tol,
        slope_mib_per_min=round(slope * 60, 3),
        growth_mib=round(growth, 2),
        tolerance_mib=tol,
        first_mib=round(post[0][1], 1),
        last_mib=round(post[-1][1], 1),
        min_mib=round(min(v for _, v in post), 1),
        max_mib=round(max(v for _, v in post), 1),
    )
    return res


_LABEL = re.compile(r'(\w+)="([^"]*)"')


def _labelled(sample: dict[str, float], name: str, label: str) -> dict[str, float]:
    out = {}
    for key, v in sample.items():
        if key.split("{", 1)[0] == name:
            labels = dict(_LABEL.findall(key))
            if label in labels:
                out[labels[label]] = v
    return out


def parse_types(text: str) -> dict[str, str]:
    types = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            parts = line.split()
            if len(parts) >= 4:
                types[parts[2]] = parts[3]
    return types


def is_cumulative(name: str, types: dict[str, str]) -> bool:
    """Counter and histogram samples never fall while a server lives."""
    if types.get(name) in ("counter", "histogram"):
        return True
    for suffix in ("_total", "_bucket", "_count", "_sum"):
        if name.endswith(suffix):
            base = name[: -len(suffix)]
            if types:
                if types.get(base) in ("counter", "histogram"):
                    return True
            else:
                return True
    return False


def check_metrics(
    scrapes: list[tuple[float, int, dict[str, float]]],
    types: dict[str, str],
    expect_ddtree: bool,
    client_tokens: dict[int, int],
    tree_budget: int | None = None,
) -> dict:
    """Consistency of the /metrics scrapes, per server lifetime (epoch).
    ``client_tokens[epoch]``: completion tokens the clients were sent by
    requests that started after that epoch's first scrape and ended before
    its last. ``tree_budget``: the configured one, the most nodes a step may
    verify per request (the budget gauge shows only the last step's)."""
    problems: list[str] = []
    epochs: dict[int, list] = defaultdict(list)
    for t, e, s in scrapes:
        epochs[e].append((t, s))
    summary = []
    if not scrapes:
        return {"ok": False, "problems": ["no /metrics scrape answered"], "epochs": []}
    for e, ss in sorted(epochs.items()):
        for (ta, a), (tb, b) in zip(ss, ss[1:]):
            for key, vb in b.items():
                name = key.split("{", 1)[0]
                if key in a and is_cumulative(name, types) and vb < a[key] - 1e-6:
                    problems.append(
                        f"epoch {e}: {key} fell from {a[key]:g} to {vb:g} "
                        f"(t={ta:.1f}s -> {tb:.1f}s)"
                    )
        first, last = ss[0][1], ss[-1][1]

        def d(key: str, first=first, last=last) -> float:
            return last.get(key, 0.0) - first.get(key, 0.0)

        drafts, acc, dtok = d(DRAFTS), d(ACCEPTED), d(DRAFT_TOKENS)
        pos = {int(k): v for k, v in _labelled(last, PER_POS, "position").items()}
        pos0 = {int(k): v for k, v in _labelled(first, PER_POS, "position").items()}
        per_pos = [pos[k] - pos0.get(k, 0.0) for k in sorted(pos)]
        budgets = [s.get(BUDGET) for _, s in ss if s.get(BUDGET) is not None]
        depth = last.get(DEPTH)
        ep = {
            "epoch": e,
            "scrapes": len(ss),
            "t": [round(ss[0][0], 2), round(ss[-1][0], 2)],
            "drafts": drafts,
            "accepted": acc,
            "draft_tokens": dtok,
            "tau": round(1 + acc / drafts, 4) if drafts else None,
            "generation_tokens": d(GEN_TOKENS),
            "client_completion_tokens": client_tokens.get(e, 0),
            "preemptions": d(PREEMPTIONS),
            "accepted_per_position": per_pos,
            "tree_budget_max": max(budgets) if budgets else None,
            "draft_depth": depth,
        }
        summary.append(ep)
        has_spec = DRAFTS in last
        has_ddtree = f"{AL}_count" in last
        if expect_ddtree and not (has_spec and has_ddtree):
            problems.append(
                f"epoch {e}: vllm:spec_decode_* or vllm:ddtree_* series missing"
            )
        if client_tokens.get(e, 0) > d(GEN_TOKENS) + 0.5:
            problems.append(
                f"epoch {e}: {GEN_TOKENS} moved {d(GEN_TOKENS):g}, less than the "
                f"{client_tokens[e]} completion tokens the clients were sent"
            )
        if not has_spec:
            continue
        if expect_ddtree and drafts <= 0 and len(ss) > 1:
            problems.append(f"epoch {e}: {DRAFTS} did not move")
        if acc > dtok + 0.5:
            problems.append(f"epoch {e}: accepted {acc:g} > draft tokens {dtok:g}")
        if dtok < drafts - 0.5:
            problems.append(f"epoch {e}: draft tokens {dtok:g} < drafts {drafts:g}")
        if tree_budget and dtok > drafts * tree_budget + 0.5:
            problems.append(
                f"epoch {e}: draft tokens {dtok:g} > drafts {drafts:g} x "
                f"tree_budget {tree_budget}"
            )
        if tree_budget and budgets and max(budgets) > tree_budget:
            problems.append(
                f"epoch {e}: {BUDGET} reached {max(budgets):g} > tree_budget "
                f"{tree_budget}"
            )
        if depth and acc > drafts * depth + 0.5:
            problems.append(
                f"epoch {e}: accepted {acc:g} > drafts {drafts:g} x depth {depth:g}"
            )
        if per_pos:
            if per_pos[0] > drafts + 0.5:
                problems.append(
                    f"epoch {e}: position 0 count {per_pos[0]:g} > drafts {drafts:g}"
                )
            if any(b > a + 0.5 for a, b in zip(per_pos, per_pos[1:])):
                problems.append(
                    f"epoch {e}: per-position accepted counts rise: {per_pos}"
                )
            if abs(sum(per_pos) - acc) > 0.5:
                problems.append(
                    f"epoch {e}: per-position counts sum to {sum(per_pos):g}, "
                    f"accepted is {acc:g}"
                )
        if not has_ddtree:
            continue
        al_count, al_sum = d(f"{AL}_count"), d(f"{AL}_sum")
        ep["emitted_tokens"] = al_sum
        if abs(al_count - drafts) > 0.5:
            problems.append(
                f"epoch {e}: {AL}_count moved {al_count:g}, drafts {drafts:g}"
            )
        if abs(al_sum - (acc + drafts)) > 0.5:
            problems.append(
                f"epoch {e}: emitted tokens ({AL}_sum) {al_sum:g} != accepted "
                f"{acc:g} + drafts {drafts:g}"
            )
        b_last = _labelled(last, f"{AL}_bucket", "le")
        b_first = _labelled(first, f"{AL}_bucket", "le")
        buckets = sorted(
            ((float(le), v - b_first.get(le, 0.0)) for le, v in b_last.items()),
            key=lambda x: x[0],
        )
        if any(b[1] < a[1] - 0.5 for a, b in zip(buckets, buckets[1:])):
            problems.append(f"epoch {e}: {AL} buckets not cumulative")
        if buckets and abs(buckets[-1][1] - al_count) > 0.5:
            problems.append(
                f"epoch {e}: {AL} +Inf bucket {buckets[-1][1]:g} != count {al_count:g}"
            )
        dl = _labelled(last, PER_DEPTH, "depth")
        df = _labelled(first, PER_DEPTH, "depth")
        for k, v in enumerate(per_pos):
            dd = dl.get(str(k + 1), 0.0) - df.get(str(k + 1), 0.0)
            if abs(dd - v) > 0.5:
                problems.append(
                    f"epoch {e}: depth {k + 1} count {dd:g} != position {k} count {v:g}"
                )
    return {
        "ok": not problems,
        "problems": problems[:30],
        "n_problems": len(problems),
        "epochs": summary,
    }


def first_difference(text: str, ref: str) -> int | None:
    for k, (a, b) in enumerate(zip(text, ref)):
        if a != b:
            return k
    return None if len(text) == len(ref) else min(len(text), len(ref))


def token_index(ref_tokens: list[str], char: int) -> int | None:
    pos = 0
    for k, tok in enumerate(ref_tokens):
        pos += len(tok)
        if pos > char:
            return k
    return None


# ------------------------------------------------------------------- soak
class Soak:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.ep = Endpoint(a.base_url)
        self.ref = Endpoint(a.reference_url) if a.reference_url else None
        self.t0 = time.monotonic()
        self.epoch = 0
        self.windows: list[list[float | None]] = []  # [start, end] per fault
        self.restarts: list[dict] = []
        self.up = asyncio.Event()
        self.up.set()
        self.stop_load = asyncio.Event()
        self.stop_monitors = asyncio.Event()
        self.outcomes: list[Outcome] = []
        self.plans: dict[int, Plan] = {}
        # (sent, answered, status): a poll cut by a restart falls in its window.
        self.health: list[tuple[float, float, int]] = []
        self.rss: list[tuple[float, int, float]] = []
        self.gpu: list[tuple[float, int, dict[str, float]]] = []
        self.gpu_reason = ""
        self.gpu_scope: str | None = None
        self.gpu_scope_note = ""
        self.scrapes: list[tuple[float, int, dict[str, float]]] = []
        self.types: dict[str, str] = {}
        self.scrape_lock = asyncio.Lock()
        self.epoch_start: dict[int, float] = {0: 0.0}
        self.issued = 0
        self.in_flight = 0
        self.server: LaunchedServer | None = None
        self.restart_begun = False
        self.load_end = 0.0

    def clock(self) -> float:
        return time.monotonic() - self.t0

    def in_window(self, t0: float, t1: float) -> bool:
        g = self.a.fault_grace
        for w0, w1 in self.windows:
            end = math.inf if w1 is None else w1 + g
            if t0 <= end and t1 >= w0:
                return True
        return False

    @property
    def server_pid(self) -> int | None:
        return self.server.pid if self.server else self.a.server_pid

    # -------------------------------------------------------- discovery
    async def discover(self) -> Context:
        models = await self.ep.json("GET", "/v1/models")
        card = models["data"][0]
        model = self.a.model or card["id"]
        max_model_len = int(self.a.max_model_len or card.get("max_model_len") or 0)
        if max_model_len <= 0:
            raise RuntimeError(
                "/v1/models gives no max_model_len; pass --max-model-len"
            )
        texts = load_prompts(self.a.prompts)[: self.a.num_prompts]
        comp, chat, long_tokens = [], [], []
        for text in texts:
            t = await self.ep.json(
                "POST", "/tokenize", {"model": model, "prompt": text}
            )
            # Room for at least 16 new tokens.
            if t["count"] <= max_model_len - 16:
                comp.append((text, int(t["count"])))
                long_tokens += t["tokens"]
            if self.a.chat_fraction == 0:
                continue  # a server without a chat template
            c = await self.ep.json(
                "POST",
                "/tokenize",
                {"model": model, "messages": [{"role": "user", "content": text}]},
            )
            if c["count"] <= max_model_len - 16:
                chat.append((text, int(c["count"])))
        if self.a.chat_fraction == 0:
            chat = comp  # only the chat bad inputs use them
        if not comp or not chat:
            raise RuntimeError(
                f"no prompt leaves 16 tokens of max_model_len={max_model_len}"
            )
        stop_ids = []
        for s in STOP_TEXTS:
            t = await self.ep.json("POST", "/tokenize", {"model": model, "prompt": s})
            if t["tokens"]:
                stop_ids.append(int(t["tokens"][-1]))
        return Context(
            model, max_model_len, comp, chat, long_tokens, sorted(set(stop_ids))
        )

    # -------------------------------------------------------- bad input
    async def bad_input_phase(self, ctx: Context) -> list[dict]:
        rows = []
        for k, case in enumerate(bad_cases(ctx)):
            plan = _bad_plan(-1 - k, case)
            out = await run_plan(self.ep, plan, self.a.timeout, self.clock)
            status, _ = await self.ep.call(
                "GET", "/health", timeout=self.a.health_timeout
            )
            rows.append(
                {
                    "name": plan.name,
                    "api": plan.api,
                    "outcome": out.status,
                    "http": out.http,
                    "error_kind": out.error_kind,
                    "message": out.error,
                    "health_after": status,
                    "ok": out.status == "rejected" and status == 200,
                }
            )
        return rows

    # ------------------------------------------------------------- load
    async def client(self, ctx: Context) -> None:
        a = self.a
        while not self.stop_load.is_set():
            if not self.up.is_set():  # the server restarts
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.up.wait(), 0.5)
                continue
            i = self.issued
            self.issued += 1
            plan = make_plan(i, a.seed, ctx, a)
            self.plans[i] = plan
            self.in_flight += 1
            epoch = self.epoch
            out = await run_plan(self.ep, plan, a.timeout, self.clock)
            self.in_flight -= 1
            out.epoch = epoch
            self.outcomes.append(out)
            if out.status == "connection_error" and not self.up.is_set():
                await asyncio.sleep(0.05)

    async def load_timer(self) -> None:
        a = self.a
        while True:
            t = self.clock()
            if t >= a.max_duration:
                break
            if t >= a.duration and self.issued >= a.requests:
                break
            await asyncio.sleep(0.05)
        self.stop_load.set()

    async def health_poller(self) -> None:
        while not self.stop_monitors.is_set():
            t = self.clock()
            status, _ = await self.ep.call(
                "GET", "/health", timeout=self.a.health_timeout
            )
            self.health.append((t, self.clock(), status))
            await self._sleep(self.a.health_interval)

    async def _sleep(self, s: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.stop_monitors.wait(), s)

    async def scrape(self) -> dict[str, float] | None:
        # One at a time, so that the list is in the server's order; the
        # lifetime is the one asked (an old server's last answer can be read
        # after the restart has begun).
        async with self.scrape_lock:
            t, epoch = self.clock(), self.epoch
            status, body = await self.ep.call("GET", "/metrics", timeout=15)
            if status != 200:
                return None
            text = body.decode("utf-8", "replace")
            if not self.types:
                self.types = parse_types(text)
            s = parse_prometheus(text, ("vllm:",))
            self.scrapes.append((t, epoch, s))
            return s

    async def metrics_scraper(self) -> None:
        while not self.stop_monitors.is_set():
            if self.up.is_set():
                await self.scrape()
            await self._sleep(self.a.metrics_interval)

    def gpu_sample(self, pids: set[int] | None) -> tuple[dict[str, float] | None, str]:
        """One GPU memory sample: the server's processes (``--gpu-memory
        server``, or ``auto`` once nvidia-smi is seen to list them) or each
        GPU's total (``device``, or ``auto`` when it does not); None and why
        (an empty why: no sample now, e.g. while the server restarts)."""
        a = self.a
        if a.gpu_memory == "device":
            self.gpu_scope = "device"
        if self.gpu_scope == "device":
            return gpu_memory_mib(a.nvidia_smi, a.gpus)
        if not pids:
            # No server process to look for (yet, or while it restarts).
            return None, ""
        mib, why = server_gpu_memory_mib(a.nvidia_smi, a.gpus, pids)
        if mib is not None:
            self.gpu_scope = "server"
            return {"server": mib}, ""
        if self.gpu_scope == "server":
            return None, ""
        if a.gpu_memory == "server":
            return None, why
        # auto, and nvidia-smi lists none of the server's processes.
        self.gpu_scope = "device"
        self.gpu_scope_note = f"{why}: each GPU's total is sampled"
        return gpu_memory_mib(a.nvidia_smi, a.gpus)

    async def memory_sampler(self) -> None:
        a = self.a
        gpu_on = True
        if a.gpu_memory == "device" or self.server_pid is None:
            self.gpu_scope = "device"
        while not self.stop_monitors.is_set():
            t, epoch, pid = self.clock(), self.epoch, self.server_pid
            pids = None
            if pid is not None:
                pids, rss = await asyncio.to_thread(process_tree, pid)
                if rss is not None:
                    self.rss.append((t, epoch, rss))
            if gpu_on:
                mem, why = await asyncio.to_thread(self.gpu_sample, pids)
                if mem is not None:
                    self.gpu.append((t, epoch, mem))
                elif why:
                    gpu_on = not why.endswith("not found")
                    self.gpu_reason = why
            await self._sleep(a.memory_interval)

    async def progress(self) -> None:
        while not self.stop_monitors.is_set():
            await self._sleep(self.a.progress_interval)
            c = Counter(o.status for o in self.outcomes)
            h = self.health[-1][2] if self.health else None
            bad_h = sum(1 for _, _, s in self.health if s != 200)
            s = self.scrapes[-1][2] if self.scrapes else {}
            s0 = next((x[2] for x in self.scrapes if x[1] == self.epoch), {})
            dr = s.get(DRAFTS, 0) - s0.get(DRAFTS, 0)
            tau = 1 + (s.get(ACCEPTED, 0) - s0.get(ACCEPTED, 0)) / dr if dr else None
            rss = f"{self.rss[-1][2]:.0f} MiB" if self.rss else "-"
            gpu = (
                "+".join(f"{v:.0f}" for v in self.gpu[-1][2].values()) + " MiB"
                if self.gpu
                else "-"
            )
            log(
                f"{self.clock():6.0f}s issued {self.issued} in flight "
                f"{self.in_flight} | {dict(sorted(c.items()))} | health {h} "
                f"({bad_h} not 200 of {len(self.health)}) | rss {rss} gpu {gpu} | "
                f"preemptions {s.get(PREEMPTIONS, 0) - s0.get(PREEMPTIONS, 0):g} "
                f"tau {tau and round(tau, 2)}"
            )

    async def restarter(self) -> None:
        a = self.a
        await asyncio.sleep(max(0.0, a.restart_at - self.clock()))
        if self.stop_load.is_set() or self.server is None:
            return
        self.restart_begun = True  # from here on it runs to its end
        await self.scrape()  # the last of this lifetime
        t_stop = self.clock()
        self.windows.append([t_stop, None])
        self.up.clear()
        log(f"restart: stopping the server (pid {self.server.pid})")
        await self.server.stop(a.stop_grace)
        self.epoch += 1
        self.server.start()
        err = await self.server.wait_ready(self.ep, a.start_timeout)
        t_up = self.clock()
        self.windows[-1][1] = t_up
        self.epoch_start[self.epoch] = t_up
        self.restarts.append(
            {"t_stop": round(t_stop, 2), "t_up": round(t_up, 2), "error": err}
        )
        if err:
            log(f"restart failed: {err}")
            self.stop_load.set()
        else:
            log(f"restart: the server answers again after {t_up - t_stop:.1f}s")
            await self.scrape()  # the first of the new lifetime
        self.up.set()

    async def drain(self) -> bool:
        deadline = time.monotonic() + self.a.drain_timeout
        while time.monotonic() < deadline:
            s = await self.scrape()
            if s and s.get(RUNNING) == 0 and s.get(WAITING, 0) == 0:
                return True
            await asyncio.sleep(0.25)
        return False

    # -------------------------------------------------------- reference
    async def compare_reference(self) -> dict:
        a = self.a
        todo = [
            o
            for o in self.outcomes
            if o.category == "load"
            and o.status == "completed"
            and o.greedy
            and not o.in_fault
        ]
        res: dict = {
            "compared": 0,
            "identical": 0,
            "near_ties": [],
            "mismatches": [],
            "num_near_ties": 0,
            "num_mismatches": 0,
            "reference_errors": [],
            "eligible": len(todo),
        }
        try:
            ref_model = (await self.ref.json("GET", "/v1/models"))["data"][0]["id"]
        except (RuntimeError, KeyError, IndexError, ValueError) as e:
            res["reference_errors"].append({"error": f"/v1/models: {e}"[:200]})
            res["ok"] = False
            return res
        sem = asyncio.Semaphore(a.reference_concurrency)
        deadline = time.monotonic() + a.reference_max_s

        async def one(o: Outcome) -> None:
            plan = self.plans[o.id]
            body = {**plan.body, "model": ref_model}
            for k in ("stream", "stream_options", "prompt_logprobs"):
                body.pop(k, None)
            if plan.api == "chat":
                body.update(
                    logprobs=True, top_logprobs=max(2, body.get("top_logprobs", 0))
                )
            else:
                body["logprobs"] = max(2, body.get("logprobs") or 0)
            async with sem:
                left = deadline - time.monotonic()
                if left <= 0:
                    res["reference_errors"].append(
                        {"id": o.id, "error": "no time left"}
                    )
                    return
                status, data = await self.ref.call(
                    "POST", plan.path, json.dumps(body).encode(), min(a.timeout, left)
                )
            try:
                payload = json.loads(data) if status == 200 else None
                c = payload["choices"][0] if payload else None
            except (ValueError, KeyError, IndexError, TypeError):
                c = None
            if c is None:
                res["reference_errors"].append(
                    {"id": o.id, "http": status, "error": error_message(data)[:200]}
                )
                return
            ref_text = _choice_text(plan.api, c, False)
            tg = choice_logprobs(plan.api, c)
            ref_tokens = [tok for tok, _ in tg]
            gaps = [g for _, g in tg]
            res["compared"] += 1
            diffs = [
                (idx, text) for idx, text in sorted(o.texts.items()) if text != ref_text
            ]
            if not diffs:
                res["identical"] += 1
                return
            idx, text = diffs[0]
            char = first_difference(text, ref_text)
            gap = divergence_gap(text, ref_text, ref_tokens, gaps)
            row = {
                "id": o.id,
                "api": o.api,
                "stream": o.stream,
                "name": o.name,
                "first_diff_char": char,
                "first_diff_token": token_index(ref_tokens, char or 0),
                "ref_top2_gap": gap,
                "sampling": {
                    k: v
                    for k, v in plan.body.items()
                    if k not in ("model", "prompt", "messages", "stream_options")
                },
                "ours": text[max(0, (char or 0) - 20) : (char or 0) + 20],
                "ref": ref_text[max(0, (char or 0) - 20) : (char or 0) + 20],
            }
            if a.float32 and gap is not None and gap < a.tie_tolerance:
                res["near_ties"].append(row)
            else:
                res["mismatches"].append(row)

        await asyncio.gather(*(one(o) for o in todo))
        res["ok"] = not res["mismatches"] and not res["reference_errors"]
        # The counts cover every output; the rows kept are the first 50 by id.
        res["num_mismatches"] = len(res["mismatches"])
        res["num_near_ties"] = len(res["near_ties"])
        res["mismatches"] = sorted(res["mismatches"], key=lambda r: r["id"])[:50]
        res["near_ties"] = sorted(res["near_ties"], key=lambda r: r["id"])[:50]
        return res

    # -------------------------------------------------------------- run
    async def run(self) -> dict:
        a = self.a
        report: dict = {
            "tool": "bench.serving.soak",
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "base_url": self.ep.base_url,
            "reference_url": self.ref.base_url if self.ref else None,
            "args": {k: v for k, v in vars(a).items()},
        }
        if a.launch:
            self.server = LaunchedServer(a.launch, a.server_log, a.after_start)
            self.server.start()
            log(f"launched the server (pid {self.server.pid}), log {a.server_log}")
            err = await self.server.wait_ready(self.ep, a.start_timeout)
            if err:
                await self.server.stop(a.stop_grace)
                return {**report, "ok": False, "fatal": err}
        try:
            return await self._run(report)
        finally:
            if self.server is not None:
                await self.server.stop(a.stop_grace)
            for ep in (self.ep, self.ref):
                if ep is not None:
                    await ep.close()

    async def _run(self, report: dict) -> dict:
        a = self.a
        try:
            ctx = await self.discover()
        except (RuntimeError, KeyError, IndexError, ValueError) as e:
            return {**report, "ok": False, "fatal": f"discovery: {e}"}
        report.update(
            model=ctx.model,
            max_model_len=ctx.max_model_len,
            prompts={
                "completion": len(ctx.completion_prompts),
                "chat": len(ctx.chat_prompts),
            },
            stop_token_ids=ctx.stop_token_ids,
        )
        log(f"model {ctx.model}, max_model_len {ctx.max_model_len}; bad inputs")
        bad_rows = await self.bad_input_phase(ctx)
        log(f"bad inputs: {sum(r['ok'] for r in bad_rows)}/{len(bad_rows)} ok; load")

        self.t0 = time.monotonic()
        self.epoch_start = {0: 0.0}
        await self.scrape()
        monitors = [
            asyncio.create_task(f())
            for f in (
                self.health_poller,
                self.metrics_scraper,
                self.memory_sampler,
                self.progress,
            )
        ]
        restart = None
        if a.restart_at and self.server is not None:
            restart = asyncio.create_task(self.restarter())
        clients = [asyncio.create_task(self.client(ctx)) for _ in range(a.concurrency)]
        timer = asyncio.create_task(self.load_timer())
        await timer
        await asyncio.gather(*clients)
        if restart is not None:
            if not self.restart_begun:
                restart.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await restart  # bounded by --stop-grace and --start-timeout
        self.load_end = self.clock()
        log(f"load done after {self.load_end:.0f}s, {self.issued} requests; drain")
        drained = await self.drain()
        probe = await run_plan(
            self.ep,
            Plan(
                -10_000,
                "load",
                "probe",
                "completion",
                {
                    "model": ctx.model,
                    "prompt": ctx.completion_prompts[0][0],
                    "max_tokens": 4,
                    "temperature": 0.0,
                },
            ),
            a.timeout,
            self.clock,
        )
        final_health, _ = await self.ep.call("GET", "/health", timeout=a.health_timeout)
        await self.scrape()
        self.stop_monitors.set()
        await asyncio.gather(*monitors)
        for o in self.outcomes:
            o.in_fault = self.in_window(o.t_start, o.t_end)
        greedy = None
        if self.ref is not None:
            log("comparing greedy outputs with the reference server")
            greedy = await self.compare_reference()
        report.update(self.evaluate(bad_rows, drained, probe, final_health, greedy))
        return report

    # --------------------------------------------------------- evaluate
    def evaluate(self, bad_rows, drained, probe, final_health, greedy) -> dict:
        a = self.a
        outs = self.outcomes
        crit: dict[str, dict] = {}

        def failing(o: Outcome) -> bool:
            if o.status in CLEAN[o.category]:
                return False
            cut = o.status in FAULT_ONLY or o.error_kind in FAULT_ONLY_KINDS
            return not (cut and o.in_fault)

        for cat, name in (
            ("load", "requests"),
            ("refuse", "refusals"),
            ("bad", "bad_input"),
        ):
            mine = [o for o in outs if o.category == cat]
            bad = [o for o in mine if failing(o)]
            crit[name] = {
                "ok": not bad,
                "detail": f"{len(mine) - len(bad)}/{len(mine)} clean"
                + (f"; failing: {dict(Counter(o.status for o in bad))}" if bad else ""),
            }
        if not a.expect_ddtree:
            crit["refusals"] = {"ok": None, "detail": "skipped (--no-expect-ddtree)"}
        elif not any(o.category == "refuse" for o in outs):
            crit["refusals"]["ok"] = False
            crit["refusals"]["detail"] = "no refused kind was sent"
        phase_bad = [r for r in bad_rows if not r["ok"]]
        if phase_bad:
            crit["bad_input"]["ok"] = False
            crit["bad_input"]["detail"] += (
                f"; one at a time: {len(phase_bad)}/{len(bad_rows)} failed "
                f"({', '.join(r['name'] for r in phase_bad[:8])})"
            )
        else:
            crit["bad_input"]["detail"] += f"; one at a time: {len(bad_rows)} ok"
        crit["load"] = {
            "ok": self.issued >= a.requests and self.load_end >= a.duration,
            "detail": f"{self.issued} requests in {self.load_end:.0f}s "
            f"(asked: {a.requests} in {a.duration:g}s)",
        }
        bad_h = [
            (t0, s)
            for t0, t1, s in self.health
            if s != 200 and not self.in_window(t0, t1)
        ]
        crit["health"] = {
            "ok": bool(self.health) and not bad_h,
            "detail": f"{len(self.health)} polls, {len(bad_h)} not 200 outside "
            "fault windows"
            + (f" (first at {bad_h[0][0]:.1f}s: {bad_h[0][1]})" if bad_h else ""),
        }
        crit["final"] = {
            "ok": drained and probe.status == "completed" and final_health == 200,
            "detail": f"drained {drained}, short request {probe.status}, "
            f"/health {final_health}",
        }

        warm = a.warmup if a.warmup is not None else 0.2 * a.duration
        # Samples inside a restart's window (a server stopping or starting)
        # are left out: neither is the steady state the criteria are about.
        memory: dict = {"warmup_s": warm}
        per_epoch_rss = {}
        for e in sorted({x[1] for x in self.rss}):
            per_epoch_rss[e] = flatness(
                [
                    (t, v)
                    for t, ep, v in self.rss
                    if ep == e and not self.in_window(t, t)
                ],
                self.epoch_start.get(e, 0.0),
                warm,
                a.rss_growth_mib,
            )
        memory["rss"] = {"pid": self.server_pid, "epochs": per_epoch_rss}
        crit["server_rss"] = self._mem_criterion(
            per_epoch_rss,
            "skipped: no server pid (use --launch or --server-pid)"
            if self.server_pid is None
            else "no RSS sample (pid gone?)",
        )
        per_gpu: dict = {}
        for e in sorted({x[1] for x in self.gpu}):
            for idx in sorted({k for _, ep, m in self.gpu if ep == e for k in m}):
                name = idx if idx == "server" else f"gpu{idx}"
                per_gpu[f"{name}/epoch{e}"] = flatness(
                    [
                        (t, m[idx])
                        for t, ep, m in self.gpu
                        if ep == e and idx in m and not self.in_window(t, t)
                    ],
                    self.epoch_start.get(e, 0.0),
                    warm,
                    a.gpu_growth_mib,
                )
        memory["gpu"] = {
            "scope": self.gpu_scope,
            "scope_note": self.gpu_scope_note or None,
            "series": per_gpu,
            "unavailable": self.gpu_reason or None,
        }
        crit["gpu_memory"] = self._mem_criterion(
            per_gpu, f"skipped: {self.gpu_reason or 'no sample'}"
        )

        # Per server lifetime: the requests that started after its first
        # scrape and ended before its last one, so that the counters read
        # cover them whole.
        client_tokens: dict[int, int] = defaultdict(int)
        span: dict[int, list[float]] = {}
        for t, e, _ in self.scrapes:
            span.setdefault(e, [t, t])[1] = t
        for o in outs:
            t_first, t_last = span.get(o.epoch, (math.inf, -math.inf))
            if (
                o.status == "completed"
                and t_first <= o.t_start
                and o.t_end <= t_last
                and o.completion_tokens
            ):
                client_tokens[o.epoch] += o.completion_tokens
        metrics = check_metrics(
            self.scrapes, self.types, a.expect_ddtree, client_tokens, a.tree_budget
        )
        detail = "consistent"
        if not metrics["ok"]:
            n = metrics.get("n_problems", 1)
            detail = f"{n} problems, first: {metrics['problems'][0]}"
        crit["metrics"] = {"ok": metrics["ok"], "detail": detail}
        preempt = sum(ep["preemptions"] for ep in metrics["epochs"])
        crit["preemption"] = {
            "ok": preempt > 0 if a.expect_preemption else None,
            "detail": f"{preempt:g} preemptions"
            + ("" if a.expect_preemption else " (not required)"),
        }
        if greedy is None:
            crit["greedy_reference"] = {
                "ok": None,
                "detail": "skipped: no --reference-url",
            }
        else:
            crit["greedy_reference"] = {
                "ok": greedy["ok"],
                "detail": f"{greedy['identical']}/{greedy['compared']} identical, "
                f"{greedy['num_near_ties']} near-ties, "
                f"{greedy['num_mismatches']} mismatches, "
                f"{len(greedy['reference_errors'])} not compared",
            }

        completed = [o for o in outs if o.status == "completed"]
        by_cat: dict = defaultdict(Counter)
        for o in outs:
            by_cat[f"{o.category}:{o.name}"][o.status] += 1
        errors = Counter(o.error_kind for o in outs if o.error_kind)
        failing_rows = [o.brief() for o in outs if failing(o)]
        ok = all(c["ok"] is not False for c in crit.values())
        return {
            "ok": ok,
            "criteria": crit,
            "requests": {
                "issued": self.issued,
                "load_s": round(self.load_end, 2),
                "by_outcome": dict(Counter(o.status for o in outs)),
                "by_kind": {k: dict(v) for k, v in sorted(by_cat.items())},
                "errors_by_kind": dict(errors),
                "in_fault_window": sum(o.in_fault for o in outs),
                "in_fault_window_by_outcome": dict(
                    Counter(
                        f"{o.status}:{o.error_kind}" if o.error_kind else o.status
                        for o in outs
                        if o.in_fault
                    )
                ),
                "failing": failing_rows[:50],
                "n_failing": len(failing_rows),
            },
            "latency_s": {
                "completed": percentiles([o.latency for o in completed]),
                "completed_stream_ttft": percentiles(
                    [o.ttft for o in completed if o.stream and o.ttft is not None]
                ),
                "aborted": percentiles(
                    [o.latency for o in outs if o.status == "aborted"]
                ),
                "refused": percentiles(
                    [o.latency for o in outs if o.status == "refused"]
                ),
                "rejected": percentiles(
                    [o.latency for o in outs if o.status == "rejected"]
                ),
            },
            "health": {
                "polls": len(self.health),
                "by_status": dict(Counter(str(s) for _, _, s in self.health)),
                "interval_s": a.health_interval,
            },
            "memory": memory,
            "metrics": metrics,
            "greedy_reference": greedy,
            "bad_input": bad_rows,
            "faults": {
                "windows": [
                    [round(w0, 2), round(w1 or 0, 2)] for w0, w1 in self.windows
                ],
                "restarts": self.restarts,
                "grace_s": a.fault_grace,
            },
        }

    @staticmethod
    def _mem_criterion(series: dict, skipped: str) -> dict:
        if not series:
            return {"ok": None, "detail": skipped}
        judged = {k: v for k, v in series.items() if v["ok"] is not None}
        if not judged:
            return {"ok": None, "detail": "skipped: fewer than 3 samples after warm-up"}
        worst = max(judged, key=lambda k: judged[k]["growth_mib"])
        w = judged[worst]
        return {
            "ok": all(v["ok"] for v in judged.values()),
            "detail": f"largest growth after warm-up {w['growth_mib']:g} MiB "
            f"({w['slope_mib_per_min']:g} MiB/min, {worst}), tolerance "
            f"{w['tolerance_mib']:g} MiB",
        }


# -------------------------------------------------------------------- CLI
# (option, default, help) per group; the type is the default's (str for None).
OPTIONS = {
    "server": [
        ("--base-url", "http://127.0.0.1:8000", None),
        ("--model", None, "default: the server's first model"),
        ("--max-model-len", 0, "default: from /v1/models"),
        (
            "--launch",
            None,
            "start this server command (split like a shell line) "
            "and stop it at the end",
        ),
        (
            "--after-start",
            None,
            "command run after every start of --launch once "
            "/health answers, before any request, e.g. python3 -m "
            "bench.pairs.load_served_pair; must exit 0",
        ),
        ("--server-log", "/tmp/soak-server.log", None),
        ("--start-timeout", 900.0, None),
        ("--stop-grace", 30.0, "seconds between SIGTERM and SIGKILL"),
        (
            "--restart-at",
            0.0,
            "with --launch: restart the server this many "
            "seconds into the load (0: never)",
        ),
        ("--fault-grace", 5.0, "seconds after a restart still inside its fault window"),
        (
            "--server-pid",
            0,
            "pid whose RSS (with its descendants) is sampled, "
            "when the server was not launched here",
        ),
        (
            "--tree-budget",
            0,
            "the server's tree_budget: bounds the draft tokens "
            "per draft (unchecked without it)",
        ),
    ],
    "load": [
        ("--duration", 600.0, "seconds, at least"),
        ("--requests", 2000, "requests, at least"),
        ("--max-duration", 1800.0, "the load stops here whatever was sent"),
        ("--concurrency", 96, None),
        ("--prompts", None, "JSONL with a 'prompt' field"),
        ("--num-prompts", 64, None),
        ("--seed", 0, None),
        ("--max-tokens-max", 1024, None),
        ("--chat-fraction", 0.4, None),
        ("--stream-fraction", 0.5, None),
        ("--greedy-fraction", 0.5, None),
        ("--n-fraction", 0.15, "of the sampled requests, n in 2..4"),
        (
            "--long-fraction",
            0.05,
            "prompts of token ids within 80 tokens of max_model_len",
        ),
        ("--abort-fraction", 0.2, None),
        ("--abort-max-s", 3.0, "aborts after a delay: uniform in [0, this]"),
        ("--refuse-fraction", 0.05, None),
        ("--bad-fraction", 0.02, None),
        ("--timeout", 300.0, "client-side limit per request, s (past it: hang)"),
    ],
    "monitoring and criteria": [
        ("--health-interval", 2.0, None),
        ("--health-timeout", 5.0, None),
        ("--metrics-interval", 10.0, None),
        ("--memory-interval", 5.0, None),
        ("--progress-interval", 15.0, None),
        (
            "--warmup",
            None,
            "seconds of each server lifetime before memory must "
            "be flat (default: 20%% of --duration)",
        ),
        ("--rss-growth-mib", 256.0, None),
        ("--gpu-growth-mib", 128.0, None),
        ("--nvidia-smi", "nvidia-smi", None),
        ("--gpus", None, "nvidia-smi -i, e.g. 0 or 0,1"),
        ("--drain-timeout", 120.0, None),
        (
            "--reference-url",
            None,
            "a no-spec server of the same model (loopback), "
            "started with --logprobs-mode processed_logprobs",
        ),
        ("--reference-concurrency", 32, None),
        ("--reference-max-s", 1200.0, None),
        (
            "--tie-tolerance",
            0.01,
            "with --float32: reference top-2 logprob gap of a near-tie",
        ),
    ],
    "output": [
        ("--pair", None, "name in the output file (default: the model name)"),
        ("--out", None, "default: bench/results/<date>-soak-<pair>.json"),
    ],
}
# Options whose "unset" is None although their type is a number.
NUMBER_OR_NONE = {"--max-model-len", "--server-pid", "--tree-budget", "--warmup"}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[1],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    groups = {name: ap.add_argument_group(name) for name in OPTIONS}
    for name, options in OPTIONS.items():
        for flag, default, help_ in options:
            kind = float if flag == "--warmup" else type(default)
            if default is None or flag in NUMBER_OR_NONE:
                kind, default = (str if kind is type(None) else kind), None
            groups[name].add_argument(flag, type=kind, default=default, help=help_)
    g = groups["server"]
    g.add_argument(
        "--expect-ddtree",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="DDTree server: send the refused kinds, check its series",
    )
    g.add_argument(
        "--expect-preemption",
        action="store_true",
        help="fail unless vllm:num_preemptions moved",
    )
    g = groups["monitoring and criteria"]
    g.add_argument(
        "--gpu-memory",
        choices=("auto", "server", "device"),
        default="auto",
        help="GPU memory of the server's processes (nvidia-smi's compute apps; "
        "auto: when nvidia-smi lists them, else each GPU's total) or each GPU's "
        "total",
    )
    g.add_argument(
        "--float32",
        action="store_true",
        help="both servers run float32: near-ties are reported, not failed",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.restart_at and not a.launch:
        raise SystemExit("soak: --restart-at needs --launch")
    result = asyncio.run(Soak(a).run())
    pair = a.pair or re.sub(
        r"[^A-Za-z0-9_.-]+", "_", os.path.basename(str(result.get("model") or "server"))
    )
    out = a.out or os.path.join(
        REPO, "bench", "results", f"{datetime.date.today():%Y-%m-%d}-soak-{pair}.json"
    )
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    crit = result.get("criteria", {})
    for name, c in crit.items():
        mark = {True: "PASS", False: "FAIL", None: "skip"}[c["ok"]]
        print(f"{mark}  {name:16s} {c['detail']}", flush=True)
    if "fatal" in result:
        print(f"FAIL  {result['fatal']}", flush=True)
    summary = {
        "ok": result["ok"],
        "out": out,
        "criteria": {k: c["ok"] for k, c in crit.items()},
        "by_outcome": result.get("requests", {}).get("by_outcome"),
    }
    if "fatal" in result:
        summary["fatal"] = result["fatal"]
    print("RESULT " + json.dumps(summary, sort_keys=True), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
