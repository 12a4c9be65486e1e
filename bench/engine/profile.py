# SPDX-License-Identifier: Apache-2.0
"""Where an engine step's time goes, under the torch profiler (engine
in-process): wall time per step, the share of it the GPU is busy, GPU kernel
time per step split into the DDTree tree build (our Triton build kernels),
DDTree bookkeeping (tree bias, walk, KV compaction kernels) and everything
else (the target and drafter forwards, sampling), the same time by phase
(the DFlash pass: a profiler range around the speculator's propose(), the
tree build taken out; tree build, bookkeeping, verify, the rest), host time
by op, and the steps with a prefill chunk apart from the others. Only the
Triton build backend (the CUDA default) has kernels of its own names; with
``VLLM_DDTREE_BACKEND=torch`` the build counts as "other". Used by
``engine/step_cost.py`` and ``pairs/run_pairs.py --profile``."""

import bisect
import json
import re
import time

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


def num_preemptions(llm) -> float:
    """The preemption counter of vLLM (requests whose KV was freed under memory
    pressure and recomputed later): a run that should exercise preemption
    shows it moved."""
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def spec_metrics(llm) -> tuple[float, float, list[float]]:
    accepted = drafts = 0.0
    per_pos: list[float] = []
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_accepted_tokens":
            accepted = m.value
        elif m.name == "vllm:spec_decode_num_drafts":
            drafts = m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per_pos = list(getattr(m, "values", []) or [])
    return accepted, drafts, per_pos


RANGE_PREFIX = "ddtree_bench::"
DRAFT_RANGE = RANGE_PREFIX + "draft"


def _label_draft_passes() -> None:
    """Wrap the DFlash speculator's propose() (the chain's and DDTree's, which
    inherits it) in a profiler range, so the GPU time of the draft pass can
    be told from the verify forward (engine in-process)."""
    import torch

    try:
        from vllm.v1.worker.gpu.spec_decode.dflash.speculator import (
            DFlashSpeculator,
        )
    except ImportError:
        return
    orig = DFlashSpeculator.propose
    if getattr(orig, "_labelled", False):
        return

    def propose(self, *args, **kwargs):
        with torch.profiler.record_function(DRAFT_RANGE):
            return orig(self, *args, **kwargs)

    propose._labelled = True  # type: ignore[attr-defined]
    DFlashSpeculator.propose = propose


# The engine steps' own ranges (`_label_steps`): the model runner's
# execute_model and sample_tokens of a step that carries a prefill chunk
# ("mixed") or only decodes and verifies ("decode").
STEP_KINDS = ("mixed", "decode")


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


# Ranges inside a step (`_label_steps`), by the runner's parts they wrap:
# (range, module, class, method). The draft pass has its own (`DRAFT_RANGE`);
# what no range covers (the eager model call, the runner's own code) is the
# step's host time less theirs.
_RUNNER = "vllm.v1.worker.gpu.model_runner"
_STATES = "vllm.v1.worker.gpu.model_states"
_GRAPHS = "vllm.v1.worker.gpu.cudagraph_utils"
_DDTREE = "vllm.v1.worker.gpu.spec_decode.ddtree.verifier"
STEP_PHASES = (
    ("requests", _RUNNER, "GPUModelRunner", "add_requests"),
    ("inputs", _RUNNER, "GPUModelRunner", "prepare_inputs"),
    ("block_tables", _RUNNER, "GPUModelRunner", "prepare_attn"),
    ("attn_metadata", f"{_STATES}.default", "DefaultModelState", "prepare_attn"),
    (
        "attn_metadata",
        f"{_STATES}.mamba_hybrid",
        "MambaHybridModelState",
        "prepare_attn",
    ),
    ("full_graph", _GRAPHS, "CudaGraphManager", "run_fullgraph"),
    ("piecewise", _GRAPHS, "CudaGraphManager", "run_pw_graph"),
    ("sample", _RUNNER, "GPUModelRunner", "sample"),
    ("ddtree_prepare", _DDTREE, "DDTreeVerifier", "prepare_verify"),
    ("ddtree_compact", _DDTREE, "DDTreeVerifier", "compact"),
    ("ddtree_store_trees", _DDTREE, "DDTreeVerifier", "store_trees"),
    (
        "ddtree_gdn_commit",
        "vllm.v1.spec_decode.ddtree.gdn_verify",
        "DDTreeGDN",
        "commit",
    ),
)


def _phase_range(phase: str) -> str:
    return f"{RANGE_PREFIX}phase_{phase}"


def _label_phases() -> None:
    """Wrap the runner's parts listed in `STEP_PHASES` in profiler ranges
    (those this vLLM has), so a step's host time splits by part."""
    import importlib

    for phase, module, cls_name, method in STEP_PHASES:
        try:
            cls = getattr(importlib.import_module(module), cls_name)
        except (ImportError, AttributeError):
            continue
        # Only the class's own method: a subclass that inherits it is
        # labelled through its base (no range inside a range of itself).
        orig = cls.__dict__.get(method)
        if orig is None or getattr(orig, "_labelled", False):
            continue

        setattr(cls, method, _in_range(orig, _phase_range(phase)))


def _in_range(fn, name: str):
    """``fn`` (a method) inside a profiler range ``name``."""
    import functools

    import torch

    @functools.wraps(fn)
    def wrapped(self, *args, **kwargs):
        with torch.profiler.record_function(name):
            return fn(self, *args, **kwargs)

    wrapped._labelled = True  # type: ignore[attr-defined]
    return wrapped


def _label_steps() -> None:
    """Wrap the V2 model runner's execute_model and sample_tokens in
    profiler ranges named by the step's kind (engine in-process), so that a
    profile tells steps with a prefill chunk from the others, and the
    runner's parts in ranges of their own (`_label_phases`)."""
    import torch

    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    except ImportError:
        return
    _label_phases()
    execute, sample = GPUModelRunner.execute_model, GPUModelRunner.sample_tokens
    if getattr(execute, "_labelled", False):
        return

    def execute_model(self, scheduler_output, *args, **kwargs):
        if kwargs.get("dummy_run") or scheduler_output.total_num_scheduled_tokens == 0:
            return execute(self, scheduler_output, *args, **kwargs)
        kind = "mixed" if _has_prefill(scheduler_output) else "decode"
        self._ddtree_bench_step_kind = kind
        with torch.profiler.record_function(_step_range("execute", kind)):
            return execute(self, scheduler_output, *args, **kwargs)

    def sample_tokens(self, *args, **kwargs):
        kind = getattr(self, "_ddtree_bench_step_kind", None)
        if kind is None:
            return sample(self, *args, **kwargs)
        self._ddtree_bench_step_kind = None
        with torch.profiler.record_function(_step_range("sample", kind)):
            return sample(self, *args, **kwargs)

    execute_model._labelled = True  # type: ignore[attr-defined]
    GPUModelRunner.execute_model = execute_model
    GPUModelRunner.sample_tokens = sample_tokens


# Host operators kept per step kind.
TOP_HOST_OPS = 12


def step_kind_summary(events, cuda_type) -> dict:
    """Per step kind (`STEP_KINDS`) of a profile with `_label_steps`' ranges:
    the steps, and per step the host time inside the runner's two calls,
    the GPU kernel time of the kernels that start inside their GPU-side
    ranges, and those ranges' span (first to last kernel: the kernel time
    plus the GPU's idle gaps inside the step). Then where the host time
    goes: per part of the runner (`STEP_PHASES`' ranges and the draft
    pass's, by their start inside the step's host ranges; ``other``: the
    rest) and the host operators with the most self time. Kinds with no
    step are left out."""
    events = list(events)
    out = {}
    for kind in STEP_KINDS:
        names = {_step_range("execute", kind), _step_range("sample", kind)}
        cpu = [ev for ev in events if ev.name in names and ev.device_type != cuda_type]
        steps = sum(1 for ev in cpu if ev.name == _step_range("execute", kind))
        if not steps:
            continue
        host_ranges = sorted((ev.time_range.start, ev.time_range.end) for ev in cpu)
        host_starts = [start for start, _ in host_ranges]

        def in_step(ev, ranges=host_ranges, starts=host_starts) -> bool:
            i = bisect.bisect_right(starts, ev.time_range.start) - 1
            return i >= 0 and ev.time_range.start < ranges[i][1]

        host_us = sum(end - start for start, end in host_ranges)
        by_phase: dict[str, float] = {}
        phase_ranges: list[tuple[float, float]] = []
        ops: dict[str, float] = {}
        for ev in events:
            if ev.device_type == cuda_type or ev.name in names or not in_step(ev):
                continue
            if ev.name.startswith(RANGE_PREFIX):
                phase = ev.name[len(RANGE_PREFIX) :].removeprefix("phase_")
                by_phase[phase] = by_phase.get(phase, 0.0) + (
                    ev.time_range.end - ev.time_range.start
                )
                phase_ranges.append((ev.time_range.start, ev.time_range.end))
            else:
                self_us = getattr(ev, "self_cpu_time_total", 0.0)
                ops[ev.name[:60]] = ops.get(ev.name[:60], 0.0) + self_us
        # A range inside another (DDTree's sampling inside the runner's) is
        # counted in both; "other" is the host time outside every range.
        by_phase["other"] = host_us - _union_us(phase_ranges)
        top_ops = sorted(ops.items(), key=lambda kv: -kv[1])[:TOP_HOST_OPS]
        spans = sorted(
            (ev.time_range.start, ev.time_range.end)
            for ev in events
            if ev.name in names and ev.device_type == cuda_type
        )
        starts = [start for start, _ in spans]
        kernel_us = 0.0
        for ev in events:
            if ev.device_type != cuda_type or ev.name.startswith(RANGE_PREFIX):
                continue
            i = bisect.bisect_right(starts, ev.time_range.start) - 1
            if i >= 0 and ev.time_range.start <= spans[i][1]:
                kernel_us += _device_us(ev)
        out[kind] = dict(
            steps=steps,
            host_ms_per_step=round(
                sum(ev.time_range.end - ev.time_range.start for ev in cpu)
                / steps
                / 1e3,
                3,
            ),
            gpu_kernel_ms_per_step=round(kernel_us / steps / 1e3, 3),
            gpu_span_ms_per_step=round(
                sum(end - start for start, end in spans) / steps / 1e3, 3
            ),
            host_ms_per_step_by_phase={
                k: round(v / steps / 1e3, 3) for k, v in by_phase.items()
            },
            top_host_ops_us_per_step={k: round(v / steps, 1) for k, v in top_ops},
        )
    return out


def _union_us(ranges: list[tuple[float, float]]) -> float:
    """The time the ``(start, end)`` ranges cover together."""
    total = 0.0
    end = float("-inf")
    for start, stop in sorted(ranges):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def _device_us(ev) -> float:
    return (
        ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    )


def split_gpu_time(events, cuda_type) -> tuple[dict, dict, float, bool, dict]:
    """GPU kernel time of profiler ``events`` by category (tree build,
    bookkeeping, other), per kernel name, and the part launched by the draft
    pass (tree build included); whether a draft range was seen; and the
    launches per kernel name (the same kernel taking longer per step is more
    calls or bigger ones: the count tells which).

    The draft pass is told by the GPU-side copy of its record_function range
    (from its first to its last kernel): a kernel belongs to it when it
    starts inside one. The CPU range's own device time misses kernels
    replayed from CUDA graphs, and the GPU-side range is a span (idle time
    included), not kernel time: neither is summed itself.
    """
    events = list(events)
    spans = sorted(
        (ev.time_range.start, ev.time_range.end)
        for ev in events
        if ev.name == DRAFT_RANGE and ev.device_type == cuda_type
    )
    starts = [start for start, _ in spans]
    us = {"tree_build": 0.0, "bookkeeping": 0.0, "other": 0.0}
    top: dict[str, float] = {}
    calls: dict[str, int] = {}
    draft_us = 0.0
    for ev in events:
        # Ranges (the draft pass's, the steps') are spans, not kernel time.
        if ev.device_type != cuda_type or ev.name.startswith(RANGE_PREFIX):
            continue
        dur = _device_us(ev)
        name = ev.name
        if TREE_BUILD_KERNELS.search(name):
            us["tree_build"] += dur
        elif BOOKKEEPING_KERNELS.search(name):
            us["bookkeeping"] += dur
        else:
            us["other"] += dur
        top[name[:60]] = top.get(name[:60], 0.0) + dur
        calls[name[:60]] = calls.get(name[:60], 0) + 1
        i = bisect.bisect_right(starts, ev.time_range.start) - 1
        if i >= 0 and ev.time_range.start <= spans[i][1]:
            draft_us += dur
    return us, top, draft_us, bool(spans), calls


# Kernels kept per profile: enough to account for a step's tail (the tree
# kernels, attention and small launches past the target's GEMMs).
TOP_KERNELS = 30


def profile_summary(prof, steps: float, wall_s: float) -> dict:
    """Per engine step, from a finished torch profile of ``steps`` steps that
    took ``wall_s`` seconds: wall time, GPU kernel time by category and by
    phase, the GPU busy share, the top kernels and host ops."""
    import torch

    us, top, draft_range_us, has_draft_range, calls = split_gpu_time(
        prof.events(), torch.autograd.DeviceType.CUDA
    )
    wall_us = wall_s * 1e6 / steps
    averages = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    top_names = [k for k, _ in sorted(top.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]]
    return dict(
        wall_us_per_step=round(wall_us, 1),
        gpu_us_per_step={k: round(v / steps, 1) for k, v in us.items()},
        # The same GPU time by phase (None without a draft pass, i.e. no
        # speculation): DFlash pass (without the tree build),
        # tree build, DDTree bookkeeping, and the rest (target verify forward,
        # sampling, input preparation).
        gpu_us_per_step_by_phase={
            "draft": round((draft_range_us - us["tree_build"]) / steps, 1),
            "tree_build": round(us["tree_build"] / steps, 1),
            "bookkeeping": round(us["bookkeeping"] / steps, 1),
            "verify_and_rest": round(
                (us["other"] - (draft_range_us - us["tree_build"])) / steps, 1
            ),
        }
        if has_draft_range
        else None,
        # Below 1: the GPU idles inside the step (host-bound or waiting).
        gpu_busy_share=round(sum(us.values()) / steps / wall_us, 3),
        ddtree_share_of_step=round(
            (us["tree_build"] + us["bookkeeping"]) / steps / wall_us, 4
        ),
        # Steps that carry a prefill chunk apart from the others (with
        # `_label_steps`): their count, host and GPU time per step.
        step_kinds=step_kind_summary(prof.events(), torch.autograd.DeviceType.CUDA),
        top_kernels_us_per_step={k: round(top[k] / steps, 1) for k in top_names},
        top_kernels_calls_per_step={k: round(calls[k] / steps, 2) for k in top_names},
        # Host side: where the step's CPU time goes (self time per op), and
        # how often each op runs per step (an op called once per layer
        # means that layer's part runs outside the CUDA graphs).
        top_cpu_ops_us_per_step={
            e.key[:60]: round(e.self_cpu_time_total / steps, 1) for e in averages[:15]
        },
        top_cpu_ops_calls_per_step={
            e.key[:60]: round(e.count / steps, 1) for e in averages[:25]
        },
    )


def profile_steps(llm, prompts, sp, conc: int = 1, **labels) -> dict:
    """Decode ``prompts`` ``conc`` at a time under the torch profiler; print
    (and return) the wall time and the GPU kernel time per engine step, by
    category."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    _label_draft_passes()
    _label_steps()
    llm.generate(prompts[:conc], sp, use_tqdm=False)  # warm-up outside the trace
    acc0, drafts0, _ = spec_metrics(llm)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.time()
        toks = 0
        for i in range(0, len(prompts), conc):
            outs = llm.generate(prompts[i : i + conc], sp, use_tqdm=False)
            toks += sum(len(o.outputs[0].token_ids) for o in outs)
        torch.cuda.synchronize()
        dt = time.time() - t
    acc1, drafts1, _ = spec_metrics(llm)
    # Draft counters are per request: an engine step drafts for `conc` of them.
    steps = ((drafts1 - drafts0) or toks) / conc
    res = dict(
        **labels,
        conc=conc,
        prompts=len(prompts),
        steps=round(steps, 1),
        tau=round(1 + (acc1 - acc0) / (drafts1 - drafts0), 3)
        if drafts1 > drafts0
        else None,
        **profile_summary(prof, steps, dt),
    )
    print("PROFILE", json.dumps(res), flush=True)
    return res
