#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Load client for a running ``vllm serve``: concurrent streaming completions
and chat completions, random client disconnects, exactness against a
reference run, and the deltas of the spec-decode / DDTree Prometheus series.

Starts nothing itself; talks only to a loopback server (127.0.0.1, ::1,
localhost). Typical use (bench/serve_e2e.sh does both steps):

    # 1. reference outputs from a server without speculation
    python3 bench/serve_load.py --base-url http://127.0.0.1:8000 \\
        --prompts P.jsonl --disconnect-fraction 0 --save ref.json
    # 2. the same requests against a DDTree server, 25% of them cut mid-stream
    python3 bench/serve_load.py --base-url http://127.0.0.1:8000 \\
        --prompts P.jsonl --reference ref.json --expect-ddtree

Every request is greedy (temperature 0). Request i is a chat completion or a
plain completion as drawn from ``--seed`` alone, so two runs with the same
seed send the same requests whatever ``--disconnect-fraction`` is; a
disconnecting request closes its stream after a random number of chunks.
Completed outputs are compared with the reference's output for the same key.

Prints one ``RESULT {json}`` line and exits 0 when every request completed or
was cancelled by us, no request failed or timed out, every compared output
equals the reference (or, without ``--exact``, first differs from it at a
token where the reference's top-2 logprobs are within ``--tie-tolerance``:
float32 greedy output follows the batch shape there, as stock chain
speculation's does; the reference run records those gaps), the server still
answers /health and a final short request, it drains
(``vllm:num_requests_running`` and ``_waiting`` back to 0: the cut requests
were aborted and freed), and (with ``--expect-ddtree``) the DDTree counters
moved.

Needs aiohttp (a vLLM dependency; also on the GPU host).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from dataclasses import asdict, dataclass
from urllib.parse import urlparse

LOOPBACK_HOSTS = {"127.0.0.1", "::1", "localhost"}
METRIC_PREFIXES = ("vllm:spec_decode", "vllm:ddtree")
# Per-engine labels summed away in the deltas.
DROP_LABELS = {"model_name", "engine"}

_SAMPLE_RE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)"
)
_LABEL_RE = re.compile(r'(?P<key>[a-zA-Z_][a-zA-Z0-9_]*)="(?P<val>(?:[^"\\]|\\.)*)"')


# ------------------------------------------------------------------ metrics
def parse_prometheus(text: str, prefixes=METRIC_PREFIXES) -> dict[str, float]:
    """Samples of the Prometheus text format whose name starts with one of
    ``prefixes``, keyed ``name{label="v",...}`` without the per-engine labels
    (summed over engines). ``_created`` samples are skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line)
        if m is None:
            continue
        name = m.group("name")
        if not name.startswith(tuple(prefixes)) or name.endswith("_created"):
            continue
        labels = [
            (lm.group("key"), lm.group("val"))
            for lm in _LABEL_RE.finditer(m.group("labels") or "")
            if lm.group("key") not in DROP_LABELS
        ]
        key = name
        if labels:
            key += "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels)) + "}"
        try:
            value = float(m.group("value"))
        except ValueError:
            continue
        out[key] = out.get(key, 0.0) + value
    return out


def _is_gauge(key: str) -> bool:
    name = key.split("{", 1)[0]
    return name in ("vllm:ddtree_tree_budget", "vllm:ddtree_draft_depth")


def metrics_delta(before: dict[str, float], after: dict[str, float]) -> dict:
    """Counter/histogram deltas (after - before) and gauges' last values."""
    deltas: dict[str, float] = {}
    gauges: dict[str, float] = {}
    for key in sorted(set(before) | set(after)):
        if _is_gauge(key):
            if key in after:
                gauges[key] = after[key]
            continue
        d = after.get(key, 0.0) - before.get(key, 0.0)
        if d:
            deltas[key] = d
    drafts = deltas.get("vllm:spec_decode_num_drafts_total", 0.0)
    accepted = deltas.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)
    tau = 1.0 + accepted / drafts if drafts else None
    per_depth = {}
    for key, d in deltas.items():
        m = re.match(
            r'vllm:spec_decode_num_accepted_tokens_per_pos_total\{position="(\d+)"\}',
            key,
        )
        if m and drafts:
            per_depth[int(m.group(1)) + 1] = round(d / drafts, 4)
    ddtree_moved = any(
        k.startswith("vllm:ddtree_") and v > 0 for k, v in deltas.items()
    )
    return {
        "deltas": deltas,
        "gauges": gauges,
        "tau": tau,
        "per_depth_acceptance": dict(sorted(per_depth.items())),
        "spec_decode_moved": drafts > 0,
        "ddtree_moved": ddtree_moved,
    }


# ----------------------------------------------------------------- requests
@dataclass
class Outcome:
    key: str
    kind: str
    status: str = "pending"  # completed | cancelled | error | timeout
    text: str = ""
    chunks: int = 0
    finish_reason: str | None = None
    disconnect_after: int | None = None
    error: str | None = None
    latency_s: float = 0.0
    # With --save (reference run): each token's text and its top-1 minus
    # top-2 logprob, to tell a near-tie divergence from a real one later.
    tokens: list[str] | None = None
    gaps: list[float] | None = None


@dataclass
class Plan:
    key: str
    kind: str  # "completion" | "chat"
    prompt: str
    disconnect_after: int | None = None


def make_plans(
    prompts: list[str],
    n: int,
    chat_fraction: float,
    disconnect_fraction: float,
    max_chunks_before_disconnect: int,
    seed: int,
) -> list[Plan]:
    kinds = random.Random(seed)
    cuts = random.Random(seed + 1)
    plans = []
    for i in range(n):
        p = i % len(prompts)
        kind = "chat" if kinds.random() < chat_fraction else "completion"
        cut = None
        if cuts.random() < disconnect_fraction:
            cut = cuts.randint(1, max_chunks_before_disconnect)
        plans.append(Plan(f"{kind}:{p}", kind, prompts[p], cut))
    return plans


def chunk_text(kind: str, payload: dict) -> tuple[str, str | None]:
    choices = payload.get("choices") or []
    if not choices:
        return "", None
    c = choices[0]
    if kind == "chat":
        text = (c.get("delta") or {}).get("content") or ""
    else:
        text = c.get("text") or ""
    return text, c.get("finish_reason")


def _top2_gap(logprobs: list[float]) -> float:
    vals = sorted(logprobs, reverse=True)
    return vals[0] - vals[1] if len(vals) > 1 else float("inf")


def chunk_logprobs(kind: str, payload: dict) -> list[tuple[str, float]]:
    """(token text, top-1 minus top-2 logprob) of each token in a chunk."""
    choices = payload.get("choices") or []
    lp = (choices[0].get("logprobs") if choices else None) or {}
    if kind == "chat":
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
    first differs from ``ref_text`` (None when that token is unknown).

    When the first differing character starts a reference token, the outputs
    may have parted one token earlier: ours may have taken a longer or shorter
    token there that spells the same characters up to this point (the
    reference's ``"(t"`` + ``")"`` against our ``"(typ"``). Our split is not
    known, so the smaller gap of the two tokens is the one that counts.
    """
    i = next(
        (k for k, (a, b) in enumerate(zip(text, ref_text)) if a != b),
        min(len(text), len(ref_text)),
    )
    pos = 0
    prev_gap = None
    for tok, gap in zip(ref_tokens, ref_gaps):
        start = pos
        pos += len(tok)
        if pos > i:
            if start == i and prev_gap is not None:
                return min(gap, prev_gap)
            return gap
        prev_gap = gap
    return None


async def one_request(
    session,
    base_url: str,
    model: str,
    plan: Plan,
    max_tokens: int,
    timeout_s: float,
    logprobs: bool = False,
) -> Outcome:
    out = Outcome(plan.key, plan.kind, disconnect_after=plan.disconnect_after)
    if plan.kind == "chat":
        url = f"{base_url}/v1/chat/completions"
        body = {"model": model, "messages": [{"role": "user", "content": plan.prompt}]}
    else:
        url = f"{base_url}/v1/completions"
        body = {"model": model, "prompt": plan.prompt}
    body.update(stream=True, temperature=0.0, max_tokens=max_tokens)
    if logprobs:
        out.tokens, out.gaps = [], []
        if plan.kind == "chat":
            body.update(logprobs=True, top_logprobs=2)
        else:
            body.update(logprobs=2)
    t0 = time.monotonic()

    async def run() -> None:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                out.status = "error"
                out.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return
            buf = b""
            async for raw in resp.content.iter_any():
                buf += raw
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        out.status = "completed"
                        return
                    payload = json.loads(data)
                    if "error" in payload:
                        out.status = "error"
                        out.error = json.dumps(payload["error"])[:300]
                        return
                    text, finish = chunk_text(plan.kind, payload)
                    if logprobs:
                        for tok, gap in chunk_logprobs(plan.kind, payload):
                            out.tokens.append(tok)
                            out.gaps.append(gap)
                    out.text += text
                    out.chunks += 1
                    if finish:
                        out.finish_reason = finish
                    if (
                        plan.disconnect_after is not None
                        and out.chunks >= plan.disconnect_after
                    ):
                        # Drop the connection mid-stream: the server must
                        # abort the request and free its resources.
                        resp.close()
                        out.status = "cancelled"
                        return
            out.status = "error"
            out.error = "stream ended without [DONE]"

    try:
        await asyncio.wait_for(run(), timeout_s)
    except asyncio.TimeoutError:
        out.status = "timeout"
    except Exception as e:  # connection refused/reset, bad JSON, ...
        out.status = "error"
        out.error = f"{type(e).__name__}: {e}"[:300]
    out.latency_s = round(time.monotonic() - t0, 3)
    return out


# ------------------------------------------------------------------- driver
def check_loopback(base_url: str, tool: str = "serve_load") -> str:
    u = urlparse(base_url)
    if u.scheme != "http" or u.hostname not in LOOPBACK_HOSTS:
        raise SystemExit(
            f"{tool}: only loopback http servers are allowed, got {base_url!r}"
        )
    return base_url.rstrip("/")


def load_prompts(path: str | None) -> list[str]:
    if not path:
        return [f"def function_{i}(x):\n    " for i in range(16)]
    prompts = []
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                prompts.append(row["prompt"] if isinstance(row, dict) else str(row))
    if not prompts:
        raise SystemExit(f"serve_load: no prompts in {path}")
    return prompts


async def _get(session, url: str, timeout_s: float = 10.0) -> tuple[int, str]:
    import aiohttp

    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
        return r.status, await r.text()


async def scrape(session, base_url: str) -> dict[str, float]:
    try:
        status, text = await _get(session, f"{base_url}/metrics")
    except Exception:
        return {}
    return (
        parse_prometheus(text, METRIC_PREFIXES + ("vllm:num_requests",))
        if status == 200
        else {}
    )


async def wait_drained(session, base_url: str, timeout_s: float) -> bool:
    """True once the server reports no running or waiting request."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = await scrape(session, base_url)
        running = m.get("vllm:num_requests_running")
        waiting = m.get("vllm:num_requests_waiting", 0.0)
        if running is not None and running == 0 and waiting == 0:
            return True
        if running is None and not m:
            return False
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.25)


async def run(args: argparse.Namespace) -> dict:
    base_url = check_loopback(args.base_url)
    import aiohttp

    prompts = load_prompts(args.prompts)
    plans = make_plans(
        prompts,
        args.n,
        args.chat_fraction,
        args.disconnect_fraction,
        args.max_chunks_before_disconnect,
        args.seed,
    )
    reference = None
    ref_logprobs: dict = {}
    if args.reference:
        with open(args.reference) as f:
            ref_json = json.load(f)
        reference = ref_json.get("outputs", {})
        ref_logprobs = ref_json.get("logprobs", {})

    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        model = args.model
        if model is None:
            try:
                _, text = await _get(session, f"{base_url}/v1/models")
                model = json.loads(text)["data"][0]["id"]
            except Exception as e:
                return {
                    "ok": False,
                    "n": len(plans),
                    "health": 0,
                    "first_errors": [
                        f"{base_url}/v1/models: {type(e).__name__}: {e}"[:300]
                    ],
                }
        before = await scrape(session, base_url)
        sem = asyncio.Semaphore(args.concurrency)

        async def limited(plan: Plan) -> Outcome:
            async with sem:
                return await one_request(
                    session,
                    base_url,
                    model,
                    plan,
                    args.max_tokens,
                    args.timeout,
                    logprobs=bool(args.save),
                )

        t0 = time.monotonic()
        outcomes = await asyncio.gather(*(limited(p) for p in plans))
        elapsed = time.monotonic() - t0
        # One short request that finishes normally: the server still serves,
        # and its last step publishes fresh scheduler gauges (an abort alone
        # sends no stats, so the gauges could still show the cut requests).
        probe = await one_request(
            session,
            base_url,
            model,
            Plan("probe", "completion", "def f():"),
            2,
            args.timeout,
        )
        drained = await wait_drained(session, base_url, args.drain_timeout)
        after = await scrape(session, base_url)
        try:
            health_status, _ = await _get(session, f"{base_url}/health")
        except Exception:
            health_status = 0

    counts = {
        s: sum(o.status == s for o in outcomes)
        for s in ("completed", "cancelled", "error", "timeout")
    }
    completed = {o.key: o.text for o in outcomes if o.status == "completed"}
    mismatches = []
    near_ties: dict[str, float] = {}
    compared = 0
    if reference is not None:
        for o in outcomes:
            if o.status != "completed" or o.key not in reference:
                continue
            compared += 1
            if o.text == reference[o.key]:
                continue
            # float32 greedy output depends on the batch shape where the
            # reference's top two logprobs are within rounding of each other
            # (stock chain speculation shows the same); such a divergence is
            # reported, any other fails the run.
            tokens, gaps = ref_logprobs.get(o.key, ([], []))
            gap = divergence_gap(o.text, reference[o.key], tokens, gaps)
            if gap is not None and gap < args.tie_tolerance:
                near_ties[o.key] = gap
            else:
                mismatches.append(o.key)
    delta = metrics_delta(
        {k: v for k, v in before.items() if not k.startswith("vllm:num_requests")},
        {k: v for k, v in after.items() if not k.startswith("vllm:num_requests")},
    )
    errors = [asdict(o) for o in outcomes if o.status in ("error", "timeout")][:5]
    ok = (
        counts["error"] == 0
        and counts["timeout"] == 0
        and counts["completed"] + counts["cancelled"] == len(plans)
        and health_status == 200
        and drained
        and probe.status == "completed"
        and not mismatches
        and (not args.exact or not near_ties)
        and (not args.expect_ddtree or delta["ddtree_moved"])
    )
    result = {
        "ok": ok,
        "n": len(plans),
        **counts,
        "chat": sum(p.kind == "chat" for p in plans),
        "planned_disconnects": sum(p.disconnect_after is not None for p in plans),
        "compared": compared,
        "identical": compared - len(mismatches) - len(near_ties),
        "mismatches": len(mismatches),
        "mismatch_keys": mismatches[:10],
        "near_tie_divergences": near_ties,
        "health": health_status,
        "drained": drained,
        "probe": probe.status,
        "elapsed_s": round(elapsed, 2),
        "tau": delta["tau"],
        "per_depth_acceptance": delta["per_depth_acceptance"],
        "ddtree_moved": delta["ddtree_moved"],
        "spec_decode_moved": delta["spec_decode_moved"],
        "gauges": delta["gauges"],
        "metrics_delta": delta["deltas"],
        "first_errors": errors,
    }
    if args.save:
        with open(args.save, "w") as f:
            json.dump(
                {
                    "model": model,
                    "max_tokens": args.max_tokens,
                    "outputs": completed,
                    "logprobs": {
                        o.key: [o.tokens, o.gaps]
                        for o in outcomes
                        if o.status == "completed" and o.tokens is not None
                    },
                },
                f,
                indent=1,
                sort_keys=True,
            )
    return result


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="default: the server's first model")
    ap.add_argument("--prompts", default=None, help="JSONL with a 'prompt' field")
    ap.add_argument("--n", type=int, default=64, help="requests")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--chat-fraction", type=float, default=0.25)
    ap.add_argument("--disconnect-fraction", type=float, default=0.25)
    ap.add_argument("--max-chunks-before-disconnect", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=180.0, help="per request, s")
    ap.add_argument("--drain-timeout", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reference", default=None, help="JSON written by --save")
    ap.add_argument("--save", default=None, help="write completed outputs here")
    ap.add_argument(
        "--tie-tolerance",
        type=float,
        default=1e-3,
        help="a divergence where the reference's top-2 logprobs "
        "are closer than this is a near-tie, not a failure",
    )
    ap.add_argument(
        "--exact", action="store_true", help="fail on near-tie divergences too"
    )
    ap.add_argument(
        "--expect-ddtree",
        action="store_true",
        help="fail unless the vllm:ddtree_* series moved",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = asyncio.run(run(args))
    print("RESULT " + json.dumps(result, sort_keys=True), flush=True)
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
