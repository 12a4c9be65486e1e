#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""No speculation, the DFlash chain and DDTree on the benchmark pairs at their
production shapes, side by side, on held-out prompts.

    python3 -m bench.pairs.run_pairs --out bench/results/pairs.json \\
        --plot bench/results/pairs.png [--models bench/pairs/models] \\
        [--pairs dense-8b,hybrid-27b] [--dtypes bfloat16,float32] \\
        [--methods nospec,chain,ddtree] [--conc 1,4,8,16,32] [--small] \\
        [--embedding full|placed|none]

Each (pair, dtype, method) runs in its own process: one vLLM engine started with
``load_format="dummy"`` at the production shape (bench/pairs/models/<pair>/
production-{target,drafter} hold the configs), the trained pair written into it
in place (pair_worker.py), then greedy decoding (temperature 0, ``ignore_eos``)
at each concurrency c: ``c`` requests always in flight, as c clients of a
server keep them (``--schedule waves``: c prompts at a time). Rows: tokens/s,
tau (vLLM's spec-decode counters), ms per engine step and whether each output
equals the no-speculation output of the same pair, dtype and concurrency; each bf16
engine then decodes ``--sampled-conc`` again at temperature 1 (rows with
``"temperature": 1.0``: tokens/s and tau, nothing compared). ``--small``
also runs the small pair itself (no speculation, float32): the production
shape's greedy outputs must equal it. Progress goes to stderr, each engine's
own log to ``<workdir>/engine_<pair>_<dtype>_<method>.log``; the JSON (a list
of rows) is rewritten after every engine, so a cut run keeps what finished;
then one embedding row per pair (check_embedding.py) and the plot.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import time

from bench import common
from bench.engine.probe import RunningProbe, engine_max_concurrency
from bench.pairs import mtp
from bench.pairs import pair_configs as pc

METHODS = ("nospec", "chain", "ddtree")
# Also accepted: "chain_v2", the chain on the V2 model runner (hybrid targets
# run the chain on the V1 runner by default; DDTree always runs on V2), and
# "ddtree_measured", DDTree with ``budget_policy: "measured"`` on top of
# ``--ddtree`` (the default policy since 2026-12-03). "ddtree" keeps the
# meaning its earlier rows have: ``budget_policy: "batch"`` unless
# ``--ddtree`` sets one. "mtp": the hybrid target's own MTP module
# (``<pair>/mtp``, mtp.py), ``--mtp-k`` draft tokens, as Qwen3.6 users run it.
DDTREE_METHODS = ("ddtree", "ddtree_measured")


PAIR_WORKER = "bench.pairs.pair_worker.EmbeddedPairWorker"
log = functools.partial(common.progress, "run_pairs")


def load_prompts(path: str, last: int = 0) -> list[list[int]]:
    """The prompts of ``path``; with ``last``, those of at least ``last``
    tokens, cut to their last ``last``."""
    with open(path) as f:
        rows = [json.loads(line)["prompt_token_ids"] for line in f if line.strip()]
    return [r[-last:] for r in rows if len(r) >= last] if last else rows


def sampled_conc(a) -> list[int]:
    """The concurrencies an engine decodes again at temperature 1."""
    return [int(c) for c in a.sampled_conc.split(",") if c]


def prompts_for(
    conc: int,
    prompts: list[list[int]],
    c1: int,
    cycle: bool = False,
    per_client: int = 4,
    min_prompts: int = 0,
) -> list[list[int]]:
    """Concurrency c = 1 decodes ``c1`` prompts one by one; c > 1 decodes
    ``per_client`` x c prompts, and at least ``min_prompts``: at most all of
    them, or (``cycle``) the list repeated as often as needed."""
    n = c1 if conc == 1 else max(per_client * conc, min_prompts)
    if not cycle:
        return prompts[: min(n, len(prompts))]
    return [prompts[i % len(prompts)] for i in range(n)]


def decode_continuous(
    engine,
    requests: list,
    params: list,
    conc: int,
    tag: str,
    clock,
    on_window=None,
):
    """Decode ``requests`` keeping ``conc`` of them in flight, as ``conc``
    clients of a server do: a finished request's place goes to the next one
    at once. ``engine`` is a vLLM ``LLMEngine`` (``add_request``, ``step``);
    ``params`` must ask for ``RequestOutputKind.DELTA``. Returns each
    request's token ids (in order) and the steady window: the tokens produced
    and the seconds elapsed from the first request's end (the start-up wave
    is over) to the moment the last request entered (the supply is not yet
    running dry), when ``conc`` requests are always in flight.
    ``on_window(opened: bool)`` is called when the window opens and closes."""
    tokens: list[list[int]] = [[] for _ in requests]
    pending = iter(range(len(requests)))
    in_flight = 0
    produced = 0
    # (seconds, tokens produced) when the window opens and when it closes.
    window_start: tuple[float, int] | None = None
    window_end: tuple[float, int] | None = None

    def add() -> bool:
        nonlocal in_flight, window_end
        i = next(pending, None)
        if i is None:
            if window_end is None and window_start is not None:
                window_end = (clock(), produced)
                if on_window is not None:
                    on_window(False)
            return False
        engine.add_request(f"{tag}-{i}", requests[i], params[i])
        in_flight += 1
        return True

    for _ in range(conc):
        if not add():
            break
    while in_flight:
        for out in engine.step():
            i = int(out.request_id.rsplit("-", 1)[1])
            new = list(out.outputs[0].token_ids)
            tokens[i] += new
            produced += len(new)
            if out.finished:
                in_flight -= 1
                if window_start is None:
                    if on_window is not None:
                        on_window(True)
                    window_start = (clock(), produced)
                add()
    if window_start is None or window_end is None or window_end[0] <= window_start[0]:
        return tokens, None, None
    return tokens, window_end[1] - window_start[1], window_end[0] - window_start[0]


# ---------------------------------------------------------------- one engine


def warm_up(
    llm,
    requests: list,
    params,
    conc: int,
    max_tokens: int,
    continuous: bool,
    tag: str,
) -> None:
    """Untimed, before a concurrency's timed decode: 2 x ``conc`` of its
    prompts, ``conc`` in flight, for up to ``max_tokens`` tokens each,
    staggered so that requests finish and new ones join while others run
    (steps that mix a prefill with verification, as in the timed window).
    Triton kernels specialised on the shapes of this concurrency compile
    here, not inside the timed window (a compile stalls the engine for
    seconds)."""
    n = 2 * conc
    prompts = [requests[i % len(requests)] for i in range(n)]
    sps = []
    for i in range(n):
        sp = params.clone()
        sp.max_tokens = max(1, max_tokens * (i + 1) // n)
        sps.append(sp)
    if continuous:
        decode_continuous(llm.llm_engine, prompts, sps, conc, tag, time.time)
    else:
        for i in range(0, n, conc):
            llm.generate(prompts[i : i + conc], sps[i : i + conc], use_tqdm=False)


def ddtree_by_batch_size(llm, conc: int) -> dict[str, float]:
    """DDTree's per-batch-size series at the label ``conc`` requests count
    at (metrics.py): the budget the schedule gives, the tau the measured
    policy expects there, and the tree request-steps and tokens they emitted
    so far. Empty for an engine without them."""
    from vllm.v1.spec_decode.ddtree import metrics as ddtree_metrics

    label = str(ddtree_metrics.batch_size_label(conc))
    names = {
        ddtree_metrics.METRIC_BUDGET_BY_BATCH: "budget",
        ddtree_metrics.METRIC_EXPECTED_TAU: "expected_tau",
        ddtree_metrics.METRIC_TREE_REQUESTS_BY_BATCH: "tree_requests",
        ddtree_metrics.METRIC_EMITTED_BY_BATCH: "emitted",
    }
    got: dict[str, float] = {}
    for m in llm.get_metrics():
        key = names.get(m.name)
        if key is not None and m.labels.get("batch_size") == label:
            got[key] = float(m.value)
    return got


def ddtree_step_readings(before: dict, after: dict) -> dict:
    """What a DDTree row records from the per-batch-size series read before
    and after its decode: the budget in use at its batch size when it ended
    (0 = no speculation), the tau the measured policy expected there, and the
    tau its tree steps observed there (None when no step verified a tree)."""
    requests = after.get("tree_requests", 0.0) - before.get("tree_requests", 0.0)
    emitted = after.get("emitted", 0.0) - before.get("emitted", 0.0)
    budget = after.get("budget")
    expected = after.get("expected_tau")
    return dict(
        budget_chosen=None if budget is None else int(budget),
        expected_tau=None if not expected else round(expected, 3),
        tree_tau=round(emitted / requests, 3) if requests > 0 else None,
    )


def measured_step_costs(cache_root: str, drafter: str, dtype: str) -> dict | None:
    """The step costs the measured budget policy timed (or read) at startup,
    from its cache (``<cache_root>/ddtree/step_costs/<key>.json``): the newest
    file for this drafter and dtype (the engine's own when it timed them; one
    an earlier engine wrote when it read them), in ms, ``target`` as
    ``[requests, tokens per request, ms]`` and ``drafter`` as ``[requests,
    ms]``. None when there is none."""
    from vllm.v1.spec_decode.ddtree import step_costs

    found = []
    folder = os.path.join(cache_root, "ddtree", "step_costs")
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        path = os.path.join(folder, name)
        try:
            with open(path) as f:
                fields = json.load(f)["fields"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if fields.get("drafter") != drafter or dtype not in str(fields.get("dtype")):
            continue
        # The policy's own reader (format and values checked).
        costs = step_costs.load_cached_costs(path, fields)
        if costs is not None:
            found.append((os.path.getmtime(path), fields, costs))
    if not found:
        return None
    _, fields, (target, drafter_costs) = max(found, key=lambda x: x[0])
    return dict(
        budgets=fields.get("budgets"),
        target=[[n, t, round(s * 1e3, 3)] for (n, t), s in sorted(target.items())],
        drafter=[[n, round(s * 1e3, 3)] for n, s in sorted(drafter_costs.items())],
    )


def spec_counters(llm) -> tuple[float, float]:
    acc = drafts = 0.0
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_accepted_tokens":
            acc = m.value
        elif m.name == "vllm:spec_decode_num_drafts":
            drafts = m.value
    return acc, drafts


class _CountedSteps:
    """An engine whose ``step()`` calls are counted, and the requests that
    joined it (``add_request``), both from the start; ``busy_steps``: the
    calls that returned outputs (one per engine step that emitted tokens),
    ``outputs``: the requests that emitted tokens, summed over them."""

    def __init__(self, engine, clock=time.perf_counter, read_counters=None):
        self.engine = engine
        # ``read_counters()`` when the window opens and closes, outside its
        # step times (before the first, after the last): ``window_counters``.
        self._read_counters = read_counters
        self.window_counters: dict[bool, dict] = {}
        self.steps = 0
        self.joined = 0
        self.busy_steps = 0
        self.outputs = 0
        # (busy_steps, outputs, joined) when the steady window opened / closed.
        self.window_marks: dict[bool, tuple[int, int, int]] = {}
        # Seconds between consecutive busy steps' returns inside the steady
        # window: one engine step each (continuous traffic keeps it busy).
        self.window_step_seconds: list[float] = []
        self._clock = clock
        self._last_busy: float | None = None
        self._in_window = False

    def mark_window(self, opened: bool) -> None:
        """`decode_continuous`'s ``on_window``."""
        if opened and self._read_counters is not None:
            self.window_counters[opened] = self._read_counters()
        self.window_marks[opened] = (self.busy_steps, self.outputs, self.joined)
        self._in_window = opened
        self._last_busy = self._clock() if opened else None
        if not opened and self._read_counters is not None:
            self.window_counters[opened] = self._read_counters()

    def add_request(self, *args, **kwargs):
        self.joined += 1
        return self.engine.add_request(*args, **kwargs)

    def step(self):
        self.steps += 1
        outs = self.engine.step()
        if outs:
            self.busy_steps += 1
            self.outputs += len(outs)
            if self._in_window:
                now = self._clock()
                if self._last_busy is not None:
                    self.window_step_seconds.append(now - self._last_busy)
                self._last_busy = now
        return outs


def _first_worker_call(llm, method: str):
    """``method``'s result on the engine's first worker (``collective_rpc``)."""
    return llm.collective_rpc(method)[0]


def step_time_spread(step_seconds: list[float], joined: int | None = None) -> dict:
    """How the steady window's engine steps spread in time: percentiles of
    the steps' wall time, and the steps slower than twice the median (under
    continuous traffic, mostly those that carry a joining request's prefill
    chunk): their share of the steps and of the window's time, and their
    mean. A step's time is the interval between two busy steps' returns.
    With ``joined``, the requests that joined in the window: the window's
    time over ``len(step_seconds)`` median steps per joined request, i.e. what
    a join costs the engine if the median step is a step without one (the
    speculative methods finish requests in fewer steps, so they take more
    joins per step)."""
    if len(step_seconds) < 2:
        return {}
    ms = sorted(x * 1e3 for x in step_seconds)

    def percentile(q: float) -> float:
        # Linear between the closest ranks (numpy's default).
        pos = (len(ms) - 1) * q / 100
        lo = int(pos)
        hi = min(lo + 1, len(ms) - 1)
        return ms[lo] + (ms[hi] - ms[lo]) * (pos - lo)

    median = percentile(50)
    slow = [x for x in ms if x > 2 * median]
    return dict(
        step_ms_percentiles={f"p{q}": round(percentile(q), 2) for q in (10, 50, 90, 99)}
        | {"max": round(ms[-1], 2)},
        slow_steps_share=round(len(slow) / len(ms), 3),
        slow_steps_time_share=round(sum(slow) / sum(ms), 3),
        slow_step_ms=round(sum(slow) / len(slow), 2) if slow else None,
    ) | (
        dict(ms_over_median_per_join=round((sum(ms) - len(ms) * median) / joined, 2))
        if joined
        else {}
    )


def allocator_in_window(before: dict | None, after: dict | None) -> dict:
    """What the target worker's CUDA caching allocator did inside the steady
    window (`pair_worker.cuda_allocator_counts` when it opened and closed):
    each counter's increase, and the bytes it held at the close. A retry
    (``num_alloc_retries``) frees every cached block and synchronises the
    device, tens of milliseconds on a full GPU: steps that need memory the
    pool does not hold pay it, which timings alone cannot tell from slow
    kernels."""
    if not before or not after:
        return {}
    counts = {
        k: after[k] - before[k] for k in after if k != "reserved_bytes" and k in before
    }
    counts["reserved_gib_at_close"] = round(after.get("reserved_bytes", 0) / 2**30, 2)
    return dict(allocator_in_window=counts)


def window_joined(marks: dict[bool, tuple[int, int, int]]) -> int | None:
    """The requests that joined inside the steady window (`_CountedSteps`'
    marks), or None without a window."""
    if True not in marks or False not in marks:
        return None
    return marks[False][2] - marks[True][2]


def window_step_stats(
    marks: dict[bool, tuple[int, int, int]], window_s: float | None
) -> dict:
    """Per engine step of the steady window, from `_CountedSteps`'
    ``(busy_steps, outputs, joined)`` when it opened (True) and closed
    (False): its wall time, the requests that emitted tokens in it and those
    that joined. The timed rows' ``ms_per_step`` divides the whole decode by
    drafts per ``c`` instead, which reads a step as slower where fewer than
    ``c`` requests decode in it."""
    if not window_s or True not in marks or False not in marks:
        return {}
    (s0, o0, j0), (s1, o1, j1) = marks[True], marks[False]
    steps = s1 - s0
    if steps <= 0:
        return {}
    return dict(
        window_engine_steps=steps,
        ms_per_engine_step=round(window_s * 1e3 / steps, 3),
        requests_per_engine_step=round((o1 - o0) / steps, 2),
        joined_per_engine_step=round((j1 - j0) / steps, 3),
    )


def profile_continuous(llm, a, requests: list, params: list, conc: int) -> dict:
    """The steady window of a continuous decode at ``conc`` under the torch
    profiler (the engine in this process): wall and GPU time per engine step
    (prefill chunks of the requests that join included, as in the timed rows),
    split as ``bench.engine.profile`` splits it."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.engine.profile import (
        _label_draft_passes,
        _label_steps,
        profile_summary,
    )

    _label_draft_passes()
    _label_steps()
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    engine = _CountedSteps(llm.llm_engine)
    marks: dict[bool, tuple[float, int, int]] = {}

    def on_window(opened: bool) -> None:
        torch.cuda.synchronize()
        if opened:
            prof.start()
        marks[opened] = (time.time(), engine.steps, engine.joined)
        if not opened:
            prof.stop()

    decode_continuous(
        engine, requests, params, conc, f"profile-c{conc}", time.time, on_window
    )
    if True not in marks or False not in marks:
        return {}
    (t0, s0, j0), (t1, s1, j1) = marks[True], marks[False]
    steps = s1 - s0
    return dict(
        profile_steps=steps,
        joined_per_step=round((j1 - j0) / steps, 3),
        **profile_summary(prof, steps, t1 - t0),
    )


def run_engine(a) -> None:
    """One engine: print one ``ROW {json}`` per concurrency, save token ids."""
    # Triton autotunes a kernel afresh in every process unless its timings
    # are kept on disk: the run's later engines read the first one's (the
    # same GPU and shapes, so the same choices) instead of timing again.
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    if a.profile:
        # The profiler sees the engine's kernels only in this process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    spec = pc.load_pair(a.models, a.pair)
    small = a.method == "small"
    drafter_id = (
        None
        if a.method == "nospec" or small
        else pc.weights_id(a.models, a.pair, "mtp" if a.method == "mtp" else "drafter")
    )
    pdir = os.path.join(a.models, a.pair)
    target = os.path.join(pdir, "target" if small else "production-target")
    max_num_seqs = max(a.conc + sampled_conc(a))
    kw = common.engine_kwargs(
        a, target, a.dtype, max_num_seqs, spec["kind"] == "hybrid"
    )
    # Every kernel compile after warm-up logged with its specialisation, not
    # only each kernel's first (`jit_compiles_in`).
    kw["jit_monitor_verbose"] = True
    if not small:
        kw.update(load_format="dummy", worker_extension_cls=PAIR_WORKER)
    drafter = os.path.join(pdir, "drafter" if small else "production-drafter")
    if a.method == "chain_v2":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    if a.method in ("chain", "chain_v2"):
        kw["speculative_config"] = common.chain_config(drafter, a.chain_k)
    elif a.method in DDTREE_METHODS:
        kw["speculative_config"] = dict(
            method="ddtree", model=drafter, **json.loads(a.ddtree)
        )
        if a.method == "ddtree_measured":
            kw["speculative_config"]["budget_policy"] = "measured"
        else:
            kw["speculative_config"].setdefault("budget_policy", "batch")
    elif a.method == "mtp":
        kw["speculative_config"] = mtp.speculative_config(a.mtp_k)
    if a.llm_kwargs:
        kw.update(json.loads(a.llm_kwargs))
    t0 = time.time()
    llm = LLM(**kw)
    startup = time.time() - t0
    step_costs = None
    if a.method == "ddtree_measured":
        import vllm.envs as envs

        step_costs = measured_step_costs(envs.VLLM_CACHE_ROOT, drafter, a.dtype)
        log(f"{a.pair} {a.dtype} {a.method}: step costs {json.dumps(step_costs)}")
    # How many requests the engine can hold: the hybrid chain keeps a
    # recurrent state per draft position and may hold fewer than a
    # concurrency asked for (its rows then say so).
    max_concurrency = engine_max_concurrency(llm)
    running = RunningProbe(llm)
    load = None
    if not small:
        load = llm.collective_rpc(
            "load_embedded_pair", args=(pdir, a.pair, a.method != "nospec")
        )[0]
        log(f"{a.pair} {a.dtype} {a.method}: embedded weights written {load}")
    prompts = load_prompts(a.prompts, a.prompt_tokens)
    greedy = SamplingParams(
        temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True, detokenize=False
    )
    warm = [TokensPrompt(prompt_token_ids=p) for p in prompts[:2]]
    llm.generate(warm, greedy, use_tqdm=False)
    # Temperature 1 (vLLM's default sampling) after the greedy sweep, in the
    # same engine: bf16 only, since float32 engines check exactness.
    sampled = [] if a.dtype == "float32" else sampled_conc(a)
    plan = [(c, 0.0) for c in a.conc] + [(c, 1.0) for c in sampled]
    for conc, temperature in plan:
        continuous = a.schedule == "continuous"
        batch = prompts_for(
            conc,
            prompts,
            a.c1_prompts,
            cycle=continuous,
            per_client=a.per_client,
            min_prompts=a.min_prompts,
        )
        # Sampled: one seed per prompt, so every method draws from the same
        # stream of seeds (outputs still differ: speculation changes which
        # random numbers each token consumes).
        sps = [
            greedy
            if temperature == 0
            else SamplingParams(
                temperature=temperature,
                seed=j,
                max_tokens=a.max_tokens,
                ignore_eos=True,
                detokenize=False,
            )
            for j in range(len(batch))
        ]
        if continuous:
            sps = [sp.clone() for sp in sps]
            for sp in sps:
                sp.output_kind = RequestOutputKind.DELTA
        if a.profile and not continuous:
            raise SystemExit("--profile profiles the continuous schedule only")
        if a.warm_tokens > 0:
            warm_up(
                llm,
                [TokensPrompt(prompt_token_ids=p) for p in batch],
                sps[0],
                conc,
                a.warm_tokens,
                continuous,
                f"warm-c{conc}-t{temperature:g}",
            )
        acc0, drafts0 = spec_counters(llm)
        by_batch0 = (
            ddtree_by_batch_size(llm, conc) if a.method in DDTREE_METHODS else {}
        )
        what = dict(
            pair=a.pair,
            dtype=a.dtype,
            method=a.method,
            temperature=temperature,
            concurrency=conc,
            prompts=len(batch),
            prompt_tokens=a.prompt_tokens or None,
        )
        if a.profile:
            # Instead of the timed decode: the same decode, profiled.
            row = dict(
                what,
                schedule=a.schedule,
                profile=profile_continuous(
                    llm, a, [TokensPrompt(prompt_token_ids=p) for p in batch], sps, conc
                ),
            )
            common.emit("ROW", row)
            log(f"{a.pair} {a.dtype} {a.method} c={conc}: profiled")
            continue
        toks: list[list[int]] = []
        running.max_running = None
        steady_tokens = steady_s = None
        counted = _CountedSteps(
            llm.llm_engine,
            # The first worker's (tensor-parallel ranks allocate alike).
            read_counters=None
            if small
            else functools.partial(_first_worker_call, llm, "cuda_allocator_counts"),
        )
        t = time.time()
        with running:
            if continuous:
                toks, steady_tokens, steady_s = decode_continuous(
                    counted,
                    [TokensPrompt(prompt_token_ids=p) for p in batch],
                    sps,
                    conc,
                    f"c{conc}-t{temperature:g}",
                    time.time,
                    counted.mark_window,
                )
            else:
                for i in range(0, len(batch), conc):
                    outs = llm.generate(
                        [TokensPrompt(prompt_token_ids=p) for p in batch[i : i + conc]],
                        sps[i : i + conc],
                        use_tqdm=False,
                    )
                    toks += [list(o.outputs[0].token_ids) for o in outs]
        dt = time.time() - t
        acc1, drafts1 = spec_counters(llm)
        drafts = drafts1 - drafts0
        steps = drafts / conc if drafts else sum(map(len, toks)) / conc
        row = dict(
            what,
            tok_s=round(
                steady_tokens / steady_s if steady_s else sum(map(len, toks)) / dt,
                1,
            ),
            tok_s_all=round(sum(map(len, toks)) / dt, 1),
            schedule=a.schedule,
            steady_s=None if steady_s is None else round(steady_s, 2),
            tau=round(1 + (acc1 - acc0) / drafts, 3) if drafts else None,
            ms_per_step=round(dt * 1e3 / steps, 3),
            startup_s=round(startup, 1),
            max_concurrency=max_concurrency,
            max_running=running.max_running,
            **window_step_stats(counted.window_marks, steady_s),
            **step_time_spread(
                counted.window_step_seconds, window_joined(counted.window_marks)
            ),
            **allocator_in_window(
                counted.window_counters.get(True), counted.window_counters.get(False)
            ),
            # The timed decode, in the engine log's clock (`jit_compiles_in`).
            timed_from=time.strftime(LOG_TIME, time.localtime(t)),
            timed_to=time.strftime(LOG_TIME, time.localtime(t + dt)),
        )
        if drafter_id is not None:
            row["drafter_id"] = drafter_id
        if a.method in DDTREE_METHODS:
            row["speculative_config"] = kw["speculative_config"]
            row.update(ddtree_step_readings(by_batch0, ddtree_by_batch_size(llm, conc)))
            if step_costs is not None:
                row["step_costs_ms"] = step_costs
        elif a.method in ("chain", "chain_v2"):
            row["k"] = a.chain_k
        elif a.method == "mtp":
            row["k"] = a.mtp_k
        if load:
            row["weights_written"] = load
        common.emit("ROW", row)
        if temperature == 0:
            with open(
                os.path.join(
                    a.workdir, f"tokens_{a.pair}_{a.dtype}_{a.method}_c{conc}.json"
                ),
                "w",
            ) as f:
                json.dump(toks, f)
        log(
            f"{a.pair} {a.dtype} {a.method} c={conc} T={temperature:g}: "
            f"{row['tok_s']} tok/s, tau {row['tau']}"
        )


# ---------------------------------------------------------------- orchestration


# vLLM's log timestamps (local time, whole seconds).
LOG_TIME = "%m-%d %H:%M:%S"
JIT_COMPILE = re.compile(
    r"(\d\d-\d\d \d\d:\d\d:\d\d).*JIT compilation during inference: (\w+)"
)


def jit_compiles_in(log_lines, rows: list[dict]) -> None:
    """Each timed row's kernel compiles (vLLM's JIT monitor, after warm-up)
    logged while it decoded, from its engine's log: ``jit_compiles``, the
    kernel names (empty: none). A compile stalls the engine for a fraction of
    a second to seconds, which a short timed window does not absorb."""
    compiles = [m.groups() for m in map(JIT_COMPILE.search, log_lines) if m]
    for r in rows:
        lo, hi = r.get("timed_from"), r.get("timed_to")
        if lo is not None and hi is not None:
            r["jit_compiles"] = [name for at, name in compiles if lo <= at <= hi]


def compare(
    workdir: str, pair: str, dtype: str, method: str, conc: int, ref_method: str
) -> str | None:
    paths = [
        os.path.join(workdir, f"tokens_{pair}_{dtype}_{m}_c{conc}.json")
        for m in (ref_method, method)
    ]
    if not all(os.path.exists(p) for p in paths):
        return None
    ref, got = [], []
    for p, dest in zip(paths, (ref, got)):
        with open(p) as f:
            dest += json.load(f)
    same = sum(x == y for x, y in zip(ref, got))
    return f"{same}/{len(got)}"


def annotate(rows: list[dict], workdir: str) -> None:
    """Each greedy row's outputs against no speculation's (and no
    speculation's against the small pair's); sampled rows compare nothing. A
    row whose token files are not in ``workdir`` (rows of an earlier run in
    the same --out) keeps what it has."""
    for r in rows:
        if "concurrency" not in r or r.get("temperature", 0.0) > 0 or "profile" in r:
            continue
        if r["method"] not in ("nospec", "small"):
            key, ref = "identical_to_nospec", "nospec"
            got = compare(
                workdir, r["pair"], r["dtype"], r["method"], r["concurrency"], ref
            )
        elif r["method"] == "nospec":
            key, ref = "identical_to_small", "small"
            got = compare(
                workdir, r["pair"], r["dtype"], "nospec", r["concurrency"], ref
            )
        else:
            continue
        if got is not None or key not in r:
            r[key] = got


def add_engine_options(ap: argparse.ArgumentParser) -> None:
    """The options every engine process takes (engine_command passes them on)."""
    common.add_engine_options(ap)
    ap.add_argument(
        "--prompts", default=None, help="default: <models>/prompts/heldout.jsonl"
    )
    ap.add_argument(
        "--prompt-tokens",
        type=int,
        default=160,
        help="cut each prompt to its last N tokens (those shorter are left "
        "out; 0: whole prompts). The pairs were trained on 512-token windows: "
        "160 + 256 new tokens stay inside them, as offline_tau.py measures; "
        "past them the dense pair's acceptance falls (RoPE positions it never "
        "saw)",
    )
    ap.add_argument("--c1-prompts", type=int, default=8)
    ap.add_argument(
        "--per-client",
        type=int,
        default=4,
        help="c > 1 decodes this many prompts per client (c of them): the "
        "continuous schedule's steady window spans about this many request "
        "lifetimes less one",
    )
    ap.add_argument(
        "--min-prompts",
        type=int,
        default=0,
        help="c > 1 decodes at least this many prompts: at 2 and 4 requests, "
        "3 per client give a steady window of a few seconds, too short to "
        "tell methods 3%% apart",
    )
    ap.add_argument(
        "--mtp-k",
        type=int,
        default=mtp.SPECULATIVE_TOKENS,
        help="draft tokens of the mtp method (default: mtp.py's choice from "
        "the head's offline tau)",
    )
    ap.add_argument(
        "--ddtree",
        default="{}",
        help="DDTree speculative_config keys (JSON), e.g. '{\"tree_budget\": 64}'",
    )
    ap.add_argument(
        "--llm-kwargs", default=None, help="extra LLM(...) keyword arguments (JSON)"
    )
    ap.add_argument(
        "--schedule",
        choices=["continuous", "waves"],
        default="continuous",
        help="'continuous': c requests always in flight (a finished one's place "
        "goes to the next at once; tok_s is the steady window's, tok_s_all the "
        "whole run's); 'waves': c prompts at a time, the next c when all are done",
    )
    ap.add_argument(
        "--warm-tokens",
        type=int,
        default=32,
        help="before each concurrency's timed decode, decode 2c of its prompts "
        "(staggered, up to this many tokens each) untimed, so that kernels "
        "specialised on its shapes compile outside the timed window; 0: none",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="instead of timing: profile each concurrency's steady window (torch "
        "profiler, engine in-process; continuous schedule): rows with a "
        "'profile' object (per engine step: wall and GPU time, by phase and "
        "kernel), not for the tables",
    )
    ap.add_argument(
        "--sampled-conc",
        default="1,8",
        help="concurrencies decoded again at temperature 1 in each bf16 engine "
        "('' for none)",
    )


ENGINE_OPTIONS = (
    *common.ENGINE_OPTIONS,
    "out",
    "prompts",
    "prompt_tokens",
    "c1_prompts",
    "per_client",
    "min_prompts",
    "mtp_k",
    "ddtree",
    "sampled_conc",
    "warm_tokens",
    "schedule",
    "workdir",
    "profile",
    "llm_kwargs",
)


def engine_command(
    a,
    pair: str,
    dtype: str,
    method: str,
    conc: str,
    workdir: str | None = None,
    llm_kwargs: str | None = None,
) -> list[str]:
    """The command line of one engine process (``--engine``) with ``a``'s
    options; ``workdir`` and ``llm_kwargs`` override ``a``'s."""
    a = argparse.Namespace(**vars(a))
    a.workdir = workdir or a.workdir
    a.llm_kwargs = llm_kwargs or a.llm_kwargs
    return [
        sys.executable,
        "-m",
        "bench.pairs.run_pairs",
        "--engine",
        *("--pair", pair, "--dtype", dtype, "--method", method, "--conc", conc),
        *common.forward(a, ENGINE_OPTIONS),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--out", required=True, help="JSON rows (rewritten after every engine)"
    )
    ap.add_argument("--pairs", default=",".join(pc.PAIRS))
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument(
        "--small",
        action="store_true",
        help="also run the small pair (float32, no speculation)",
    )
    ap.add_argument("--conc", default="1,4,8,16,32")
    ap.add_argument(
        "--float32-conc",
        default=None,
        help="concurrencies of the float32 (exactness) engines (default: --conc)",
    )
    ap.add_argument(
        "--embedding",
        choices=["full", "placed", "none"],
        default="full",
        help="also check each pair's embedding (check_embedding.py): 'full' at the "
        "whole production shape (GPU memory: Qwen3.6-27B in float32), 'placed' "
        "without the identity layers and with 16384 vocabulary rows",
    )
    ap.add_argument("--plot", default=None, help="PNG of tokens/s (plot_pairs.py)")
    add_engine_options(ap)
    ap.add_argument(
        "--workdir", default=None, help="token files (default: next to --out)"
    )
    # one engine (internal)
    ap.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--pair", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    ap.add_argument("--method", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.prompts = a.prompts or os.path.join(a.models, "prompts", "heldout.jsonl")
    a.float32_conc = a.float32_conc or a.conc
    a.workdir = a.workdir or os.path.join(
        os.path.dirname(os.path.abspath(a.out)), "pairs-tokens"
    )
    os.makedirs(a.workdir, exist_ok=True)
    if a.engine:
        a.conc = [int(c) for c in a.conc.split(",")]
        run_engine(a)
        return
    rows: list[dict] = []
    if os.path.exists(a.out):
        with open(a.out) as f:
            rows = json.load(f)
    plan = []
    for pair in a.pairs.split(","):
        pc.pair(pair)
        if a.small:
            plan.append((pair, "float32", "small", a.float32_conc))
        for dtype in a.dtypes.split(","):
            conc = a.float32_conc if dtype == "float32" else a.conc
            plan += [(pair, dtype, m, conc) for m in a.methods.split(",")]
    t_all = time.time()
    for k, (pair, dtype, method, conc) in enumerate(plan):
        log(
            f"engine {k + 1}/{len(plan)}: {pair} {dtype} {method} at c={conc} "
            f"({time.time() - t_all:.0f} s so far)"
        )
        t = time.time()
        engine_log = os.path.join(a.workdir, f"engine_{pair}_{dtype}_{method}.log")
        new, rc, _, _ = common.run_engine_process(
            engine_command(a, pair, dtype, method, conc),
            a.engine_timeout,
            stdout_path=engine_log,
        )
        with open(engine_log) as f:
            jit_compiles_in(f, new)
        for r in new:
            if r.get("jit_compiles"):
                log(
                    f"{pair} {dtype} {method} c={r['concurrency']}: kernel compiles "
                    f"while timed: {', '.join(r['jit_compiles'])}"
                )
        if rc != 0:
            log(
                f"engine {pair} {dtype} {method} ended with {rc} "
                f"after {time.time() - t:.0f} s"
            )
            new.append(dict(pair=pair, dtype=dtype, method=method, error=str(rc)))
        rows = [
            r
            for r in rows
            if (r.get("pair"), r.get("dtype"), r.get("method")) != (pair, dtype, method)
        ]
        rows += new
        annotate(rows, a.workdir)
        common.write_json(a.out, rows)
    if a.embedding != "none":
        for pair in a.pairs.split(","):
            rows = [
                r
                for r in rows
                if not (r.get("pair") == pair and "embedding_max_abs_logit_diff" in r)
            ]
            rows.append(check_embedding(a, pair))
            common.write_json(a.out, rows)
    if a.plot:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.pairs.plot_pairs",
                a.out,
                "--out",
                a.plot,
            ],
            check=False,
        )
    print(json.dumps(rows))


def check_embedding(a, pair: str) -> dict:
    """One pair's embedding row (check_embedding.py in its own process)."""
    log(f"embedding check of {pair} ({a.embedding})")
    cmd = [
        sys.executable,
        "-m",
        "bench.pairs.check_embedding",
        "--models",
        a.models,
        "--pair",
        pair,
    ]
    if a.embedding == "placed":
        cmd += ["--placed-layers-only", "--vocab-cap", "16384"]
    try:
        out = subprocess.run(
            cmd, stdout=subprocess.PIPE, text=True, timeout=a.engine_timeout
        ).stdout
    except subprocess.TimeoutExpired:
        out = ""
    rows = [
        json.loads(line[10:])
        for line in out.splitlines()
        if line.startswith("EMBEDDING ")
    ]
    return (
        rows[0]
        if rows
        else {
            "pair": pair,
            "embedding_max_abs_logit_diff": None,
            "error": "check failed",
        }
    )


if __name__ == "__main__":
    main()
