# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU tests for the spec-row bound that sizes the Gated DeltaNet verify
buffers (`policy.max_spec_rows_per_step`), against brute force over every
history of a small scheduler."""

from __future__ import annotations

import itertools
import random

import pytest

from vllm.v1.spec_decode.ddtree import policy as P

BATCH_POLICY_SCHEDULE = [(1, 1, 64), (2, 3, 32), (4, 1024, 15)]


def _budget_at(schedule, b: int, tree_budget: int) -> int:
    """K(b) read off the ranges directly: the range holding ``b``, else the
    last range ending before it; never above ``tree_budget``."""
    if not schedule:
        return tree_budget
    holding = [k for lo, hi, k in schedule if lo <= b <= hi]
    if holding:
        return min(tree_budget, holding[0])
    before = [(hi, k) for lo, hi, k in schedule if hi < b]
    return min(tree_budget, max(before)[1]) if before else tree_budget


def _budgets(schedule, max_num_seqs: int, tree_budget: int) -> list[int]:
    """K(1) .. K(max_num_seqs), as the scheduler's lookup gives them."""
    return [_budget_at(schedule, b, tree_budget) for b in range(1, max_num_seqs + 1)]


def _brute_force_max_rows(max_num_seqs: int, tree_budget: int, schedule) -> int:
    """The most spec rows of a step over every history of a scheduler that
    keeps its running requests in admission order and, each step: finishes
    any of them, schedules a prefix of the rest (any cut: budgets are not
    modelled), admits new requests only when it scheduled them all, and
    gives every scheduled request that has sampled ``K(b)`` drafts, ``b``
    the step's batch size; a request it passes over keeps its drafts.

    A running request is "P" (prefilling: no drafts) or its draft count;
    each scheduled request counts one row (a decode, or a prompt tail that
    runs as one) plus its drafts."""
    k = {b: _budget_at(schedule, b, tree_budget) for b in range(1, max_num_seqs + 1)}
    seen = {()}
    frontier = [()]
    best = 0
    while frontier:
        next_frontier = []
        for state in frontier:
            for keep in itertools.product((True, False), repeat=len(state)):
                running = tuple(r for r, kept in zip(state, keep) if kept)
                for cut in range(len(running) + 1):
                    admits = (
                        range(max_num_seqs - len(running) + 1)
                        if cut == len(running)
                        else (0,)
                    )
                    for admitted in admits:
                        b = cut + admitted
                        if b == 0:
                            continue
                        scheduled = running[:cut] + ("P",) * admitted
                        rows = sum(1 + (0 if r == "P" else r) for r in scheduled)
                        best = max(best, rows)
                        # A prefilling request may finish its prompt here.
                        choices = [
                            (k[b],) if r != "P" else (k[b], "P") for r in scheduled
                        ]
                        for after in itertools.product(*choices):
                            new = after + running[cut:]
                            if new not in seen:
                                seen.add(new)
                                next_frontier.append(new)
        frontier = next_frontier
    return best


def _random_schedule(rng: random.Random, max_batch: int, max_budget: int):
    """Sorted ranges from batch size 1, with gaps; budgets in any order."""
    schedule = []
    lo = 1
    while lo <= max_batch:
        hi = rng.randint(lo, lo + 1)
        schedule.append((lo, hi, rng.randint(0, max_budget + 1)))
        lo = hi + 1 + rng.choice((0, 0, 1))
    return schedule


@pytest.mark.parametrize("seed", range(16))
def test_bound_is_the_brute_force_maximum(seed):
    rng = random.Random(seed)
    max_num_seqs = rng.randint(2, 4)
    tree_budget = rng.randint(1, 4)
    schedule = _random_schedule(rng, max_num_seqs, tree_budget)
    brute = _brute_force_max_rows(max_num_seqs, tree_budget, schedule)
    budgets = _budgets(schedule, max_num_seqs, tree_budget)
    assert P.max_spec_rows_per_step(10**6, budgets) == brute


def test_drafts_from_earlier_steps_exceed_one_proposal():
    # Budgets 4 / 2 / 1 at batch sizes 1 / 2-3 / 4+: a step whose requests
    # all come from one proposal verifies at most max_b b x K(b) = 6 drafts;
    # requests passed over by the steps in between keep larger trees.
    schedule = [(1, 1, 4), (2, 3, 2), (4, 8, 1)]
    budgets = _budgets(schedule, 4, 4)
    one_proposal = max(b * k for b, k in enumerate(budgets, start=1))
    assert one_proposal == 6
    assert _brute_force_max_rows(4, 4, schedule) == 4 + 4 + 2 + 2 + 1
    assert P.max_spec_rows_per_step(10**6, _budgets(schedule, 4, 4)) == 13


def test_no_schedule_is_a_full_tree_per_request():
    assert _brute_force_max_rows(3, 4, None) == 3 * (1 + 4)
    assert P.max_spec_rows_per_step(10**6, _budgets(None, 3, 4)) == 15
    assert P.max_spec_rows_per_step(16384, _budgets(None, 64, 64)) == 64 * 65
    assert P.max_spec_rows_per_step(16384, _budgets(None, 256, 64)) == 16384


def test_batch_policy_schedule_at_the_served_shape():
    # 64 requests: 64 + (64 + 2 x 32 + 61 x 15) rows, not 64 x 65 = 4160.
    assert (
        P.max_spec_rows_per_step(8192, _budgets(BATCH_POLICY_SCHEDULE, 64, 64)) == 1107
    )
    assert P.max_spec_rows_per_step(
        16384, _budgets(BATCH_POLICY_SCHEDULE, 256, 64)
    ) == (256 + 64 + 2 * 32 + 253 * 15)
    # Never more than a step's tokens.
    assert P.max_spec_rows_per_step(512, _budgets(BATCH_POLICY_SCHEDULE, 64, 64)) == 512
    # A schedule above tree_budget is clamped to it, as the scheduler does.
    assert P.max_spec_rows_per_step(10**6, _budgets([(1, 4, 32)], 2, 8)) == 2 + 2 * 8
