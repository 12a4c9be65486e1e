# SPDX-License-Identifier: Apache-2.0
"""The offline acceptance replay of the benchmark pairs (bench/pairs/acceptance.py):
the DDTree tree is the B most probable prefixes, and the chain and tree walks
count what vLLM's greedy verification accepts."""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")
from bench.pairs import acceptance  # noqa: E402


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


def test_replaying_a_sampled_continuation_gives_rejection_samplings_tau():
    """acceptance.py's claim for temperature > 0: walking the argmax chain
    down one sample of the target accepts as many tokens, in distribution, as
    vLLM's rejection sampling of greedy drafts (accept a draft with the
    target's probability of it, else draw from the target without it). A
    first-order Markov target over 5 tokens, drafts the argmax chain of a
    perturbed copy of it; both processes run long enough that their tau agree
    to a few percent (fixed seeds: the figures do not move between runs)."""
    gen = torch.Generator().manual_seed(0)
    vocab, k, n_tokens = 5, 4, 40_000
    target = torch.softmax(2.0 * torch.randn(vocab, vocab, generator=gen), -1)
    drafter = target + 0.3 * torch.rand(vocab, vocab, generator=gen)
    nxt = drafter.argmax(-1)

    def draft_after(tok: int) -> list[int]:
        out = []
        for _ in range(k):
            tok = int(nxt[tok])
            out.append(tok)
        return out

    # vLLM's process: rejection sampling with one-hot draft probabilities.
    steps, tok, emitted = [], 0, 0
    while emitted < n_tokens:
        n = 0
        for d in draft_after(tok):
            p = target[tok]
            if torch.rand((), generator=gen) < p[d]:
                tok, n = d, n + 1
                continue
            resid = p.clone()
            resid[d] = 0
            tok = int(torch.multinomial(resid / resid.sum(), 1, generator=gen))
            break
        else:
            tok = int(torch.multinomial(target[tok], 1, generator=gen))
        steps.append(n + 1)
        emitted += n + 1
    tau_rejection = acceptance.tau([steps])

    # The replay: one sample of the target, the chain walked down it.
    seq = [0]
    for _ in range(n_tokens):
        seq.append(int(torch.multinomial(target[seq[-1]], 1, generator=gen)))

    def drafts_of(seq: list[int]) -> torch.Tensor:
        return torch.tensor([draft_after(t) for t in seq])

    tau_replay = acceptance.tau(
        [acceptance.chain_steps(drafts_of(seq), seq, 0, len(seq) - 1)]
    )

    # The greedy replay (the target's argmax sequence) is not it: the check
    # tells the two apart.
    greedy = [0]
    for _ in range(n_tokens):
        greedy.append(int(target[greedy[-1]].argmax()))
    tau_greedy = acceptance.tau(
        [acceptance.chain_steps(drafts_of(greedy), greedy, 0, len(greedy) - 1)]
    )
    print(
        f"tau: rejection {tau_rejection:.3f} replay {tau_replay:.3f} "
        f"greedy {tau_greedy:.3f}"
    )
    assert 1.3 < tau_rejection < k + 1
    assert tau_replay == pytest.approx(tau_rejection, rel=0.03)
    assert abs(tau_greedy - tau_rejection) > 0.2
