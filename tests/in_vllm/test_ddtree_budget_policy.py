# SPDX-License-Identifier: Apache-2.0
"""CPU tests of the measured budget policy's vLLM wiring: the acceptance the
verifier counts from its walk, the configuration surface, the planner on
the worker (step costs, re-planning, the schedule it hands the scheduler),
the scheduler applying it, and its metrics."""

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
    )


def test_the_walk_is_counted_per_rank_on_the_device():
    verifier = _measured_verifier()
    assert verifier.acceptance is not None
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
    counts = verifier.acceptance.counts
    assert counts[0].tolist() == [1, 1, 0, 1]  # ranks 0 and 3; rank 1
    assert counts[1].tolist() == [2, 2, 2, 2]  # two trees of 4 nodes
    # The next step adds to them; the prefill row never counts.
    verifier.compact(batch, None, None)
    verifier.prepare_verify(batch)
    verifier.sample(ArgmaxSampler(), logits, batch, draft_tokens, prefill_len)
    assert counts.tolist() == [[2, 2, 0, 2], [4, 4, 4, 4]]


def test_other_policies_count_nothing():
    from verifier_fakes import make_verifier

    assert make_verifier().acceptance is None
    assert _measured_verifier(budget_policy="batch").acceptance is None


# ------------------------------------------------------------------ config
from verifier_fakes import DRAFTER, make_spec, needs_models  # noqa: E402


@needs_models
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
    # Every budget it may switch to gets decode graphs, no speculation too.
    assert capture_budgets(spec) == [0, 15, 32, 64]
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
    assert capture_budgets(small) == [0, 8]
    batch = make_spec(target_model_config, method="ddtree", model=DRAFTER)
    assert capture_budgets(batch) == [15, 32, 64]


@needs_models
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


def test_measured_policy_needs_cuda_graphs_and_one_scheduler():
    from vllm.v1.spec_decode.ddtree.config import _verify_measured_budget_policy

    def fake(policy="measured", eager=False, dp=1):
        return SimpleNamespace(
            speculative_config=SimpleNamespace(budget_policy=policy),
            model_config=SimpleNamespace(enforce_eager=eager),
            parallel_config=SimpleNamespace(data_parallel_size=dp),
        )

    _verify_measured_budget_policy(fake())
    _verify_measured_budget_policy(fake("batch", eager=True, dp=2))
    for bad, message in ((fake(eager=True), "enforce_eager"), (fake(dp=2), "data")):
        with pytest.raises(ValueError, match=message) as info:
            _verify_measured_budget_policy(bad)
        assert "\n" not in str(info.value) and str(info.value).startswith("DDTree")
