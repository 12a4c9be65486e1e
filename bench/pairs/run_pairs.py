#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""No speculation, the DFlash chain, MTP and DDTree on the benchmark pairs at
their production shapes, side by side, on held-out prompts.

    python3 -m bench.pairs.run_pairs --out bench/results/pairs.json \\
        --plot bench/results/pairs.png [--pairs dense-8b,hybrid-27b] \\
        [--dtypes bfloat16,float32] [--methods nospec,chain,ddtree] \\
        [--conc 1,4,8,16,32] [--small]

Each (pair, dtype, method) runs in its own process: one vLLM engine loaded with
dummy weights at the production shape (``<models>/<pair>/production-*``), the
trained pair written in (pair_worker.py), then greedy decoding (``ignore_eos``)
at each concurrency c with c requests always in flight. Rows: tokens/s of the
steady window, tau, ms per engine step, whether each output equals no
speculation's (the same pair, dtype and concurrency). ``--small`` also runs
the small pair itself (float32): the production shape's outputs must equal it.
After each timed decode the no-speculation engine scores its own outputs
(untimed, ``prompt_logprobs``): the top-2 logprob gap at every token, so that
a row that differs from no speculation says where (``divergence_gaps``, the
gap at each differing output's first differing token) and, in float32, which
differences are near-ties (a gap below ``common.NEAR_TIE_NATS``, as the
greedy GPU test judges them) and which are not (``mismatches_to_nospec``);
16-bit rows record the gaps and judge none.

Methods: ``nospec``, ``chain``, ``chain_v2`` (the chain on the V2 model runner),
``ddtree`` (``budget_policy: "batch"`` unless ``--ddtree`` sets one),
``ddtree_measured``, ``mtp`` (the hybrid target's MTP head, ``--mtp-k``). The
JSON is rewritten after every engine (a cut run keeps what finished); each
engine's log is ``<workdir>/engine_<pair>_<dtype>_<method>.log``; then the
plot. The embedding rows come from check_embedding.py.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time

from bench import common
from bench.engine.probe import RunningProbe, engine_max_concurrency
from bench.pairs import mtp
from bench.pairs import pair_configs as pc

METHODS = ("nospec", "chain", "ddtree")
DDTREE_METHODS = ("ddtree", "ddtree_measured")
PAIR_WORKER = "bench.pairs.pair_worker.EmbeddedPairWorker"
# Before each timed decode, 2c of its prompts untimed, up to this many tokens.
WARM_TOKENS = 32
# vLLM's log timestamps (local time, whole seconds) and its JIT monitor's line.
LOG_TIME = "%m-%d %H:%M:%S"
JIT_COMPILE = re.compile(
    r"(\d\d-\d\d \d\d:\d\d:\d\d).*JIT compilation during inference: (\w+)"
)
# vLLM's startup line with the engine's KV-cache size (its last one: the
# extensible KV cache of vLLM 0.34 logs the size it extends to).
KV_CACHE_TOKENS = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
log = functools.partial(common.progress, "run_pairs")


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


def decode_continuous(engine, requests, params, conc, tag, clock, on_window=None):
    """Decode ``requests`` keeping ``conc`` of them in flight, as ``conc``
    clients of a server do: a finished request's place goes to the next one
    at once. ``engine`` is a vLLM ``LLMEngine`` (``add_request``, ``step``);
    ``params`` must ask for ``RequestOutputKind.DELTA``. Returns each
    request's token ids and the steady window's tokens and seconds: from the
    first request's end (the start-up wave is over) to the moment the last
    request entered (the supply is not yet running dry). ``on_window(opened)``
    is called when the window opens and closes."""
    tokens: list[list[int]] = [[] for _ in requests]
    pending = iter(range(len(requests)))
    in_flight = produced = 0
    # (seconds, tokens produced) when the window opens / closes.
    opened: tuple[float, int] | None = None
    closed: tuple[float, int] | None = None

    def add() -> bool:
        nonlocal in_flight, closed
        i = next(pending, None)
        if i is None:
            if closed is None and opened is not None:
                closed = (clock(), produced)
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
            new = list(out.outputs[0].token_ids)
            tokens[int(out.request_id.rsplit("-", 1)[1])] += new
            produced += len(new)
            if out.finished:
                in_flight -= 1
                if opened is None:
                    if on_window is not None:
                        on_window(True)
                    opened = (clock(), produced)
                add()
    if opened is None or closed is None or closed[0] <= opened[0]:
        return tokens, None, None
    return tokens, closed[1] - opened[1], closed[0] - opened[0]


def warm_up(llm, requests, params, conc: int, max_tokens: int, tag: str) -> None:
    """Untimed, before a concurrency's timed decode: 2 x ``conc`` of its
    prompts, ``conc`` in flight, up to ``max_tokens`` tokens each, staggered
    so that requests finish and join while others run (steps that mix a
    prefill with verification, as in the timed window). Triton kernels
    specialised on this concurrency's shapes compile here, not in the timed
    window (a compile stalls the engine for seconds)."""
    n = 2 * conc
    sps = []
    for i in range(n):
        sps.append(params.clone())
        sps[-1].max_tokens = max(1, max_tokens * (i + 1) // n)
    prompts = [requests[i % len(requests)] for i in range(n)]
    decode_continuous(llm.llm_engine, prompts, sps, conc, tag, time.time)


def ddtree_by_batch_size(llm, conc: int) -> dict[str, float]:
    """DDTree's per-batch-size series at the label ``conc`` requests count
    at (metrics.py): the budget the schedule gives, the tau the measured
    policy expects there, the tree request-steps and the tokens they emitted
    so far. Empty for an engine without them."""
    from vllm.v1.spec_decode.ddtree import metrics as dm

    label = str(dm.batch_size_label(conc))
    names = {
        dm.METRIC_BUDGET_BY_BATCH: "budget",
        dm.METRIC_EXPECTED_TAU: "expected_tau",
        dm.METRIC_TREE_REQUESTS_BY_BATCH: "tree_requests",
        dm.METRIC_EMITTED_BY_BATCH: "emitted",
    }
    return {
        names[m.name]: float(m.value)
        for m in llm.get_metrics()
        if m.name in names and m.labels.get("batch_size") == label
    }


def ddtree_step_readings(before: dict, after: dict) -> dict:
    """From the per-batch-size series before and after a decode: the budget
    in use at its batch size at the end (0 = no speculation), the tau the
    measured policy expected there, the tau its tree steps observed there
    (None when no step verified a tree)."""
    requests = after.get("tree_requests", 0.0) - before.get("tree_requests", 0.0)
    emitted = after.get("emitted", 0.0) - before.get("emitted", 0.0)
    budget, expected = after.get("budget"), after.get("expected_tau")
    return dict(
        budget_chosen=None if budget is None else int(budget),
        expected_tau=round(expected, 3) if expected else None,
        tree_tau=round(emitted / requests, 3) if requests > 0 else None,
    )


def measured_step_costs(cache_root: str, drafter: str, dtype: str) -> dict | None:
    """The step costs the measured budget policy timed (or read) at startup:
    the newest file of its cache (``<cache_root>/ddtree/step_costs/``) for
    this drafter and dtype, in ms, ``target`` as ``[requests, tokens per
    request, ms]`` and ``drafter`` as ``[requests, ms]``; None without one."""
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
        costs = step_costs.load_cached_costs(path, fields)  # the policy's reader
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


class _CountedSteps:
    """An engine whose ``step()`` calls (``steps``; ``busy_steps``: those
    that returned outputs, ``outputs``: the outputs they returned) and joined
    requests (``joined``) are counted from the start. ``mark_window`` (as
    `decode_continuous`'s ``on_window``) records the counts when the steady
    window opens (True) and closes (False), and the seconds between
    consecutive busy steps inside the window: one engine step each."""

    def __init__(self, engine, clock=time.perf_counter):
        self.engine, self._clock = engine, clock
        self.steps = self.joined = self.busy_steps = self.outputs = 0
        self.window_marks: dict[bool, tuple[int, int, int]] = {}
        self.window_step_seconds: list[float] = []
        self._last_busy: float | None = None

    def mark_window(self, opened: bool) -> None:
        self.window_marks[opened] = (self.busy_steps, self.outputs, self.joined)
        self._last_busy = self._clock() if opened else None

    def add_request(self, *args, **kwargs):
        self.joined += 1
        return self.engine.add_request(*args, **kwargs)

    def step(self):
        self.steps += 1
        outs = self.engine.step()
        if outs:
            self.busy_steps += 1
            self.outputs += len(outs)
            if self._last_busy is not None:
                now = self._clock()
                self.window_step_seconds.append(now - self._last_busy)
                self._last_busy = now
        return outs


def step_time_spread(step_seconds: list[float], joined: int | None = None) -> dict:
    """How the steady window's engine steps spread in time: percentiles of
    their wall time and the steps slower than twice the median (under
    continuous traffic mostly those carrying a joining request's prefill
    chunk): their share of the steps and of the time, and their mean. With
    ``joined``, the requests that joined in the window: the window's time
    over that of as many median steps, per joined request (what a join costs
    if the median step carries none)."""
    if len(step_seconds) < 2:
        return {}
    ms = sorted(x * 1e3 for x in step_seconds)
    # Linear between the closest ranks (numpy's default).
    pct = statistics.quantiles(ms, n=100, method="inclusive")
    median = pct[49]
    slow = [x for x in ms if x > 2 * median]
    out = dict(
        step_ms_percentiles={f"p{q}": round(pct[q - 1], 2) for q in (10, 50, 90, 99)}
        | {"max": round(ms[-1], 2)},
        slow_steps_share=round(len(slow) / len(ms), 3),
        slow_steps_time_share=round(sum(slow) / sum(ms), 3),
        slow_step_ms=round(sum(slow) / len(slow), 2) if slow else None,
    )
    if joined:
        extra = sum(ms) - len(ms) * median
        out["ms_over_median_per_join"] = round(extra / joined, 2)
    return out


def window_joined(marks: dict[bool, tuple[int, int, int]]) -> int | None:
    """The requests that joined in the steady window; None without one."""
    if True not in marks or False not in marks:
        return None
    return marks[False][2] - marks[True][2]


def window_step_stats(marks: dict, window_s: float | None) -> dict:
    """Per engine step of the steady window (`_CountedSteps.window_marks`):
    its wall time and the requests that emitted tokens and that joined in it.
    ``ms_per_step`` divides the whole decode by drafts per ``c`` instead,
    which reads a step as slower where fewer than ``c`` requests decode."""
    if not window_s or True not in marks or False not in marks:
        return {}
    (s0, o0, j0), (s1, o1, j1) = marks[True], marks[False]
    if s1 <= s0:
        return {}
    return dict(
        window_engine_steps=s1 - s0,
        ms_per_engine_step=round(window_s * 1e3 / (s1 - s0), 3),
        requests_per_engine_step=round((o1 - o0) / (s1 - s0), 2),
        joined_per_engine_step=round((j1 - j0) / (s1 - s0), 3),
    )


def profile_continuous(llm, requests: list, params: list, conc: int) -> dict:
    """The steady window of a continuous decode at ``conc`` under the torch
    profiler (the engine in this process): wall and GPU time per engine step,
    split as ``bench.engine.profile`` splits it."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.engine import profile as ep

    ep.label_steps()
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
    return dict(
        profile_steps=s1 - s0,
        joined_per_step=round((j1 - j0) / (s1 - s0), 3),
        **ep.profile_summary(prof, s1 - s0, t1 - t0),
    )


def speculative_config(a, drafter: str) -> dict | None:
    """The speculative_config of ``a.method`` (None: no speculation)."""
    if a.method in ("chain", "chain_v2"):
        return common.chain_config(drafter, a.chain_k)
    if a.method == "mtp":
        return mtp.speculative_config(a.mtp_k)
    if a.method in DDTREE_METHODS:
        policy = "measured" if a.method == "ddtree_measured" else "batch"
        return common.ddtree_config(drafter, budget_policy=policy)
    return None


def run_engine(a) -> None:
    """One engine: one ``ROW {json}`` per concurrency, token ids saved."""
    # Triton autotunes afresh in every process unless its timings are kept
    # on disk: the later engines read the first one's (same GPU and shapes).
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    if a.profile:  # the profiler sees the engine's kernels in this process only
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if a.method == "chain_v2":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    small = a.method == "small"
    pdir = os.path.join(a.models, a.pair)
    prefix = "" if small else "production-"
    drafter = os.path.join(pdir, prefix + "drafter")
    hybrid = pc.load_pair(a.models, a.pair)["kind"] == "hybrid"
    target = os.path.join(pdir, prefix + "target")
    max_num_seqs = max(a.max_num_seqs, *a.conc)
    # Every compile after warm-up logged with its specialisation.
    kw = common.engine_kwargs(
        a, target, a.dtype, max_num_seqs, hybrid, jit_monitor_verbose=True
    )
    if not small:
        kw.update(load_format="dummy", worker_extension_cls=PAIR_WORKER)
    spec = speculative_config(a, drafter)
    if spec is not None:
        kw["speculative_config"] = spec
    t0 = time.time()
    llm = LLM(**kw)
    startup = time.time() - t0
    costs = None
    if a.method == "ddtree_measured":
        import vllm.envs as envs

        costs = measured_step_costs(envs.VLLM_CACHE_ROOT, drafter, a.dtype)
        log(f"{a.pair} {a.dtype} {a.method}: step costs {json.dumps(costs)}")
    # The hybrid chain keeps a recurrent state per draft position and may
    # hold fewer requests than a concurrency asks for (its rows say so).
    max_concurrency = engine_max_concurrency(llm)
    running = RunningProbe(llm)
    load = None
    if not small:
        load = llm.collective_rpc(
            "load_embedded_pair", args=(pdir, a.pair, a.method != "nospec")
        )[0]
        log(f"{a.pair} {a.dtype} {a.method}: embedded weights written {load}")
    prompts = common.load_prompts(a.prompts, a.prompt_tokens)
    greedy = dict(max_tokens=a.max_tokens, ignore_eos=True, detokenize=False)
    llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts[:2]],
        SamplingParams(temperature=0.0, **greedy),
        use_tqdm=False,
    )
    for conc in a.conc:
        batch = prompts_for(
            conc, prompts, a.c1_prompts, True, a.per_client, a.min_prompts
        )
        requests = [TokensPrompt(prompt_token_ids=p) for p in batch]
        delta = RequestOutputKind.DELTA
        sps = [
            SamplingParams(temperature=0.0, output_kind=delta, **greedy) for _ in batch
        ]
        tag = f"c{conc}-t0"
        warm_up(llm, requests, sps[0], conc, WARM_TOKENS, "warm-" + tag)
        what = dict(
            pair=a.pair,
            dtype=a.dtype,
            method=a.method,
            temperature=0.0,
            concurrency=conc,
            max_num_seqs=max_num_seqs,
            prompts=len(batch),
            prompt_tokens=a.prompt_tokens or None,
            schedule="continuous",
        )
        if a.profile:  # instead of the timed decode: the same one, profiled
            prof = profile_continuous(llm, requests, sps, conc)
            common.emit("ROW", dict(what, profile=prof))
            log(f"{a.pair} {a.dtype} {a.method} c={conc}: profiled")
            continue
        spec0 = common.spec_decode_counters(llm)
        ddtree = a.method in DDTREE_METHODS
        by_batch0 = ddtree_by_batch_size(llm, conc) if ddtree else {}
        counted = _CountedSteps(llm.llm_engine)
        running.max_running = None
        t = time.time()
        with running:
            toks, steady_tokens, steady_s = decode_continuous(
                counted, requests, sps, conc, tag, time.time, counted.mark_window
            )
        dt = time.time() - t
        spec1 = common.spec_decode_counters(llm)
        drafts, produced = spec1["drafts"] - spec0["drafts"], sum(map(len, toks))
        readings = common.spec_readings(spec0, spec1)
        marks = counted.window_marks
        row = dict(
            what,
            tok_s=round(steady_tokens / steady_s if steady_s else produced / dt, 1),
            tok_s_all=round(produced / dt, 1),
            steady_s=None if steady_s is None else round(steady_s, 2),
            tau=readings.pop("tau"),
            ms_per_step=round(dt * 1e3 * conc / (drafts or produced), 3),
            startup_s=round(startup, 1),
            max_concurrency=max_concurrency,
            max_running=running.max_running,
            **window_step_stats(marks, steady_s),
            **step_time_spread(counted.window_step_seconds, window_joined(marks)),
            # The timed decode in the engine log's clock (`jit_compiles_in`).
            timed_from=time.strftime(LOG_TIME, time.localtime(t)),
            timed_to=time.strftime(LOG_TIME, time.localtime(t + dt)),
        )
        if spec is not None:
            row.update(readings)
            row["drafter_id"] = pc.weights_id(
                a.models, a.pair, "mtp" if a.method == "mtp" else "drafter"
            )
        if ddtree:
            row["speculative_config"] = spec
            row.update(ddtree_step_readings(by_batch0, ddtree_by_batch_size(llm, conc)))
            if costs is not None:
                row["step_costs_ms"] = costs
        elif spec is not None:
            row["k"] = a.mtp_k if a.method == "mtp" else a.chain_k
        if load:
            row["weights_written"] = load
        common.emit("ROW", row)
        name = f"tokens_{a.pair}_{a.dtype}_{a.method}_c{conc}.json"
        with open(os.path.join(a.workdir, name), "w") as f:
            json.dump(toks, f)
        if a.method == "nospec":
            # Untimed: where the other methods' outputs differ, how close the
            # reference's own top two were there (`compare_outputs`).
            gaps = score_outputs(llm, batch, toks)
            name = f"gaps_{a.pair}_{a.dtype}_{a.method}_c{conc}.json"
            with open(os.path.join(a.workdir, name), "w") as f:
                json.dump(gaps, f)
        log(f"{a.pair} {a.dtype} {a.method} {tag}: {row['tok_s']} tok/s")


# ---------------------------------------------------------------- orchestration


def jit_compiles_in(log_lines, rows: list[dict]) -> None:
    """Each timed row's kernel compiles (vLLM's JIT monitor, after warm-up)
    logged while it decoded: ``jit_compiles``, the kernel names. A compile
    stalls the engine for up to seconds, which a short window does not
    absorb."""
    compiles = [m.groups() for m in map(JIT_COMPILE.search, log_lines) if m]
    for r in rows:
        lo, hi = r.get("timed_from"), r.get("timed_to")
        if lo is not None and hi is not None:
            r["jit_compiles"] = [name for at, name in compiles if lo <= at <= hi]


def kv_cache_tokens_in(log_lines, rows: list[dict]) -> None:
    """The engine's KV-cache size in tokens, from vLLM's own startup line, on
    each of its rows (``kv_cache_tokens``): an engine whose cache holds fewer
    requests than the concurrency runs fewer per step, which its tok/s then
    measures."""
    sizes = [m.group(1) for m in map(KV_CACHE_TOKENS.search, log_lines) if m]
    if sizes:
        for r in rows:
            r["kv_cache_tokens"] = int(sizes[-1].replace(",", ""))


def score_outputs(llm, prompts, outputs) -> list[list[float | None]]:
    """Each output's top-2 logprob gap at each of its tokens (None where
    there are not two ranked tokens), from one untimed pass over prompt +
    output but its last token: ``prompt_logprobs`` for the tokens before the
    last, the one generated token's ``logprobs`` for the last (so the pass
    fits ``max_model_len`` whenever the decode did)."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(
        temperature=0.0,
        max_tokens=1,
        logprobs=2,
        prompt_logprobs=2,
        detokenize=False,
    )
    scored = [(p, o) for p, o in zip(prompts, outputs) if o]
    done = llm.generate(
        [TokensPrompt(prompt_token_ids=p + o[:-1]) for p, o in scored],
        params,
        use_tqdm=False,
    )
    results = iter(done)
    gaps: list[list[float | None]] = []
    for output in outputs:
        if not output:
            gaps.append([])
            continue
        d = next(results)
        # prompt_logprobs[k]: the distribution the k-th token was chosen from
        # (read one by one: vLLM 0.26's flat container cannot slice empty).
        n = len(d.prompt_token_ids)
        positions = [d.prompt_logprobs[k] for k in range(n - len(output) + 1, n)]
        positions.append(d.outputs[0].logprobs[0])
        gaps.append([_finite_or_none(common.top2_gap(x)) for x in positions])
    return gaps


def _finite_or_none(x: float) -> float | None:
    return None if math.isinf(x) else round(x, 5)


def _read_json(workdir: str, name: str):
    path = os.path.join(workdir, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def compare_outputs(workdir, pair, dtype, method, conc, ref_method) -> dict | None:
    """``identical_to_<ref_method>``: how many outputs of ``method`` equal
    ``ref_method``'s, as ``"same/total"``. Where the reference scored its
    outputs (`score_outputs`), also ``divergence_gaps``: the reference's
    top-2 gap at each differing output's first differing token, in prompt
    order (None past the end of its output or without two ranked tokens);
    and in float32 how many of those are near-ties (``near_ties_to_<ref>``,
    below ``common.NEAR_TIE_NATS``) and how many are not
    (``mismatches_to_<ref>``). None without both token files."""
    ref, got = (
        _read_json(workdir, f"tokens_{pair}_{dtype}_{m}_c{conc}.json")
        for m in (ref_method, method)
    )
    if ref is None or got is None:
        return None
    same = sum(x == y for x, y in zip(ref, got))
    out: dict = {f"identical_to_{ref_method}": f"{same}/{len(got)}"}
    scores = _read_json(workdir, f"gaps_{pair}_{dtype}_{ref_method}_c{conc}.json")
    if scores is None or len(scores) != len(ref):
        return out
    gaps = []
    for r, g, s in zip(ref, got, scores):
        j = common.first_divergence(r, g)
        if j is not None:
            gaps.append(s[j] if j < len(s) else None)
    out["divergence_gaps"] = gaps
    if dtype == "float32":
        near = sum(gap is not None and gap < common.NEAR_TIE_NATS for gap in gaps)
        out[f"near_ties_to_{ref_method}"] = near
        out[f"mismatches_to_{ref_method}"] = len(gaps) - near
    return out


def annotate(rows: list[dict], workdir: str) -> None:
    """Each greedy row's outputs against no speculation's (no speculation's
    against the small pair's); sampled and profiled rows compare nothing. A
    row whose token files are not in ``workdir`` (an earlier run's, in the
    same --out) keeps what it has."""
    for r in rows:
        if "concurrency" not in r or r.get("temperature", 0.0) > 0 or "profile" in r:
            continue
        if r["method"] == "small":
            continue
        ref = "small" if r["method"] == "nospec" else "nospec"
        key = f"identical_to_{ref}"
        got = compare_outputs(
            workdir, r["pair"], r["dtype"], r["method"], r["concurrency"], ref
        )
        if got is not None:
            r.update(got)
        elif key not in r:
            r[key] = None


def add_engine_options(ap: argparse.ArgumentParser) -> None:
    """The options every engine process takes (engine_command passes them on)."""
    common.add_engine_options(ap)
    common.add_options(ap, {
        "--prompts": (None, "default: <models>/prompts/heldout.jsonl"),
        "--prompt-tokens": (160, "cut each prompt to its last N tokens, leaving "
            "out shorter ones (0: whole): 160 + 256 new tokens stay inside the "
            "512-token windows the pairs were trained on"),
        "--c1-prompts": (8, "prompts decoded at c = 1"),
        "--per-client": (4, "c > 1 decodes this many prompts per client: the "
            "steady window spans about this many request lifetimes less one"),
        "--min-prompts": (0, "c > 1 decodes at least this many prompts"),
        "--max-num-seqs": (0, "each engine's max_num_seqs, at least its largest "
            "concurrency (0: that)"),
        "--mtp-k": (mtp.SPECULATIVE_TOKENS, "draft tokens of the mtp method"),
        "--profile": (False, "profile each steady window instead of timing it "
            "(torch profiler): rows with a 'profile' object, not for the tables"),
    })  # fmt: skip


ENGINE_OPTIONS = (
    *common.ENGINE_OPTIONS,
    *("out", "prompts", "prompt_tokens", "c1_prompts", "per_client", "min_prompts"),
    "max_num_seqs",
    *("mtp_k", "workdir", "profile"),
)


def engine_command(a, pair, dtype, method, conc) -> list[str]:
    """The command line of one engine process (``--engine``) with ``a``'s
    options."""
    return [
        *(sys.executable, "-m", "bench.pairs.run_pairs", "--engine"),
        *("--pair", pair, "--dtype", dtype, "--method", method, "--conc", conc),
        *common.forward(a, ENGINE_OPTIONS),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON rows (rewritten per engine)")
    common.add_options(ap, {
        "--pairs": (",".join(pc.PAIRS), None),
        "--dtypes": ("bfloat16,float32", None),
        "--methods": (",".join(METHODS), None),
        "--small": (False, "also run the small pair"),
        "--conc": ("1,4,8,16,32", None),
        "--plot": (None, "PNG of tokens/s (plot_pairs.py)"),
        "--workdir": (None, "token files (default: next to --out)"),
    })  # fmt: skip
    add_engine_options(ap)
    for internal in ("--pair", "--dtype", "--method"):  # one engine's
        ap.add_argument(internal, help=argparse.SUPPRESS)
    ap.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.prompts = a.prompts or os.path.join(a.models, common.HELDOUT)
    a.workdir = a.workdir or os.path.join(
        os.path.dirname(os.path.abspath(a.out)), "pairs-tokens"
    )
    os.makedirs(a.workdir, exist_ok=True)
    if a.engine:
        a.conc = common.csv_ints(a.conc)
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
            plan.append((pair, "float32", "small", a.conc))
        plan += [
            (pair, dtype, m, a.conc)
            for dtype in a.dtypes.split(",")
            for m in a.methods.split(",")
        ]
    t_all = time.time()
    for k, (pair, dtype, method, conc) in enumerate(plan):
        name = f"{pair} {dtype} {method}"
        log(
            f"engine {k + 1}/{len(plan)}: {name} c={conc} ({time.time() - t_all:.0f} s)"
        )
        t = time.time()
        engine_log = os.path.join(a.workdir, f"engine_{pair}_{dtype}_{method}.log")
        new, rc, _, log_lines = common.run_engine_process(
            engine_command(a, pair, dtype, method, conc),
            a.engine_timeout,
            stdout_path=engine_log,
        )
        jit_compiles_in(log_lines, new)
        kv_cache_tokens_in(log_lines, new)
        for r in new:
            if r.get("jit_compiles"):
                compiles = ", ".join(r["jit_compiles"])
                log(f"{name} c={r['concurrency']}: compiles while timed: {compiles}")
        if rc != 0:
            log(f"engine {name} ended with {rc} after {time.time() - t:.0f} s")
            new.append(dict(pair=pair, dtype=dtype, method=method, error=str(rc)))
        key = (pair, dtype, method)
        rows = [
            r for r in rows if (r.get("pair"), r.get("dtype"), r.get("method")) != key
        ]
        rows += new
        annotate(rows, a.workdir)
        common.write_json(a.out, rows)
    if a.plot:
        cmd = [sys.executable, "-m", "bench.pairs.plot_pairs", a.out, "--out", a.plot]
        subprocess.run(cmd, check=False)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
