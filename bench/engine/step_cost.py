#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The cost of a DDTree step against a DFlash chain step at production shapes,
with dummy weights (tau = 1: the figures are pure step cost), bf16, CUDA graphs:

    python3 -m bench.engine.step_cost --out bench/results/step-cost.json \\
        [--shapes dense-8b,hybrid-27b] [--conc 1,8,32] [--chain-k 15] \\
        [--c1-budgets 64] [--profile-batches 2] \\
        [--tree-attention unified,split] [--prompt-len 128]

Shapes are the benchmark pairs' production configs (Qwen3-8B and Qwen3.6-27B with
their 5-layer DFlash drafters), loaded with ``load_format="dummy"``. One engine
per configuration, each in its own process and in-process inside it (the torch
profiler sees its kernels), all on the V2 model runner: the chain (K =
``--chain-k``), DDTree with ``budget_policy: fixed`` at ``--chain-k`` nodes
(as many verified tokens as the chain) at every ``--conc`` and at each
``--c1-budgets`` at concurrency 1, once per ``--tree-attention`` mode.

Per concurrency: an untimed batch (its kernels compile there), the same
prompts' prefill alone, ``--timed-repeats`` timed decodes (the median taken;
GPU clocks and power sampled meanwhile), then ``--profile-batches`` batches
under the torch profiler (profile.py). ``--weights dummy,pair`` measures again
with the shape's trained pair written in (held-out prompts, both taus): with
dummy weights the chain's drafts are likely one repeated token, which the GPU,
at its power cap, verifies faster than a tree's distinct tokens.

``--out``: ``{"command", "rows", "engines"}``, one row per (shape, weights,
concurrency, tree budget) against the chain (``ratio``, the same less the
prefill: ``decode_ratio``, GPU-busy shares, clocks), rewritten after every
engine.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import sys
import threading
import time
from statistics import median_low

from bench import common
from bench.engine import profile
from bench.engine.probe import RunningProbe, engine_max_concurrency

SHAPES = ("dense-8b", "hybrid-27b")
FORWARDED_OPTIONS = (
    *common.ENGINE_OPTIONS,
    *("out", "timed_batches", "timed_repeats", "profile_batches", "prompt_len"),
    *("profile_max_tokens", "profile_conc", "weights"),
)
log = functools.partial(common.progress, "step_cost")


def engines_for(
    shape: str,
    conc: list[int],
    equal_budget: int,
    c1_budgets: list[int],
    tree_attention: tuple[str, ...] = ("unified",),
) -> list[dict]:
    """The engines of one shape: the chain, then per tree-attention mode
    DDTree at the equal budget at every concurrency and at each other budget
    at concurrency 1."""
    chain = [dict(method="chain", runner="v2", conc=conc)]
    trees = [
        dict(method="ddtree", runner="v2", budget=b, conc=c, tree_attention=mode)
        for mode in tree_attention
        for b, c in [(equal_budget, conc)]
        + [(b, [1]) for b in c1_budgets if b != equal_budget]
    ]
    return chain + trees


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab) for _ in range(length)] for _ in range(n)]


def heldout_prompts(models: str, n: int, length: int) -> list[list[int]]:
    """``n`` of the pairs' held-out prompts (in file order, repeated when
    there are fewer), each cut to its last ``length`` tokens."""
    path = os.path.join(models, common.HELDOUT)
    ids = [p[-length:] for p in common.load_prompts(path) if p]
    return [ids[i % len(ids)] for i in range(n)]


def capped(engine_row: dict) -> str | None:
    """Why an engine ran fewer requests at a time than its row's
    concurrency, or None: the most it held during the timed decodes
    (``max_running``) or, where no step was seen, its KV cache's capacity in
    requests of ``max_model_len`` tokens (``max_concurrency``; on hybrid
    targets the recurrent state's slots count)."""
    c = engine_row["concurrency"]
    running = engine_row.get("max_running")
    if running is not None:
        return f"at most {running} of {c} requests running" if running < c else None
    capacity = engine_row.get("max_concurrency")
    if capacity is not None and capacity < c:
        return f"its KV cache holds {capacity} requests of max_model_len tokens"
    return None


def summarize(engine_rows: list[dict], chain_k: int) -> list[dict]:
    """One step-cost row per DDTree measurement, against the chain at the
    same shape, weights (rows of runs before ``--weights`` were all dummy)
    and concurrency."""

    def key(r: dict) -> tuple:
        return (r["shape"], r.get("weights", "dummy"), r["concurrency"])

    chains = {key(r): r for r in engine_rows if r["method"] == "chain"}
    rows = []
    for r in engine_rows:
        chain = chains.get(key(r))
        if r["method"] != "ddtree" or chain is None:
            continue
        pair = (("chain", chain), ("ddtree", r))
        row = dict(
            shape=r["shape"],
            weights=r.get("weights", "dummy"),
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
        )
        for name, e in pair:
            row[f"{name}_gpu_busy"] = e.get("gpu_busy")
            for field in ("tok_s", "max_concurrency", "max_running"):
                if e.get(field) is not None:
                    row[f"{name}_{field}"] = e[field]
        short = [f"{name} engine: {why}" for name, e in pair if (why := capped(e))]
        if short:
            # Fewer requests at a time than the concurrency asked for: the
            # two ms_per_step are not one step's cost at that concurrency.
            row.update(ratio=None, not_comparable="; ".join(short))
        if row["weights"] != "dummy":  # trained weights: real drafts, tau > 1
            row.update(chain_tau=chain.get("tau"), ddtree_tau=r.get("tau"))
        if chain.get("gpu") and r.get("gpu"):
            for name in ("sm_clock_mhz", "power_w"):
                row[f"chain_{name}"] = chain["gpu"][name]
                row[f"ddtree_{name}"] = r["gpu"][name]
        rows.append(row)
    return rows


# ---------------------------------------------------------------- one engine


class GpuSampler:
    """GPU 0's SM clock, board power, temperature and throttle reasons,
    sampled from a thread while a timed decode runs: two engines' step times
    compare only at the same clocks (a GPU at its power or heat limit runs
    the same kernels slower)."""

    def __init__(self, period_s: float = 0.02):
        self.period_s = period_s
        self.samples: list[tuple[int, float, int, int]] = []
        try:
            from vllm.third_party import pynvml

            pynvml.nvmlInit()
            self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception as exc:  # no NVML: the rows go without the figures
            log(f"no GPU clock samples ({exc})")
            self.nvml = None

    def __enter__(self) -> GpuSampler:
        self.samples, self.stopped = [], threading.Event()
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


def timed_decode(llm, prompts, sp, conc: int) -> tuple[float, int, float]:
    """Decode ``prompts`` ``conc`` at a time: (seconds, new tokens, engine
    steps; the draft counter counts one per request and step)."""
    drafts0 = common.spec_counters(llm)[1]
    t = time.time()
    toks = profile.decode_in_batches(llm, prompts, sp, conc)
    dt = time.time() - t
    return dt, toks, (common.spec_counters(llm)[1] - drafts0) / conc


def decode_ms_per_step(
    decode_s: float, steps: float, prefill_s: float, prefill_steps: float
) -> float | None:
    """Milliseconds per engine step of a timed decode less its prompts'
    prefill (timed alone, one new token per request). None where the decode
    took no step beyond the prefill's."""
    if steps <= prefill_steps:
        return None
    return round((decode_s - prefill_s) * 1e3 / (steps - prefill_steps), 3)


def run_engine(a) -> None:
    """One in-process engine: per concurrency the timed decodes, then the
    profiled ones; one ``ROW {json}`` line each."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    ddtree = a.method == "ddtree"
    if ddtree:
        os.environ["VLLM_DDTREE_TREE_ATTENTION"] = a.tree_attention
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    pdir = os.path.join(a.models, a.shape)
    drafter = os.path.join(pdir, "production-drafter")
    conc = common.csv_ints(a.conc)
    target = os.path.join(pdir, "production-target")
    hybrid = a.shape.startswith("hybrid")
    kw = common.engine_kwargs(
        a, target, "bfloat16", max(conc), hybrid, load_format="dummy"
    )
    weights_modes = [w for w in a.weights.split(",") if w]
    if "pair" in weights_modes:  # the trained pair written in after dummy's
        kw["worker_extension_cls"] = "bench.pairs.pair_worker.EmbeddedPairWorker"
    kw["speculative_config"] = (
        common.ddtree_config(
            drafter, tree_budget=a.budget, draft_depth=a.chain_k, budget_policy="fixed"
        )
        if ddtree
        else common.chain_config(drafter, a.chain_k)
    )
    t0 = time.time()
    llm = LLM(**kw)
    startup_s = round(time.time() - t0, 1)
    log(f"engine up in {startup_s} s")
    n = max(conc) * (a.timed_batches + a.profile_batches + 1)
    vocab = min(llm.llm_engine.model_config.get_vocab_size(), 150000)
    random_set = [
        TokensPrompt(prompt_token_ids=p) for p in random_prompts(n, a.prompt_len, vocab)
    ]
    greedy = dict(temperature=0.0, ignore_eos=True, detokenize=False)
    max_concurrency = engine_max_concurrency(llm)
    if max_concurrency is not None and max_concurrency < max(conc):
        log(f"the engine holds {max_concurrency} requests of {a.max_model_len} tokens")
    ctx = argparse.Namespace(
        llm=llm,
        conc=conc,
        sp=SamplingParams(max_tokens=a.max_tokens, **greedy),
        # The profiler's trace analysis takes far longer than the steps it
        # traces (minutes at c = 32 on the 27B shape): fewer steps suffice.
        profile_sp=SamplingParams(
            max_tokens=a.profile_max_tokens or a.max_tokens, **greedy
        ),
        prefill_sp=SamplingParams(max_tokens=1, **greedy),
        profile_labels=dict(
            mode="ddtree" if ddtree else "dflash",
            budget=a.budget if ddtree else None,
            k=None if ddtree else a.chain_k,
        ),
        sampler=GpuSampler(),
        profile_conc=common.csv_ints(a.profile_conc) or conc,
        startup_s=startup_s,
        max_concurrency=max_concurrency,
        running=RunningProbe(llm),
    )
    llm.generate(random_set[:2], ctx.sp, use_tqdm=False)  # warm-up
    for weights in weights_modes:
        prompts = random_set
        if weights == "pair":
            loads = llm.collective_rpc("load_embedded_pair", args=(pdir, a.shape))
            log(f"pair weights written: {loads[0]}")
            held = heldout_prompts(a.models, n, a.prompt_len)
            prompts = [TokensPrompt(prompt_token_ids=p) for p in held]
        measure(a, ctx, weights, prompts)


def measure(a, ctx, weights: str, prompts: list) -> None:
    """Per concurrency of ``ctx.conc``: an untimed batch, the timed decodes,
    then the profiled ones; one ``ROW {json}`` line each."""
    llm, sampler, ddtree = ctx.llm, ctx.sampler, a.method == "ddtree"
    for c in ctx.conc:
        # Kernels specialised on this concurrency's shapes compile here.
        llm.generate(prompts[-c:], ctx.sp, use_tqdm=False)
        timed = prompts[: c * a.timed_batches]
        # The same prompts' prefill alone (no prefix caching: computed again
        # below): with trained weights the methods decode in different
        # numbers of steps, over which the prefill would spread unequally.
        prefill_s, _, prefill_steps = timed_decode(llm, timed, ctx.prefill_sp, c)
        acc0, drafts0 = common.spec_counters(llm)
        repeats, gpu_repeats = [], []
        ctx.running.max_running = None
        for _ in range(max(1, a.timed_repeats)):
            with sampler, ctx.running:
                repeats.append(timed_decode(llm, timed, ctx.sp, c))
            gpu_repeats.append(sampler.summary())
        acc1, drafts1 = common.spec_counters(llm)
        ms_repeats = [round(dt * 1e3 / steps, 3) for dt, _, steps in repeats]
        # The repeat of the median step time: one slow repeat moves nothing.
        median = ms_repeats.index(median_low(ms_repeats))
        dt, toks, steps = repeats[median]
        log(f"c={c}: {len(timed)} requests x {len(repeats)}: {ms_repeats} ms/step")
        tag = f"{a.shape}-{a.method}-{a.budget if ddtree else a.chain_k}-c{c}"
        if ddtree:
            tag += f"-{a.tree_attention}"
        if weights != "dummy":
            tag += f"-{weights}"
        profiled = prompts[
            c * a.timed_batches : c * (a.timed_batches + a.profile_batches)
        ]
        prof = None
        if c in ctx.profile_conc:
            prof = profile.profile_steps(
                llm, profiled, ctx.profile_sp, c, tag=tag, **ctx.profile_labels
            )
        row = dict(
            shape=a.shape,
            weights=weights,
            method=a.method,
            runner="v2",
            budget=a.budget if ddtree else None,
            tree_attention=a.tree_attention if ddtree else None,
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
        common.emit("ROW", row)
        log(f"{tag}: {row['ms_per_step']} ms/step, GPU busy {row['gpu_busy']}")


# ---------------------------------------------------------------- orchestration


def write_result(a, result: dict) -> None:
    """``result``'s rows from its engines' rows, into ``--out``."""
    measured = [r for r in result["engines"] if "ms_per_step" in r]
    result["rows"] = summarize(measured, a.chain_k)
    common.write_json(a.out, result)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    common.add_engine_options(ap, max_tokens=128)
    common.add_options(ap, {
        "--shapes": (",".join(SHAPES), None),
        "--conc": ("1,8,32", None),
        "--c1-budgets": ("64", "DDTree's budgets at concurrency 1"),
        "--profile-conc": ("", "concurrencies profiled (default: all)"),
        "--timed-batches": (4, None),
        "--timed-repeats": (3, "timed decodes per concurrency, the median taken"),
        "--profile-batches": (2, None),
        "--prompt-len": (128, None),
        "--profile-max-tokens": (0, "tokens per profiled request (0: --max-tokens)"),
        "--weights": ("dummy", "'dummy', 'pair' or 'dummy,pair': 'pair' writes the "
            "shape's trained pair into each engine (after its dummy-weight figures) "
            "and decodes held-out prompts"),
        "--tree-attention": ("unified,split", "VLLM_DDTREE_TREE_ATTENTION modes "
            "(unified, split, auto) of the DDTree engines, one set each"),
    })  # fmt: skip
    ap.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    for internal in ("--shape", "--method"):
        ap.add_argument(internal, help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.engine:
        run_engine(a)
        return
    result = dict(
        command=common.command_line("bench.engine.step_cost", argv),
        rows=[],
        engines=[],
    )
    run_engines(a, result)
    write_result(a, result)
    for r in result["rows"]:
        print(json.dumps(r))


def run_engines(a, result: dict) -> None:
    """Every engine of the plan in its own process; ``--out`` after each."""
    conc = common.csv_ints(a.conc)
    modes = tuple(m for m in a.tree_attention.split(",") if m)
    c1_budgets = common.csv_ints(a.c1_budgets)
    plan = [
        (shape, e)
        for shape in a.shapes.split(",")
        for e in engines_for(shape, conc, a.chain_k, c1_budgets, modes)
    ]
    t_all = time.time()
    for k, (shape, e) in enumerate(plan):
        keys = ("method", "runner", "budget", "tree_attention", "conc")
        what = " ".join(str(e.get(x, "")) for x in keys)
        log(f"engine {k + 1}/{len(plan)}: {shape} {what} ({time.time() - t_all:.0f} s)")
        cmd = [sys.executable, "-m", "bench.engine.step_cost", "--engine"]
        cmd += ["--shape", shape, "--method", e["method"]]
        cmd += ["--conc", ",".join(map(str, e["conc"]))]
        cmd += common.forward(a, FORWARDED_OPTIONS)
        if e.get("budget"):
            cmd += ["--budget", str(e["budget"])]
        if e.get("tree_attention"):
            cmd += ["--tree-attention", e["tree_attention"]]
        new, rc, _, lines = common.run_engine_process(cmd, a.engine_timeout)
        if rc == "timeout":
            log(f"engine {k + 1} ran past {a.engine_timeout} s")
        # vLLM logs to stdout: its lines (startup, PROFILE records) go to
        # this run's log, apart from the rows.
        sys.stderr.write("".join(x + "\n" for x in lines))
        result["engines"] += new or [dict(shape=shape, **e, error="no rows")]
        write_result(a, result)


if __name__ == "__main__":
    main()
