# SPDX-License-Identifier: Apache-2.0
"""DDTree at T > 0 (torch only): tree-correct penalties against a brute-force
per-node computation, the logprob row order, and a chi-square test on a toy
model that the emitted tokens are distributed exactly as target-only
sampling (with deliberately biased variants that the same test rejects)."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

import ddtree_reference as ref
from vllm.v1.spec_decode.ddtree import sampling as sampling_module
from vllm.v1.spec_decode.ddtree import tree as tree_module

scipy_stats = pytest.importorskip("scipy.stats")


@pytest.fixture(scope="module")
def tree_mod():
    return tree_module


@pytest.fixture(scope="module")
def samp():
    return sampling_module


# ------------------------------------------------------------ references
def ref_penalties(logits, counts, prompt_mask, rep, freq, pres):
    """Torch twin of upstream's `_penalties_kernel` with explicit counts:
    logits [N, V], counts [N, V] int, prompt_mask [N, V] bool, rep/freq/pres
    [N]. Returns new logits (float32)."""
    x = logits.float()
    present = counts > 0
    scale = torch.where(prompt_mask | present, rep[:, None], torch.ones(()))
    x = x * torch.where(x > 0, 1.0 / scale, scale)
    x = x - freq[:, None] * counts.float()
    x = x - pres[:, None] * present.float()
    return x


def pack_bits(mask):
    """[S, V] bool -> upstream's int32 prompt_bin_mask [S, ceil(V / 32)]."""
    s, v = mask.shape
    words = (v + 31) // 32
    padded = torch.zeros(s, words * 32, dtype=torch.int64)
    padded[:, :v] = mask.long()
    weights = torch.tensor([1 << j for j in range(32)], dtype=torch.int64)
    packed = (padded.view(s, words, 32) * weights).sum(-1)
    packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed)
    return packed.to(torch.int32)


def python_path(parent, tokens, node):
    """Tokens on root -> node (root excluded), by walking parent pointers."""
    out = []
    while node != 0:
        out.append(tokens[node - 1])
        node = parent[node - 1]
    return out


# ------------------------------------------------------------ penalties
@pytest.mark.parametrize(
    "rep, freq, pres",
    [(1.7, 0.0, 0.0), (1.0, 0.6, 0.0), (1.0, 0.0, 0.9), (1.3, 0.4, 0.7)],
    ids=["repetition", "frequency", "presence", "combined"],
)
@pytest.mark.parametrize("with_history", [False, True])
@pytest.mark.parametrize("vocab", [5, 40])
def test_tree_penalties_match_brute_force(
    tree_mod, samp, rep, freq, pres, with_history, vocab
):
    gen = torch.Generator().manual_seed(hash((rep, freq, pres, vocab)) % 2**31)
    num_states, depth, budget = 6, 4, 9
    # Small vocabularies make tokens repeat along paths.
    draft = torch.randn(num_states, depth, vocab, generator=gen)
    tree = tree_mod.build_tree(draft, budget)
    if vocab == 5:
        # Force repeats: some trees reuse one token at several depths.
        tree = tree._replace(
            token_ids=torch.where(
                tree.depth % 2 == 0, tree.token_ids, tree.token_ids % 2
            )
        )
    depth_with_root = torch.nn.functional.pad(tree.depth, (1, 0))
    hist = torch.zeros(num_states, vocab, dtype=torch.int32)
    prompt = torch.zeros(num_states, vocab, dtype=torch.bool)
    if with_history:
        hist = torch.randint(
            0, 3, (num_states, vocab), generator=gen, dtype=torch.int32
        ) * (torch.rand(num_states, vocab, generator=gen) < 0.4)
        prompt = torch.rand(num_states, vocab, generator=gen) < 0.3
    # Batch: states 4, 1, 3 verify (full trees); state 0 is a prefill row.
    batch_states = [4, 1, 3]
    row_req, row_node, row_tok = [0], [0], [7 % vocab]
    for s in batch_states:
        row_req += [s] * (budget + 1)
        row_node += list(range(budget + 1))
        row_tok += [3 % vocab] + tree.token_ids[s].tolist()
    n = len(row_req)
    row_req_t = torch.tensor(row_req, dtype=torch.int32)
    row_node_t = torch.tensor(row_node, dtype=torch.int32)
    logits = torch.randn(n, vocab, generator=gen) * 3
    reps = torch.full((num_states,), rep)
    freqs = torch.full((num_states,), freq)
    press = torch.full((num_states,), pres)
    reps[2] = 1.0  # one request state without penalties (never used here)
    r = row_req_t.long()

    # Expected: every row with counts = history + its root -> node path.
    expected = torch.empty(n, vocab)
    for i in range(n):
        counts = hist[row_req[i]].clone()
        if i > 0:
            s = row_req[i]
            for t in python_path(
                tree.parent_idx[s].tolist(), tree.token_ids[s].tolist(), row_node[i]
            ):
                counts[t] += 1
        expected[i] = ref_penalties(
            logits[i : i + 1],
            counts[None],
            prompt[row_req[i]][None],
            reps[r[i : i + 1]],
            freqs[r[i : i + 1]],
            press[r[i : i + 1]],
        )[0]

    paths = samp.row_path_tokens(
        torch.tensor(row_tok),
        tree.parent_idx,
        depth_with_root,
        row_req_t,
        row_node_t,
        depth,
    )
    got = logits.clone()
    orig = samp.gather_path_logits(got, paths)
    got = ref_penalties(got, hist[r], prompt[r], reps[r], freqs[r], press[r])
    h, in_prompt = samp.path_history_stats(hist, pack_bits(prompt), row_req_t, paths)
    samp.penalize_path_tokens(
        got, orig, paths, h, in_prompt, reps[r], freqs[r], press[r]
    )
    torch.testing.assert_close(got, expected, rtol=0, atol=0)

    # Upstream's chain adjustment (row p counts rows 1..p) differs for trees.
    if vocab == 5 and (freq or pres):
        chain = torch.empty(n, vocab)
        for i in range(n):
            counts = hist[row_req[i]].clone()
            for j in range(i - row_node[i] + 1, i + 1):
                counts[row_tok[j]] += 1
            chain[i] = ref_penalties(
                logits[i : i + 1],
                counts[None],
                prompt[row_req[i]][None],
                reps[r[i : i + 1]],
                freqs[r[i : i + 1]],
                press[r[i : i + 1]],
            )[0]
        assert not torch.equal(chain, expected)


def test_path_tokens_of_a_hand_built_tree(samp):
    # root -> 1(11) -> 3(13); root -> 2(12); 1 -> 4(11): token 11 twice.
    parent = torch.tensor([[0, 0, 1, 1]])
    depth = torch.tensor([[0, 1, 1, 2, 2]])
    row_tok = torch.tensor([10, 11, 12, 13, 11])
    paths = samp.row_path_tokens(
        row_tok, parent, depth, torch.zeros(5, dtype=torch.int32), torch.arange(5), 3
    )
    assert paths.valid.tolist() == [
        [False] * 3,
        [True, False, False],
        [True, False, False],
        [True, True, False],
        [True, True, False],
    ]
    assert paths.tokens[paths.valid].tolist() == [11, 12, 13, 11, 11, 11]
    assert paths.count.tolist()[4] == [2, 2, 2]
    assert paths.count.tolist()[3] == [1, 1, 1]
    assert paths.has_path.tolist() == [False, True, True, True, True]


def test_logprob_rows_follow_the_accepted_path(samp):
    # Request 0: 1 row (prefill); request 1: rows 1..5, path 0 -> 1 -> 4.
    accepted = torch.tensor([[0, -1, -1], [0, 1, 4]])
    order = samp.path_row_order(accepted, torch.tensor([1, 3]), torch.tensor([0, 1]), 6)
    assert order.tolist() == [0, 1, 2, 5, 4, 5]


# ------------------------------------------------------------ toy model
V, DEPTH, BUDGET = 6, 3, 6
PROMPT = [1, 4]
ROOT = 2  # the last sampled token (already an output token)


def _toy_tables():
    gen = torch.Generator().manual_seed(1234)
    target = torch.randn(V, V, V, generator=gen) * 1.2  # [prev2, prev1] -> V
    # Factorised drafter: per depth, a function of the root only, and
    # deliberately different from the target.
    draft = torch.randn(DEPTH, V, V, generator=gen) * 1.5
    return target, draft


def _target_logprobs(table, context, temperature, penalties):
    """Target-only next-token log-probs after `context` (prompt + outputs)."""
    logits = table[context[-2], context[-1]].clone()[None]
    if penalties is not None:
        rep, freq, pres = penalties
        counts = torch.zeros(1, V, dtype=torch.int32)
        for t in context[len(PROMPT) :]:
            counts[0, t] += 1
        prompt = torch.zeros(1, V, dtype=torch.bool)
        prompt[0, PROMPT] = True
        logits = ref_penalties(
            logits,
            counts,
            prompt,
            torch.tensor([rep]),
            torch.tensor([freq]),
            torch.tensor([pres]),
        )
    return torch.log_softmax(logits[0].double() / temperature, dim=-1)


@functools.cache
def _exact_three(temperature, penalties):
    table = _toy_tables()[0]
    probs = {}
    start = PROMPT + [ROOT]
    for seq in itertools.product(range(V), repeat=3):
        lp = 0.0
        ctx = list(start)
        for t in seq:
            lp += float(_target_logprobs(table, ctx, temperature, penalties)[t])
            ctx.append(t)
        probs[seq] = float(torch.tensor(lp).exp())
    return probs


def _run_ddtree(
    tree_mod, samp, table, draft_table, trials, temperature, penalties, variant, seed=0
):
    """First 3 emitted tokens of `trials` independent DDTree generations.

    Per step and trial: build the tree from the drafter, compute every
    node's target logits from its own context (history + ancestor path),
    history-only penalties then the path correction (as the vLLM path),
    temperature, and one Gumbel draw per (trial, depth) shared by siblings;
    then walk. Variants: "correct", "shared_noise" (one draw reused across
    depths), "chain_penalties" (upstream's chain counting of earlier rows).
    """
    gen = torch.Generator().manual_seed(seed)
    n_nodes = BUDGET + 1
    hist = torch.full((trials, 3 + 3 * (DEPTH + 1)), -1, dtype=torch.int64)
    hist[:, :3] = torch.tensor(PROMPT + [ROOT])
    length = torch.full((trials,), 3, dtype=torch.int64)
    counts = torch.zeros(trials, V, dtype=torch.int32)
    counts[:, ROOT] = 1
    prompt = torch.zeros(trials, V, dtype=torch.bool)
    prompt[:, PROMPT] = True
    prompt_bits = pack_bits(prompt)
    ar = torch.arange(trials)
    # The drafter depends on the root only: one tree (and one set of node
    # paths) per root token, indexed per trial below.
    root_trees = tree_mod.build_tree(draft_table.permute(1, 0, 2), BUDGET)
    root_paths = samp.row_path_tokens(
        torch.cat([torch.arange(V)[:, None], root_trees.token_ids], dim=1).reshape(-1),
        root_trees.parent_idx,
        torch.nn.functional.pad(root_trees.depth, (1, 0)),
        torch.arange(V).repeat_interleave(n_nodes),
        torch.arange(n_nodes).repeat(V),
        DEPTH,
    )
    while int((length - 3).min()) < 3:
        root = hist[ar, length - 1]
        prev = hist[ar, length - 2]
        tree = root_trees._replace(
            **{
                f: getattr(root_trees, f)[root]
                for f in ("token_ids", "parent_idx", "depth", "score", "valid")
            }
        )
        tokens = torch.cat([root[:, None], tree.token_ids], dim=1)
        parent = torch.nn.functional.pad(tree.parent_idx, (1, 0))
        depth = torch.nn.functional.pad(tree.depth, (1, 0))
        prev_tok = torch.where(parent == 0, root[:, None], tokens.gather(1, parent))
        prev_tok[:, 0] = prev
        logits = table[prev_tok, tokens].reshape(-1, V)  # [trials*(B+1), V]
        row_req = ar.repeat_interleave(n_nodes)
        row_node = torch.arange(n_nodes).repeat(trials)
        if penalties is not None:
            rep, freq, pres = (torch.full((trials * n_nodes,), p) for p in penalties)
            if variant == "chain_penalties":
                row_counts = counts[row_req].clone()
                flat = tokens.reshape(-1)
                for j in range(1, n_nodes):
                    later = row_node >= j
                    tok_j = flat[row_req * n_nodes + j]
                    row_counts[later, tok_j[later]] += 1
                logits = ref_penalties(
                    logits, row_counts, prompt[row_req], rep, freq, pres
                )
            else:
                paths = samp.RowPaths(
                    *(
                        x.view(V, n_nodes, *x.shape[1:])[root].flatten(0, 1)
                        for x in root_paths
                    )
                )
                orig = samp.gather_path_logits(logits, paths)
                logits = ref_penalties(
                    logits, counts[row_req], prompt[row_req], rep, freq, pres
                )
                h, in_prompt = samp.path_history_stats(
                    counts, prompt_bits, row_req, paths
                )
                samp.penalize_path_tokens(
                    logits, orig, paths, h, in_prompt, rep, freq, pres
                )
        logits = logits.view(trials, n_nodes, V) / temperature
        u = torch.rand(trials, DEPTH + 1, V, generator=gen).clamp_min(1e-12)
        gumbel = -torch.log(-torch.log(u))
        if variant == "shared_noise":
            gumbel = gumbel[:, :1].expand(-1, DEPTH + 1, -1)
        noise = gumbel.gather(1, depth[:, :, None].expand(-1, -1, V))
        target = (logits + noise).argmax(dim=-1)
        walk = ref.walk_tree(tree, target)
        out = walk.output_token_ids
        for k in range(DEPTH + 1):
            take = k < walk.num_accepted
            idx = ar[take]
            hist[idx, length[take]] = out[take, k]
            counts[idx, out[take, k]] += 1
            length = length + take.long()
    return hist[:, 3:6], float(walk.num_accepted.float().mean())


def _chi_square_p(samples, probs, keys):
    observed = torch.zeros(len(keys))
    index = {key: i for i, key in enumerate(keys)}
    for row in samples:
        observed[index[row]] += 1
    expected = torch.tensor([probs[k] for k in keys], dtype=torch.float64)
    expected = expected / expected.sum() * len(samples)
    # Pool the rare categories so every expected count is >= 5.
    rare = expected < 5
    obs = observed.double()
    if rare.any():
        obs = torch.cat([obs[~rare], obs[rare].sum()[None]])
        expected = torch.cat([expected[~rare], expected[rare].sum()[None]])
    return float(scipy_stats.chisquare(obs.numpy(), expected.numpy()).pvalue)


CASES = {
    "T1_plain": (1.0, None),
    "T07_penalties": (0.7, (1.8, 0.7, 0.6)),
}
TRIALS = 20000


@pytest.fixture(scope="module")
def toy():
    return _toy_tables()


def _p_values(tree_mod, samp, toy, case, variant):
    table, draft = toy
    temperature, penalties = CASES[case]
    got, tau = _run_ddtree(
        tree_mod, samp, table, draft, TRIALS, temperature, penalties, variant
    )
    probs3 = _exact_three(temperature, penalties)
    first = {}
    for seq, p in probs3.items():
        first[seq[:1]] = first.get(seq[:1], 0.0) + p
    rows3 = [tuple(r) for r in got.tolist()]
    p_first = _chi_square_p([r[:1] for r in rows3], first, sorted(first))
    p_three = _chi_square_p(rows3, probs3, sorted(probs3))
    return p_first, p_three, tau


@pytest.mark.parametrize("case", sorted(CASES))
def test_toy_ddtree_matches_target_only_sampling(tree_mod, samp, toy, case):
    p_first, p_three, tau = _p_values(tree_mod, samp, toy, case, "correct")
    assert tau > 1.3, f"the toy trees should accept something (tau={tau})"
    assert p_first > 0.01 and p_three > 0.01, (p_first, p_three)


@pytest.mark.parametrize(
    "case, variant",
    [
        ("T1_plain", "shared_noise"),
        ("T07_penalties", "shared_noise"),
        ("T07_penalties", "chain_penalties"),
    ],
)
def test_toy_biased_variants_are_rejected(tree_mod, samp, toy, case, variant):
    p_first, p_three, _ = _p_values(tree_mod, samp, toy, case, variant)
    assert min(p_first, p_three) < 1e-6, (variant, p_first, p_three)
