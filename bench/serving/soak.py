#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Bounded soak and bad-input check of a DDTree ``vllm serve`` (loopback only).

    python3 -m bench.serving.soak --base-url http://127.0.0.1:8000 \\
        --prompts P.jsonl --reference-url http://127.0.0.1:8001 --float32 \\
        [--launch "vllm serve ..." --restart-at 300] [--server-pid PID]

Phases: discovery (``/v1/models``, ``/tokenize``); every bad input once (a 4xx
with a message, ``/health`` 200 right after it); load from ``--concurrency``
httpx clients until ``--duration`` s and ``--requests`` requests (at most
``--max-duration`` s): chat and completions, streamed or not, greedy and
sampled (penalties, seeds, ``n`` > 1), logprobs, stops, prompts near
``max_model_len`` and the kinds DDTree refuses (structured outputs,
``response_format``, ``bad_words``: a 4xx, or a streamed request's first event,
with DDTree's message), while ``/health``, ``/metrics`` (parsed by
prometheus_client), each GPU's memory (nvidia-smi) and the server's RSS with its
descendants (psutil) are sampled; with ``--launch --restart-at`` one
restart, whose fault window runs to ``--fault-grace`` s after the server
answers again and ``--after-start`` has run; drain, a short request,
``/health``; with ``--reference-url`` (no speculation, same model) every
completed greedy request outside a fault window is sent again there and the
outputs compared (with ``--float32`` a divergence where the reference's top-2
logprobs are within 0.01 is a near-tie, reported; start the
reference with ``--logprobs-mode processed_logprobs`` for the penalties).

Criteria (exit status 1 when one fails; one without its input is skipped):
requests (no hang past ``--timeout``, 4xx, 5xx or connection error outside a
fault window), load, refusals, bad_input, health, final (drained, short
request, ``/health``), gpu_memory and server_rss (least-squares growth after
``--warmup`` per server lifetime within the tolerance), greedy_reference,
metrics (per lifetime: counters monotone, the ``vllm:spec_decode_*`` /
``vllm:ddtree_*`` identities, generation tokens cover what the clients got),
preemption (``--expect-preemption``). One progress line every
``--progress-interval`` s on stderr, the report to ``--out``, one ``RESULT``
line on stdout."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import functools
import itertools
import json
import math
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from subprocess import DEVNULL, STDOUT

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench.common import (
    NEAR_TIE_NATS,
    REPO,
    add_options,
    check_loopback,
    emit,
    progress,
    write_json,
)

REFUSE_STRUCTURED = "DDTree does not support structured outputs"
REFUSE_BAD_WORDS = "DDTree does not support bad_words"
STOP_STRINGS = ("\n\n", "return", ")", "\ndef ", ":")
STOP_TEXTS = ("\n", ")", ":", " the")  # their last token ids stop requests
# The load's mix; the prompts kept; the reference's concurrency.
CHAT, STREAM, GREEDY, N_GT_1, LONG = 0.4, 0.5, 0.5, 0.15, 0.05
NUM_PROMPTS, REFERENCE_CONCURRENCY, HEALTH_TIMEOUT = 64, 32, 5.0

DRAFTS = "vllm:spec_decode_num_drafts_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
AL = "vllm:ddtree_acceptance_length"
AL_COUNT, AL_SUM = f"{AL}_count", f"{AL}_sum"
PER_DEPTH = "vllm:ddtree_num_accepted_tokens_per_depth_total"
BUDGET = "vllm:ddtree_tree_budget"
DEPTH = "vllm:ddtree_draft_depth"
GEN_TOKENS = "vllm:generation_tokens_total"
PREEMPTIONS = "vllm:num_preemptions_total"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
DROP_LABELS = {"model_name", "engine"}  # per-engine labels, summed away
MONOTONE = ("_total", "_bucket", "_count", "_sum")  # without # TYPE lines

# Fine outcomes per kind of request; those allowed only inside a fault window
# (a 200 with fewer choices than asked is vLLM's answer for a request its
# shutdown aborted).
CLEAN = {"load": {"completed"}, "refuse": {"refused"}, "bad": {"rejected"}}
FAULT_ONLY = {"server_error", "connection_error"}
FAULT_ONLY_KINDS = {"missing_choices"}

log = functools.partial(progress, "soak")
MARK = {True: "PASS", False: "FAIL", None: "skip"}


def parse_metrics(text: str) -> tuple[dict[str, float], set[str]]:
    """The ``vllm:`` samples of a /metrics page keyed ``name{label="v",...}``
    (summed over engines) and the names of its counter and histogram samples,
    which never fall while a server lives."""
    families = list(text_string_to_metric_families(text))
    # By the family's base name: "# TYPE x counter" over "x_total" samples
    # (rather than "# TYPE x_total counter") leaves the samples untyped.
    typed = {f.name for f in families if f.type in ("counter", "histogram")}
    samples: dict[str, float] = {}
    cumulative = set()
    for s in (s for fam in families for s in fam.samples):
        if not s.name.startswith("vllm:") or s.name.endswith("_created"):
            continue
        labels = ",".join(
            f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k not in DROP_LABELS
        )
        key = f"{s.name}{{{labels}}}" if labels else s.name
        samples[key] = samples.get(key, 0.0) + s.value
        if re.sub(r"_(total|bucket|count|sum)$", "", s.name) in typed:
            cumulative.add(s.name)
    return samples, cumulative


def load_prompts(path: str | None) -> list[str]:
    if not path:
        return [f"def function_{i}(x):\n    " for i in range(16)]
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r["prompt"] if isinstance(r, dict) else str(r) for r in rows]


class Endpoint:
    """A loopback server; a connection per request, so that a client that
    gives up closes its connection as a real one does."""

    def __init__(self, base_url: str):
        self.base_url = check_loopback(base_url, "soak")
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        self.client = httpx.AsyncClient(
            base_url=self.base_url, timeout=None, limits=limits
        )

    async def call(self, method, path, payload=None, timeout=10.0) -> tuple[int, bytes]:
        """(status, body); status 0 for no answer in time or no connection."""
        try:
            r = await self.client.request(method, path, json=payload, timeout=timeout)
        except (httpx.HTTPError, OSError):
            return 0, b""
        return r.status_code, r.content

    async def json(self, method: str, path: str, payload=None):
        status, data = await self.call(method, path, payload)
        if status != 200:
            why = f"HTTP {status}: {data[:200]!r}" if status else "no answer"
            raise RuntimeError(f"{method} {self.base_url}{path}: {why}")
        return json.loads(data)


def error_message(body: bytes) -> str:
    """An error body's message (OpenAI ``error.message``, FastAPI ``detail``)."""
    try:
        p = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:500]
    p = p if isinstance(p, dict) else {}
    err = p.get("error")
    if isinstance(err, dict) and err.get("message"):
        return str(err["message"])[:500]
    return next(
        (str(p[k])[:500] for k in ("detail", "message", "error") if p.get(k)), ""
    )


@dataclass
class Plan:
    """A request to send and, once sent, what came of it."""

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
    expect_msg: str | None = None
    status: str = "pending"
    http: int | None = None
    error_kind: str | None = None
    error: str | None = None
    t_start: float = 0.0
    t_end: float = 0.0
    texts: dict[int, str] = field(default_factory=dict)
    completion_tokens: int | None = None
    epoch: int = 0
    in_fault: bool = False

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.api == "chat" else "/v1/completions"

    def brief(self) -> dict:
        keys = ("id", "category", "name", "api", "stream", "status", "http")
        return {k: getattr(self, k) for k in (*keys, "error_kind", "error")} | {
            "t_start": round(self.t_start, 3),
            "latency_s": round(self.t_end - self.t_start, 3),
            "in_fault_window": self.in_fault,
        }

    @property
    def failing(self) -> bool:
        cut = self.status in FAULT_ONLY or self.error_kind in FAULT_ONLY_KINDS
        return self.status not in CLEAN[self.category] and not (cut and self.in_fault)

    def set(self, status: str, kind: str | None = None, error: str | None = None):
        self.status, self.error_kind, self.error = status, kind, error

    def error_answer(self, code: int, msg: str, where: str) -> None:
        kind, refused = f"{where}_{code}", self.expect_msg and self.expect_msg in msg
        msg = msg[:300] or None
        if code >= 500 or code < 400:
            self.set("server_error" if code >= 500 else "bad_response", kind, msg)
        elif self.category == "refuse" and not refused:
            self.set("client_error", kind + "_wrong_refusal", msg)
        elif self.category == "bad" and not msg:
            self.set("client_error", kind + "_without_message", msg)
        else:
            status = {"refuse": "refused", "bad": "rejected"}
            self.set(status.get(self.category, "client_error"), kind, msg)

    def served(self) -> None:
        """A 2xx answer with the whole output: what it means for this plan."""
        if self.category == "refuse":
            self.set("not_refused", "served_refused_kind")
        elif self.category == "bad":
            self.set("accepted_bad", "served_bad_input")
        elif len(self.texts) != self.n:
            n = len(self.texts)
            self.set("bad_response", "missing_choices", f"{n} choices, not {self.n}")
        else:
            self.status = "completed"


@dataclass
class Context:
    model: str
    max_model_len: int
    completion_prompts: list[tuple[str, int]]  # (text, prompt tokens)
    chat_prompts: list[tuple[str, int]]
    long_tokens: list[int]  # token ids to cut long prompts from
    stop_token_ids: list[int]

    def long_prompt(self, length: int) -> list[int]:
        return [self.long_tokens[i % len(self.long_tokens)] for i in range(length)]


# Bad inputs: (name, api, fields over a valid request of that api).
BAD_FIELDS = [
    ("max_tokens_wrong_type", "completion", {"max_tokens": "ten"}),
    ("prompt_wrong_type", "completion", {"prompt": {"text": "x"}}),
    ("messages_wrong_type", "chat", {"messages": "hello"}),
    ("temperature_wrong_type", "chat", {"temperature": "hot"}),
    ("seed_wrong_type", "completion", {"seed": "abc"}),
    ("temperature_negative", "completion", {"temperature": -0.5}),
    ("temperature_above_2", "chat", {"temperature": 3.0}),
    ("top_p_zero", "completion", {"temperature": 1.0, "top_p": 0.0}),
    ("top_p_above_1", "chat", {"temperature": 1.0, "top_p": 1.5}),
    ("top_k_below_minus_1", "completion", {"top_k": -5}),
    ("min_p_above_1", "completion", {"min_p": 1.5}),
    ("presence_penalty_above_2", "completion", {"presence_penalty": 3}),
    ("frequency_penalty_below_2", "chat", {"frequency_penalty": -3}),
    ("repetition_penalty_zero", "completion", {"repetition_penalty": 0}),
    ("n_zero", "completion", {"temperature": 1.0, "n": 0}),
    ("greedy_n_above_1", "completion", {"temperature": 0.0, "n": 2}),
    ("max_tokens_negative", "completion", {"max_tokens": -1}),
    ("logprobs_above_max", "completion", {"logprobs": 1000}),
    ("stop_empty_string", "completion", {"stop": [""]}),
    ("prompt_empty", "completion", {"prompt": ""}),
    ("prompt_token_negative", "completion", {"prompt": [5, -1, 7]}),
    ("model_unknown", "completion", {"model": "no-such-model"}),
    (
        "stream_temperature_negative",
        "completion",
        {"temperature": -1.0, "stream": True},
    ),
    ("stream_prompt_logprobs", "completion", {"prompt_logprobs": 1, "stream": True}),
]


def bad_cases(ctx: Context) -> list[tuple[str, str, dict | bytes, str]]:
    """(name, api, body: a dict or raw bytes, content type); each must get a
    4xx with a message."""
    m, j = ctx.model, "application/json"
    base = {"model": m, "prompt": ctx.completion_prompts[0][0], "max_tokens": 4}
    msgs = [{"role": "user", "content": ctx.chat_prompts[0][0]}]
    chat = {"model": m, "messages": msgs, "max_tokens": 4}
    over = ctx.max_model_len + 16
    text, ntok = ctx.completion_prompts[0]
    over_text = text * (over // max(ntok, 1) + 2)
    raw = [
        ("malformed_json", b'{"model": "' + m.encode() + b'", "prompt', j),
        ("body_not_json", b"prompt=hello&max_tokens=4", j),
        ("content_type_not_json", json.dumps(base).encode(), "text/plain"),
    ]
    fields = [
        *BAD_FIELDS,
        ("prompt_over_context_tokens", "completion", {"prompt": ctx.long_prompt(over)}),
        ("prompt_over_context_text", "completion", {"prompt": over_text}),
    ]
    return [(n, "completion", body, ct) for n, body, ct in raw] + [
        (n, api, (chat if api == "chat" else base) | f, j) for n, api, f in fields
    ]


def _bad_plan(i: int, case) -> Plan:
    name, api, body, ctype = case
    if isinstance(body, bytes):
        return Plan(i, "bad", name, api, None, raw=body, content_type=ctype)
    return Plan(i, "bad", name, api, body, stream=body.get("stream") is True)


_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["name"],
}
REFUSALS = {
    "structured_outputs_json": {"structured_outputs": {"json": _SCHEMA}},
    "structured_outputs_regex": {"structured_outputs": {"regex": "[a-z]{3,8}"}},
    "structured_outputs_choice": {"structured_outputs": {"choice": ["yes", "no"]}},
    "response_format_json_schema": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "thing", "schema": _SCHEMA},
        }
    },
    "response_format_json_object": {"response_format": {"type": "json_object"}},
    "bad_words": {"bad_words": ["return", " the"]},
}


def refusal_kind(i: int, refuse_fraction: float) -> str | None:
    """The refusal request ``i`` asks for, or None: every round(1 / fraction)-th
    request, the kinds in turn, so that any ``len(REFUSALS)`` refusals in a
    row send each kind once, however many requests the load's time allows."""
    if refuse_fraction <= 0:
        return None
    period = max(1, round(1 / refuse_fraction))
    if i % period != period - 1:
        return None
    return list(REFUSALS)[(i // period) % len(REFUSALS)]


def make_plan(i: int, seed: int, ctx: Context, a: argparse.Namespace) -> Plan:
    """Request ``i`` of the load, drawn from ``seed`` and ``i`` alone (the same
    requests whatever the concurrency and timing)."""
    rng = random.Random(seed * 1_000_003 + i)
    u = rng.uniform
    kind = refusal_kind(i, a.refuse_fraction)
    refusing = kind is not None
    long_prompt = not refusing and rng.random() < LONG
    api = "chat" if not long_prompt and rng.random() < CHAT else "completion"
    stream = rng.random() < STREAM
    greedy = refusing or rng.random() < GREEDY
    body: dict = {"model": ctx.model}
    if long_prompt:
        max_tokens = rng.randint(1, 64)
        n_prompt = ctx.max_model_len - max_tokens - rng.randint(0, 16)
        body["prompt"] = ctx.long_prompt(max(1, n_prompt))
    else:
        prompts = ctx.chat_prompts if api == "chat" else ctx.completion_prompts
        text, n_prompt = prompts[rng.randrange(len(prompts))]
        if api == "chat":
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        lo, hi = math.log(1), math.log(a.max_tokens_max + 1)  # log-uniform
        max_tokens = min(int(math.exp(u(lo, hi))), ctx.max_model_len - n_prompt)
    body["max_tokens"] = max(1, max_tokens)
    n = 1
    if greedy:
        body["temperature"] = 0.0
        if rng.random() < 0.3:
            body["repetition_penalty"] = round(u(1.05, 1.3), 3)
            body["presence_penalty"] = round(u(-1.0, 1.0), 3)
            body["frequency_penalty"] = round(u(-1.0, 1.0), 3)
    else:
        body["temperature"] = round(u(0.2, 1.5), 3)
        for key, p, draw in (
            ("top_p", 0.5, lambda: round(u(0.5, 1.0), 3)),
            ("top_k", 0.4, lambda: rng.choice([1, 5, 20, 100])),
            ("min_p", 0.3, lambda: round(u(0.01, 0.2), 3)),
            ("presence_penalty", 0.3, lambda: round(u(-1.5, 1.5), 3)),
            ("frequency_penalty", 0.3, lambda: round(u(-1.5, 1.5), 3)),
            ("repetition_penalty", 0.3, lambda: round(u(0.9, 1.3), 3)),
            ("n", N_GT_1, lambda: rng.randint(2, 4)),
        ):
            if rng.random() < p:
                body[key] = draw()
        n = body.get("n", 1)
    if rng.random() < 0.5:
        body["seed"] = rng.randrange(1 << 31)
    if rng.random() < 0.25:
        body["stop"] = rng.sample(STOP_STRINGS, rng.randint(1, 2))
    if ctx.stop_token_ids and rng.random() < 0.2:
        body["stop_token_ids"] = [rng.choice(ctx.stop_token_ids)]
    if rng.random() < 0.25:
        k = rng.randint(0, 5)
        body.update(
            {"logprobs": True, "top_logprobs": k} if api == "chat" else {"logprobs": k}
        )
    # Not on the long prompts (a vocabulary row per prompt token), nor
    # streamed (vLLM refuses that: one of the bad inputs).
    if not long_prompt and rng.random() < 0.1 and not stream:
        body["prompt_logprobs"] = rng.randint(0, 3)
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    if kind is not None:
        body.update(REFUSALS[kind], max_tokens=min(body["max_tokens"], 32))
        msg = REFUSE_BAD_WORDS if kind == "bad_words" else REFUSE_STRUCTURED
        return Plan(i, "refuse", kind, api, body, stream, expect_msg=msg, greedy=True)
    name = "long" if long_prompt else api
    return Plan(i, "load", name, api, body, stream, greedy=greedy, n=n)


def choice_text(api: str, c: dict, stream: bool = False) -> str:
    if api == "chat":
        return (c.get("delta" if stream else "message") or {}).get("content") or ""
    return c.get("text") or ""


def choice_logprobs(api: str, c: dict) -> tuple[list[str], list[float]]:
    """The tokens of a choice and the top-1 minus top-2 logprob of each."""
    lp = c.get("logprobs") or {}
    if api == "chat":
        content = lp.get("content") or []
        tokens = [e.get("token", "") for e in content]
        tops = [[t["logprob"] for t in e.get("top_logprobs") or []] for e in content]
    else:
        tokens = lp.get("tokens") or []
        tops = [list((top or {}).values()) for top in lp.get("top_logprobs") or []]
    tops = [sorted(t, reverse=True) for t in tops]
    return tokens, [t[0] - t[1] if len(t) > 1 else math.inf for t in tops]


def first_difference(text: str, ref: str) -> int | None:
    k = next((k for k, (a, b) in enumerate(zip(text, ref)) if a != b), None)
    return k if k is not None or len(text) == len(ref) else min(len(text), len(ref))


def token_index(ref_tokens: list[str], char: int) -> int | None:
    ends = itertools.accumulate(len(t) for t in ref_tokens)
    return next((k for k, end in enumerate(ends) if end > char), None)


def divergence_gap(char: int, tokens: list[str], gaps: list[float]) -> float | None:
    """The reference's top-2 gap at the token holding character ``char``, where
    the outputs part (None when unknown). Where that is the start of a
    reference token, ours may have parted a token earlier (another split of
    the same characters): the smaller gap of the two counts."""
    k = token_index(tokens, char)
    if k is None:
        return None
    at_start = k > 0 and sum(len(t) for t in tokens[:k]) == char
    return min(gaps[k], gaps[k - 1]) if at_start else gaps[k]


async def run_plan(ep: Endpoint, req: Plan, timeout: float, clock) -> Plan:
    """Send ``req`` and record what came of it in it."""
    req.t_start = clock()

    def take(payload: dict) -> None:
        for c in payload.get("choices") or []:
            text, idx = choice_text(req.api, c, req.stream), int(c.get("index", 0))
            req.texts[idx] = req.texts.get(idx, "") + text
        if usage := payload.get("usage"):
            req.completion_tokens = usage.get("completion_tokens")

    async def receive() -> None:
        body = req.raw if req.raw is not None else json.dumps(req.body).encode()
        headers = {"content-type": req.content_type}
        async with ep.client.stream(
            "POST", req.path, content=body, headers=headers
        ) as resp:
            req.http = resp.status_code
            if resp.status_code != 200:
                msg = error_message(await resp.aread())
                return req.error_answer(resp.status_code, msg, "http")
            if not req.stream:
                take(json.loads(await resp.aread()))
                return req.served()
            if "text/event-stream" not in resp.headers.get("content-type", ""):
                return req.set("bad_response", "not_an_event_stream")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                if (data := line[5:].strip()) == "[DONE]":
                    return req.served()
                payload = json.loads(data)
                if (err := payload.get("error")) is not None:
                    err = err if isinstance(err, dict) else {"message": str(err)}
                    msg, code = str(err.get("message", "")), int(err.get("code") or 500)
                    return req.error_answer(code, msg, "stream_error")
                take(payload)
            req.set("connection_error", "stream_ended_without_done")

    try:
        await asyncio.wait_for(receive(), timeout)
    except asyncio.TimeoutError:
        req.set("hang", "client_timeout", f"no complete answer within {timeout:g}s")
    except (httpx.TransportError, OSError) as e:
        req.set("connection_error", type(e).__name__, str(e)[:300])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        req.set("bad_response", type(e).__name__, str(e)[:300])
    req.t_end = clock()
    return req


def process_tree(pid: int) -> float | None:
    """The RSS in MiB of ``pid`` and its descendants (vLLM's API server and
    engine cores); None when ``pid`` is gone."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
        total = root.memory_info().rss / 2**20
    except psutil.Error:
        return None
    for p in procs[1:]:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss / 2**20
    return total


def nvidia_smi(cmd: str, query: str) -> tuple[list[tuple[str, float]], str]:
    """(pid or GPU index, MiB) of each line nvidia-smi prints for the two-field
    ``query`` (lines without a number, e.g. "[N/A]", left out), or [] and why."""
    args = [cmd, query, "--format=csv,noheader,nounits"]
    try:
        p = subprocess.run(args, capture_output=True, text=True, timeout=15)
    except FileNotFoundError:
        return [], f"{cmd} not found"
    except (OSError, subprocess.TimeoutExpired) as e:
        return [], f"{cmd}: {type(e).__name__}"
    if p.returncode != 0:
        return [], f"{cmd} exited {p.returncode}: {p.stderr.strip()[:200]}"
    rows = [[x.strip() for x in line.split(",")] for line in p.stdout.splitlines()]
    number = re.compile(r"\d+(\.\d*)?")
    found = [r for r in rows if len(r) == 2 and number.fullmatch(r[1])]
    return [(k, float(v)) for k, v in found], ""


class LaunchedServer:
    """The ``--launch`` command in its own session (process group), so that
    stopping it stops the engine processes it started."""

    def __init__(self, a: argparse.Namespace):
        self.a, self.proc = a, None

    def start(self) -> None:
        cmd = shlex.split(self.a.launch)
        with open(self.a.server_log, "ab") as log_file:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log_file,
                stderr=STDOUT,
                stdin=DEVNULL,
                start_new_session=True,
            )

    async def wait_ready(self, ep: Endpoint) -> str | None:
        """None once /health answers 200 and --after-start exited 0, else
        what went wrong."""
        a, deadline = self.a, time.monotonic() + self.a.start_timeout
        see = f"; see {a.server_log}"
        while (await ep.call("GET", "/health", timeout=HEALTH_TIMEOUT))[0] != 200:
            if (rc := self.proc.poll()) is not None:
                return f"server exited during startup (rc {rc}){see}"
            if time.monotonic() > deadline:
                return f"server not healthy after {a.start_timeout:g}s{see}"
            await asyncio.sleep(0.2)
        if a.after_start:
            left = max(1.0, deadline - time.monotonic())
            proc = await asyncio.create_subprocess_exec(*shlex.split(a.after_start))
            try:
                if rc := await asyncio.wait_for(proc.wait(), left):
                    return f"--after-start exited {rc}"
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
                return f"--after-start still running after {left:.0f}s"
        return None

    async def stop(self) -> None:
        proc = self.proc
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if proc is None or proc.poll() is not None:
                return
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            deadline = time.monotonic() + self.a.stop_grace
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.1)


def flatness(
    samples: list[tuple[float, float]], start: float, warmup: float, tol: float
) -> dict:
    """Least-squares slope of the samples after ``start + warmup`` and the
    growth it implies over their span; ``ok`` when within ``tol``."""
    post = [(t, v) for t, v in samples if t >= start + warmup]
    res: dict = {
        "samples": len(samples),
        "after_warmup": len(post),
        "curve": [[round(t, 2), round(v, 1)] for t, v in samples],
    }
    if len(post) < 3:
        return res | {"ok": None, "reason": "fewer than 3 samples after the warm-up"}
    ts, vs = zip(*post)
    slope = statistics.linear_regression(ts, vs).slope
    growth = slope * (ts[-1] - ts[0])
    return res | {
        "ok": growth <= tol,
        "slope_mib_per_min": round(slope * 60, 3),
        "growth_mib": round(growth, 2),
        "tolerance_mib": tol,
        "first_mib": round(vs[0], 1),
        "last_mib": round(vs[-1], 1),
        "min_mib": round(min(vs), 1),
        "max_mib": round(max(vs), 1),
    }


def _labelled(sample: dict[str, float], name: str, label: str) -> dict[float, float]:
    """{``label``'s value: sample} of the series ``name``, in numeric order."""
    pattern = re.compile(rf'{re.escape(name)}{{.*\b{label}="([^"]*)"')
    found = ((m, v) for key, v in sample.items() if (m := pattern.match(key)))
    return dict(sorted((float(m[1]), v) for m, v in found))


def check_metrics(scrapes, cumulative, expect_ddtree, client_tokens, tree_budget=None):
    """Consistency of the /metrics scrapes ``(t, epoch, samples)`` per server
    lifetime (epoch). ``cumulative``: the counter and histogram sample names
    (empty: told by their suffix). ``client_tokens[epoch]``: completion
    tokens the clients got from requests inside that epoch's first and last
    scrape. ``tree_budget``: the configured one, the most nodes a step may
    verify per request (the gauge shows only the last step's)."""
    if not scrapes:
        return {"ok": False, "problems": ["no /metrics scrape answered"], "epochs": []}
    epochs: dict[int, list] = defaultdict(list)
    for t, e, s in scrapes:
        epochs[e].append((t, s))
    problems: list[str] = []
    args = (cumulative, expect_ddtree, tree_budget)
    summary = [
        _check_epoch(e, ss, problems, client_tokens.get(e, 0), *args)
        for e, ss in sorted(epochs.items())
    ]
    n = len(problems)
    return {"ok": not n, "problems": problems[:30], "n_problems": n, "epochs": summary}


def _check_epoch(e, ss, problems, client, cumulative, expect_ddtree, tree_budget):
    """One lifetime's summary; its problems appended to ``problems``."""

    def check(failed: bool, what: str) -> None:
        if failed:
            problems.append(f"epoch {e}: {what}")

    for (ta, a), (tb, b) in itertools.pairwise(ss):
        for key, v in b.items():
            name = key.split("{", 1)[0]
            mono = name in cumulative if cumulative else name.endswith(MONOTONE)
            if key in a and mono and v < a[key] - 1e-6:
                check(
                    True, f"{key} fell from {a[key]:g} to {v:g} ({ta:.1f}s, {tb:.1f}s)"
                )
    first, last = ss[0][1], ss[-1][1]
    delta = {k: v - first.get(k, 0.0) for k, v in last.items()}
    drafts, acc, dtok, gen, al_count, al_sum = (
        delta.get(k, 0.0)
        for k in (DRAFTS, ACCEPTED, DRAFT_TOKENS, GEN_TOKENS, AL_COUNT, AL_SUM)
    )
    per_pos = list(_labelled(delta, PER_POS, "position").values())
    budget = max((s[BUDGET] for _, s in ss if BUDGET in s), default=None)
    depth = last.get(DEPTH)
    ep = {
        "epoch": e,
        "scrapes": len(ss),
        "t": [round(ss[0][0], 2), round(ss[-1][0], 2)],
        "drafts": drafts,
        "accepted": acc,
        "draft_tokens": dtok,
        "tau": round(1 + acc / drafts, 4) if drafts else None,
        "generation_tokens": gen,
        "client_completion_tokens": client,
        "preemptions": delta.get(PREEMPTIONS, 0.0),
        "accepted_per_position": per_pos,
        "tree_budget_max": budget,
        "draft_depth": depth,
    }
    has_spec, has_ddtree = DRAFTS in last, AL_COUNT in last
    missing = expect_ddtree and not (has_spec and has_ddtree)
    check(missing, "vllm:spec_decode_* or vllm:ddtree_* series missing")
    msg = f"{GEN_TOKENS} moved {gen:g}, less than the {client} completion tokens"
    check(client > gen + 0.5, msg + " the clients were sent")
    if not has_spec:
        return ep
    tb = tree_budget or math.inf
    check(expect_ddtree and drafts <= 0 and len(ss) > 1, f"{DRAFTS} did not move")
    check(acc > dtok + 0.5, f"accepted {acc:g} > draft tokens {dtok:g}")
    check(dtok < drafts - 0.5, f"draft tokens {dtok:g} < drafts {drafts:g}")
    msg = f"draft tokens {dtok:g} > drafts {drafts:g} x tree_budget {tree_budget}"
    check(dtok > drafts * tb + 0.5, msg)
    check((budget or 0) > tb, f"{BUDGET} reached {budget:g} > tree_budget {tb:g}")
    msg = f"accepted {acc:g} > drafts {drafts:g} x depth {depth}"
    check(bool(depth) and acc > drafts * (depth or 0) + 0.5, msg)
    if per_pos:
        msg = f"position 0 count {per_pos[0]:g} > drafts {drafts:g}"
        check(per_pos[0] > drafts + 0.5, msg)
        rise = any(y > x + 0.5 for x, y in itertools.pairwise(per_pos))
        check(rise, f"per-position accepted counts rise: {per_pos}")
        msg = f"per-position counts sum to {sum(per_pos):g}, accepted is {acc:g}"
        check(abs(sum(per_pos) - acc) > 0.5, msg)
    if not has_ddtree:
        return ep
    ep["emitted_tokens"] = al_sum
    msg = f"{AL_COUNT} moved {al_count:g}, drafts {drafts:g}"
    check(abs(al_count - drafts) > 0.5, msg)
    msg = f"emitted tokens ({AL_SUM}) {al_sum:g} != accepted {acc:g} + drafts"
    check(abs(al_sum - acc - drafts) > 0.5, msg)
    buckets = list(_labelled(delta, f"{AL}_bucket", "le").values())
    falls = any(y < x - 0.5 for x, y in itertools.pairwise(buckets))
    check(falls, f"{AL} buckets not cumulative")
    inf = buckets[-1] if buckets else al_count
    check(abs(inf - al_count) > 0.5, f"{AL} +Inf bucket {inf:g} != count {al_count:g}")
    depths = _labelled(delta, PER_DEPTH, "depth")
    for k, v in enumerate(per_pos):
        n = depths.get(k + 1, 0.0)
        msg = f"depth {k + 1} count {n:g} != position {k} count {v:g}"
        check(abs(n - v) > 0.5, msg)
    return ep


class Soak:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.ep = Endpoint(a.base_url)
        self.ref = Endpoint(a.reference_url) if a.reference_url else None
        self.server = LaunchedServer(a) if a.launch else None
        self.t0 = time.monotonic()
        self.epoch, self.epoch_start = 0, {0: 0.0}
        self.windows: list[list] = []  # [start, end] of each restart
        self.restarts: list[dict] = []
        self.up = asyncio.Event()  # cleared while the server restarts
        self.up.set()
        self.stop_load, self.stop_monitors = asyncio.Event(), asyncio.Event()
        self.outcomes: list[Plan] = []
        self.issued = self.in_flight = 0
        self.health: list[tuple[float, float, int]] = []  # (sent, answered, status)
        self.rss: list[tuple[float, int, float]] = []  # (t, epoch, MiB)
        self.gpu: list[tuple[float, int, dict[str, float]]] = []
        self.gpu_reason = ""
        self.gpu_on = True
        self.scrapes: list[tuple[float, int, dict[str, float]]] = []
        self.cumulative: set[str] = set()
        self.scrape_lock = asyncio.Lock()
        self.load_end = 0.0
        self.warmup = a.warmup if a.warmup is not None else 0.2 * a.duration

    def clock(self) -> float:
        return time.monotonic() - self.t0

    def in_window(self, t0: float, t1: float) -> bool:
        g = self.a.fault_grace
        return any(
            t0 <= (math.inf if w1 is None else w1 + g) and t1 >= w0
            for w0, w1 in self.windows
        )

    @property
    def server_pid(self) -> int | None:
        return self.server.proc.pid if self.server else self.a.server_pid

    async def discover(self) -> Context:
        card = (await self.ep.json("GET", "/v1/models"))["data"][0]
        model, max_len = card["id"], int(card["max_model_len"])
        comp, chat, long_tokens, stop_ids = [], [], [], set()

        async def tokenize(**kw) -> dict:
            return await self.ep.json("POST", "/tokenize", {"model": model, **kw})

        for text in load_prompts(self.a.prompts)[:NUM_PROMPTS]:
            t = await tokenize(prompt=text)
            if t["count"] <= max_len - 16:  # room for 16 new tokens
                comp.append((text, t["count"]))
                long_tokens += t["tokens"]
            c = await tokenize(messages=[{"role": "user", "content": text}])
            if c["count"] <= max_len - 16:
                chat.append((text, c["count"]))
        if not comp or not chat:
            raise RuntimeError(f"no prompt leaves 16 tokens of max_model_len={max_len}")
        for s in STOP_TEXTS:
            stop_ids.update((await tokenize(prompt=s))["tokens"][-1:])
        return Context(model, max_len, comp, chat, long_tokens, sorted(stop_ids))

    async def bad_input_phase(self, ctx: Context) -> list[dict]:
        rows = []
        for k, case in enumerate(bad_cases(ctx)):
            out = _bad_plan(-1 - k, case)
            await run_plan(self.ep, out, self.a.timeout, self.clock)
            health, _ = await self.ep.call("GET", "/health", timeout=HEALTH_TIMEOUT)
            keys = ("name", "api", "http", "error_kind")
            rows.append(
                {k: getattr(out, k) for k in keys}
                | {"outcome": out.status, "message": out.error, "health_after": health}
                | {"ok": out.status == "rejected" and health == 200}
            )
        return rows

    async def client(self, ctx: Context) -> None:
        while not self.stop_load.is_set():
            if not self.up.is_set():  # the server restarts
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.up.wait(), 0.5)
                continue
            i, self.issued = self.issued, self.issued + 1
            req = make_plan(i, self.a.seed, ctx, self.a)
            req.epoch, self.in_flight = self.epoch, self.in_flight + 1
            self.outcomes.append(
                await run_plan(self.ep, req, self.a.timeout, self.clock)
            )
            self.in_flight -= 1
            if req.status == "connection_error" and not self.up.is_set():
                await asyncio.sleep(0.05)

    async def load_timer(self) -> None:
        a = self.a
        while self.clock() < a.max_duration and (
            self.clock() < a.duration or self.issued < a.requests
        ):
            await asyncio.sleep(0.05)
        self.stop_load.set()

    async def every(self, interval: float, sample) -> None:
        """``sample()`` every ``interval`` s until the monitors stop."""
        while not self.stop_monitors.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stop_monitors.wait(), interval)
            await sample()

    async def poll_health(self) -> None:
        t = self.clock()
        status, _ = await self.ep.call("GET", "/health", timeout=HEALTH_TIMEOUT)
        self.health.append((t, self.clock(), status))

    async def scrape(self) -> dict[str, float] | None:
        # One at a time, in the server's order; the lifetime is the one asked
        # (an old server's last answer can come after the restart has begun).
        async with self.scrape_lock:
            t, epoch = self.clock(), self.epoch
            status, body = await self.ep.call("GET", "/metrics", timeout=15)
            try:
                s, cumulative = parse_metrics(body.decode("utf-8", "replace"))
            except ValueError:
                status = 0
            if status != 200:
                return None
            self.cumulative |= cumulative
            self.scrapes.append((t, epoch, s))
            return s

    async def scrape_if_up(self) -> None:
        if self.up.is_set():
            await self.scrape()

    async def sample_memory(self) -> None:
        t, epoch, pid = self.clock(), self.epoch, self.server_pid
        if pid is not None:
            rss = await asyncio.to_thread(process_tree, pid)
            if rss is not None:
                self.rss.append((t, epoch, rss))
        if self.gpu_on:
            query = (self.a.nvidia_smi, "--query-gpu=index,memory.used")
            rows, why = await asyncio.to_thread(nvidia_smi, *query)
            if rows:
                self.gpu.append((t, epoch, dict(rows)))
            else:
                why = why or f"{self.a.nvidia_smi} printed no memory.used"
                self.gpu_on, self.gpu_reason = not why.endswith("not found"), why

    async def progress(self) -> None:
        c = dict(sorted(Counter(o.status for o in self.outcomes).items()))
        log(
            f"{self.clock():6.0f}s issued {self.issued} in flight {self.in_flight}: {c}"
        )

    async def restarter(self) -> None:
        await asyncio.sleep(max(0.0, self.a.restart_at - self.clock()))
        if self.stop_load.is_set():
            return
        await self.scrape()  # the last of this lifetime
        t_stop = self.clock()
        self.windows.append([t_stop, None])
        self.up.clear()
        log(f"restart: stopping the server (pid {self.server_pid})")
        await self.server.stop()
        self.epoch += 1
        self.server.start()
        err = await self.server.wait_ready(self.ep)
        t_up = self.windows[-1][1] = self.epoch_start[self.epoch] = self.clock()
        self.restarts.append(
            {"t_stop": round(t_stop, 2), "t_up": round(t_up, 2), "error": err}
        )
        if err:
            log(f"restart failed: {err}")
            self.stop_load.set()
        else:
            log(f"restart: up again after {t_up - t_stop:.1f}s")
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

    async def compare_reference(self) -> dict:
        a = self.a
        done = [o for o in self.outcomes if o.status == "completed" and o.greedy]
        todo = [o for o in done if not o.in_fault]
        res: dict = {"compared": 0, "identical": 0, "eligible": len(todo)}
        near, bad, errors = [], [], []
        try:
            ref_model = (await self.ref.json("GET", "/v1/models"))["data"][0]["id"]
        except (RuntimeError, KeyError, IndexError, ValueError) as e:
            errors.append({"error": f"/v1/models: {e}"[:200]})
            todo = []
        sem = asyncio.Semaphore(REFERENCE_CONCURRENCY)
        deadline = time.monotonic() + a.reference_max_s

        async def one(o: Plan) -> None:
            skip = ("stream", "stream_options", "prompt_logprobs")
            body = {k: v for k, v in o.body.items() if k not in skip}
            key = "top_logprobs" if o.api == "chat" else "logprobs"
            body |= {"model": ref_model, key: max(2, body.get(key) or 0)}
            if o.api == "chat":
                body["logprobs"] = True
            async with sem:
                left = deadline - time.monotonic()
                if left <= 0:
                    return errors.append({"id": o.id, "error": "no time left"})
                status, data = await self.ref.call(
                    "POST", o.path, body, min(a.timeout, left)
                )
            try:
                c = json.loads(data)["choices"][0] if status == 200 else None
            except (ValueError, KeyError, IndexError, TypeError):
                c = None
            if c is None:
                return errors.append(
                    {"id": o.id, "http": status, "error": error_message(data)[:200]}
                )
            ref_text, (tokens, gaps) = choice_text(o.api, c), choice_logprobs(o.api, c)
            res["compared"] += 1
            diffs = [text for _, text in sorted(o.texts.items()) if text != ref_text]
            if not diffs:
                res["identical"] += 1
                return
            char = first_difference(diffs[0], ref_text) or 0
            gap = divergence_gap(char, tokens, gaps)
            drop = ("model", "prompt", "messages", "stream_options")
            row = {k: getattr(o, k) for k in ("id", "api", "stream", "name")} | {
                "first_diff_char": char,
                "first_diff_token": token_index(tokens, char),
                "ref_top2_gap": gap,
                "sampling": {k: v for k, v in o.body.items() if k not in drop},
                "ours": diffs[0][max(0, char - 20) : char + 20],
                "ref": ref_text[max(0, char - 20) : char + 20],
            }
            tie = a.float32 and gap is not None and gap < NEAR_TIE_NATS
            (near if tie else bad).append(row)

        await asyncio.gather(*(one(o) for o in todo))
        # The counts cover every output; the rows kept are the first 50 by id.
        return res | {
            "ok": not bad and not errors,
            "num_mismatches": len(bad),
            "num_near_ties": len(near),
            "mismatches": sorted(bad, key=lambda r: r["id"])[:50],
            "near_ties": sorted(near, key=lambda r: r["id"])[:50],
            "reference_errors": errors,
        }

    async def run(self) -> dict:
        a = self.a
        report: dict = {
            "tool": "bench.serving.soak",
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "base_url": self.ep.base_url,
            "reference_url": self.ref.base_url if self.ref else None,
            "args": vars(a),
        }
        try:
            if self.server is not None:
                self.server.start()
                log(f"launched the server (pid {self.server_pid}), log {a.server_log}")
                if err := await self.server.wait_ready(self.ep):
                    return report | {"ok": False, "fatal": err}
            try:
                ctx = await self.discover()
            except (RuntimeError, KeyError, IndexError, ValueError) as e:
                return report | {"ok": False, "fatal": f"discovery: {e}"}
            return report | await self._run(ctx)
        finally:
            if self.server is not None:
                await self.server.stop()
            for ep in filter(None, (self.ep, self.ref)):
                await ep.client.aclose()

    async def _run(self, ctx: Context) -> dict:
        a = self.a
        log(f"model {ctx.model}, max_model_len {ctx.max_model_len}; bad inputs")
        bad_rows = await self.bad_input_phase(ctx)
        log(f"bad inputs: {sum(r['ok'] for r in bad_rows)}/{len(bad_rows)} ok; load")
        self.t0 = time.monotonic()
        await self.scrape()
        monitors = [
            asyncio.create_task(self.every(interval, sample))
            for sample, interval in (
                (self.poll_health, a.health_interval),
                (self.scrape_if_up, a.metrics_interval),
                (self.sample_memory, a.memory_interval),
                (self.progress, a.progress_interval),
            )
        ]
        restart = asyncio.create_task(self.restarter()) if a.restart_at else None
        clients = [asyncio.create_task(self.client(ctx)) for _ in range(a.concurrency)]
        await self.load_timer()
        await asyncio.gather(*clients)
        if restart is not None:
            if not self.windows:  # not begun; once begun it runs to its end
                restart.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await restart  # bounded by --stop-grace and --start-timeout
        self.load_end = self.clock()
        log(f"load done after {self.load_end:.0f}s, {self.issued} requests; drain")
        drained = await self.drain()
        prompt = ctx.completion_prompts[0][0]
        body = {"model": ctx.model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
        probe = Plan(-10_000, "load", "probe", "completion", body)
        probe = await run_plan(self.ep, probe, a.timeout, self.clock)
        final_health, _ = await self.ep.call("GET", "/health", timeout=HEALTH_TIMEOUT)
        await self.scrape()
        self.stop_monitors.set()
        await asyncio.gather(*monitors)
        for o in self.outcomes:
            o.in_fault = self.in_window(o.t_start, o.t_end)
        greedy = None
        if self.ref is not None:
            log("comparing greedy outputs with the reference server")
            greedy = await self.compare_reference()
        final = drained, probe.status, final_health
        n = {"completion": len(ctx.completion_prompts), "chat": len(ctx.chat_prompts)}
        keys = ("model", "max_model_len", "stop_token_ids")
        report = {k: getattr(ctx, k) for k in keys} | {"prompts": n}
        return report | self.evaluate(bad_rows, final, greedy)

    def memory(self, samples, tol: float, name) -> dict:
        """flatness() of each series of ``samples`` (t, epoch, {key: MiB}),
        named ``name(key, epoch)``, without the samples inside a restart's
        window (a server stopping or starting is not the steady state)."""
        series = defaultdict(list)
        for t, e, mem in samples:
            for key, v in mem.items() if not self.in_window(t, t) else ():
                series[key, e].append((t, v))
        return {
            name(key, e): flatness(v, self.epoch_start.get(e, 0.0), self.warmup, tol)
            for (key, e), v in sorted(series.items())
        }

    def evaluate(self, bad_rows: list[dict], final: tuple, greedy: dict | None) -> dict:
        a, outs = self.a, self.outcomes
        failing = [o for o in outs if o.failing]
        crit: dict[str, dict] = {}
        for cat, name in (("load", "requests"), ("refuse", "refusals")):
            n = sum(o.category == cat for o in outs)
            bad = Counter(o.status for o in failing if o.category == cat)
            more = f"; failing: {dict(bad)}" if bad else ""
            crit[name] = _crit(not bad, f"{n - bad.total()}/{n} clean{more}")
        if not any(o.category == "refuse" for o in outs):
            crit["refusals"] = _crit(False, "no refused kind was sent")
        phase_bad = [r["name"] for r in bad_rows if not r["ok"]]
        detail = f"{len(phase_bad)}/{len(bad_rows)} failed ({', '.join(phase_bad[:8])})"
        crit["bad_input"] = _crit(not phase_bad, detail if phase_bad else "all 4xx")
        ok = self.issued >= a.requests and self.load_end >= a.duration
        detail = f"{self.issued} requests in {self.load_end:.0f}s"
        crit["load"] = _crit(ok, detail + f" (asked: {a.requests} in {a.duration:g}s)")
        bad_h = [
            (t, s) for t, t1, s in self.health if s != 200 and not self.in_window(t, t1)
        ]
        detail = f"{len(self.health)} polls, {len(bad_h)} not 200 outside fault windows"
        first = f" (first at {bad_h[0][0]:.1f}s: {bad_h[0][1]})" if bad_h else ""
        crit["health"] = _crit(bool(self.health) and not bad_h, detail + first)
        drained, probe, last = final
        detail = f"drained {drained}, short request {probe}, /health {last}"
        crit["final"] = _crit(drained and probe == "completed" and last == 200, detail)
        rss = [(t, e, {"rss": v}) for t, e, v in self.rss]
        rss = self.memory(rss, a.rss_growth_mib, lambda _, e: str(e))
        gpu_name = lambda k, e: f"gpu{k}/epoch{e}"
        gpu = self.memory(self.gpu, a.gpu_growth_mib, gpu_name)
        why = "no server pid (--launch, --server-pid)"
        why = "no RSS sample" if self.server_pid else why
        crit["server_rss"] = _memory_criterion(rss, f"skipped: {why}")
        why = self.gpu_reason or "no sample"
        crit["gpu_memory"] = _memory_criterion(gpu, f"skipped: {why}")
        tokens = self.client_tokens()
        metrics = check_metrics(
            self.scrapes, self.cumulative, True, tokens, a.tree_budget
        )
        problems = metrics["problems"]
        detail = problems and f"{metrics['n_problems']} problems, first: {problems[0]}"
        crit["metrics"] = _crit(metrics["ok"], detail or "consistent")
        preempt = sum(ep["preemptions"] for ep in metrics["epochs"])
        ok = preempt > 0 if a.expect_preemption else None
        more = "" if ok is not None else " (not required)"
        crit["preemption"] = _crit(ok, f"{preempt:g} preemptions{more}")
        crit["greedy_reference"] = _crit(None, "skipped: no --reference-url")
        if g := greedy:
            detail = f"{g['identical']}/{g['compared']} identical, {g['num_near_ties']}"
            detail += f" near-ties, {g['num_mismatches']} mismatches,"
            detail += f" {len(g['reference_errors'])} not compared"
            crit["greedy_reference"] = _crit(g["ok"], detail)

        by_kind: dict = defaultdict(Counter)
        fault: Counter = Counter()
        for o in outs:
            by_kind[f"{o.category}:{o.name}"][o.status] += 1
            kind = f"{o.status}:{o.error_kind}" if o.error_kind else o.status
            fault[kind] += o.in_fault
        return {
            "ok": all(c["ok"] is not False for c in crit.values()),
            "criteria": crit,
            "requests": {
                "issued": self.issued,
                "load_s": round(self.load_end, 2),
                "by_outcome": dict(Counter(o.status for o in outs)),
                "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
                "errors_by_kind": dict(
                    Counter(o.error_kind for o in outs if o.error_kind)
                ),
                "in_fault_window": sum(o.in_fault for o in outs),
                "in_fault_window_by_outcome": {k: v for k, v in fault.items() if v},
                "failing": [o.brief() for o in failing[:50]],
                "n_failing": len(failing),
            },
            "health": {
                "polls": len(self.health),
                "by_status": dict(Counter(str(s) for _, _, s in self.health)),
                "interval_s": a.health_interval,
            },
            "memory": {
                "warmup_s": self.warmup,
                "rss": {"pid": self.server_pid, "epochs": rss},
                "gpu": {"series": gpu, "unavailable": self.gpu_reason or None},
            },
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

    def client_tokens(self) -> dict[int, int]:
        """Per server lifetime: the completion tokens of the requests that
        started after its first scrape and ended before its last, which its
        counters cover."""
        span: dict[int, list[float]] = {}
        for t, e, _ in self.scrapes:
            span.setdefault(e, [t, t])[1] = t
        tokens: dict[int, int] = defaultdict(int)
        for o in self.outcomes:
            t_first, t_last = span.get(o.epoch, (math.inf, -math.inf))
            if o.status == "completed" and t_first <= o.t_start and o.t_end <= t_last:
                tokens[o.epoch] += o.completion_tokens or 0
        return tokens


def _crit(ok: bool | None, detail: str) -> dict:
    return {"ok": ok, "detail": detail}


def _memory_criterion(series: dict, skipped: str) -> dict:
    judged = {k: v for k, v in series.items() if v["ok"] is not None}
    if not judged:
        return _crit(
            None, "skipped: fewer than 3 samples after warm-up" if series else skipped
        )
    worst = max(judged, key=lambda k: judged[k]["growth_mib"])
    w = judged[worst]
    detail = f"largest growth after warm-up {w['growth_mib']:g} MiB "
    detail += f"({w['slope_mib_per_min']:g} MiB/min, {worst}), "
    detail += f"tolerance {w['tolerance_mib']:g} MiB"
    return _crit(all(v["ok"] for v in judged.values()), detail)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[1],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    types = {"--server-pid": int, "--tree-budget": int, "--warmup": float}
    add_options(ap, {
        "--base-url": ("http://127.0.0.1:8000", None),
        "--launch": (None, "start this server command, stop it at the end"),
        "--after-start": (None, "run after each start of --launch; must exit 0"),
        "--server-log": ("/tmp/soak-server.log", None),
        "--start-timeout": (900.0, None),
        "--stop-grace": (30.0, "seconds between SIGTERM and SIGKILL"),
        "--restart-at": (0.0, "with --launch: restart the server at this second"),
        "--fault-grace": (5.0, "seconds after a restart still in its fault window"),
        "--server-pid": (None, "whose RSS (and descendants') is sampled, no "
            "--launch"),
        "--tree-budget": (None, "the server's: bounds the draft tokens per draft"),
        "--duration": (600.0, "seconds, at least"),
        "--requests": (2000, "requests, at least"),
        "--max-duration": (1800.0, "the load stops here whatever was sent"),
        "--concurrency": (96, None),
        "--prompts": (None, "JSONL with a 'prompt' field"),
        "--seed": (0, None),
        "--max-tokens-max": (1024, None),
        "--refuse-fraction": (0.05, "every round(1 / F)-th request asks for a "
            "refusal, the kinds in turn"),
        "--timeout": (300.0, "client-side limit per request (past it: hang)"),
        "--health-interval": (2.0, None),
        "--metrics-interval": (10.0, None),
        "--memory-interval": (5.0, None),
        "--progress-interval": (15.0, None),
        "--warmup": (None, "s per server lifetime, memory not judged (20%% of "
            "--duration)"),
        "--rss-growth-mib": (256.0, None),
        "--gpu-growth-mib": (128.0, None),
        "--nvidia-smi": ("nvidia-smi", None),
        "--drain-timeout": (120.0, None),
        "--reference-url": (None, "no-spec server, --logprobs-mode "
            "processed_logprobs"),
        "--reference-max-s": (1200.0, None),
        "--pair": (None, "name in the output file (default: the model's)"),
        "--out": (None, "default: bench/results/<date>-soak-<pair>.json"),
        "--expect-preemption": (False, "fail unless vllm:num_preemptions moved"),
        "--float32": (False, "near-ties are not failures"),
    }, types)  # fmt: skip
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.restart_at and not a.launch:
        raise SystemExit("soak: --restart-at needs --launch")
    result = asyncio.run(Soak(a).run())
    model = os.path.basename(str(result.get("model") or "server"))
    pair = a.pair or re.sub(r"[^A-Za-z0-9_.-]+", "_", model)
    name = f"{datetime.date.today():%Y-%m-%d}-soak-{pair}.json"
    out = a.out or os.path.join(REPO, "bench", "results", name)
    write_json(out, result)
    crit = result.get("criteria", {})
    for name, c in crit.items():
        print(f"{MARK[c['ok']]}  {name:16s} {c['detail']}")
    summary = {"ok": result["ok"], "out": out}
    summary["criteria"] = {k: c["ok"] for k, c in crit.items()}
    summary["by_outcome"] = result.get("requests", {}).get("by_outcome")
    if "fatal" in result:
        print(f"FAIL  {result['fatal']}")
        summary["fatal"] = result["fatal"]
    emit("RESULT", summary)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
