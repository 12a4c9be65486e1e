#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The cost of a DDTree step against a DFlash chain step at production shapes,
with dummy weights (tau = 1: the figures are pure step cost), bf16, CUDA graphs:

    python3 -m bench.engine.step_cost --out bench/results/step-cost.json \\
        [--shapes dense-8b,hybrid-27b] [--conc 1,8,32] [--chain-k 15] \\
        [--equal-budget 15] [--c1-budgets 64] [--profile-batches 4] \\
        [--tree-attention unified,split] [--prompt-len 128]

Shapes are the benchmark pairs' production configs
(``bench/pairs/models/<shape>/production-{target,drafter}``: Qwen3-8B and
Qwen3.6-27B with their 5-layer DFlash drafters), loaded with
``load_format="dummy"``. One engine per configuration, each in its own process:
the chain (K = ``--chain-k``; on the hybrid shape on both model runners, V1 as
vLLM picks by default and V2 as DDTree always runs), DDTree with
``budget_policy: fixed`` at ``--equal-budget`` nodes (as many verified tokens
per request as the chain) at every ``--conc``, and DDTree at each
``--c1-budgets`` at concurrency 1; the DDTree engines once per
``--tree-attention`` mode, set as ``VLLM_DDTREE_TREE_ATTENTION`` in each DDTree
engine (by default ``unified``, the Triton kernel, and ``split``, the FA3 prefix
+ tree kernel: both timed, whichever the engine's own default, ``auto``, would
take).

Each engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the torch
profiler sees its kernels) and, per concurrency: an untimed batch (kernels
specialised on its shapes compile there), ``--timed-repeats`` timed decodes of
the same prompts (wall time per engine step, no profiler; the row takes the
median and keeps them all), then ``--profile-batches`` batches under the
profiler (profile.py's ``profile_steps``: the share of the step the GPU is
busy, GPU time by kernel class and by phase, the top kernels and host ops).

With ``--weights dummy,pair`` each engine, once its dummy-weight figures are
taken, gets the shape's trained benchmark pair written in place
(bench/pairs/pair_worker.py) and measures again on the pairs' held-out
prompts (rows with ``"weights": "pair"`` and both taus). Dummy weights give
tau = 1, but the chain's drafts are then likely one token repeated (every
mask position of a near-zero drafter reads alike): a verify batch that the
GPU, at its power cap, runs faster than the distinct tokens of a tree.
Trained weights give both methods real drafts.

``--out`` holds ``{"command", "rows", "profiles"}``: one row per (shape,
concurrency, tree budget) with ``chain_ms_per_step``, ``ddtree_ms_per_step``,
their ratio, ``equal_tokens``, the same less each batch's prefill
(``*_decode_ms_per_step`` and ``decode_ratio``: the prefill timed alone, one
new token per request; with trained weights the methods take different
numbers of steps, over which ms_per_step spreads the prefill unequally) and
both GPU-busy shares (``chain_runner`` says
which chain the row compares with: the V2 runner's on the hybrid shape, the
runner DDTree uses; the V1 chain's figures are in ``chain_v1_*``), and each
engine's PROFILE records. It is rewritten after every engine, so a cut run
keeps what finished.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
import traceback
from statistics import median_low

from bench import common
from bench.engine import profile
from bench.engine.probe import RunningProbe, engine_max_concurrency

SHAPES = ("dense-8b", "hybrid-27b")
# Options the orchestrator passes on to each engine process.
FORWARDED_OPTIONS = (
    *common.ENGINE_OPTIONS,
    "out",
    "timed_batches",
    "timed_repeats",
    "profile_batches",
    "prompt_len",
    "profile_max_tokens",
    "stack_dump_s",
    "host_profile_conc",
    "profile_conc",
    "weights",
)


log = functools.partial(common.progress, "step_cost")


def engines_for(
    shape: str,
    conc: list[int],
    equal_budget: int,
    c1_budgets: list[int],
    tree_attention: tuple[str, ...] = ("unified",),
    chain_last: bool = False,
    v1_chain: bool = True,
    chain_twice: bool = False,
) -> list[dict]:
    """The engines of one shape: the V2 chain, then per tree-attention mode
    DDTree at the equal budget at every concurrency and at each larger budget
    at concurrency 1, and on the hybrid shape the V1 chain. ``chain_last``
    puts the V2 chain after the DDTree engines (a run cut short then still
    has DDTree's figures); ``v1_chain`` False leaves the V1 chain out;
    ``chain_twice`` runs the V2 chain both before and after the DDTree engines
    (a drift of the GPU's clocks over the run then shows as two chain
    figures apart)."""
    engines = [dict(method="chain", runner="v2", conc=conc)]
    for mode in tree_attention:
        engines.append(
            dict(
                method="ddtree",
                runner="v2",
                budget=equal_budget,
                conc=conc,
                tree_attention=mode,
            )
        )
        engines += [
            dict(method="ddtree", runner="v2", budget=b, conc=[1], tree_attention=mode)
            for b in c1_budgets
            if b != equal_budget
        ]
    # The V1 chain (what vLLM picks for a hybrid target by default) last: the
    # rows compare with the V2 chain, so a run cut short keeps those first.
    if chain_twice:
        engines.append(dict(engines[0]))
    elif chain_last:
        engines = engines[1:] + engines[:1]
    if shape.startswith("hybrid") and v1_chain:
        engines.append(dict(method="chain", runner="v1", conc=conc))
    return engines


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab) for _ in range(length)] for _ in range(n)]


def profiled_gpu_ms(engine_row: dict) -> float | None:
    """The profiled GPU time per step in ms, or None for a row without a
    profile or a timed step (a timed-only concurrency)."""
    prof = engine_row.get("profile")
    if not prof or not engine_row.get("ms_per_step"):
        return None
    return sum(prof["gpu_us_per_step"].values()) / 1e3


def gpu_busy_timed(engine_row: dict) -> float | None:
    """The profiled GPU time per step over the timed (unprofiled) step: the
    GPU's busy share of a real step. The profiled decode's own busy share
    (``gpu_busy``) counts the profiler's host overhead and, on short
    profiled decodes, the prefill's host work as idle time."""
    gpu_ms = profiled_gpu_ms(engine_row)
    if gpu_ms is None:
        return None
    return round(gpu_ms / engine_row["ms_per_step"], 3)


def host_gap_ms(engine_row: dict) -> float | None:
    """The timed step's time without GPU work: the timed (unprofiled) step
    minus the profiled GPU time per step, in ms."""
    gpu_ms = profiled_gpu_ms(engine_row)
    if gpu_ms is None:
        return None
    return round(engine_row["ms_per_step"] - gpu_ms, 3)


def capped(engine_row: dict) -> str | None:
    """Why an engine ran fewer requests at a time than its row's
    concurrency, or None: the most it held during the timed decodes
    (``max_running``) or, for logs without that, its KV cache's capacity in
    requests of ``max_model_len`` tokens (``max_concurrency``, as vLLM logs
    it at startup; on hybrid targets the recurrent state's slots count)."""
    c = engine_row["concurrency"]
    running = engine_row.get("max_running")
    if running is not None:
        return f"at most {running} of {c} requests running" if running < c else None
    capacity = engine_row.get("max_concurrency")
    if capacity is not None and capacity < c:
        return f"its KV cache holds {capacity} requests of max_model_len tokens"
    return None


def weights_of(engine_row: dict) -> str:
    """The weights an engine row was measured with (rows of runs before
    ``--weights`` existed were all dummy)."""
    return engine_row.get("weights", "dummy")


def summarize(engine_rows: list[dict], chain_k: int) -> list[dict]:
    """One step-cost row per DDTree measurement, against the chain of the
    runner DDTree uses (V2) at the same shape and concurrency."""
    by_key: dict[tuple, dict] = {}
    v2_passes: dict[tuple, list[float]] = {}
    for r in engine_rows:
        if r["method"] == "chain":
            key = (r["shape"], weights_of(r), "chain", r["runner"], r["concurrency"])
            if key in by_key and r["runner"] == "v2":
                # The chain ran before and after the DDTree engines: their
                # mean is the figure, both are kept.
                passes = v2_passes.setdefault(key, [by_key[key]["ms_per_step"]])
                passes.append(r["ms_per_step"])
                r = dict(r, ms_per_step=round(sum(passes) / len(passes), 3))
            by_key[key] = r
    rows = []
    for r in engine_rows:
        if r["method"] != "ddtree":
            continue
        w = weights_of(r)
        chain = by_key.get((r["shape"], w, "chain", "v2", r["concurrency"]))
        if chain is None:
            continue
        row = dict(
            shape=r["shape"],
            weights=w,
            concurrency=r["concurrency"],
            tree_budget=r["budget"],
            tree_attention=r.get("tree_attention", "unified"),
            chain_k=chain_k,
            chain_runner="v2",
            chain_ms_per_step=chain["ms_per_step"],
            ddtree_ms_per_step=r["ms_per_step"],
            ratio=round(r["ms_per_step"] / chain["ms_per_step"], 3),
            equal_tokens=r["budget"] == chain_k,
            chain_decode_ms_per_step=chain.get("decode_ms_per_step"),
            ddtree_decode_ms_per_step=r.get("decode_ms_per_step"),
            decode_ratio=(
                round(r["decode_ms_per_step"] / chain["decode_ms_per_step"], 3)
                if r.get("decode_ms_per_step") and chain.get("decode_ms_per_step")
                else None
            ),
            chain_gpu_busy=chain.get("gpu_busy"),
            ddtree_gpu_busy=r.get("gpu_busy"),
            chain_gpu_busy_timed=gpu_busy_timed(chain),
            ddtree_gpu_busy_timed=gpu_busy_timed(r),
            chain_host_gap_ms=host_gap_ms(chain),
            ddtree_host_gap_ms=host_gap_ms(r),
        )
        for name, e in (("chain", chain), ("ddtree", r)):
            for field in ("tok_s", "max_concurrency", "max_running"):
                if e.get(field) is not None:
                    row[f"{name}_{field}"] = e[field]
        short = [
            f"{name} engine: {why}"
            for name, e in (("chain", chain), ("ddtree", r))
            if (why := capped(e))
        ]
        if short:
            # Fewer requests at a time than the concurrency asked for:
            # ms_per_step divides by steps of `concurrency` requests, which
            # that engine did not run, so the two are not one step's cost.
            row.update(ratio=None, not_comparable="; ".join(short))
        if w != "dummy":
            # Trained weights: both methods accept tokens (tau > 1), from
            # real drafts on both sides.
            row.update(chain_tau=chain.get("tau"), ddtree_tau=r.get("tau"))
        key = (r["shape"], w, "chain", "v2", r["concurrency"])
        if key in v2_passes:
            row["chain_ms_per_step_passes"] = v2_passes[key]
        for name in ("sm_clock_mhz", "power_w"):
            if chain.get("gpu") and r.get("gpu"):
                row[f"chain_{name}"] = chain["gpu"][name]
                row[f"ddtree_{name}"] = r["gpu"][name]
        v1 = by_key.get((r["shape"], w, "chain", "v1", r["concurrency"]))
        if v1 is not None:
            row.update(
                chain_v1_ms_per_step=v1["ms_per_step"],
                chain_v1_gpu_busy=v1.get("gpu_busy"),
                ratio_to_chain_v1=round(r["ms_per_step"] / v1["ms_per_step"], 3),
            )
        rows.append(row)
    return rows


# ---------------------------------------------------------------- one engine


class StageWatchdog:
    """Print every thread's Python stack to stderr when a stage runs past
    ``period_s`` (again each period), so that a slow or stuck engine says
    where it is. The stacks are read by a Python thread holding the GIL
    (``sys._current_frames``): faulthandler's watchdog reads them without
    it, and crashed engines mid-compile when it fired."""

    def __init__(self, period_s: float):
        self.period_s = period_s
        self.deadline = time.monotonic() + period_s
        self.stopped = threading.Event()
        # 0: off. A dump holds the GIL; one a second would perturb the timing.
        if period_s > 0:
            threading.Thread(target=self._run, daemon=True).start()

    def rearm(self) -> None:
        self.deadline = time.monotonic() + self.period_s

    def stop(self) -> None:
        self.stopped.set()

    def _run(self) -> None:
        me = threading.get_ident()
        while not self.stopped.wait(1.0):
            if time.monotonic() < self.deadline:
                continue
            self.rearm()
            names = {t.ident: t.name for t in threading.enumerate()}
            dump = [f"stage running past {self.period_s} s; stacks:"]
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    dump.append(f"--- thread {names.get(ident, ident)}")
                    dump += [x.rstrip() for x in traceback.format_stack(frame)]
            log("\n".join(dump))


class GpuSampler:
    """GPU 0's SM clock, board power and temperature, sampled from a thread
    while a timed decode runs. Two engines' step times compare only at the
    same clocks: a GPU held at its power or heat limit runs the same kernels
    slower (the figures of a run that drifted say so)."""

    def __init__(self, period_s: float = 0.02):
        self.period_s = period_s
        self.samples: list[tuple[int, float, int, int]] = []
        try:
            from vllm.third_party import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception as exc:  # no NVML: the rows go without the figures
            log(f"no GPU clock samples ({exc})")
            self.nvml = None

    def __enter__(self) -> GpuSampler:
        self.samples = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        if self.nvml is not None:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join()

    def _run(self) -> None:
        nvml, h = self.nvml, self.handle
        while not self.stopped.wait(self.period_s):
            self.samples.append(
                (
                    nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM),
                    nvml.nvmlDeviceGetPowerUsage(h) / 1e3,
                    nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU),
                    nvml.nvmlDeviceGetCurrentClocksThrottleReasons(h),
                )
            )

    def summary(self) -> dict | None:
        """Mean and lowest SM clock, mean power, highest temperature and the
        throttle reasons seen (NVML's bit mask, OR over the samples)."""
        if not self.samples:
            return None
        clocks, power, temp, reasons = zip(*self.samples)
        mask = 0
        for bits in reasons:
            mask |= bits
        return dict(
            sm_clock_mhz=round(sum(clocks) / len(clocks)),
            sm_clock_min_mhz=min(clocks),
            power_w=round(sum(power) / len(power), 1),
            temp_max_c=max(temp),
            throttle_reasons=hex(mask),
            samples=len(clocks),
        )


def host_profile(llm, prompts, sp, conc: int, steps_of, top: int = 40) -> dict:
    """Decode ``prompts`` ``conc`` at a time under cProfile (the engine runs
    in this thread): where the host time of a step goes, by Python function.
    ``steps_of()`` counts engine steps (the draft counter). Per step: the
    functions' own time (``self_us``), their time with callees (``cum_us``)
    and their calls; the top ``top`` by each."""
    import cProfile
    import pstats

    s0 = steps_of()
    prof = cProfile.Profile()
    t = time.time()
    prof.enable()
    for i in range(0, len(prompts), conc):
        llm.generate(prompts[i : i + conc], sp, use_tqdm=False)
    prof.disable()
    dt = time.time() - t
    steps = max(steps_of() - s0, 1.0)
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tt, ct, _)

    def name(key: tuple) -> str:
        file, line, func = key
        parts = file.replace("\\", "/").split("/")
        return f"{'/'.join(parts[-2:])}:{line}:{func}"[-90:]

    def rows(col: int) -> dict:
        ranked = sorted(stats.items(), key=lambda kv: -kv[1][col])[:top]
        return {
            name(k): dict(
                self_us=round(v[2] * 1e6 / steps, 1),
                cum_us=round(v[3] * 1e6 / steps, 1),
                calls=round(v[1] / steps, 2),
            )
            for k, v in ranked
        }

    return dict(
        conc=conc,
        prompts=len(prompts),
        steps=round(steps, 1),
        wall_ms_per_step=round(dt * 1e3 / steps, 3),
        by_self=rows(2),
        by_cum=rows(3),
    )


def timed_decode(llm, prompts, sp, conc: int) -> tuple[float, int, float]:
    """Decode ``prompts`` ``conc`` at a time: (seconds, new tokens, engine
    steps; the draft counter counts one per request and step)."""
    drafts0 = profile.spec_metrics(llm)[1]
    t = time.time()
    toks = 0
    for i in range(0, len(prompts), conc):
        outs = llm.generate(prompts[i : i + conc], sp, use_tqdm=False)
        toks += sum(len(o.outputs[0].token_ids) for o in outs)
    dt = time.time() - t
    return dt, toks, (profile.spec_metrics(llm)[1] - drafts0) / conc


def decode_ms_per_step(
    decode_s: float, steps: float, prefill_s: float, prefill_steps: float
) -> float | None:
    """Milliseconds per engine step of a timed decode less its prompts'
    prefill (timed alone, one new token per request): the decode steps' own
    cost. None where the decode took no step beyond the prefill's."""
    if steps <= prefill_steps:
        return None
    return round((decode_s - prefill_s) * 1e3 / (steps - prefill_steps), 3)


def run_engine(a) -> None:
    """One in-process engine: a timed decode, then a profiled one, per
    concurrency; one ``ROW {json}`` line each."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if a.runner == "v2":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    mode = a.tree_attention if a.method == "ddtree" else None
    if mode:
        os.environ["VLLM_DDTREE_TREE_ATTENTION"] = mode

    watchdog = StageWatchdog(a.stack_dump_s)

    def stage_done(msg: str) -> None:
        """Log a finished stage and re-arm the watchdog."""
        if msg:
            log(msg)
        watchdog.rearm()

    stage_done("")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    pdir = os.path.join(a.models, a.shape)
    target = os.path.join(pdir, "production-target")
    drafter = os.path.join(pdir, "production-drafter")
    conc = [int(c) for c in a.conc.split(",")]
    budget = a.budget if a.method == "ddtree" else None
    kw = common.engine_kwargs(
        a, target, "bfloat16", max(conc), a.shape.startswith("hybrid")
    )
    kw["load_format"] = "dummy"
    weights_modes = [w for w in a.weights.split(",") if w]
    if "pair" in weights_modes:
        # The trained pair is written into the dummy engine in place
        # (bench/pairs/pair_worker.py) after the dummy-weight measurements.
        kw["worker_extension_cls"] = "bench.pairs.pair_worker.EmbeddedPairWorker"
    if a.method == "chain":
        kw["speculative_config"] = common.chain_config(drafter, a.chain_k)
    else:
        kw["speculative_config"] = dict(
            method="ddtree",
            model=drafter,
            tree_budget=budget,
            draft_depth=a.chain_k,
            budget_policy="fixed",
        )
    t0 = time.time()
    llm = LLM(**kw)
    startup_s = round(time.time() - t0, 1)
    stage_done(f"engine up in {startup_s} s")
    vocab = llm.llm_engine.model_config.get_vocab_size()
    host_conc = [int(c) for c in a.host_profile_conc.split(",") if c]
    profile_conc = (
        [int(c) for c in a.profile_conc.split(",") if c] if a.profile_conc else conc
    )
    n = max(conc) * (a.timed_batches + a.profile_batches + 1)
    random_set = [
        TokensPrompt(prompt_token_ids=p)
        for p in random_prompts(n, a.prompt_len, min(vocab, 150000))
    ]
    sp = SamplingParams(
        temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True, detokenize=False
    )
    # The profiler's trace analysis takes far longer than the steps it
    # traces (minutes at c = 32 on the 27B shape): fewer steps suffice.
    profile_sp = SamplingParams(
        temperature=0.0,
        max_tokens=a.profile_max_tokens or a.max_tokens,
        ignore_eos=True,
        detokenize=False,
    )
    prefill_sp = SamplingParams(
        temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False
    )
    max_concurrency = engine_max_concurrency(llm)
    if max_concurrency is not None and max_concurrency < max(conc):
        log(
            f"the engine holds {max_concurrency} requests of {a.max_model_len} "
            f"tokens, fewer than concurrency {max(conc)}"
        )
    t = time.time()
    llm.generate(random_set[:2], sp, use_tqdm=False)  # warm-up
    stage_done(f"warm-up in {time.time() - t:.1f} s")
    sampler = GpuSampler()
    ddtree = a.method == "ddtree"
    profile_labels = dict(
        mode="ddtree" if ddtree else "dflash",
        budget=budget if ddtree else None,
        k=None if ddtree else a.chain_k,
    )
    ctx = argparse.Namespace(
        llm=llm,
        sp=sp,
        profile_sp=profile_sp,
        prefill_sp=prefill_sp,
        profile_labels=profile_labels,
        sampler=sampler,
        conc=conc,
        profile_conc=profile_conc,
        host_conc=host_conc,
        budget=budget,
        mode=mode,
        startup_s=startup_s,
        stage_done=stage_done,
        max_concurrency=max_concurrency,
        running=RunningProbe(llm),
    )
    for weights in weights_modes:
        prompts = random_set
        if weights == "pair":
            loads = llm.collective_rpc("load_embedded_pair", args=(pdir, a.shape))
            stage_done(f"pair weights written: {loads[0]}")
            prompts = [
                TokensPrompt(prompt_token_ids=p)
                for p in heldout_prompts(a.models, n, a.prompt_len)
            ]
        measure(a, ctx, weights, prompts)


def heldout_prompts(models: str, n: int, length: int) -> list[list[int]]:
    """``n`` of the pairs' held-out prompts (in file order, repeated when
    there are fewer), each cut to its last ``length`` tokens."""
    with open(os.path.join(models, "prompts", "heldout.jsonl")) as f:
        ids = [json.loads(line)["prompt_token_ids"] for line in f if line.strip()]
    ids = [p[-length:] for p in ids if p]
    return [ids[i % len(ids)] for i in range(n)]


def measure(a, ctx, weights: str, prompts: list) -> None:
    """Per concurrency of ``ctx.conc``: an untimed batch, the timed decodes,
    then the profiled ones; one ``ROW {json}`` line each. ``ctx`` holds the
    engine and what run_engine set up for it."""
    llm, sp, profile_sp, sampler = ctx.llm, ctx.sp, ctx.profile_sp, ctx.sampler
    budget, mode, stage_done = ctx.budget, ctx.mode, ctx.stage_done
    for c in ctx.conc:
        # One untimed batch at this concurrency first: kernels specialised
        # on its shapes compile here, not inside the timed decode.
        llm.generate(prompts[-c:], sp, use_tqdm=False)
        timed = prompts[: c * a.timed_batches]
        # The same prompts' prefill alone (one new token each; no prefix
        # caching, so it is computed again below): with trained weights the
        # methods decode in different numbers of steps, over which the
        # prefill's time would otherwise be spread unequally.
        prefill_s, _, prefill_steps = timed_decode(llm, timed, ctx.prefill_sp, c)
        acc0, drafts0, _ = profile.spec_metrics(llm)
        repeats, gpu_repeats = [], []
        ctx.running.max_running = None
        for _ in range(max(1, a.timed_repeats)):
            with sampler, ctx.running:
                repeats.append(timed_decode(llm, timed, sp, c))
            gpu_repeats.append(sampler.summary())
        acc1, drafts1, _ = profile.spec_metrics(llm)
        ms_repeats = [round(dt * 1e3 / steps, 3) for dt, _, steps in repeats]
        # The repeat of the median step time (the same prompts each time; no
        # prefix caching): one slow repeat does not move the figure.
        median = ms_repeats.index(median_low(ms_repeats))
        dt, toks, steps = repeats[median]
        stage_done(
            f"c={c}: timed {len(timed)} requests x {len(repeats)}: {ms_repeats} ms/step"
            + (f", GPU {gpu_repeats[median]}" if gpu_repeats[median] else "")
        )
        tag = f"{a.shape}-{a.method}-{a.runner}-{budget or a.chain_k}-c{c}"
        if mode:
            tag += f"-{mode}"
        if weights != "dummy":
            tag += f"-{weights}"
        profiled = prompts[
            c * a.timed_batches : c * (a.timed_batches + a.profile_batches)
        ]
        prof = None
        if c in ctx.profile_conc:
            prof = profile.profile_steps(
                llm, profiled, profile_sp, c, tag=tag, **ctx.profile_labels
            )
            stage_done("")
        host = None
        if c in ctx.host_conc:
            # The profiled prompts again (their prefix is not cached): the
            # same decode under cProfile instead of the torch profiler.
            host = host_profile(
                llm,
                profiled,
                profile_sp,
                c,
                lambda c=c: profile.spec_metrics(llm)[1] / c,
            )
            stage_done(
                f"c={c}: host profile {host['wall_ms_per_step']} ms/step "
                f"over {host['steps']} steps"
            )
        row = dict(
            shape=a.shape,
            weights=weights,
            method=a.method,
            runner=a.runner,
            budget=budget,
            tree_attention=mode,
            concurrency=c,
            ms_per_step=round(dt * 1e3 / steps, 3),
            ms_per_step_repeats=ms_repeats,
            decode_ms_per_step=decode_ms_per_step(dt, steps, prefill_s, prefill_steps),
            prefill_s=round(prefill_s, 4),
            gpu=gpu_repeats[median],
            tok_s=round(toks / dt, 1),
            tau=round(1 + (acc1 - acc0) / (drafts1 - drafts0), 3),
            steps=round(steps, 1),
            gpu_busy=prof["gpu_busy_share"] if prof else None,
            profiled_ms_per_step=round(prof["wall_us_per_step"] / 1e3, 3)
            if prof
            else None,
            startup_s=ctx.startup_s,
            max_concurrency=ctx.max_concurrency,
            max_running=ctx.running.max_running,
            profile=prof,
        )
        if host is not None:
            row["host_profile"] = host
        common.emit("ROW", row)
        log(
            f"{tag}: {row['ms_per_step']} ms/step, GPU busy {row['gpu_busy']}, "
            f"tau {row['tau']}"
        )


# ---------------------------------------------------------------- orchestration


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    common.add_engine_options(ap, max_tokens=128)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--conc", default="1,8,32")
    ap.add_argument("--equal-budget", type=int, default=15)
    ap.add_argument("--c1-budgets", default="64")
    ap.add_argument(
        "--chain-last",
        action="store_true",
        help="run the V2 chain after the DDTree engines",
    )
    ap.add_argument(
        "--chain-twice",
        action="store_true",
        help="run the V2 chain before and after the DDTree engines; the rows "
        "take the mean of the two and keep both",
    )
    ap.add_argument(
        "--no-v1-chain",
        action="store_true",
        help="leave out the hybrid shape's V1-runner chain",
    )
    ap.add_argument(
        "--host-profile-conc",
        default="",
        help="concurrencies at which each engine also decodes the profiled "
        "batches under cProfile (host time per step by Python function)",
    )
    ap.add_argument(
        "--profile-conc",
        default="",
        help="concurrencies profiled under the torch profiler (default: all "
        "of --conc; the others are timed only)",
    )
    ap.add_argument("--timed-batches", type=int, default=4)
    ap.add_argument(
        "--timed-repeats",
        type=int,
        default=3,
        help="timed decodes per concurrency (the same prompts); the row takes "
        "the median step time and keeps them all",
    )
    ap.add_argument("--profile-batches", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument(
        "--profile-max-tokens",
        type=int,
        default=0,
        help="new tokens per profiled request (0: --max-tokens)",
    )
    ap.add_argument(
        "--stack-dump-s",
        type=int,
        default=240,
        help="an engine stage running longer prints its Python stacks "
        "(again each period; 0: never)",
    )
    ap.add_argument(
        "--weights",
        default="dummy",
        help="'dummy', 'pair' or 'dummy,pair': 'pair' writes the trained "
        "benchmark pair of the shape into each engine (after its dummy-weight "
        "measurements, if any: one engine start for both) and decodes held-out "
        "prompts, so that both methods verify real drafts",
    )
    ap.add_argument(
        "--rows-from",
        default="",
        help="comma-separated logs of engines run one by one (this script's "
        "--engine mode, whose ROW lines they hold): write --out from their "
        "rows, as a run of all of them would, and start no engine",
    )
    ap.add_argument(
        "--tree-attention",
        default="unified,split",
        help="DDTree's target tree attention modes (VLLM_DDTREE_TREE_ATTENTION: "
        "unified, split or auto), one set of DDTree engines each; the default "
        "times both kernels",
    )
    # one engine (internal)
    ap.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--runner", help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.engine:
        run_engine(a)
        return
    if a.rows_from:
        rows_from_logs(a, argv)
        return
    conc = [int(c) for c in a.conc.split(",")]
    c1_budgets = [int(b) for b in a.c1_budgets.split(",") if b]
    plan = [
        (shape, e)
        for shape in a.shapes.split(",")
        for e in engines_for(
            shape,
            conc,
            a.equal_budget,
            c1_budgets,
            tuple(m for m in a.tree_attention.split(",") if m),
            a.chain_last,
            not a.no_v1_chain,
            a.chain_twice,
        )
    ]
    result = dict(command=run_command(argv), rows=[], engines=[])
    t_all = time.time()
    for k, (shape, e) in enumerate(plan):
        log(
            f"engine {k + 1}/{len(plan)}: {shape} {e['method']} runner {e['runner']} "
            f"budget {e.get('budget')} {e.get('tree_attention', '')} c={e['conc']} "
            f"({time.time() - t_all:.0f} s)"
        )
        cmd = [
            sys.executable,
            "-m",
            "bench.engine.step_cost",
            "--engine",
            "--shape",
            shape,
            "--method",
            e["method"],
            "--runner",
            e["runner"],
            "--conc",
            ",".join(map(str, e["conc"])),
        ]
        cmd += common.forward(a, FORWARDED_OPTIONS)
        if e.get("budget"):
            cmd += ["--budget", str(e["budget"])]
        if e.get("tree_attention"):
            cmd += ["--tree-attention", e["tree_attention"]]
        try:
            out = subprocess.run(
                cmd, stdout=subprocess.PIPE, text=True, timeout=a.engine_timeout
            ).stdout
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else ""
            log(f"engine {k + 1} ran past {a.engine_timeout} s")
        # vLLM logs to stdout: keep its lines (startup timings, PROFILE
        # records) in this run's log, apart from the rows.
        lines = out.splitlines()
        sys.stderr.write("".join(x + "\n" for x in lines if not x.startswith("ROW ")))
        new = engine_rows(lines)
        if not new:
            result["engines"].append(dict(shape=shape, **e, error="no rows"))
        result["engines"] += new
        write_result(a, result)
    for r in result["rows"]:
        print(json.dumps(r))


def run_command(argv: list[str] | None) -> str:
    return common.command_line("bench.engine.step_cost", argv)


# vLLM's startup line of the KV cache's capacity in requests.
MAX_CONCURRENCY = re.compile(
    r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x"
)


def engine_rows(lines) -> list[dict]:
    """The ``ROW {json}`` lines of an engine's output. A row without its
    engine's capacity (``max_concurrency``; rows of runs before it was
    recorded) takes it from vLLM's startup line in the same output."""
    rows, capacity = [], None
    for x in lines:
        if x.startswith("ROW "):
            row = json.loads(x[4:])
            if row.get("max_concurrency") is None and capacity is not None:
                row["max_concurrency"] = capacity
            rows.append(row)
        elif m := MAX_CONCURRENCY.search(x):
            capacity = float(m.group(1))
    return rows


def write_result(a, result: dict) -> None:
    """``result``'s rows from its engines' rows, into ``--out``."""
    result["rows"] = summarize(
        [r for r in result["engines"] if "ms_per_step" in r], a.chain_k
    )
    common.write_json(a.out, result)


def rows_from_logs(a, argv: list[str] | None) -> None:
    """``--out`` from the ROW lines of engines run one by one."""
    result = dict(command=run_command(argv), rows=[], engines=[])
    for path in a.rows_from.split(","):
        with open(path) as f:
            new = engine_rows(f)
        if not new:
            raise SystemExit(f"{path}: no ROW lines (an engine's log is needed)")
        result["engines"] += new
    write_result(a, result)
    for r in result["rows"]:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
