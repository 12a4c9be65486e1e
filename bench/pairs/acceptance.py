# SPDX-License-Identifier: Apache-2.0
"""Offline acceptance of a drafter against its target's continuation.

Given the target's continuation of a prompt and the drafter's per-depth
log-probabilities at every possible anchor (bonus-token position), replay what
vLLM does: the DFlash chain accepts the longest prefix of its argmax draft
that the target agrees with; DDTree builds the B most probable prefixes of the
factorised draft distribution and walks the target's tokens down it. Both
return tau: tokens emitted per step (accepted + the bonus).

At temperature 0 the continuation is the target's greedy one. At temperature
T > 0 it is one sample from the target at T, and the same replay gives the
accepted lengths of sampled verification: DDTree draws the target's token at
every node and walks, which emits a true target sample and leaves the tree
exactly where that sample does; vLLM's chain drafts argmax tokens (its default
``draft_sample_method="greedy"``: one-hot draft probabilities), and rejection
sampling then accepts a draft token with the target's probability of it and
otherwise draws from the target with that token removed, which is the same as
drawing from the target and accepting when the draw equals the draft.
"""

from __future__ import annotations

import heapq

import torch


def chain_steps(
    draft: torch.Tensor, tokens: list[int], start: int, end: int
) -> list[int]:
    """Accepted-plus-one per step of the chain. ``draft[p]`` [K] is the argmax draft
    after a bonus token at position p (predicting positions p+1..p+K); ``tokens``
    the target's sequence (greedy, or sampled: see above); decoding starts with
    the bonus at ``start`` and stops once position ``end`` is emitted."""
    out, p = [], start
    k = draft.shape[1]
    while p < end:
        n = 0
        while n < k and p + 1 + n <= end and int(draft[p, n]) == tokens[p + 1 + n]:
            n += 1
        out.append(n + 1)
        p += n + 1
    return out


def best_prefixes(logp_topk: torch.Tensor, budget: int) -> set[tuple[int, ...]]:
    """The ``budget`` most probable prefixes of a factorised distribution whose
    per-depth log-probabilities, sorted descending, are ``logp_topk`` [D, R];
    a prefix is a tuple of per-depth ranks. The set is prefix-closed."""
    depth, ranks = logp_topk.shape
    lp = logp_topk.tolist()
    heap = [(-lp[0][0], (0,))]
    chosen: set[tuple[int, ...]] = set()
    while heap and len(chosen) < budget:
        neg, node = heapq.heappop(heap)
        chosen.add(node)
        d, r = len(node) - 1, node[-1]
        if r + 1 < ranks:  # next sibling
            heapq.heappush(heap, (neg + lp[d][r] - lp[d][r + 1], node[:-1] + (r + 1,)))
        if d + 1 < depth:  # first child
            heapq.heappush(heap, (neg - lp[d + 1][0], node + (0,)))
    return chosen


def tree_steps(
    vals: torch.Tensor,
    idx: torch.Tensor,
    tokens: list[int],
    start: int,
    end: int,
    budget: int,
) -> list[int]:
    """Accepted-plus-one per step of DDTree with ``budget`` nodes. ``vals[p]`` and
    ``idx[p]`` [K, R] (R >= budget) are the top-R draft log-probabilities and token
    ids per depth after a bonus at position p, sorted descending."""
    out, p = [], start
    k = vals.shape[1]
    while p < end:
        tree = best_prefixes(vals[p, :, :budget], budget)
        rank_of = [
            {int(t): j for j, t in enumerate(idx[p, d, :budget].tolist())}
            for d in range(k)
        ]
        n, node = 0, ()
        while n < k and p + 1 + n <= end:
            j = rank_of[n].get(tokens[p + 1 + n])
            if j is None or node + (j,) not in tree:
                break
            node += (j,)
            n += 1
        out.append(n + 1)
        p += n + 1
    return out


def tau(steps: list[list[int]]) -> float:
    """Mean tokens per step over all prompts' steps."""
    flat = [s for row in steps for s in row]
    return sum(flat) / max(1, len(flat))
