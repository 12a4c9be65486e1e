# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU tests for the DDTree core: the tree build of
overlay/vllm/v1/spec_decode/ddtree/tree.py against brute force, and the torch
reference verification (tests/ddtree_reference.py) on the trees it builds.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ddtree_reference as ref
from vllm.v1.spec_decode.ddtree import tree as tree_module

NEG_INF = float("-inf")


@pytest.fixture(scope="module")
def T():
    """The DDTree tree build (the overlay's tree.py, imported where it stands)."""
    return tree_module


# --------------------------------------------------------------------------
# Reference implementations (plain Python, deliberately naive)
# --------------------------------------------------------------------------


def reference_logprobs(draft: torch.Tensor, inputs_are_logprobs: bool):
    """(rank_values, logprobs) as documented: NaN -> -inf, float32."""
    x = torch.nan_to_num(
        draft.float(), nan=NEG_INF, posinf=float("inf"), neginf=NEG_INF
    )
    if inputs_are_logprobs:
        x = x.clamp_max(0.0)
        return x, x
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    lp = torch.nan_to_num(x - lse, nan=NEG_INF, posinf=NEG_INF).clamp_max(0.0)
    return x, lp


def brute_force_tree(rank_values: torch.Tensor, logprobs: torch.Tensor, budget: int):
    """Enumerate every prefix of one request ([D, V] inputs), order them by
    the documented key and keep the first ``budget``.

    Returns a list of (tokens tuple, parent index, depth, score) in node
    order (node i+1 at list index i).
    """
    depth_total, vocab = logprobs.shape
    lp = logprobs.numpy().astype(np.float32)
    values = rank_values.numpy()
    # token rank per depth: (value desc, token id asc)
    token_rank = []
    for d in range(depth_total):
        order = sorted(range(vocab), key=lambda t: (-values[d, t], t))
        token_rank.append({t: i for i, t in enumerate(order)})

    per_depth = []  # per depth: list of (tokens, score) sorted by key
    prev = [((), np.float32(0.0))]
    for d in range(depth_total):  # float32 sums, -inf allowed
        cands = []
        for parent_rank, (tokens, score) in enumerate(prev):
            for t in range(vocab):
                with np.errstate(all="ignore"):
                    s = np.float32(score + lp[d, t]) if d else lp[d, t]
                cands.append(
                    (
                        (-float(s), parent_rank, token_rank[d][t]),
                        tokens + (t,),
                        np.float32(s),
                    )
                )
        cands.sort(key=lambda c: c[0])
        prev = [(tokens, s) for _, tokens, s in cands]
        per_depth.append(prev)

    nodes = []
    for d, level in enumerate(per_depth):
        for rank, (tokens, s) in enumerate(level):
            nodes.append(((-float(s), d + 1, rank), tokens, s))
    nodes.sort(key=lambda n: n[0])
    nodes = nodes[:budget]
    position = {tokens: i + 1 for i, (_, tokens, _) in enumerate(nodes)}
    out = []
    for _, tokens, s in nodes:
        parent = position[tokens[:-1]] if len(tokens) > 1 else 0
        out.append((tokens, parent, len(tokens), float(s)))
    return out


def tree_prefixes(tree, r: int):
    """Token tuple of every valid node of request r, following parents."""
    tokens = tree.token_ids[r].tolist()
    parents = tree.parent_idx[r].tolist()
    valid = tree.valid[r].tolist()
    prefixes = {0: ()}
    out = []
    for i in range(len(tokens)):
        if not valid[i]:
            continue
        prefixes[i + 1] = prefixes[parents[i]] + (tokens[i],)
        out.append(prefixes[i + 1])
    return out


def assert_matches_brute_force(T, draft, budget, inputs_are_logprobs=False, **kwargs):
    tree = T.build_tree(
        draft, budget, inputs_are_logprobs=inputs_are_logprobs, **kwargs
    )
    R, D, V = draft.shape
    rank_values, lp = reference_logprobs(draft, inputs_are_logprobs)
    for r in range(R):
        ref = brute_force_tree(rank_values[r], lp[r], budget)
        n = len(ref)
        assert tree.valid[r].tolist() == [True] * n + [False] * (budget - n)
        assert tree_prefixes(tree, r) == [tokens for tokens, *_ in ref]
        assert tree.parent_idx[r, :n].tolist() == [p for _, p, _, _ in ref]
        assert tree.depth[r, :n].tolist() == [d for _, _, d, _ in ref]
        assert tree.score[r, :n].tolist() == [s for *_, s in ref]
        # padding
        assert tree.token_ids[r, n:].eq(0).all()
        assert tree.parent_idx[r, n:].eq(0).all()
        assert tree.depth[r, n:].eq(1).all()
        assert tree.score[r, n:].eq(NEG_INF).all()
    return tree


def check_structure(tree, draft_depth):
    """Invariants every tree must satisfy."""
    R, B = tree.token_ids.shape
    assert tree.token_ids.dtype == torch.int64
    assert tree.parent_idx.dtype == torch.int64
    assert tree.depth.dtype == torch.int64
    assert tree.score.dtype == torch.float32
    assert tree.valid.dtype == torch.bool
    idx = torch.arange(1, B + 1)
    assert (tree.parent_idx < idx).all()
    assert (tree.depth >= 1).all() and (tree.depth <= draft_depth).all()
    for r in range(R):
        depth = [0] + tree.depth[r].tolist()
        score = [0.0] + tree.score[r].tolist()
        seen = set()
        for i in range(1, B + 1):
            if not tree.valid[r, i - 1]:
                continue
            p = tree.parent_idx[r, i - 1].item()
            assert depth[i] == depth[p] + 1
            assert score[i] <= score[p]
            key = (p, tree.token_ids[r, i - 1].item())
            assert key not in seen, "siblings must be distinct"
            seen.add(key)


# --------------------------------------------------------------------------
# build_tree
# --------------------------------------------------------------------------

SMALL_SHAPES = [(2, 1), (2, 3), (3, 3), (4, 2), (5, 3), (3, 5), (7, 2)]


@pytest.mark.parametrize("vocab,depth", SMALL_SHAPES)
def test_build_matches_brute_force_every_budget(T, vocab, depth):
    torch.manual_seed(vocab * 10 + depth)
    draft = torch.randn(3, depth, vocab) * 2
    num_prefixes = sum(vocab**d for d in range(1, depth + 1))
    for budget in range(1, num_prefixes + 3):
        tree = assert_matches_brute_force(T, draft, budget)
        check_structure(tree, depth)


@pytest.mark.parametrize("vocab,depth", SMALL_SHAPES)
def test_build_tied_logits_every_budget(T, vocab, depth):
    """Heavily tied logits: the documented tie order must be reproduced."""
    torch.manual_seed(100 + vocab * 10 + depth)
    draft = torch.randint(0, 3, (3, depth, vocab)).float()
    draft[0] = 0.0  # everything tied
    num_prefixes = sum(vocab**d for d in range(1, depth + 1))
    for budget in range(1, num_prefixes + 3):
        assert_matches_brute_force(T, draft, budget)


def test_build_tied_logprobs_input(T):
    """Exactly equal log-probs across depths (uniform drafter)."""
    draft = torch.full((2, 3, 4), math.log(0.25))
    draft[1, 1] = torch.tensor([-1.0, -2.0, -1.0, -2.0])
    for budget in range(1, 90):
        assert_matches_brute_force(T, draft, budget, inputs_are_logprobs=True)


def test_build_logprobs_input_matches_logits(T):
    torch.manual_seed(1)
    logits = torch.randn(2, 4, 6)
    for budget in (1, 5, 17, 40):
        assert_matches_brute_force(
            T, logits.log_softmax(-1), budget, inputs_are_logprobs=True
        )


def test_build_nan_and_inf(T):
    torch.manual_seed(2)
    draft = torch.randn(4, 3, 5)
    draft[0, 0, 1] = float("nan")
    draft[0, 2, :] = float("nan")  # a whole depth of NaN -> all -inf
    draft[1, 1, 2:] = NEG_INF
    draft[2, 0, :4] = NEG_INF  # a single finite token at depth 1
    draft[3] = NEG_INF  # nothing finite at all
    for budget in range(1, 160):
        tree = assert_matches_brute_force(T, draft, budget)
        check_structure(tree, 3)
    tree = T.build_tree(draft, 8)
    assert tree.valid.all()
    assert not torch.isnan(tree.score).any()
    # request 2: the finite prefixes come first
    assert tree.score[2, 0].isfinite() and tree.token_ids[2, 0] == 4


def test_build_nan_logprobs_input(T):
    draft = torch.tensor([[[-0.5, float("nan"), -1.5], [NEG_INF, -0.1, float("nan")]]])
    for budget in range(1, 14):
        assert_matches_brute_force(T, draft, budget, inputs_are_logprobs=True)


def test_build_bf16_input(T):
    torch.manual_seed(3)
    draft = (torch.randn(2, 3, 6) * 3).to(torch.bfloat16)
    for budget in (1, 7, 30, 100, 300):
        assert_matches_brute_force(T, draft, budget)


def test_build_budget_one(T):
    torch.manual_seed(4)
    draft = torch.randn(5, 6, 50)
    tree = T.build_tree(draft, 1)
    assert tree.token_ids.shape == (5, 1)
    assert torch.equal(tree.token_ids[:, 0], draft[:, 0].argmax(-1))
    assert tree.parent_idx.eq(0).all() and tree.depth.eq(1).all()
    assert tree.valid.all()
    assert_matches_brute_force(T, draft[:, :2, :6], 1)


def test_build_budget_exceeds_prefixes(T):
    draft = torch.randn(2, 2, 2)  # 2 + 4 = 6 prefixes
    tree = assert_matches_brute_force(T, draft, 10)
    assert tree.valid.sum(1).tolist() == [6, 6]
    # padded nodes are never accepted, even if the target says token 0
    target = torch.zeros(2, 11, dtype=torch.int64)
    walk = ref.walk_tree(tree, target)
    assert not walk.accepted_mask[:, 7:].any()


def test_build_large_vocab_against_brute_force_top(T):
    """Realistic V: compare with brute force on the union of per-depth
    top-B tokens (Lemma 1: other tokens can never be selected)."""
    torch.manual_seed(5)
    R, D, V, B = 2, 3, 1000, 12
    logits = torch.randn(R, D, V) * 3
    tree = T.build_tree(logits, B)
    check_structure(tree, D)
    _, lp = reference_logprobs(logits, False)
    for r in range(R):
        # expected score of every node by summing along its prefix
        for prefix, score in zip(tree_prefixes(tree, r), tree.score[r]):
            s = lp[r, 0, prefix[0]]
            for d, t in enumerate(prefix[1:], start=1):
                s = s + lp[r, d, t]
            assert s.item() == score.item()
        # optimality: the worst selected score beats every unselected
        # one-step extension and every unselected depth-1 token
        selected = set(tree_prefixes(tree, r))
        worst = tree.score[r].min().item()
        extensions = [()] + [p for p in selected if len(p) < D]
        for p in extensions:
            base = sum(lp[r, d, t].item() for d, t in enumerate(p))
            best_child = lp[r, len(p)].topk(B + 1)
            for val, tok in zip(best_child.values, best_child.indices):
                if p + (tok.item(),) not in selected:
                    assert base + val.item() <= worst + 1e-5
                    break


def test_build_deterministic(T):
    torch.manual_seed(6)
    draft = torch.randint(0, 4, (3, 5, 40)).float()
    a = T.build_tree(draft, 33)
    b = T.build_tree(draft.clone(), 33)
    for x, y in zip(a[:5], b[:5]):
        assert torch.equal(x, y)


def test_build_fast_path_without_ties(T):
    """exact_vocab_ties=False equals the exact path when there are no ties
    and always gives a valid tree."""
    torch.manual_seed(7)
    draft = torch.randn(3, 4, 100)
    a = T.build_tree(draft, 20)
    b = T.build_tree(draft, 20, exact_vocab_ties=False)
    for x, y in zip(a[:5], b[:5]):
        assert torch.equal(x, y)
    tied = torch.randint(0, 2, (3, 4, 100)).float()
    check_structure(T.build_tree(tied, 20, exact_vocab_ties=False), 4)


def test_build_does_not_modify_input(T):
    draft = torch.randn(2, 3, 7)
    draft[0, 0, 0] = float("nan")
    copy = draft.clone()
    T.build_tree(draft, 9)
    T.build_tree(draft, 9, inputs_are_logprobs=True)
    assert torch.equal(draft.isnan(), copy.isnan())
    assert torch.equal(draft.nan_to_num(0.0), copy.nan_to_num(0.0))


logprob_values = st.sampled_from(
    [0.0, -0.5, -1.0, -1.5, -2.0, -3.0, NEG_INF, float("nan")]
) | st.floats(-8.0, 0.0)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    vocab=st.integers(1, 4),
    depth=st.integers(1, 4),
    budget=st.integers(1, 40),
    as_logprobs=st.booleans(),
)
def test_build_property(T, data, vocab, depth, budget, as_logprobs):
    """Random (often tied, NaN, -inf) inputs: prefix-closed, parents first,
    scores consistent, and equal to brute force."""
    values = data.draw(
        st.lists(logprob_values, min_size=2 * depth * vocab, max_size=2 * depth * vocab)
    )
    draft = torch.tensor(values, dtype=torch.float32).view(2, depth, vocab)
    tree = assert_matches_brute_force(T, draft, budget, inputs_are_logprobs=as_logprobs)
    check_structure(tree, depth)
    for r in range(2):
        prefixes = tree_prefixes(tree, r)
        assert len(set(prefixes)) == len(prefixes)
        assert all(p[:-1] in set(prefixes) | {()} for p in prefixes)


# --------------------------------------------------------------------------
# Verification inputs
# --------------------------------------------------------------------------


def brute_force_ancestors(parent_idx: torch.Tensor) -> torch.Tensor:
    R, B = parent_idx.shape
    mask = torch.zeros(R, B + 1, B + 1, dtype=torch.bool)
    for r in range(R):
        parents = [0] + parent_idx[r].tolist()
        for i in range(B + 1):
            j = i
            mask[r, i, j] = True
            while j != 0:
                j = parents[j]
                mask[r, i, j] = True
    return mask


@pytest.mark.parametrize("depth", [1, 2, 3, 5, 15, 16, 17])
def test_ancestor_mask_matches_brute_force(T, depth):
    torch.manual_seed(depth)
    for budget, vocab in [(1, 3), (7, 2), (31, 5), (33, 4), (64, 8)]:
        tree = T.build_tree(torch.randn(3, depth, vocab) * 0.3, budget)
        mask = ref.ancestor_mask(tree.parent_idx, depth)
        assert torch.equal(mask, brute_force_ancestors(tree.parent_idx))


def test_ancestor_mask_deep_chain(T):
    B = D = 40
    parent = torch.arange(B).unsqueeze(0)  # node i+1 has parent i
    mask = ref.ancestor_mask(parent, D)
    assert torch.equal(mask[0], torch.ones(B + 1, B + 1, dtype=torch.bool).tril())


def test_bias_and_packed_bits(T):
    torch.manual_seed(8)
    for budget in (1, 30, 31, 32, 63, 64, 100):
        tree = T.build_tree(torch.randn(2, 4, 6), budget)
        mask = ref.ancestor_mask(tree.parent_idx, 4)
        bias = ref.tree_attention_bias(mask, torch.bfloat16)
        assert bias.dtype == torch.bfloat16
        assert torch.equal(bias == 0, mask)
        assert torch.isneginf(bias[~mask].float()).all()
        words = ref.pack_ancestor_bits(mask)
        n = budget + 1
        assert words.dtype == torch.int32
        assert words.shape == (2, n, (n + 31) // 32)
        w = words.to(torch.int64) & 0xFFFFFFFF
        for j in range(n):
            bit = (w[:, :, j // 32] >> (j % 32)) & 1
            assert torch.equal(bit.bool(), mask[:, :, j])


def test_tree_positions(T):
    root = torch.tensor([5, 100], dtype=torch.int32)
    depth = torch.tensor([[1, 2, 1], [1, 1, 3]])
    pos = ref.tree_positions(root, depth)
    assert pos.dtype == torch.int32
    assert pos.tolist() == [[5, 6, 7, 6], [100, 101, 101, 103]]


# --------------------------------------------------------------------------
# Walk and compaction
# --------------------------------------------------------------------------


def make_tree(T, token_ids, parent_idx, depth, draft_depth, valid=None):
    token_ids = torch.tensor(token_ids, dtype=torch.int64)
    R, B = token_ids.shape
    return T.DDTree(
        token_ids=token_ids,
        parent_idx=torch.tensor(parent_idx, dtype=torch.int64),
        depth=torch.tensor(depth, dtype=torch.int64),
        score=torch.zeros(R, B),
        valid=torch.ones(R, B, dtype=torch.bool)
        if valid is None
        else torch.tensor(valid),
        draft_depth=draft_depth,
    )


def reference_walk(tree, target):
    """Sequential walk: from the root, move to the child whose token is the
    target's token at the current node."""
    R, B = tree.token_ids.shape
    out = []
    for r in range(R):
        node, path = 0, [0]
        while True:
            nxt = [
                i + 1
                for i in range(B)
                if tree.valid[r, i]
                and tree.parent_idx[r, i] == node
                and tree.token_ids[r, i] == target[r, node]
            ]
            assert len(nxt) <= 1
            if not nxt:
                break
            node = nxt[0]
            path.append(node)
        out.append(path)
    return out


def check_walk(T, tree, target, expected_paths=None):
    walk = ref.walk_tree(tree, target)
    # the ancestor-mask variant must agree exactly
    mask = ref.ancestor_mask(tree.parent_idx, tree.draft_depth)
    walk_masked = ref.walk_tree(tree, target, ancestors=mask)
    for a, b in zip(walk, walk_masked):
        assert torch.equal(a, b)
    paths = reference_walk(tree, target)
    if expected_paths is not None:
        assert paths == expected_paths
    D = tree.draft_depth
    for r, path in enumerate(paths):
        n = len(path)
        assert walk.num_accepted[r] == n
        assert walk.accepted_idx[r].tolist() == path + [-1] * (D + 1 - n)
        emitted = [target[r, i].item() for i in path]
        assert walk.output_token_ids[r].tolist() == emitted + [-1] * (D + 1 - n)
        assert walk.bonus_token_ids[r] == emitted[-1]
        assert walk.accepted_mask[r].nonzero().flatten().tolist() == path
    return walk


def test_walk_hand_built_branch_off_spine(T):
    # Tree (depth in brackets):        root
    #                      1:a[1]                2:b[1]
    #               3:c[2]      4:d[2]           5:e[2]
    #               6:f[3]      7:g[3]
    tree = make_tree(
        T,
        token_ids=[[10, 11, 12, 13, 14, 15, 16]],
        parent_idx=[[0, 0, 1, 1, 2, 3, 4]],
        depth=[[1, 1, 2, 2, 2, 3, 3]],
        draft_depth=3,
    )
    # target at root says 10 (node 1), at node 1 says 13 (node 4, off the
    # spine 1-3-6), at node 4 says 16 (node 7), at node 7 says 99 (bonus).
    target = torch.tensor([[10, 13, 0, 0, 16, 0, 0, 99]])
    walk = check_walk(T, tree, target, [[0, 1, 4, 7]])
    assert walk.output_token_ids.tolist() == [[10, 13, 16, 99]]
    plan = ref.compaction_indices(walk, torch.tensor([0, 8]))
    assert plan.src_idx.tolist() == [[0, 1, 4, 7]]
    assert plan.dst_offset.tolist() == [[0, 1, 2, 3]]
    assert plan.needs_move.tolist() == [[False, False, True, True]]
    assert plan.src_token_idx.tolist() == [[0, 1, 4, 7]]
    assert plan.dst_token_idx.tolist() == [[0, 1, 2, 3]]

    # root's target matches nothing: only the bonus is emitted
    target = torch.tensor([[42, 13, 0, 0, 16, 0, 0, 99]])
    walk = check_walk(T, tree, target, [[0]])
    assert walk.bonus_token_ids.tolist() == [42]
    plan = ref.compaction_indices(walk)
    assert not plan.needs_move.any() and plan.src_token_idx is None

    # second branch: root -> 2 -> 5, stops at depth 2
    target = torch.tensor([[11, 0, 14, 0, 0, 7, 0, 0]])
    walk = check_walk(T, tree, target, [[0, 2, 5]])
    plan = ref.compaction_indices(walk, torch.tensor([3, 11]))
    assert plan.src_idx.tolist() == [[0, 2, 5, 0]]
    assert plan.needs_move.tolist() == [[False, True, True, False]]
    assert plan.src_token_idx.tolist() == [[3, 5, 8, 3]]
    assert plan.dst_token_idx.tolist() == [[3, 4, 5, 3]]


def test_walk_invalid_nodes_never_accepted(T):
    tree = make_tree(T, [[5, 0]], [[0, 1]], [[1, 2]], 2, valid=[[True, False]])
    target = torch.tensor([[5, 0, 0]])
    check_walk(T, tree, target, [[0, 1]])


@pytest.mark.parametrize("depth", [1, 2, 7, 15, 16])
def test_chain_walk_equals_linear_verification(T, depth):
    """A chain tree (node k at depth k, parent k-1) walks exactly like
    linear DFlash verification: accept while draft[k] == target[k-1]."""
    torch.manual_seed(depth)
    R = 64
    drafts = torch.randint(0, 3, (R, depth))
    target = torch.randint(0, 3, (R, depth + 1))
    target[:8, :depth] = drafts[:8]  # some full acceptances
    tree = make_tree(
        T,
        drafts.tolist(),
        [list(range(depth))] * R,
        [list(range(1, depth + 1))] * R,
        depth,
    )
    walk = check_walk(T, tree, target)
    for r in range(R):
        n = 0
        while n < depth and drafts[r, n] == target[r, n]:
            n += 1
        expected = target[r, : n + 1].tolist()  # accepted drafts + bonus
        assert walk.num_accepted[r] == n + 1
        assert walk.output_token_ids[r, : n + 1].tolist() == expected
        assert walk.bonus_token_ids[r] == target[r, n]
        plan = ref.compaction_indices(walk)
        assert not plan.needs_move.any()  # a chain is always in place


@pytest.mark.parametrize(
    "depth,vocab,budget", [(3, 3, 10), (5, 2, 31), (15, 4, 64), (4, 6, 100)]
)
def test_walk_and_compaction_random_trees(T, depth, vocab, budget):
    torch.manual_seed(depth * 1000 + budget)
    R = 16
    # peaked drafter so that long paths get accepted
    draft = torch.randn(R, depth, vocab) * 4
    tree = T.build_tree(draft, budget)
    # target follows the drafter's argmax with random deviations
    target = torch.randint(0, vocab, (R, budget + 1))
    greedy = draft.argmax(-1)
    follow = torch.rand(R, budget + 1) < 0.7
    node_depth = torch.cat([torch.zeros(R, 1, dtype=torch.int64), tree.depth], 1)
    next_greedy = greedy.gather(1, node_depth.clamp_max(depth - 1))
    target = torch.where(follow, next_greedy, target)
    walk = check_walk(T, tree, target)

    qsl = torch.cat(
        [torch.zeros(1, dtype=torch.int64), torch.full((R,), budget + 1).cumsum(0)]
    )
    plan = ref.compaction_indices(walk, qsl)
    # Apply the moves to a fake per-token buffer (gather, then scatter) and
    # check the accepted path lands at root + k.
    buffer = torch.arange(R * (budget + 1)) * 10
    moved = buffer.clone()
    moved[plan.dst_token_idx.flatten()] = buffer[plan.src_token_idx.flatten()]
    for r in range(R):
        n = walk.num_accepted[r].item()
        path = walk.accepted_idx[r, :n]
        expected = buffer[qsl[r] + path]
        assert torch.equal(moved[qsl[r] : qsl[r] + n], expected)
        # untouched elsewhere in the window: only destinations 0..n-1 move
        rest = torch.arange(qsl[r] + n, qsl[r + 1])
        assert torch.equal(moved[rest], buffer[rest])
        assert plan.needs_move[r].tolist() == [
            k < n and path[k].item() != k for k in range(depth + 1)
        ]


# --------------------------------------------------------------------------
# CUDA graph capture (GPU only)
# --------------------------------------------------------------------------


def _pipeline(T, logits, target, root_pos, qsl, budget):
    tree = T.build_tree(logits, budget)
    pos = ref.tree_positions(root_pos, tree.depth)
    mask = ref.ancestor_mask(tree.parent_idx, tree.draft_depth)
    bits = ref.pack_ancestor_bits(mask)
    walk = ref.walk_tree(tree, target)
    walk_masked = ref.walk_tree(tree, target, ancestors=mask)
    plan = ref.compaction_indices(walk, qsl)
    return (
        *walk_masked[:4],
        tree.token_ids,
        tree.parent_idx,
        tree.depth,
        tree.score,
        tree.valid,
        pos,
        mask,
        bits,
        walk.accepted_idx,
        walk.num_accepted,
        walk.output_token_ids,
        walk.bonus_token_ids,
        plan.src_token_idx,
        plan.dst_token_idx,
        plan.needs_move,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_replay_matches_eager(T, dtype):
    dev = torch.device("cuda")
    R, D, V, B = 4, 15, 4096, 64
    gen = torch.Generator(device=dev).manual_seed(0)

    def inputs():
        logits = torch.randn(R, D, V, device=dev, generator=gen).to(dtype) * 3
        target = torch.randint(0, V, (R, B + 1), device=dev, generator=gen)
        return logits, target

    s_logits, s_target = inputs()
    s_root = torch.tensor([0, 10, 200, 3000], device=dev)
    s_qsl = torch.arange(R + 1, device=dev) * (B + 1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up: builds the cached index tables
            _pipeline(T, s_logits, s_target, s_root, s_qsl, B)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _pipeline(T, s_logits, s_target, s_root, s_qsl, B)
    for _ in range(3):
        logits, target = inputs()
        # make the target follow the tree sometimes so walks are non-trivial
        target[:, 0] = logits[:, 0].float().argmax(-1)
        s_logits.copy_(logits)
        s_target.copy_(target)
        graph.replay()
        torch.cuda.synchronize()
        ref = _pipeline(T, logits, target, s_root, s_qsl, B)
        for a, b in zip(outs, ref):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_cuda_topk_boundary_ties(T):
    """Heavy ties at the vocabulary's top-B boundary on the GPU (integer
    logits, V = 151936). The fast path (exact_vocab_ties=False) leaves the
    choice among exactly tied boundary tokens to torch.topk: the tree may hold
    other tokens, but it is still an optimal tree of the same shape: the same
    parents, depths, scores and validity, and each node's token has the same
    draft logit as the exact tree's node there. The Triton vocabulary pass
    resolves the ties exactly either way."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randint(0, 4, (8, 15, 151936), device=dev, generator=gen).to(
        torch.bfloat16
    )
    exact = T.build_tree(logits, 64, backend="torch")
    fast = T.build_tree(logits, 64, backend="torch", exact_vocab_ties=False)
    check_structure(T.DDTree(*[x.cpu() if torch.is_tensor(x) else x for x in fast]), 15)
    for name in ("parent_idx", "depth", "score", "valid"):
        assert torch.equal(getattr(exact, name), getattr(fast, name)), name

    def token_logits(tree):
        depth0 = (tree.depth - 1).unsqueeze(2).expand(-1, -1, logits.shape[2])
        per_depth = logits.gather(1, depth0)  # [R, B, V]: the node's depth row
        return per_depth.gather(2, tree.token_ids.unsqueeze(2)).squeeze(2)

    assert torch.equal(token_logits(exact), token_logits(fast))
    if _has_triton():
        lp_exact, tok_exact = T.vocab_stage(logits, 64, backend="torch")
        for exact_ties in (True, False):
            lp, tok = T.vocab_stage(
                logits, 64, backend="triton", exact_vocab_ties=exact_ties
            )
            assert torch.equal(tok, tok_exact)
            torch.testing.assert_close(lp, lp_exact, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------
# Triton backend (interpreter on CPU: TRITON_INTERPRET=1, set in conftest)
# --------------------------------------------------------------------------


def _has_triton():
    try:
        import triton  # noqa: F401

        return True
    except ImportError:
        return False


triton_only = pytest.mark.skipif(not _has_triton(), reason="triton not importable")


def assert_same_tree(a, b, scores_exact=True):
    for name in ("token_ids", "parent_idx", "depth", "valid"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.draft_depth == b.draft_depth
    assert a.score.dtype == b.score.dtype == torch.float32
    if scores_exact:
        assert torch.equal(a.score, b.score)
    else:
        torch.testing.assert_close(a.score, b.score, rtol=0, atol=1e-5)


@triton_only
@pytest.mark.parametrize("vocab,depth", SMALL_SHAPES)
def test_triton_build_matches_brute_force(T, vocab, depth):
    torch.manual_seed(vocab * 10 + depth)
    num_prefixes = sum(vocab**d for d in range(1, depth + 1))
    # (the interpreter's tl.sort is slow: keep the blocks small)
    budgets = sorted(
        b
        for b in {
            1,
            2,
            3,
            vocab,
            vocab + 1,
            num_prefixes // 2,
            num_prefixes - 1,
            num_prefixes,
            num_prefixes + 2,
            24,
        }
        if 1 <= b <= 24
    )
    random = torch.randn(2, depth, vocab) * 2
    tied = torch.randint(0, 3, (2, depth, vocab)).float()
    tied[0] = 0.0
    for draft, no_ties in ((random, True), (tied, False)):
        for budget in budgets:
            tree = assert_matches_brute_force(T, draft, budget, backend="triton")
            check_structure(tree, depth)
            fast = T.build_tree(draft, budget, backend="triton", exact_vocab_ties=False)
            check_structure(fast, depth)
            if no_ties:
                # the fast path resolves vocabulary ties exactly too; only
                # the logsumexp rounding may differ, which can only reorder
                # (near-)tied prefix scores
                assert_same_tree(tree, fast, scores_exact=False)


@triton_only
def test_triton_build_special_values(T):
    torch.manual_seed(2)
    draft = torch.randn(4, 3, 5)
    draft[0, 0, 1] = float("nan")
    draft[0, 2, :] = float("nan")
    draft[1, 1, 2:] = NEG_INF
    draft[2, 0, :4] = NEG_INF
    draft[3] = NEG_INF
    for budget in (1, 4, 9, 40):
        assert_matches_brute_force(T, draft, budget, backend="triton")
        fast = T.build_tree(draft, budget, backend="triton", exact_vocab_ties=False)
        check_structure(fast, 3)
        assert_same_tree(
            T.build_tree(draft, budget, backend="torch"), fast, scores_exact=False
        )
    lp = torch.tensor(
        [[[-0.5, float("nan"), -1.5, 0.0], [NEG_INF, -0.1, float("nan"), -0.0]]]
    )
    for budget in (1, 3, 7, 20):
        for exact in (True, False):
            assert_matches_brute_force(
                T,
                lp,
                budget,
                inputs_are_logprobs=True,
                backend="triton",
                exact_vocab_ties=exact,
            )
    # +0.0 and -0.0 logits tie (then the smaller id wins), +inf logits
    signed_zero = torch.tensor(
        [[[-0.0, 0.0, -0.0, 0.0, -1.0], [0.0, -0.0, float("inf"), -0.0, 1.0]]]
    )
    for budget in (1, 2, 5, 12):
        assert_matches_brute_force(T, signed_zero, budget, backend="triton")


@triton_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("budget", [1, 8, 32])
def test_triton_vocab_stage_multi_chunk(T, monkeypatch, dtype, budget):
    """Several vocabulary chunks, heavy ties across chunk borders: the
    Triton top-K equals the exact torch top-K (set and order)."""
    torch.manual_seed(budget)
    R, D, V = 1, 2, 300
    assert T._vocab_chunking(151936, 64) == (1024, 149)
    assert T._vocab_chunking(151936, 2000) == (2048, 75)
    assert T._vocab_chunking(300, 8) == (512, 1)
    # small chunks (the interpreter's tl.sort is slow), last one partial, and
    # merge groups of 2 chunks: several tournament levels
    monkeypatch.setattr(T, "_vocab_chunking", lambda v, k: (32, -(-v // 32)))
    monkeypatch.setattr(T, "_merge_fan_in", lambda k: 2)
    logits = torch.randint(-2, 2, (R, D, V)).to(dtype)
    logits[0, 0] = (torch.randn(V) * 3).to(dtype)
    logits[0, 1, ::7] = float("nan")
    logits[0, 1, 5::11] = NEG_INF
    for exact in (True, False):
        ref_lp, ref_tok = T.vocab_stage(
            logits, budget, backend="torch", exact_vocab_ties=True
        )
        lp, tok = T.vocab_stage(
            logits, budget, backend="triton", exact_vocab_ties=exact
        )
        assert torch.equal(tok, ref_tok)
        if exact:
            assert torch.equal(lp, ref_lp)
        else:
            torch.testing.assert_close(lp, ref_lp, rtol=0, atol=2e-6)
    lp_in = torch.log_softmax(logits.float().nan_to_num(0.0), -1).to(dtype)
    ref = T.vocab_stage(lp_in, budget, backend="torch", inputs_are_logprobs=True)
    out = T.vocab_stage(
        lp_in,
        budget,
        backend="triton",
        inputs_are_logprobs=True,
        exact_vocab_ties=False,
    )
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


@triton_only
@pytest.mark.parametrize(
    "depth,vocab,budget", [(15, 40, 32), (4, 50, 64), (2, 300, 40)]
)
def test_triton_build_equals_torch_build(T, depth, vocab, budget):
    """Larger shapes (many candidate pairs per depth): Triton tree stage
    equals the torch tree stage bit for bit, including tied inputs."""
    torch.manual_seed(depth + budget)
    peaked = torch.randn(1, depth, vocab) * 4
    tied = torch.randint(0, 3, (1, depth, vocab)).float()
    for draft in (peaked, tied):
        a = T.build_tree(draft, budget, backend="torch")
        b = T.build_tree(draft, budget, backend="triton")
        assert_same_tree(a, b)
        check_structure(b, depth)
        # tree stage alone, from identical vocab-stage inputs
        lp, tok = T.vocab_stage(draft, budget, backend="torch")
        assert_same_tree(
            T.tree_stage(lp, tok, budget, backend="torch"),
            T.tree_stage(lp, tok, budget, backend="triton"),
        )


@triton_only
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    vocab=st.integers(1, 4),
    depth=st.integers(1, 3),
    budget=st.integers(1, 20),
    as_logprobs=st.booleans(),
)
def test_triton_build_property(T, data, vocab, depth, budget, as_logprobs):
    values = data.draw(
        st.lists(logprob_values, min_size=2 * depth * vocab, max_size=2 * depth * vocab)
    )
    draft = torch.tensor(values, dtype=torch.float32).view(2, depth, vocab)
    tree = assert_matches_brute_force(
        T, draft, budget, inputs_are_logprobs=as_logprobs, backend="triton"
    )
    check_structure(tree, depth)


def test_backend_selection(T):
    with pytest.raises(ValueError):
        T.build_tree(torch.randn(1, 2, 3), 2, backend="nope")
    # auto on CPU is the torch backend unless VLLM_DDTREE_BACKEND says so
    assert T._resolve_backend("torch", torch.device("cpu")) == "torch"


@pytest.mark.gpu
@triton_only
@pytest.mark.parametrize("budget", [16, 64, 256])
def test_cuda_triton_equals_torch(T, budget):
    """GPU: the Triton build (exact path) equals the torch build bit for bit
    at the production vocabulary; the fast path equals it up to logsumexp
    rounding when there are no near-ties."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(budget)
    logits = (torch.randn(4, 15, 151936, device=dev, generator=gen) * 4).to(
        torch.bfloat16
    )
    a = T.build_tree(logits, budget, backend="torch")
    b = T.build_tree(logits, budget, backend="triton")
    assert_same_tree(a, b)
    lp_t, tok_t = T.vocab_stage(logits, budget, backend="torch")
    lp_f, tok_f = T.vocab_stage(
        logits, budget, backend="triton", exact_vocab_ties=False
    )
    assert torch.equal(tok_t, tok_f)
    torch.testing.assert_close(lp_f, lp_t, rtol=0, atol=1e-5)
