# SPDX-License-Identifier: Apache-2.0
"""A fake OpenAI-compatible server for tests/bench/test_soak.py, on 127.0.0.1
(http.server in threads; standard library only).

It speaks what bench/serving/soak.py uses: ``/v1/models`` (with ``max_model_len``),
``/tokenize``, ``/v1/completions`` and ``/v1/chat/completions`` (streaming
over chunked transfer encoding, or not; ``n``, logprobs, prompt logprobs,
stop strings and stop token ids), ``/health`` and ``/metrics`` with vLLM's
spec-decode and DDTree series kept consistent with the tokens it generated.
It validates requests and refuses structured outputs and ``bad_words`` as
the DDTree server does. ``FakeConfig`` switches on one misbehaviour at a
time, so that each pass criterion of the soak can be shown to fail.

Tokens are characters (ids = ``min(ord(c), 255)``); greedy output is a
function of the prompt alone, so two fakes agree on it.

    python3 tests/soak_fake.py --port 8123 [--mode good]
"""

from __future__ import annotations

import argparse
import json
import random
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ALPHABET = "abcdefghij ()\n:"
VOCAB = 256
BUDGET, DEPTH = 4, 3
STRUCTURED = (
    "DDTree does not support structured outputs (guided decoding): the grammar "
    "would have to be advanced along every tree branch. Use method='dflash' (or "
    "no speculative decoding) for such requests."
)
BAD_WORDS = (
    "DDTree does not support bad_words (they are matched against the verified "
    "tokens as a chain, not along tree branches); use method='dflash'."
)


@dataclass
class FakeConfig:
    model: str = "fake-model"
    max_model_len: int = 256
    chunk_delay: float = 0.001
    validate: bool = True  # False: answers bad input with 200
    refuse: bool = True  # False: serves structured outputs and bad_words
    fail_at: set[int] = field(default_factory=set)  # generation ordinals -> 500
    # Ordinals answered 200 without choices (vLLM's answer for a request its
    # shutdown aborted): a bad response outside a restart's window.
    no_choices_at: set[int] = field(default_factory=set)
    hang_at: set[int] = field(default_factory=set)  # ordinals that never answer
    hang_s: float = 60.0
    leak_kib: int = 0  # kept per generation request (RSS growth)
    health_fail: tuple[int, int] = (0, 0)  # /health polls [a, b) answer 503
    perturb_greedy: bool = False  # greedy outputs differ at the 4th character
    tie_gap: float = 0.5  # top-1 minus top-2 logprob of every token
    preempt: bool = True
    metrics_backwards: bool = False  # every other scrape halves the counters
    metrics_inconsistent: bool = False  # emitted tokens != accepted + drafts
    stuck_running: bool = False  # num_requests_running never returns to 0
    needs_rpc: bool = False  # 503 until /collective_rpc load_embedded_pair


class BadRequest(Exception):
    def __init__(self, message: str, code: int = 400):
        super().__init__(message)
        self.code = code


class FakeState:
    def __init__(self, cfg: FakeConfig):
        self.cfg = cfg
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.generations = 0
        self.health_polls = 0
        self.scrapes = 0
        self.running = 0
        self.loaded_pair: str | None = None
        self.leak: list[bytes] = []
        self.c = dict(
            drafts=0,
            accepted=0,
            draft_tokens=0,
            generation=0,
            prompt=0,
            preemptions=0,
            al_count=0,
            al_sum=0,
            requests=0,
        )
        self.per_pos = [0] * DEPTH
        self.buckets = [0] * (DEPTH + 1)  # emitted 1 .. DEPTH + 1

    def account(self, prompt_len: int, generated: int) -> None:
        """The spec-decode counters of one sequence: the first token from the
        prefill, the rest in tree steps of 1, 2, 3 tokens."""
        with self.lock:
            c = self.c
            c["requests"] += 1
            c["prompt"] += prompt_len
            c["generation"] += generated
            left, step = generated - 1, 0
            while left > 0:
                e = min(left, 1 + step % 3)
                c["drafts"] += 1
                c["accepted"] += e - 1
                c["draft_tokens"] += BUDGET
                for k in range(e - 1):
                    self.per_pos[k] += 1
                for b in range(e - 1, DEPTH + 1):
                    self.buckets[b] += 1
                c["al_count"] += 1
                c["al_sum"] += e
                left -= e
                step += 1
            if self.cfg.metrics_inconsistent:
                c["al_sum"] += 1
            if self.cfg.preempt and c["requests"] % 3 == 0:
                c["preemptions"] += 1

    def metrics(self) -> str:
        with self.lock:
            self.scrapes += 1
            f = 0.5 if self.cfg.metrics_backwards and self.scrapes % 2 == 0 else 1.0
            c = {k: v * f for k, v in self.c.items()}
            per_pos = [v * f for v in self.per_pos]
            buckets = [v * f for v in self.buckets]
            running = self.running + (1 if self.cfg.stuck_running else 0)
        lab = 'engine="0",model_name="fake"'
        lines = []

        def counter(name: str, value: float, extra: str = "", typed=True) -> None:
            if typed:
                lines.append(f"# TYPE {name} counter")
            labels = lab + (f",{extra}" if extra else "")
            lines.append(f"{name}_total{{{labels}}} {value}")
            if typed:
                lines.append(f"{name}_created{{{labels}}} 1.7e9")

        counter("vllm:spec_decode_num_drafts", c["drafts"])
        counter("vllm:spec_decode_num_accepted_tokens", c["accepted"])
        counter("vllm:spec_decode_num_draft_tokens", c["draft_tokens"])
        lines.append("# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter")
        for k, v in enumerate(per_pos):
            counter(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                v,
                f'position="{k}"',
                typed=False,
            )
        lines.append("# TYPE vllm:ddtree_num_accepted_tokens_per_depth counter")
        for k, v in enumerate(per_pos):
            counter(
                "vllm:ddtree_num_accepted_tokens_per_depth",
                v,
                f'depth="{k + 1}"',
                typed=False,
            )
        lines.append("# TYPE vllm:ddtree_acceptance_length histogram")
        for b, v in enumerate(buckets):
            lines.append(
                f'vllm:ddtree_acceptance_length_bucket{{{lab},le="{b + 1}.0"}} {v}'
            )
        lines.append(
            f'vllm:ddtree_acceptance_length_bucket{{{lab},le="+Inf"}} {c["al_count"]}'
        )
        lines.append(f"vllm:ddtree_acceptance_length_count{{{lab}}} {c['al_count']}")
        lines.append(f"vllm:ddtree_acceptance_length_sum{{{lab}}} {c['al_sum']}")
        lines.append("# TYPE vllm:ddtree_tree_budget gauge")
        lines.append(f"vllm:ddtree_tree_budget{{{lab}}} {float(BUDGET)}")
        lines.append("# TYPE vllm:ddtree_draft_depth gauge")
        lines.append(f"vllm:ddtree_draft_depth{{{lab}}} {float(DEPTH)}")
        counter("vllm:generation_tokens", c["generation"])
        counter("vllm:prompt_tokens", c["prompt"])
        counter("vllm:num_preemptions", c["preemptions"])
        lines.append("# TYPE vllm:num_requests_running gauge")
        lines.append(f"vllm:num_requests_running{{{lab}}} {float(running)}")
        lines.append("# TYPE vllm:num_requests_waiting gauge")
        lines.append(f"vllm:num_requests_waiting{{{lab}}} 0.0")
        lines.append("# TYPE vllm:kv_cache_usage_perc gauge")
        lines.append(f"vllm:kv_cache_usage_perc{{{lab}}} {0.5 * f}")
        return "\n".join(lines) + "\n"


def tokenize(text: str) -> list[int]:
    return [min(ord(ch), VOCAB - 1) for ch in text]


def chat_text(messages: list[dict]) -> str:
    return "".join(f"U: {m['content']}\n" for m in messages) + "A:"


def _num(body: dict, key: str, default, kind=(int, float)):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, kind):
        raise BadRequest(f"1 validation error: {key}: input should be a number")
    return v


def parse_request(cfg: FakeConfig, chat: bool, body: dict) -> dict:
    """The request's prompt tokens and sampling parameters, or BadRequest
    (the checks vLLM makes that the soak's bad inputs hit)."""
    if not isinstance(body, dict):
        raise BadRequest("1 validation error: body: input should be an object")
    if body.get("model", cfg.model) != cfg.model:
        raise BadRequest(f"The model `{body.get('model')}` does not exist.", 404)
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not all(
            isinstance(m, dict) and isinstance(m.get("content"), str) for m in msgs
        ):
            raise BadRequest("1 validation error: messages: input should be a list")
        prompt = tokenize(chat_text(msgs))
    else:
        p = body.get("prompt")
        if isinstance(p, str):
            if not p:
                raise BadRequest("Either prompt or prompt_embeds must be provided.")
            prompt = tokenize(p)
        elif isinstance(p, list) and p and all(isinstance(t, int) for t in p):
            if min(p) < 0:
                raise BadRequest("1 validation error: prompt.1: should be >= 0")
            if max(p) >= VOCAB:
                raise BadRequest(f"Token id {max(p)} is out of vocabulary")
            prompt = p
        else:
            raise BadRequest("1 validation error: prompt: input should be a string")
    max_tokens = _num(body, "max_tokens", 16, int)
    temperature = _num(body, "temperature", 1.0)
    top_p = _num(body, "top_p", 1.0)
    top_k = _num(body, "top_k", 0, int)
    min_p = _num(body, "min_p", 0.0)
    presence = _num(body, "presence_penalty", 0.0)
    frequency = _num(body, "frequency_penalty", 0.0)
    repetition = _num(body, "repetition_penalty", 1.0)
    n = _num(body, "n", 1, int)
    seed = _num(body, "seed", None, int)
    if chat:
        logprobs = _num(body, "top_logprobs", 0, int) if body.get("logprobs") else None
    else:
        logprobs = _num(body, "logprobs", None, int)
    prompt_logprobs = _num(body, "prompt_logprobs", None, int)
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest("1 validation error: stop: input should be a list")
    stop_ids = body.get("stop_token_ids") or []
    checks = [
        (max_tokens < 1, f"max_tokens must be at least 1, got {max_tokens}."),
        (
            not 0 <= temperature <= 2,
            f"temperature must be in [0, 2], got {temperature}.",
        ),
        (not 0 < top_p <= 1, f"top_p must be in (0, 1], got {top_p}."),
        (top_k < -1, f"top_k must be 0 (disable), or at least 1, got {top_k}."),
        (not 0 <= min_p <= 1, f"min_p must be in [0, 1], got {min_p}."),
        (not -2 <= presence <= 2, "presence_penalty must be in [-2, 2]"),
        (not -2 <= frequency <= 2, "frequency_penalty must be in [-2, 2]"),
        (repetition <= 0, "repetition_penalty must be greater than zero"),
        (n < 1, f"n must be at least 1, got {n}."),
        (temperature == 0 and n > 1, "n must be 1 when using greedy sampling"),
        (
            prompt_logprobs is not None and body.get("stream") is True,
            "`prompt_logprobs` are not available when `stream=True`.",
        ),
        (
            logprobs is not None and logprobs > 20,
            "Requested sample logprobs of more than 20",
        ),
        (any(not s for s in stop), "stop cannot contain an empty string."),
        (
            len(prompt) + max_tokens > cfg.max_model_len,
            f"This model's maximum context length is {cfg.max_model_len} tokens. "
            f"However, you requested {max_tokens} output tokens and your prompt "
            f"contains {len(prompt)} input tokens.",
        ),
    ]
    for bad, msg in checks:
        if bad:
            raise BadRequest(msg)
    refusal = None
    rf = body.get("response_format")
    if body.get("structured_outputs") or (
        isinstance(rf, dict) and rf.get("type") in ("json_schema", "json_object")
    ):
        refusal = STRUCTURED
    elif body.get("bad_words"):
        refusal = BAD_WORDS
    return dict(
        prompt=prompt,
        max_tokens=max_tokens,
        greedy=temperature == 0,
        n=n,
        seed=seed,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        stop=stop,
        stop_ids=set(stop_ids),
        refusal=refusal,
    )


def generate(cfg: FakeConfig, req: dict, index: int) -> tuple[str, str, int]:
    """(text, finish_reason, tokens generated) of choice ``index``."""
    toks = list(req["prompt"])
    rng = None
    if not req["greedy"]:
        rng = random.Random(None if req["seed"] is None else req["seed"] + index)
    text, finish, generated = "", "length", 0
    for _ in range(req["max_tokens"]):
        if rng is None:
            prev = toks[-2] if len(toks) > 1 else 0
            h = (toks[-1] * 7 + prev * 3 + len(toks) * 13) % len(ALPHABET)
        else:
            h = rng.randrange(len(ALPHABET))
        tok = ord(ALPHABET[h])
        toks.append(tok)
        generated += 1
        if tok in req["stop_ids"]:
            finish = "stop"
            break
        text += chr(tok)
        hit = [text.find(s) for s in req["stop"] if s in text]
        if hit:
            text, finish = text[: min(hit)], "stop"
            break
    if cfg.perturb_greedy and req["greedy"] and len(text) > 3:
        text = text[:3] + "Z" + text[4:]
    return text, finish, generated


def _top(piece: str, gap: float) -> dict:
    return {piece: -0.1, "~" if piece != "~" else "^": -0.1 - gap}


def completion_logprobs(pieces: list[str], gap: float) -> dict:
    return {
        "tokens": pieces,
        "token_logprobs": [-0.1] * len(pieces),
        "top_logprobs": [_top(p, gap) for p in pieces],
        "text_offset": list(range(len(pieces))),
    }


def chat_logprobs(pieces: list[str], gap: float) -> dict:
    return {
        "content": [
            {
                "token": p,
                "logprob": -0.1,
                "top_logprobs": [
                    {"token": p, "logprob": -0.1},
                    {"token": "~", "logprob": -0.1 - gap},
                ],
            }
            for p in pieces
        ]
    }


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeHTTPServer

    def log_message(self, format, *args):  # noqa: A002 (quiet)
        pass

    @property
    def st(self) -> FakeState:
        return self.server.state

    def _send(self, code: int, payload, ctype="application/json") -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.close_connection = True

    def _error(self, code: int, msg: str) -> None:
        self._send(
            code,
            {
                "error": {
                    "message": msg,
                    "type": "BadRequestError",
                    "param": None,
                    "code": code,
                }
            },
        )

    def do_GET(self):
        st = self.st
        if self.path == "/health":
            with st.lock:
                st.health_polls += 1
                k = st.health_polls
            a, b = st.cfg.health_fail
            self._send(503 if a <= k < b else 200, b"")
        elif self.path == "/metrics":
            self._send(200, st.metrics().encode(), "text/plain; version=0.0.4")
        elif self.path == "/v1/models":
            self._send(
                200,
                {
                    "object": "list",
                    "data": [
                        {
                            "id": st.cfg.model,
                            "object": "model",
                            "max_model_len": st.cfg.max_model_len,
                        }
                    ],
                },
            )
        else:
            self._error(404, f"no route {self.path}")

    def _body(self):
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.headers.get("Content-Type", "").split(";")[0] != "application/json":
            raise BadRequest(
                "Unsupported Media Type: Only 'application/json' is allowed"
            )
        try:
            return json.loads(raw)
        except ValueError as e:
            raise BadRequest(f"JSON decode error: {e}") from e

    def do_POST(self):
        st, cfg = self.st, self.st.cfg
        if self.path == "/tokenize":
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if "messages" in body:
                toks = tokenize(chat_text(body["messages"]))
            else:
                p = body["prompt"]
                toks = p if isinstance(p, list) else tokenize(p)
            self._send(
                200,
                {
                    "count": len(toks),
                    "max_model_len": cfg.max_model_len,
                    "tokens": toks,
                },
            )
            return
        if self.path == "/collective_rpc":
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if body.get("method") != "load_embedded_pair":
                self._error(400, f"no method {body.get('method')}")
                return
            st.loaded_pair = body["args"][1]
            self._send(200, {"results": [{"pair": st.loaded_pair}]})
            return
        chat = self.path == "/v1/chat/completions"
        if not chat and self.path != "/v1/completions":
            self._error(404, f"no route {self.path}")
            return
        if cfg.needs_rpc and st.loaded_pair is None:
            self._error(503, "the pair's weights are not loaded")
            return
        body = None
        try:
            body = self._body()
            req = parse_request(cfg, chat, body)
        except BadRequest as e:
            if cfg.validate:
                self._error(e.code, str(e))
            else:  # the misbehaving fake: anything goes
                choice = {"index": 0, "finish_reason": "length"}
                choice.update(
                    {"message": {"content": "ok"}} if chat else {"text": "ok"}
                )
                if isinstance(body, dict) and body.get("stream") is True:
                    self._start_stream()
                    self._event({"choices": [choice]})
                    self._event_raw(b"[DONE]")
                    self._end_stream()
                else:
                    self._send(200, {"choices": [choice], "usage": {}})
            return
        stream = body.get("stream") is True
        if req["refusal"] and cfg.refuse:
            if stream:
                self._start_stream()
                self._event(
                    {
                        "error": {
                            "message": req["refusal"],
                            "code": 400,
                            "type": "BadRequestError",
                        }
                    }
                )
                self._event_raw(b"[DONE]")
                self._end_stream()
            else:
                self._error(400, req["refusal"])
            return
        with st.lock:
            st.generations += 1
            k = st.generations
            if cfg.leak_kib:
                st.leak.append(b"x" * (cfg.leak_kib * 1024))
        if k in cfg.hang_at:
            st.stop.wait(cfg.hang_s)
            return
        if k in cfg.fail_at:
            self._error(500, "Internal server error")
            return
        if k in cfg.no_choices_at and not stream:
            self._send(200, {"id": "cmpl-fake", "choices": [], "usage": {}})
            return
        outs = [generate(cfg, req, i) for i in range(req["n"])]
        for _, _, g in outs:
            st.account(len(req["prompt"]), g)
        usage = {
            "prompt_tokens": len(req["prompt"]),
            "completion_tokens": sum(g for _, _, g in outs),
        }
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        with st.lock:
            st.running += 1
        try:
            if stream:
                self._stream(chat, req, body, outs, usage)
            else:
                self._send(200, self._full(chat, req, outs, usage))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away: the request is aborted
        finally:
            with st.lock:
                st.running -= 1

    def _full(self, chat: bool, req: dict, outs, usage) -> dict:
        gap = self.st.cfg.tie_gap
        choices = []
        for i, (text, finish, _) in enumerate(outs):
            pieces = list(text)
            c: dict = {"index": i, "finish_reason": finish}
            if chat:
                c["message"] = {"role": "assistant", "content": text}
                c["logprobs"] = (
                    chat_logprobs(pieces, gap) if req["logprobs"] is not None else None
                )
            else:
                c["text"] = text
                c["logprobs"] = (
                    completion_logprobs(pieces, gap)
                    if req["logprobs"] is not None
                    else None
                )
            if req["prompt_logprobs"] is not None:
                c["prompt_logprobs"] = [None] + [
                    {str(t): {"logprob": -1.0}} for t in req["prompt"][1:]
                ]
            choices.append(c)
        return {
            "id": "cmpl-fake",
            "object": "text_completion",
            "choices": choices,
            "usage": usage,
        }

    def _start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

    def _event_raw(self, data: bytes) -> None:
        chunk = b"data: " + data + b"\n\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        self.wfile.flush()

    def _event(self, payload: dict) -> None:
        self._event_raw(json.dumps(payload).encode())

    def _end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _stream(self, chat: bool, req: dict, body: dict, outs, usage) -> None:
        gap = self.st.cfg.tie_gap
        self._start_stream()
        for i, (text, finish, _) in enumerate(outs):
            if chat:
                self._event(
                    {
                        "choices": [
                            {"index": i, "delta": {"role": "assistant", "content": ""}}
                        ]
                    }
                )
            for piece in text:
                if chat:
                    c = {"index": i, "delta": {"content": piece}, "finish_reason": None}
                    if req["logprobs"] is not None:
                        c["logprobs"] = chat_logprobs([piece], gap)
                else:
                    c = {"index": i, "text": piece, "finish_reason": None}
                    if req["logprobs"] is not None:
                        c["logprobs"] = completion_logprobs([piece], gap)
                self._event({"choices": [c]})
                if self.st.cfg.chunk_delay:
                    self.st.stop.wait(self.st.cfg.chunk_delay)
            last = {"index": i, "finish_reason": finish}
            last.update({"delta": {}} if chat else {"text": ""})
            self._event({"choices": [last]})
        if (body.get("stream_options") or {}).get("include_usage"):
            self._event({"choices": [], "usage": usage})
        self._event_raw(b"[DONE]")
        self._end_stream()


class FakeHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # the soak's clients connect all at once

    def __init__(self, cfg: FakeConfig, port: int = 0):
        super().__init__(("127.0.0.1", port), Handler)
        self.state = FakeState(cfg)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def start(cfg: FakeConfig, port: int = 0) -> tuple[FakeHTTPServer, threading.Thread]:
    srv = FakeHTTPServer(cfg, port)
    th = threading.Thread(
        target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    th.start()
    return srv, th


def stop(srv: FakeHTTPServer, th: threading.Thread) -> None:
    srv.state.stop.set()
    srv.shutdown()
    srv.server_close()
    th.join(5)


def main() -> None:
    ap = argparse.ArgumentParser(description="fake OpenAI server for test_soak.py")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument(
        "--needs-rpc",
        action="store_true",
        help="answer generation requests only after load_embedded_pair",
    )
    a = ap.parse_args()
    cfg = FakeConfig(max_model_len=a.max_model_len, needs_rpc=a.needs_rpc)
    srv = FakeHTTPServer(cfg, a.port)
    srv.serve_forever(poll_interval=0.05)


if __name__ == "__main__":
    main()
