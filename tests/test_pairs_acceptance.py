# SPDX-License-Identifier: Apache-2.0
"""The offline acceptance replay of the benchmark pairs (bench/pairs/acceptance.py):
the DDTree tree is the B most probable prefixes, and the chain and tree walks
count what vLLM's greedy verification accepts."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "pairs"))

import acceptance  # noqa: E402


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget", [1, 3, 7, 20, 40])
def test_best_prefixes_are_the_most_probable(seed, budget):
    depth, ranks = 3, 4
    gen = torch.Generator().manual_seed(seed)
    lp = torch.randn(depth, 10, generator=gen).log_softmax(-1)
    lp = lp.sort(-1, descending=True).values[:, :ranks]
    scored = sorted(
        (
            (sum(lp[i, r].item() for i, r in enumerate(node)), node)
            for d in range(1, depth + 1)
            for node in itertools.product(range(ranks), repeat=d)
        ),
        reverse=True,
    )
    want = {node for _, node in scored[:budget]}
    got = acceptance.best_prefixes(lp, budget)
    assert got == want
    assert all(node[:-1] in got for node in got if len(node) > 1)  # prefix-closed


def test_chain_accepts_the_longest_agreeing_prefix():
    tokens = [5, 6, 7, 8, 9, 10, 11, 12]
    # draft[p] predicts positions p+1.. after a bonus at p
    draft = torch.zeros(8, 3, dtype=torch.long)
    draft[1] = torch.tensor([2, 3, 9])  # wrong at once: 1 token per step
    draft[2] = torch.tensor([8, 9, 10])  # all three right
    draft[6] = torch.tensor([12, 0, 0])  # one right, then the end
    assert acceptance.chain_steps(draft, tokens, 1, 7) == [1, 4, 2]
    assert acceptance.tau([[1, 4, 2]]) == pytest.approx(7 / 3)


def test_tree_walk_follows_siblings_the_chain_cannot():
    tokens = [0, 4, 5, 6]
    k, r = 3, 3
    # after the bonus at 0: depth 1 ranks tokens [7, 4, 1]; the true token 4 is
    # the second choice, reachable only through a sibling
    idx = torch.zeros(4, k, r, dtype=torch.long)
    vals = torch.full((4, k, r), -30.0)
    idx[0] = torch.tensor([[7, 4, 1], [5, 2, 3], [6, 8, 9]])
    vals[0] = torch.tensor([[-0.2, -1.8, -3.0], [-0.1, -2.5, -3.0], [-0.1, -2.6, -3.0]])
    chain = acceptance.chain_steps(idx[..., 0], tokens, 0, 3)
    assert chain[0] == 1  # 7 != 4
    # budget 1: only (7,); budget 4 holds (7,), (7,5), (7,5,6), (4,) ... but the
    # path 4 -> 5 -> 6 needs (4,), (4,0), (4,0,0)
    assert acceptance.tree_steps(vals, idx, tokens, 0, 3, 1)[0] == 1
    tree = acceptance.best_prefixes(vals[0], 6)
    assert {(1,), (1, 0), (1, 0, 0)} <= tree
    assert acceptance.tree_steps(vals, idx, tokens, 0, 3, 6) == [4]
