# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU tests for DDTree's per-rank acceptance counters
(overlay/vllm/v1/spec_decode/ddtree/acceptance.py): the torch update and the
Triton launch (in the interpreter here) against brute force, over steps of
mixed batches, and the host snapshot."""

from __future__ import annotations

import random

import pytest
import torch

import ddtree_reference as ref
from vllm.v1.spec_decode.ddtree import acceptance as A
from vllm.v1.spec_decode.ddtree.tree import build_tree

BACKENDS = [False] + ([True] if A.triton is not None else [])


def _random_step(rng: random.Random, budget: int, depth: int, num_reqs: int):
    """One step's walk outputs, as `ddtree_walk` lays them out, and the
    brute-force per-rank counts. Requests verify 0 (prefill, plain decode)
    to ``budget`` nodes; the accepted path takes strictly increasing ranks
    among the verified ones."""
    query_lens, cu_logits, paths = [], [0], []
    for _ in range(num_reqs):
        kind = rng.random()
        if kind < 0.2:  # a prefill chunk: many query rows, one logit
            query_lens.append(rng.randint(1, 40))
            cu_logits.append(cu_logits[-1] + 1)
            paths.append([])
            continue
        nodes = rng.randint(0, budget)
        query_lens.append(1 + nodes)
        cu_logits.append(cu_logits[-1] + 1 + nodes)
        length = rng.randint(0, min(depth, nodes))
        paths.append(sorted(rng.sample(range(1, nodes + 1), length)))
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    src_row = torch.empty(num_reqs, depth + 1, dtype=torch.int64)
    for r, path in enumerate(paths):
        row = [qsl[r]] + [qsl[r] + node for node in path]
        row += [qsl[r]] * (depth + 1 - len(row))  # root self-copies
        src_row[r] = torch.tensor(row)
    num_accepted = torch.tensor([1 + len(p) for p in paths], dtype=torch.int32)
    want = torch.zeros(2, budget, dtype=torch.int64)
    for r, path in enumerate(paths):
        for node in path:
            want[0, node - 1] += 1
        for rank in range(cu_logits[r + 1] - cu_logits[r] - 1):
            want[1, rank] += 1
    return (
        num_accepted,
        src_row,
        torch.tensor(qsl, dtype=torch.int32),
        torch.tensor(cu_logits, dtype=torch.int32),
        want,
    )


@pytest.mark.parametrize("use_triton", BACKENDS)
@pytest.mark.parametrize("seed", range(8))
def test_counts_match_brute_force_over_steps(seed, use_triton):
    rng = random.Random(seed)
    budget = rng.choice([1, 7, 16, 64])
    depth = rng.choice([1, 4, 15])
    counts = torch.zeros(2, budget, dtype=torch.int64)
    total = torch.zeros_like(counts)
    for _ in range(5):
        *step, want = _random_step(rng, budget, depth, rng.randint(1, 12))
        A.count_accepted_ranks(counts, *step, use_triton=use_triton)
        total += want
        assert torch.equal(counts, total)
    assert counts[1, 0] >= counts[0, 0]  # rank 0: accepted <= verified


@pytest.mark.parametrize("use_triton", BACKENDS)
def test_counts_from_the_reference_walk_on_built_trees(use_triton):
    """The walk's own outputs (reference walk + compaction rows) on trees
    that `build_tree` made: accepted counts are the accepted masks summed
    over requests, verified counts the requests' scheduled nodes."""
    g = torch.Generator().manual_seed(3)
    reqs, depth, vocab, budget = 12, 5, 4, 24
    logits = torch.randn(reqs, depth, vocab, generator=g) * 2
    tree = build_tree(logits, budget, backend="torch")
    target = torch.randint(0, vocab, (reqs, budget + 1), generator=g)
    target[:, 0] = tree.token_ids[:, 0]  # the first node always matches
    walk = ref.walk_tree(tree, target)
    qsl = torch.arange(reqs + 1, dtype=torch.int32) * (budget + 1)
    plan = ref.compaction_indices(walk, qsl)
    counts = torch.zeros(2, budget, dtype=torch.int64)
    A.count_accepted_ranks(
        counts, walk.num_accepted.int(), plan.src_token_idx, qsl, qsl, use_triton
    )
    assert torch.equal(counts[0], walk.accepted_mask[:, 1:].sum(0))
    assert torch.equal(counts[1], torch.full((budget,), reqs))
    assert counts[0, 0] == reqs


def test_snapshot_reaches_the_host_copy():
    counters = A.AcceptanceCounters(8, torch.device("cpu"))
    assert not counters.snapshot_ready()  # nothing queued
    counters.counts[0, 3] = 5
    counters.counts[1, :4] = 9
    counters.snapshot()
    assert counters.pending
    with pytest.raises(AssertionError):
        counters.snapshot()  # one copy in flight at a time
    assert counters.snapshot_ready() and not counters.pending
    assert counters.host_np[0].tolist() == [0, 0, 0, 5, 0, 0, 0, 0]
    assert counters.host_np[1].tolist() == [9, 9, 9, 9, 0, 0, 0, 0]
    # The host copy is a snapshot: later counts do not show until the next.
    counters.counts[0, 3] = 7
    assert counters.host_np[0, 3] == 5
