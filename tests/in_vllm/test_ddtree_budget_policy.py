# SPDX-License-Identifier: Apache-2.0
"""CPU tests of the measured budget policy's vLLM wiring: the acceptance the
verifier counts from its walk, the configuration surface, the planner on
the worker (step costs, re-planning, the schedule it hands the scheduler),
the scheduler applying it, and its metrics."""

import functools
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
vllm = pytest.importorskip("vllm")

from verifier_fakes import (  # noqa: E402
    DEPTH,
    PARENT,
    TOKENS,
    ArgmaxSampler,
    B,
    D,
    logits_for,
    store_trees,
)

try:  # the 0.26.0 line's patch: the measured schedule to the scheduler
    from vllm.v1.spec_decode.dynamic.utils import DynamicSDScheduleUpdate  # noqa: F401

    MEASURED_POLICY = True
except ImportError:
    MEASURED_POLICY = False
measured_policy_line = pytest.mark.skipif(
    not MEASURED_POLICY,
    reason="budget_policy 'measured' is refused on this vLLM line (nothing "
    "carries a worker-measured schedule to the scheduler)",
)


def _measured_verifier(max_reqs=4, max_tokens=64, **spec_fields):
    from vllm.v1.worker.gpu.spec_decode.ddtree.verifier import DDTreeVerifier

    spec = dict(
        use_ddtree=lambda: True,
        tree_budget=B,
        draft_depth=D,
        budget_policy="measured",
        budget_replan_interval=10.0,
        acceptance_prior=0.8,
        acceptance_prior_weight=256,
        num_speculative_tokens_per_batch_size=[(1, 1024, B)],
    )
    spec.update(spec_fields)
    cfg = SimpleNamespace(
        speculative_config=SimpleNamespace(**spec),
        scheduler_config=SimpleNamespace(
            max_num_seqs=max_reqs, max_num_batched_tokens=max_tokens
        ),
        max_concurrent_batches=2,
    )
    return DDTreeVerifier(cfg, torch.device("cpu"))


def _two_tree_batch():
    """Batch row 0: a prefill chunk of 3 tokens (request state 0); rows 1
    and 2: request states 2 and 3 verify root + 4 nodes each."""
    positions = torch.tensor(
        [0, 1, 2, 20, 21, 22, 23, 24, 40, 41, 42, 43, 44], dtype=torch.int64
    )
    return SimpleNamespace(
        num_reqs=3,
        num_tokens=13,
        num_tokens_after_padding=13,
        num_draft_tokens=2 * B,
        positions=positions,
        input_ids=torch.arange(13, dtype=torch.int64),
        logits_indices=torch.tensor([2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]),
        expanded_idx_mapping=torch.tensor(
            [0, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3], dtype=torch.int32
        ),
        expanded_local_pos=torch.tensor(
            [0, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4], dtype=torch.int32
        ),
        idx_mapping=torch.tensor([0, 2, 3], dtype=torch.int32),
        idx_mapping_np=np.array([0, 2, 3], dtype=np.int32),
        cu_num_logits=torch.tensor([0, 1, 6, 11], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 3, 8, 13], dtype=torch.int32),
        seq_lens=torch.tensor([3, 25, 45], dtype=torch.int32),
        # vLLM 0.33+: the sampler's per-request sequence-length bound.
        seq_lens_cpu_upper_bound=torch.tensor([3, 25, 45], dtype=torch.int32),
    )


def test_the_walk_is_counted_per_rank_on_the_device():
    verifier = _measured_verifier()
    assert verifier.budget is not None
    tree = (PARENT, DEPTH, TOKENS)
    draft_tokens = store_trees(verifier, [2, 3], [tree, tree])
    batch = _two_tree_batch()
    prefill_len = torch.tensor([3, 0, 10, 0], dtype=torch.int32)
    # Request state 2: root says 11 (node 1), node 1 says 14 (node 4, rank
    # 3), node 4 says 9 (bonus). Request state 3: root says 12 (node 2,
    # rank 1), node 2 says 30 (bonus).
    logits = logits_for([5, 11, 14, 30, 30, 9, 12, 30, 30, 30, 30])
    verifier.prepare_verify(batch)
    out = verifier.sample(ArgmaxSampler(), logits, batch, draft_tokens, prefill_len)
    assert out.num_sampled.tolist() == [1, 3, 2]
    counts = verifier.budget.acceptance.counts
    assert counts[0].tolist() == [1, 1, 0, 1]  # ranks 0 and 3; rank 1
    assert counts[1].tolist() == [2, 2, 2, 2]  # two trees of 4 nodes
    # The next step adds to them; the prefill row never counts.
    verifier.compact(batch, None, None)
    verifier.prepare_verify(batch)
    verifier.sample(ArgmaxSampler(), logits, batch, draft_tokens, prefill_len)
    assert counts.tolist() == [[2, 2, 0, 2], [4, 4, 4, 4]]


def test_other_policies_count_nothing():
    from verifier_fakes import make_verifier

    assert make_verifier().budget is None
    assert _measured_verifier(budget_policy="batch").budget is None


# ------------------------------------------------------------------ config
from verifier_fakes import DRAFTER, make_spec  # noqa: E402


@measured_policy_line
def test_measured_policy_starts_from_the_batch_schedule(target_model_config):
    from vllm.v1.spec_decode.ddtree.config import capture_budgets

    spec = make_spec(
        target_model_config,
        method="ddtree",
        model=DRAFTER,
        tree_budget=64,
        budget_policy="measured",
    )
    assert spec.budget_policy == "measured"
    assert spec.num_speculative_tokens_per_batch_size == [
        (1, 1, 64),
        (2, 3, 32),
        (4, 1024, 15),
    ]
    # Every budget it may switch to gets decode graphs: no speculation, the
    # small trees below draft_depth and the batch policy's budgets.
    assert capture_budgets(spec) == [0, 1, 3, 7, 15, 32, 64]
    assert (spec.budget_replan_interval, spec.acceptance_prior) == (10.0, 0.8)
    assert spec.acceptance_prior_weight == 256
    # A single-budget start (tree_budget <= draft_depth) is still a dynamic
    # schedule: no speculation is an option at every batch size.
    small = make_spec(
        target_model_config,
        method="ddtree",
        model=DRAFTER,
        tree_budget=8,
        budget_policy="measured",
    )
    assert small.num_speculative_tokens_per_batch_size == [(1, 1024, 8)]
    assert capture_budgets(small) == [0, 1, 3, 7, 8]
    batch = make_spec(
        target_model_config, method="ddtree", model=DRAFTER, budget_policy="batch"
    )
    assert capture_budgets(batch) == [15, 32, 64]


@measured_policy_line
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(num_speculative_tokens_per_batch_size=[(1, 8, 64), (9, 64, 15)]),
            "drop num_speculative_tokens_per_batch_size",
        ),
        (dict(budget_replan_interval=0), "budget_replan_interval must be"),
        (dict(budget_replan_interval=-1.5), "budget_replan_interval must be"),
        (dict(acceptance_prior=1.0), "acceptance_prior must be"),
        (dict(acceptance_prior=0), "acceptance_prior must be"),
        (dict(acceptance_prior_weight=-1), "acceptance_prior_weight must be"),
    ],
)
def test_measured_policy_rejects_bad_values(target_model_config, kwargs, message):
    with pytest.raises(Exception, match="DDTree") as info:
        make_spec(
            target_model_config,
            method="ddtree",
            model=DRAFTER,
            budget_policy="measured",
            **kwargs,
        )
    assert message in str(info.value)


def test_measured_policy_needs_cuda_graphs_and_one_scheduler(monkeypatch):
    from vllm.v1.spec_decode.ddtree import config
    from vllm.v1.spec_decode.ddtree.config import _verify_measured_budget_policy

    def fake(policy="measured", eager=False, dp=1, async_scheduling=None):
        return SimpleNamespace(
            speculative_config=SimpleNamespace(
                budget_policy=policy,
                tree_budget=64,
                num_speculative_tokens_per_batch_size=[(1, 1, 64), (2, 8, 15)],
            ),
            model_config=SimpleNamespace(enforce_eager=eager),
            parallel_config=SimpleNamespace(data_parallel_size=dp),
            scheduler_config=SimpleNamespace(async_scheduling=async_scheduling),
        )

    _verify_measured_budget_policy(fake())
    _verify_measured_budget_policy(fake(async_scheduling=True))
    _verify_measured_budget_policy(fake("batch", eager=True, dp=2))
    for bad, message in (
        (fake(eager=True), "enforce_eager"),
        (fake(dp=2), "data"),
        (fake(async_scheduling=False), "async scheduling"),
    ):
        with pytest.raises(ValueError, match=message) as info:
            _verify_measured_budget_policy(bad)
        assert "\n" not in str(info.value) and str(info.value).startswith("DDTree")
    # The batch policy's schedule without async scheduling: a warning (every
    # request would verify tree_budget nodes), not an error.
    warnings = []
    monkeypatch.setattr(
        config,
        "logger",
        SimpleNamespace(warning=lambda msg, *args: warnings.append(msg % args)),
    )
    _verify_measured_budget_policy(fake("batch", async_scheduling=False))
    assert len(warnings) == 1 and "tree_budget=64 nodes" in warnings[0]
    _verify_measured_budget_policy(fake("batch", async_scheduling=True))
    assert len(warnings) == 1


def test_the_default_policy_is_measured_where_it_can_run(monkeypatch):
    """budget_policy unset: "measured" with CUDA graphs, async scheduling and
    one data-parallel rank; otherwise "batch", with one startup line that
    says why, and the schedule the batch policy would have."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.spec_decode.ddtree import config
    from vllm.v1.spec_decode.ddtree.config import (
        _resolve_default_budget_policy,
        _verify_measured_budget_policy,
    )

    def verify(vllm_config):
        # As verify_ddtree_vllm_config runs them: resolve, then verify.
        _resolve_default_budget_policy(vllm_config)
        _verify_measured_budget_policy(vllm_config)

    lines = []
    monkeypatch.setattr(
        config,
        "logger",
        SimpleNamespace(
            info=lambda msg, *args: lines.append(msg % args),
            warning=lambda msg, *args: lines.append(msg % args),
        ),
    )

    def fake(
        schedule=((1, 1, 64), (2, 3, 32), (4, 1024, 15)),
        eager=False,
        dp=1,
        tp=1,
        async_scheduling=None,
        cudagraph_mode=None,
    ):
        return SimpleNamespace(
            speculative_config=SimpleNamespace(
                budget_policy=None,
                tree_budget=64,
                draft_depth=15,
                num_speculative_tokens_per_batch_size=list(schedule),
            ),
            model_config=SimpleNamespace(enforce_eager=eager),
            compilation_config=SimpleNamespace(cudagraph_mode=cudagraph_mode),
            parallel_config=SimpleNamespace(
                data_parallel_size=dp, tensor_parallel_size=tp
            ),
            scheduler_config=SimpleNamespace(async_scheduling=async_scheduling),
        )

    for ok in (
        fake(),
        fake(async_scheduling=True),
        fake(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE),
        fake(cudagraph_mode=CUDAGraphMode.FULL_DECODE_ONLY),
    ):
        verify(ok)
        assert ok.speculative_config.budget_policy == "measured"
    assert lines == []
    for fallback, why in (
        (fake(eager=True), "enforce_eager"),
        (fake(cudagraph_mode=CUDAGraphMode.PIECEWISE), "cudagraph_mode PIECEWISE"),
        (fake(cudagraph_mode=CUDAGraphMode.NONE), "cudagraph_mode NONE"),
        (fake(async_scheduling=False), "async scheduling"),
        (fake(dp=2), "data_parallel_size=2"),
        (fake(tp=2), "tensor_parallel_size=2"),
    ):
        lines.clear()
        verify(fallback)
        spec = fallback.speculative_config
        assert spec.budget_policy == "batch"
        assert spec.num_speculative_tokens_per_batch_size == [
            (1, 1, 64),
            (2, 3, 32),
            (4, 1024, 15),
        ]
        assert why in lines[0] and "not the default measured" in lines[0], lines
        assert "1-1: 64, 2-3: 32, >=4: 15" in lines[0]
    # The batch policy keeps a schedule only where the budget changes.
    single = fake(schedule=[(1, 1024, 8)], eager=True)
    verify(single)
    assert single.speculative_config.budget_policy == "batch"
    assert single.speculative_config.num_speculative_tokens_per_batch_size is None
    # Chosen explicitly, "measured" is refused there, in one line.
    explicit = fake(cudagraph_mode=CUDAGraphMode.PIECEWISE)
    explicit.speculative_config.budget_policy = "measured"
    with pytest.raises(ValueError, match="cudagraph_mode PIECEWISE") as info:
        verify(explicit)
    assert "\n" not in str(info.value)
    # Under tensor parallelism it is the user's choice (not yet run there).
    chosen = fake(tp=2)
    chosen.speculative_config.budget_policy = "measured"
    verify(chosen)
    assert chosen.speculative_config.budget_policy == "measured"


@measured_policy_line
def test_an_unset_policy_with_a_pinned_schedule_is_batch(target_model_config):
    spec = make_spec(
        target_model_config,
        method="ddtree",
        model=DRAFTER,
        tree_budget=64,
        num_speculative_tokens_per_batch_size=[(1, 4, 64), (5, 256, 8)],
    )
    assert spec.budget_policy == "batch"
    assert spec.num_speculative_tokens_per_batch_size == [(1, 4, 64), (5, 256, 8)]
    unset = make_spec(target_model_config, method="ddtree", model=DRAFTER)
    # Decided with the engine config (VllmConfig); until then the schedule
    # the measured policy starts from.
    assert unset.budget_policy is None
    assert unset.num_speculative_tokens_per_batch_size == [
        (1, 1, 64),
        (2, 3, 32),
        (4, 1024, 15),
    ]


# ----------------------------------------------------------------- planner
class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _planner(tree_budget=64, draft_depth=15, max_num_seqs=64, **spec_fields):
    from vllm.v1.worker.gpu.spec_decode.ddtree.budget import DDTreeBudgetPlanner

    spec = dict(
        tree_budget=tree_budget,
        draft_depth=draft_depth,
        budget_replan_interval=10.0,
        acceptance_prior=0.8,
        acceptance_prior_weight=256,
        num_speculative_tokens_per_batch_size=[(1, 1, 64), (2, 3, 32), (4, 1024, 15)],
    )
    spec.update(spec_fields)
    cfg = SimpleNamespace(
        speculative_config=SimpleNamespace(**spec),
        scheduler_config=SimpleNamespace(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=8192
        ),
    )
    clock = _Clock()
    return DDTreeBudgetPlanner(cfg, torch.device("cpu"), clock=clock), clock


def _timings(budgets=(0, 15, 32, 64), batches=(1, 2, 4, 8, 16, 32, 64)):
    """Flat until the batch's tokens make the target compute-bound."""
    target = {
        (n, 1 + b): 4e-3 + 4e-6 * n * (1 + b)
        for b in budgets
        for n in batches
        if n * (1 + b) <= 2048
    }
    drafter = {n: 1e-3 + 1e-6 * n for n in batches}
    return target, drafter


def _walk_outputs(num_reqs, budget, accepted_ranks):
    """Walk outputs where every request verified ``budget`` nodes and
    accepted the nodes of ``accepted_ranks`` (a path)."""
    qsl = torch.arange(num_reqs + 1, dtype=torch.int32) * (budget + 1)
    path = [0] + [r + 1 for r in accepted_ranks]
    src = torch.tensor(
        [
            [int(qsl[i]) + node for node in path + [0] * (16 - len(path))]
            for i in range(num_reqs)
        ]
    )
    num_accepted = torch.full((num_reqs,), len(path), dtype=torch.int32)
    return num_accepted, src, qsl, qsl


@measured_policy_line
def test_planner_starts_from_the_prior_and_replans_on_its_interval(caplog):
    from vllm.v1.spec_decode.ddtree import policy

    planner, clock = _planner()
    assert planner.budgets == [0, 1, 3, 7, 15, 32, 64]
    assert planner.update is None  # nothing published before the costs
    target, drafter = _timings()
    planner.set_costs(target, drafter, {0: 64, 15: 64, 32: 32, 64: 16})
    planner.acceptance.counts[1] += 5  # e.g. the warm-up's walk
    planner.begin()
    assert planner.acceptance.counts.sum() == 0  # counting starts here
    first = planner.update
    assert first.version == 1
    assert first.schedule == planner.schedule
    assert first.schedule[0][2] == 64  # the prior expects trees to pay off
    assert len(first.expected_acceptance_length) == len(first.schedule)
    assert first.schedule == policy.as_schedule(
        policy.plan(
            [0, 15, 32, 64],
            planner.costs,
            [0] * 64,
            [0] * 64,
            planner.prior,
            64,
            256,
            8192,
            {0: 64, 15: 64, 32: 32, 64: 16},
        )
    )

    # Steps that accept nothing: no snapshot before the interval is over.
    for _ in range(3):
        planner.observe_walk(*_walk_outputs(8, 64, []))
    assert not planner.acceptance.pending and planner.update is first
    clock.now += 10.0
    planner.observe_walk(*_walk_outputs(8, 64, []))  # queues the snapshot
    assert planner.acceptance.pending
    # Enough counted steps of zero acceptance to outweigh the prior...
    planner.acceptance.counts[1] += 10**6
    planner.observe_walk(*_walk_outputs(8, 64, []))  # landed: re-plan
    # ... from the snapshot: it was taken before the extra counts.
    assert planner.acceptance.host_np[1, 0] == 4 * 8
    # 32 request-steps against 256 of the prior: lower tau, trees still.
    second = planner.update
    assert second.version == 2 and second.schedule != first.schedule
    assert second.schedule[0][2] == 64
    assert second.expected_acceptance_length[0] < first.expected_acceptance_length[0]
    clock.now += 10.0
    planner.observe_walk(*_walk_outputs(8, 64, []))
    planner.observe_walk(*_walk_outputs(8, 64, []))
    third = planner.update
    assert third.version == 3
    assert third.schedule == [(1, 64, 0)]  # no speculation pays off now
    assert third.expected_acceptance_length == [1.0]
    # An unchanged plan publishes nothing new.
    clock.now += 10.0
    planner.observe_walk(*_walk_outputs(8, 64, []))
    planner.observe_walk(*_walk_outputs(8, 64, []))
    assert planner.update is third


@measured_policy_line
def test_first_replans_come_sooner_then_every_interval():
    """A fresh server re-plans 1 s after `begin`, then after 2, 4 and 8 s,
    then every ``budget_replan_interval`` (10 s here)."""
    from vllm.v1.worker.gpu.spec_decode.ddtree import budget

    planner, clock = _planner()
    target, drafter = _timings()
    planner.set_costs(target, drafter, {0: 64, 15: 64, 32: 32, 64: 16})
    planner.begin()
    start = clock.now
    assert budget.FIRST_REPLAN_INTERVAL == 1.0
    snapshots = []
    for _ in range(160):  # 40 s of steps, 0.25 s apart
        clock.now += 0.25
        was_pending = planner.acceptance.pending
        planner.observe_walk(*_walk_outputs(8, 64, []))
        if planner.acceptance.pending and not was_pending:
            snapshots.append(clock.now - start)
    assert snapshots == [1.0, 3.0, 7.0, 15.0, 25.0, 35.0]


def test_planner_refuses_a_resolved_sync_scheduler():
    from vllm.v1.worker.gpu.spec_decode.ddtree.budget import DDTreeBudgetPlanner

    planner, _ = _planner()
    cfg = planner.vllm_config
    cfg.scheduler_config.async_scheduling = False
    with pytest.raises(ValueError, match="needs async scheduling"):
        DDTreeBudgetPlanner(cfg, torch.device("cpu"))


@measured_policy_line
def test_planner_drops_budgets_without_graphs_and_needs_nospec():
    planner, _ = _planner()
    target, drafter = _timings(budgets=(0, 15))
    planner.set_costs(target, drafter, {0: 64, 15: 64})
    assert planner.timed_budgets == [0, 15]
    planner.begin()
    assert {k for _, _, k in planner.update.schedule} <= {0, 15}
    target, drafter = _timings(budgets=(15, 32))
    with pytest.raises(ValueError, match="no one-token decode"):
        planner.set_costs(target, drafter, {15: 64, 32: 32})


@measured_policy_line
def test_planner_start_measures_once_then_reads_the_cache(monkeypatch, tmp_path):
    from vllm.v1.worker.gpu.spec_decode.ddtree import budget as budget_module

    timed = []
    target, drafter = _timings()

    def fake_measure(runner, target_shapes, drafter_shapes, log, timer=None):
        timed.append((sorted(target_shapes), sorted(drafter_shapes)))
        return target, drafter

    shapes = (
        {(n, t): None for n, t in target},
        {n: None for n in drafter},
    )
    monkeypatch.setattr(budget_module, "measure_step_costs", fake_measure)
    monkeypatch.setattr(
        budget_module, "captured_decode_shapes", lambda runner, budgets: shapes
    )
    monkeypatch.setattr(
        budget_module, "cost_cache_fields", lambda runner, budgets: {"m": "x"}
    )
    monkeypatch.setattr(budget_module, "_cache_root", lambda: str(tmp_path))
    import vllm.distributed.parallel_state as ps

    monkeypatch.setattr(
        ps, "get_tp_group", lambda: SimpleNamespace(rank_in_group=0, world_size=1)
    )
    planner, _ = _planner()
    planner.start(runner=None)
    assert len(timed) == 1 and planner.update.version == 1
    # The fake timings have no graphs for the small trees (1, 3, 7).
    assert planner.max_batch_per_budget == {
        0: 64,
        1: 0,
        3: 0,
        7: 0,
        15: 64,
        32: 32,
        64: 16,
    }
    again, _ = _planner()
    again.start(runner=None)
    assert len(timed) == 1  # read from the cache
    assert again.costs.points == planner.costs.points
    assert again.update.schedule == planner.update.schedule


def test_captured_decode_shapes_are_the_full_decode_graphs_of_the_budgets():
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor
    from vllm.v1.worker.gpu.spec_decode.ddtree.budget import (
        captured_decode_shapes,
        max_batch_per_tokens,
    )

    def desc(n, q, mode=CUDAGraphMode.FULL, loras=0):
        return BatchExecutionDescriptor(mode, n * q, n, q, loras)

    graphs = {desc(n, 1): 0 for n in (1, 2, 3, 4, 8, 16, 24)}
    graphs.update({desc(n, 16): 0 for n in range(1, 33)})
    graphs.update({desc(n, 65): 0 for n in range(1, 8)})
    graphs[desc(2, 16, loras=1)] = 0  # LoRA graphs are not timed
    graphs[desc(5, 9)] = 0  # not a candidate budget
    graphs[BatchExecutionDescriptor(CUDAGraphMode.FULL, 64, 64, None)] = 0
    drafter_graphs = {desc(n, 16): 0 for n in (1, 2, 3, 4, 6, 8)}
    runner = SimpleNamespace(
        cudagraph_manager=SimpleNamespace(graphs=graphs),
        speculator=SimpleNamespace(
            query_cudagraph_manager=SimpleNamespace(graphs=drafter_graphs)
        ),
    )
    target, drafter = captured_decode_shapes(runner, [0, 15, 32, 64])
    assert sorted(target) == sorted(
        [(n, 1) for n in (1, 2, 4, 8, 16, 24)]
        + [(n, 16) for n in (1, 2, 4, 8, 16, 32)]
        + [(n, 65) for n in (1, 2, 4, 7)]
    )
    assert sorted(drafter) == [1, 2, 4, 8]
    assert max_batch_per_tokens(target) == {1: 24, 16: 32, 65: 7}
    empty = SimpleNamespace(
        cudagraph_manager=SimpleNamespace(graphs={}),
        speculator=SimpleNamespace(query_cudagraph_manager=None),
    )
    with pytest.raises(ValueError, match="no decode CUDA graphs") as info:
        captured_decode_shapes(empty, [0, 15])
    assert "\n" not in str(info.value)


# --------------------------------------------------------------- scheduler
@measured_policy_line
def test_scheduler_applies_each_new_version_and_reports_it_once():
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.spec_decode.dynamic.utils import DynamicSDScheduleUpdate
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    sched = SimpleNamespace(
        dynamic_sd_version=0,
        dynamic_sd_lookup=[0, 64, 32, 32] + [15] * 5,
        _dynamic_sd_to_report=None,
        scheduler_config=SimpleNamespace(max_num_seqs=8),
        num_spec_tokens=64,
    )
    update = DynamicSDScheduleUpdate(1, [(1, 2, 64), (3, 8, 0)], [6.5, 1.0])
    Scheduler.update_dynamic_sd_schedule(sched, update)
    assert sched.dynamic_sd_lookup == [0, 64, 64, 0, 0, 0, 0, 0, 0]
    assert sched._dynamic_sd_to_report == [(1, 2, 64, 6.5), (3, 8, 0, 1.0)]
    # The same version again (every output carries it): nothing changes.
    sched.dynamic_sd_lookup = "kept"
    sched._dynamic_sd_to_report = None
    Scheduler.update_dynamic_sd_schedule(sched, update)
    assert sched.dynamic_sd_lookup == "kept" and sched._dynamic_sd_to_report is None
    Scheduler.update_dynamic_sd_schedule(
        sched, DynamicSDScheduleUpdate(2, [(1, 8, 15)], [3.0])
    )
    assert sched.dynamic_sd_lookup == [0] + [15] * 8

    # The next stats carry it, with or without a tree step.
    stats_self = SimpleNamespace(
        log_stats=True,
        kv_cache_manager=SimpleNamespace(
            make_prefix_cache_stats=lambda: object(), usage=0.0
        ),
        connector_prefix_cache_stats=None,
        kv_metrics_collector=None,
        running=[],
        waiting=[],
        skipped_waiting=[],
        # vLLM 0.33's make_stats counts the queues through get_request_counts
        # (upstream's, below) and reads these too.
        kv_holding_waiting=[],
        deferred_waiting=set(),
        _kv_fetch_counts={},
        num_spec_tokens=64,
        _dynamic_sd_to_report=[(1, 8, 15, 3.0)],
    )
    stats_self.get_request_counts = functools.partial(
        Scheduler.get_request_counts, stats_self
    )
    stats = Scheduler.make_stats(stats_self)
    spec_stats = stats.spec_decoding_stats
    assert isinstance(spec_stats, SpecDecodingStats) and spec_stats.num_drafts == 0
    assert spec_stats.dynamic_sd_schedule == [(1, 8, 15, 3.0)]
    assert Scheduler.make_stats(stats_self).spec_decoding_stats is None  # once
    own = SpecDecodingStats.new(64)
    own.observe_draft(15, 3)
    stats_self._dynamic_sd_to_report = [(1, 8, 0, 1.0)]
    assert Scheduler.make_stats(stats_self, own).spec_decoding_stats is own
    assert own.dynamic_sd_schedule == [(1, 8, 0, 1.0)]


@measured_policy_line
def test_runner_outputs_and_stats_carry_the_schedule_types():
    """ModelRunnerOutput's field defaults to None (nothing changes without
    the measured policy); SpecDecodingStats round-trips through vLLM's
    msgpack encoding with the schedule."""
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder
    from vllm.v1.spec_decode.metrics import SpecDecodingLogging, SpecDecodingStats

    assert ModelRunnerOutput(req_ids=[], req_id_to_index={}).dynamic_sd_schedule is None
    stats = SpecDecodingStats.new(4)
    stats.dynamic_sd_schedule = [(1, 2, 4, 3.5), (3, 8, 0, 1.0)]
    decoded = MsgpackDecoder(SpecDecodingStats).decode(MsgpackEncoder().encode(stats))
    assert decoded.dynamic_sd_schedule == [(1, 2, 4, 3.5), (3, 8, 0, 1.0)]
    # Stats that only carry a schedule leave the periodic log line alone.
    logging = SpecDecodingLogging()
    logging.observe(stats)
    assert logging.num_drafts == []


# ---------------------------------------------------- CUDA-graph capture
@measured_policy_line
def test_decode_graphs_are_captured_for_every_measured_budget(monkeypatch):
    from vllm.config import (
        CacheConfig,
        CompilationConfig,
        CUDAGraphMode,
        ParallelConfig,
        SchedulerConfig,
    )
    from vllm.v1.worker.gpu import cudagraph_utils as cg

    monkeypatch.setattr(
        cg,
        "get_pp_group",
        lambda: SimpleNamespace(is_first_rank=True, is_last_rank=True),
    )
    # No graph pool on a CPU machine (nothing is captured here).
    monkeypatch.setattr(
        cg, "current_platform", SimpleNamespace(get_global_graph_pool=lambda: None)
    )

    def manager(policy):
        compilation_config = CompilationConfig(
            cudagraph_mode="FULL_AND_PIECEWISE",
            cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
        )
        compilation_config.max_cudagraph_capture_size = 512
        compilation_config.post_init_cudagraph_sizes()
        spec = SimpleNamespace(
            uses_dynamic_speculative_decoding=lambda: True,
            use_ddtree=lambda: True,
            num_speculative_tokens_per_batch_size=[(1, 1, 64), (2, 1024, 15)],
            budget_policy=policy,
            tree_budget=64,
            draft_depth=15,
        )
        config = SimpleNamespace(
            compilation_config=compilation_config,
            scheduler_config=SchedulerConfig.default_factory(max_num_seqs=64),
            parallel_config=ParallelConfig(),
            cache_config=CacheConfig(),  # vLLM 0.33 reads its recoverSSM flag
            num_speculative_tokens=64,
            speculative_config=spec,
        )
        return cg.CudaGraphManager(
            config, torch.device("cpu"), CUDAGraphMode.FULL_AND_PIECEWISE, 65
        )

    def uniform_counts(m):
        return {d.uniform_token_count for d in m._capture_descs[CUDAGraphMode.FULL]}

    assert uniform_counts(manager("batch")) == {16, 65}
    assert uniform_counts(manager("measured")) == {1, 2, 4, 8, 16, 33, 65}


# ------------------------------------------------------------------ metrics
@pytest.fixture
def registry():
    prometheus_client = pytest.importorskip("prometheus_client")
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    unregister_vllm_metrics()
    yield prometheus_client.REGISTRY
    unregister_vllm_metrics()


def test_budget_and_tau_per_batch_size_in_metrics(registry):
    from vllm.v1.spec_decode.ddtree.metrics import DDTreeProm, batch_size_label
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    engine = {"model_name": "tiny", "engine": "0"}
    spec = SimpleNamespace(
        tree_budget=64,
        num_speculative_tokens=64,
        draft_depth=15,
        num_speculative_tokens_per_batch_size=[(1, 1, 64), (2, 3, 32), (4, 1024, 15)],
    )
    prom = DDTreeProm(spec, ["model_name", "engine"], {0: ["tiny", "0"]})

    def value(name, **labels):
        return registry.get_sample_value(name, {**engine, **labels})

    budget = "vllm:ddtree_budget_by_batch_size"
    # The configured schedule until a new one is applied.
    assert [value(budget, batch_size=str(n)) for n in (1, 2, 4, 1024)] == [
        64, 32, 15, 15,
    ]  # fmt: skip
    stats = SpecDecodingStats.new(64)
    stats.dynamic_sd_schedule = [(1, 1, 64, 6.2), (2, 8, 32, 5.1), (9, 64, 0, 1.0)]
    prom.observe(stats)  # no drafts: the schedule only
    expected = "vllm:ddtree_expected_acceptance_length"
    assert [value(budget, batch_size=str(n)) for n in (1, 2, 8, 16, 1024)] == [
        64, 32, 32, 0, 0,
    ]  # fmt: skip
    assert value(expected, batch_size="1") == pytest.approx(6.2)
    assert value(expected, batch_size="4") == pytest.approx(5.1)
    assert value(expected, batch_size="64") == 1.0
    requests = "vllm:ddtree_tree_requests_by_batch_size_total"
    assert value(requests, batch_size="8") == 0
    # A step of 6 tree requests (label 8) emitting 6 + 10 tokens.
    step = SpecDecodingStats.new(64)
    for accepted in (0, 1, 2, 3, 4, 0):
        step.observe_draft(32, accepted)
    prom.observe(step)
    emitted = "vllm:ddtree_emitted_tokens_by_batch_size_total"
    assert value(requests, batch_size="8") == 6
    assert value(emitted, batch_size="8") == 16
    assert [batch_size_label(n) for n in (1, 2, 3, 5, 1000, 5000)] == [
        1, 2, 4, 8, 1024, 1024,
    ]  # fmt: skip


# ----------------------------------------------- no speculation, no drafts
@measured_policy_line
def test_drafts_are_skipped_only_after_start_and_for_budget_zero():
    planner, _ = _planner()
    assert planner.begin_step(8, None, 0)  # the warm-up's steps carry no number
    target, drafter = _timings()
    planner.set_costs(target, drafter, {0: 64, 15: 64, 32: 32, 64: 16})
    planner.begin()
    assert not planner.begin_step(8, None, 0)
    assert planner.begin_step(8, np.full(8, 15, dtype=np.int32), 15)


def _by_batch(schedule):
    return {n: b for lo, hi, b in schedule for n in range(lo, hi + 1)}


@measured_policy_line
def test_served_steps_are_timed_between_step_starts_and_move_the_plan():
    """The host clock between two steps' starts is the first one's served
    time, filed under its batch size and kind (drafts or none) against the
    table's cost of its shape; idle gaps are not steps. Steps without drafts
    re-plan on the interval too, and the re-plan adds to the table what the
    served steps add: tree steps served at 3x the table turn 64 requests to
    no speculation."""
    from vllm.v1.worker.gpu.spec_decode.ddtree import budget

    planner, clock = _planner()
    target, drafter = _timings()
    planner.set_costs(target, drafter, {0: 64, 15: 64, 32: 32, 64: 16})
    planner.begin()
    first = planner.update
    assert _by_batch(first.schedule)[64] > 0  # the table alone: trees at 64
    table_15 = planner.costs.cost(64, 16)
    drafts = np.full(64, 15, dtype=np.int32)
    for _ in range(40):
        planner.begin_step(64, drafts, 15)
        clock.now += 3 * table_15
    # The 40th step has not ended yet: 39 served steps of 64 x 15 nodes.
    acc = planner.served.sums[(64, True)]
    assert acc[2] == 39
    assert acc[0] == pytest.approx(39 * 3 * table_15)
    assert acc[1] == pytest.approx(39 * table_15)
    planner.begin_step(64, drafts, 15)  # the 40th ends
    assert planner.served.sums[(64, True)][2] == 40
    clock.now += budget.MAX_SERVED_STEP_SECONDS + 0.5  # an idle engine
    planner.begin_step(64, drafts, 15)
    assert planner.served.sums[(64, True)][2] == 40  # not a step
    clock.now += 3 * table_15
    planner.begin_step(64, drafts, 15)
    assert planner.served.sums[(64, True)][2] == 41

    # Tree steps count their walks; the re-plan (snapshot queued, landed)
    # takes the served ratios.
    clock.now += 10.0
    planner.observe_walk(*_walk_outputs(8, 64, list(range(15))))
    planner.observe_walk(*_walk_outputs(8, 64, list(range(15))))
    second = planner.update
    assert second is not first
    assert (
        _by_batch(second.schedule)[64] == 0
    )  # 3x the table for trees: no speculation wins
    # The re-plan halved the sums and their weight (not the step count, nor
    # what a step adds: twice the table entry here).
    assert planner.served.sums[(64, True)] == pytest.approx(
        [41 * 1.5 * table_15, 41 * 0.5 * table_15, 41 * 0.5, 41]
    )
    xs, extra = planner.served.extra(True)
    assert xs.tolist() == [64.0] and extra[0] == pytest.approx(2 * table_15)

    # Steps without drafts: timed as their own kind, and they re-plan.
    nodrafts = np.zeros(64, dtype=np.int32)
    planner.begin_step(64, nodrafts, 0)
    table_0 = planner.costs.cost(64, 1)
    for _ in range(30):
        clock.now += 1.05 * table_0
        planner.begin_step(64, nodrafts, 0)
    assert planner.served.sums[(64, False)][3] == 30
    assert planner.served.sums[(64, True)][3] == 41
    clock.now += 20.0
    before = planner.acceptance.pending
    planner.begin_step(64, nodrafts, 0)  # queues the snapshot
    assert planner.acceptance.pending and not before
    planner.begin_step(64, nodrafts, 0)  # landed: re-plan (decays the sums)
    assert planner.served.sums[(64, False)][1] == pytest.approx(31 * 0.5 * table_0)
    assert _by_batch(planner.update.schedule)[64] == 0


def test_a_step_without_next_drafts_only_stores_its_context(monkeypatch):
    from vllm.v1.worker.gpu.spec_decode.ddtree import speculator as module
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    calls = []
    monkeypatch.setattr(
        DFlashSpeculator,
        "propose",
        lambda self, *a, **k: calls.append(("draft", k.get("num_speculative_tokens"))),
    )
    monkeypatch.setattr(
        module,
        "prepare_dflash_inputs",
        lambda *a: calls.append(("inputs", a[3].tolist())),
    )
    stored = {}

    class Drafter:
        def combine_hidden_states(self, h):
            return h * 2

        def precompute_and_store_context_kv(self, states, positions, slots):
            stored.update(states=states.clone(), positions=positions, slots=slots)

    spec = object.__new__(module.DDTreeSpeculator)
    spec.model = Drafter()
    spec.hidden_states = torch.zeros(16, 4)
    spec.context_positions = torch.arange(16)
    spec.draft_kv_cache_group_ids = [0]
    spec._context_slot_mappings = torch.arange(32).view(2, 16)
    spec._layer_group_idx = None
    spec.input_buffers = spec.sample_indices = spec.sample_pos = None
    spec.sample_idx_mapping = None
    spec.block_tables = SimpleNamespace(
        slot_mappings=[None], input_block_tables=[None], kernel_block_sizes=[16]
    )
    spec.parallel_drafting_token_id = 0
    spec.num_query_per_req = spec.num_speculative_steps = 4
    # The instance's own values (vLLM 0.33 makes max_model_len a property).
    vars(spec).update(max_num_reqs=4, max_num_tokens=16, max_model_len=64)
    spec.sample_from_anchor = False
    spec.draft_tokens = torch.full((4, B), 7)
    # The input kernel's block widths are compiled (a warm-up run did it).
    spec.dflash_input_blocks_compiled = True
    batch = SimpleNamespace(num_reqs=3, num_tokens=5)
    aux = [torch.ones(5, 2), torch.ones(5, 2)]
    args = (
        batch,
        None,
        None,
        torch.zeros(5, 4),
        aux,
        None,
        None,
        None,
        None,
        None,
        None,
    )

    spec.draft_next_step = True
    spec.propose(*args)
    assert calls == [("draft", None)]
    calls.clear()
    spec.draft_next_step = False
    spec.propose(*args, dummy_run=True)  # dummy runs always draft
    assert calls == [("draft", None)]
    calls.clear()
    out = spec.propose(*args)
    if module.PROPOSE_TAKES_NUM_SPECULATIVE_TOKENS:
        # vLLM 0.33+: upstream's own step without drafts (context K/V only).
        assert calls == [("draft", 0)]
        return
    # The context positions and slots of group 0; no query pass, no tree.
    assert calls == [("inputs", list(range(16)))]
    assert torch.equal(stored["states"], torch.full((5, 4), 2.0))  # aux combined
    assert stored["positions"].tolist() == [0, 1, 2, 3, 4]
    assert stored["slots"].tolist() == [0, 1, 2, 3, 4]
    assert out.shape == (3, B)
