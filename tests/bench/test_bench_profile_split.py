# SPDX-License-Identifier: Apache-2.0
"""bench/engine/profile.py's split of profiled GPU time into the draft pass and
the rest: kernels are assigned by their start inside the GPU-side draft
range; the range events themselves are not kernel time."""

from types import SimpleNamespace

from bench.engine import profile as e2e

CPU, CUDA = "cpu", "cuda"


def ev(name, start, end, device=CUDA, dur=None):
    return SimpleNamespace(
        name=name,
        device_type=device,
        time_range=SimpleNamespace(start=start, end=end),
        device_time_total=end - start if dur is None else dur,
    )


def host_op(name, start, end, self_us):
    """A host operator (no device time) with its self CPU time."""
    return SimpleNamespace(
        name=name,
        device_type=CPU,
        time_range=SimpleNamespace(start=start, end=end),
        self_cpu_time_total=self_us,
    )


def test_split_by_gpu_side_draft_range():
    events = [
        # the CPU range (its device time misses graph-replayed kernels)
        ev(e2e.DRAFT_RANGE, 0, 50, device=CPU, dur=3),
        # the GPU-side copies of two draft ranges: spans, not kernel time
        ev(e2e.DRAFT_RANGE, 100, 200),
        ev(e2e.DRAFT_RANGE, 400, 450),
        ev("dflash_layer_gemm", 100, 130),  # draft
        ev("_vocab_stats_kernel", 140, 150),  # draft, tree build
        ev("_tree_kernel", 150, 170),  # draft, tree build
        ev("target_gemm", 210, 300),  # verify
        ev("_ddtree_walk_kernel", 310, 315),  # bookkeeping
        ev("dflash_layer_gemm", 400, 440),  # second draft
        ev("sampler", 460, 470),  # after it
        ev("cpu_op", 0, 1000, device=CPU),  # not a kernel
    ]
    us, top, draft_us, has_range, calls = e2e.split_gpu_time(events, CUDA)
    assert has_range
    assert us == {"tree_build": 30, "bookkeeping": 5, "other": 30 + 90 + 40 + 10}
    assert draft_us == 30 + 10 + 20 + 40
    assert e2e.DRAFT_RANGE not in top and top["dflash_layer_gemm"] == 70
    assert calls["dflash_layer_gemm"] == 2 and calls["target_gemm"] == 1
    assert e2e.DRAFT_RANGE not in calls and "cpu_op" not in calls


def test_no_draft_range():
    us, _, draft_us, has_range, _ = e2e.split_gpu_time([ev("gemm", 0, 10)], CUDA)
    assert (us["other"], draft_us, has_range) == (10, 0.0, False)


def test_profile_summary_is_per_engine_step():
    """Two steps of 1 ms wall: each step's kernel time by phase and the GPU
    busy share, from the same events as split_gpu_time."""
    import torch

    cuda = torch.autograd.DeviceType.CUDA
    events = [
        ev(e2e.DRAFT_RANGE, 100, 199, device=cuda),
        ev("dflash_layer_gemm", 100, 160, device=cuda),
        ev("_vocab_stats_kernel", 160, 200, device=cuda),
        ev("target_gemm", 200, 900, device=cuda),
        ev("_ddtree_walk_kernel", 900, 1000, device=cuda),
    ]
    op = SimpleNamespace(key="cudaGraphLaunch", self_cpu_time_total=300, count=4)
    prof = SimpleNamespace(events=lambda: events, key_averages=lambda: [op])
    got = e2e.profile_summary(prof, steps=2, wall_s=2e-3)
    assert got["wall_us_per_step"] == 1000
    assert got["gpu_us_per_step"] == {
        "tree_build": 20,
        "bookkeeping": 50,
        "other": 380,
    }
    assert got["gpu_us_per_step_by_phase"] == {
        "draft": 30,
        "tree_build": 20,
        "bookkeeping": 50,
        "verify_and_rest": 350,
    }
    assert got["gpu_busy_share"] == 0.45
    assert got["top_cpu_ops_us_per_step"] == {"cudaGraphLaunch": 150}
    assert got["top_cpu_ops_calls_per_step"] == {"cudaGraphLaunch": 2}
    assert got["top_kernels_us_per_step"]["target_gemm"] == 350
    assert got["top_kernels_calls_per_step"] == {
        "target_gemm": 0.5,
        "dflash_layer_gemm": 0.5,
        "_ddtree_walk_kernel": 0.5,
        "_vocab_stats_kernel": 0.5,
    }
    assert list(got["top_kernels_calls_per_step"]) == list(
        got["top_kernels_us_per_step"]
    )


def test_steps_with_a_prefill_chunk_are_told_apart():
    """Three steps: two decode-only (4 + 1 tokens with drafts), one with a
    new request's 160-token prompt. Per kind: the steps, the host time in
    the runner's two calls, the kernel time inside their GPU-side ranges and
    those ranges' span (idle gaps included); the ranges are not kernels."""
    out = SimpleNamespace(
        num_scheduled_tokens={"a": 16, "b": 16},
        scheduled_spec_decode_tokens={"a": [0] * 15, "b": [0] * 15},
    )
    assert not e2e._has_prefill(out)
    out.num_scheduled_tokens["c"] = 160
    assert e2e._has_prefill(out)
    out = SimpleNamespace(
        num_scheduled_tokens={"a": 1}, scheduled_spec_decode_tokens={}
    )
    assert not e2e._has_prefill(out)  # a decode without drafts

    def step(kind, host, gpu, kernels):
        """The runner's two calls of one step: their CPU ranges (``host``:
        execute and sample, each (start, end)), their GPU-side ranges
        (``gpu``, likewise) and the step's kernels."""
        names = (e2e._step_range("execute", kind), e2e._step_range("sample", kind))
        return [
            *(ev(n, a, b, device=CPU) for n, (a, b) in zip(names, host)),
            *(ev(n, a, b) for n, (a, b) in zip(names, gpu)),
            *(ev(name, a, b) for name, a, b in kernels),
        ]

    events = [
        # decode steps: host 100 + 20 and 80 + 20 us; kernels 250 and 200 us
        # in GPU ranges of 300 and 250 us
        *step(
            "decode",
            [(0, 100), (100, 120)],
            [(1000, 1200), (1200, 1300)],
            [("gemm", 1000, 1150), ("sampler", 1200, 1300)],
        ),
        *step(
            "decode",
            [(200, 280), (280, 300)],
            [(1400, 1600), (1600, 1650)],
            [("gemm", 1400, 1550), ("sampler", 1600, 1650)],
        ),
        # the mixed step: a long host part, the GPU idle half of its span
        *step(
            "mixed",
            [(400, 3400), (3400, 3500)],
            [(2000, 5000), (5000, 5100)],
            [
                ("gemm", 2000, 2800),
                ("chunk_gated_delta_rule", 4000, 4700),
                ("sampler", 5000, 5100),
            ],
        ),
        ev("outside", 6000, 6100),  # in no step range
        # Host ops inside the steps: the mixed step's sort (its draft pass's
        # range, no op, beside it), a decode step's launch; and a sort
        # outside every step.
        host_op("aten::argsort", 600, 900, self_us=250),
        ev(e2e.DRAFT_RANGE, 2000, 2500, device=CPU),
        host_op("cudaGraphLaunch", 60, 90, self_us=30),
        host_op("aten::argsort", 7100, 7200, self_us=100),
    ]
    got = e2e.step_kind_summary(events, CUDA)
    assert got == {
        "mixed": dict(
            steps=1,
            host_ms_per_step=3.1,
            gpu_kernel_ms_per_step=1.6,
            gpu_span_ms_per_step=3.1,
            top_host_ops_us_per_step={"aten::argsort": 250},
        ),
        "decode": dict(
            steps=2,
            host_ms_per_step=0.11,
            gpu_kernel_ms_per_step=0.225,
            gpu_span_ms_per_step=0.275,
            top_host_ops_us_per_step={"cudaGraphLaunch": 15},
        ),
    }
    # The step ranges are spans, never kernel time in the split.
    us, top, _, _, _ = e2e.split_gpu_time(events, CUDA)
    assert not any(name.startswith(e2e.RANGE_PREFIX) for name in top)
    assert sum(us.values()) == 150 + 100 + 150 + 50 + 800 + 700 + 100 + 100
    assert e2e.step_kind_summary([ev("gemm", 0, 10)], CUDA) == {}
