# SPDX-License-Identifier: Apache-2.0
"""Where an engine step's time goes, under the torch profiler (engine
in-process): wall time per step, the share of it the GPU is busy, GPU kernel
time split into the DDTree tree build (our Triton build kernels), DDTree
bookkeeping (tree bias, walk, KV compaction) and the rest (the forwards,
sampling), the same time by phase (the DFlash pass: a profiler range around
the speculator's propose(), the tree build taken out), host time by op, and
the steps with a prefill chunk apart from the others.
With ``VLLM_DDTREE_BACKEND=torch`` the build has no kernels of its own names
and counts as "other". Used by ``engine/step_cost.py`` and
``pairs/run_pairs.py --profile``."""

import bisect
import functools
import re
import time
from collections import Counter

from bench import common

# Kernel-name patterns of DDTree's own GPU work.
TREE_BUILD_KERNELS = re.compile(
    r"_vocab_chunk_kernel|_topk_merge_kernel|_vocab_merge_kernel|_tree_kernel\b"
    r"|_vocab_stats_kernel|_vocab_threshold_kernel|_vocab_filter_kernel"
    r"|_fallback_chunk_kernel|_fallback_merge_kernel"
)
BOOKKEEPING_KERNELS = re.compile(
    r"_ddtree_walk_kernel|_ddtree_tree_bias_kernel|_ddtree_compact_kv_kernel"
    r"|_ddtree_compact_rows_kernel|_commit_conv_kernel|_commit_gdn_kernel"
    r"|_ddtree_tree_positions_kernel|_ddtree_store_trees_kernel"
)
RANGE_PREFIX = "ddtree_bench::"
DRAFT_RANGE = RANGE_PREFIX + "draft"
# The engine steps' ranges (`label_steps`): the runner's execute_model and
# sample_tokens of a step with a prefill chunk ("mixed") or without.
STEP_KINDS = ("mixed", "decode")
# Kernels kept per profile (enough for a step's tail past the target's
# GEMMs) and host operators per step kind.
TOP_KERNELS = 30
TOP_HOST_OPS = 12


def _step_range(phase: str, kind: str) -> str:
    return f"{RANGE_PREFIX}{phase}_{kind}"


def _has_prefill(scheduler_output) -> bool:
    """Whether a step schedules more tokens for some request than one plus
    its drafts: a prefill chunk (a new request's or a long prompt's next)."""
    spec = scheduler_output.scheduled_spec_decode_tokens
    return any(
        n > 1 + len(spec.get(req_id, ()))
        for req_id, n in scheduler_output.num_scheduled_tokens.items()
    )


def _in_range(fn, name):
    """Method ``fn`` inside a profiler range: ``name``, or ``name(self)``
    when callable (None: no range)."""
    import torch

    @functools.wraps(fn)
    def wrapped(self, *args, **kwargs):
        label = name(self, *args, **kwargs) if callable(name) else name
        if label is None:
            return fn(self, *args, **kwargs)
        with torch.profiler.record_function(label):
            return fn(self, *args, **kwargs)

    wrapped._labelled = True  # type: ignore[attr-defined]
    return wrapped


def _label(cls, method: str, name) -> None:
    """Wrap ``cls``'s own ``method`` once (a subclass that inherits it is
    labelled through its base: no range inside a range of itself)."""
    orig = cls.__dict__.get(method)
    if orig is not None and not getattr(orig, "_labelled", False):
        setattr(cls, method, _in_range(orig, name))


def label_steps() -> None:
    """Ranges around the DFlash speculator's propose() (the chain's and
    DDTree's: the draft pass) and the V2 model runner's execute_model and
    sample_tokens, named by the step's kind; engine in-process."""
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner
        from vllm.v1.worker.gpu.spec_decode.dflash.speculator import (
            DFlashSpeculator,
        )
    except ImportError:
        return
    _label(DFlashSpeculator, "propose", DRAFT_RANGE)

    def execute_kind(runner, scheduler_output, *args, **kwargs):
        runner._ddtree_bench_step_kind = None
        if kwargs.get("dummy_run") or scheduler_output.total_num_scheduled_tokens == 0:
            return None
        kind = "mixed" if _has_prefill(scheduler_output) else "decode"
        runner._ddtree_bench_step_kind = kind
        return _step_range("execute", kind)

    def sample_kind(runner, *args, **kwargs):
        kind = getattr(runner, "_ddtree_bench_step_kind", None)
        runner._ddtree_bench_step_kind = None
        return None if kind is None else _step_range("sample", kind)

    _label(GPUModelRunner, "execute_model", execute_kind)
    _label(GPUModelRunner, "sample_tokens", sample_kind)


def _device_us(ev) -> float:
    return getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)


def _starts_inside(spans: list[tuple[float, float]], end_inside: bool = True):
    """Whether an event starts inside one of the sorted ``(start, end)``
    (on its end too unless not ``end_inside``)."""
    starts = [start for start, _ in spans]

    def inside(ev) -> bool:
        i = bisect.bisect_right(starts, ev.time_range.start) - 1
        at = ev.time_range.start
        return i >= 0 and (at <= spans[i][1] if end_inside else at < spans[i][1])

    return inside


def _span(ev) -> tuple[float, float]:
    return ev.time_range.start, ev.time_range.end


def step_kind_summary(events, cuda_type) -> dict:
    """Per step kind (`STEP_KINDS`, from `label_steps`' ranges): the steps,
    per step the host time inside the runner's two calls, the GPU kernel
    time of the kernels starting inside their GPU-side ranges and those
    ranges' span (kernel time plus the GPU's idle gaps) and the host
    operators starting inside the step's host ranges with the most self
    time. Kinds with no step are left out."""
    events = list(events)
    out = {}
    for kind in STEP_KINDS:
        names = {_step_range("execute", kind), _step_range("sample", kind)}
        cpu = [ev for ev in events if ev.name in names and ev.device_type != cuda_type]
        steps = sum(ev.name == _step_range("execute", kind) for ev in cpu)
        if not steps:
            continue
        host_ranges = sorted(map(_span, cpu))
        # Host ranges end where the next may start: a start on an end is out.
        in_step = _starts_inside(host_ranges, end_inside=False)
        ops: Counter[str] = Counter()
        for ev in events:
            if ev.device_type == cuda_type or ev.name.startswith(RANGE_PREFIX):
                continue  # the ranges (the steps', the draft pass's) are no ops
            if in_step(ev):
                ops[ev.name[:60]] += getattr(ev, "self_cpu_time_total", 0)
        host_us = sum(end - start for start, end in host_ranges)
        spans = sorted(
            _span(ev)
            for ev in events
            if ev.name in names and ev.device_type == cuda_type
        )
        inside = _starts_inside(spans)
        kernel_us = sum(
            _device_us(ev)
            for ev in events
            if ev.device_type == cuda_type
            and not ev.name.startswith(RANGE_PREFIX)
            and inside(ev)
        )
        top_ops = ops.most_common(TOP_HOST_OPS)
        out[kind] = dict(
            steps=steps,
            host_ms_per_step=round(host_us / steps / 1e3, 3),
            gpu_kernel_ms_per_step=round(kernel_us / steps / 1e3, 3),
            gpu_span_ms_per_step=round(
                sum(end - start for start, end in spans) / steps / 1e3, 3
            ),
            top_host_ops_us_per_step={k: round(v / steps, 1) for k, v in top_ops},
        )
    return out


def split_gpu_time(events, cuda_type) -> tuple[dict, dict, float, bool, dict]:
    """GPU kernel time of profiler ``events`` by category (tree build,
    bookkeeping, other) and per kernel name; the part launched by the draft
    pass (tree build included); whether a draft range was seen; the launches
    per kernel name.

    A kernel belongs to the draft pass when it starts inside the GPU-side
    copy of its range (first to last kernel). The CPU range's own device
    time misses kernels replayed from CUDA graphs, and the GPU-side range is
    a span (idle time included): neither is summed itself."""
    events = list(events)
    spans = sorted(
        _span(ev)
        for ev in events
        if ev.name == DRAFT_RANGE and ev.device_type == cuda_type
    )
    in_draft = _starts_inside(spans)
    us = {"tree_build": 0.0, "bookkeeping": 0.0, "other": 0.0}
    top: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    draft_us = 0.0
    for ev in events:
        # Ranges (the draft pass's, the steps') are spans, not kernel time.
        if ev.device_type != cuda_type or ev.name.startswith(RANGE_PREFIX):
            continue
        dur, name = _device_us(ev), ev.name[:60]
        if TREE_BUILD_KERNELS.search(ev.name):
            us["tree_build"] += dur
        elif BOOKKEEPING_KERNELS.search(ev.name):
            us["bookkeeping"] += dur
        else:
            us["other"] += dur
        top[name] += dur
        calls[name] += 1
        if in_draft(ev):
            draft_us += dur
    return us, top, draft_us, bool(spans), calls


def profile_summary(prof, steps: float, wall_s: float) -> dict:
    """Per engine step, from a finished torch profile of ``steps`` steps that
    took ``wall_s`` seconds: wall time, GPU kernel time by category and by
    phase, the GPU busy share, the top kernels and host ops."""
    import torch

    cuda = torch.autograd.DeviceType.CUDA
    us, top, draft_us, has_draft, calls = split_gpu_time(prof.events(), cuda)
    wall_us = wall_s * 1e6 / steps
    averages = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    top_names = [name for name, _ in top.most_common(TOP_KERNELS)]
    draft = draft_us - us["tree_build"]  # the DFlash pass less the tree build

    def per_step(values: dict, digits: int = 1) -> dict:
        return {k: round(v / steps, digits) for k, v in values.items()}

    return dict(
        wall_us_per_step=round(wall_us, 1),
        gpu_us_per_step=per_step(us),
        # None without a draft pass (no speculation).
        gpu_us_per_step_by_phase=per_step(
            dict(
                draft=draft,
                tree_build=us["tree_build"],
                bookkeeping=us["bookkeeping"],
                verify_and_rest=us["other"] - draft,
            )
        )
        if has_draft
        else None,
        # Below 1: the GPU idles inside the step (host-bound or waiting).
        gpu_busy_share=round(sum(us.values()) / steps / wall_us, 3),
        ddtree_share_of_step=round(
            (us["tree_build"] + us["bookkeeping"]) / steps / wall_us, 4
        ),
        step_kinds=step_kind_summary(prof.events(), cuda),
        top_kernels_us_per_step=per_step({k: top[k] for k in top_names}),
        top_kernels_calls_per_step=per_step({k: calls[k] for k in top_names}, 2),
        # Host side: self time and calls per op (an op called once per layer
        # runs outside the CUDA graphs).
        top_cpu_ops_us_per_step={
            e.key[:60]: round(e.self_cpu_time_total / steps, 1) for e in averages[:15]
        },
        top_cpu_ops_calls_per_step={
            e.key[:60]: round(e.count / steps, 1) for e in averages[:25]
        },
    )


def decode_in_batches(llm, prompts, sp, conc: int) -> int:
    """Decode ``prompts`` ``conc`` at a time; the new tokens."""
    toks = 0
    for i in range(0, len(prompts), conc):
        outs = llm.generate(prompts[i : i + conc], sp, use_tqdm=False)
        toks += sum(len(o.outputs[0].token_ids) for o in outs)
    return toks


def profile_steps(llm, prompts, sp, conc: int = 1, **labels) -> dict:
    """Decode ``prompts`` ``conc`` at a time under the torch profiler; print
    (``PROFILE {json}``) and return `profile_summary` per engine step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    label_steps()
    llm.generate(prompts[:conc], sp, use_tqdm=False)  # warm-up outside the trace
    acc0, drafts0 = common.spec_counters(llm)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.time()
        toks = decode_in_batches(llm, prompts, sp, conc)
        torch.cuda.synchronize()
        dt = time.time() - t
    acc1, drafts1 = common.spec_counters(llm)
    drafts = drafts1 - drafts0
    # Draft counters are per request: an engine step drafts for `conc` of them.
    steps = (drafts or toks) / conc
    res = dict(
        **labels,
        conc=conc,
        prompts=len(prompts),
        steps=round(steps, 1),
        tau=round(1 + (acc1 - acc0) / drafts, 3) if drafts > 0 else None,
        **profile_summary(prof, steps, dt),
    )
    common.emit("PROFILE", res)
    return res
