# SPDX-License-Identifier: Apache-2.0
"""Tree-aware causal conv1d (DDTree through the short conv of GDN layers)
against upstream's `causal_conv1d_update` run over every root-to-node path.
On a CPU machine both run in the Triton interpreter (tests/in_vllm/conftest.py
sets it up)."""

import pytest
import torch

tree_conv = pytest.importorskip("vllm.v1.spec_decode.ddtree.tree_conv")
from vllm.model_executor.layers.mamba.ops.causal_conv1d import (  # noqa: E402
    causal_conv1d_update,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(seed, budgets, width, state_len, dim, sd_layout):
    gen = torch.Generator().manual_seed(seed)
    num_rows = len(budgets)
    budget = max(budgets)
    max_reqs = num_rows + 2
    # Batch order != request-state order: row r's tree is parent[idx_mapping[r]].
    idx_mapping = torch.randperm(max_reqs, generator=gen)[:num_rows].to(torch.int32)
    parent = torch.zeros(max_reqs, budget, dtype=torch.int64)
    for r, n in enumerate(budgets):
        # Random prefix-closed tree (parent < child); node 2 hangs off the
        # root so that every tree of >= 2 nodes branches.
        row = [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n + 1)]
        if n >= 2:
            row[1] = 0
        parent[int(idx_mapping[r]), :n] = torch.tensor(row, dtype=torch.int64)
    counts = torch.tensor([1 + n for n in budgets])
    qsl = torch.zeros(num_rows + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(counts, 0)
    T = int(qsl[-1])
    # x as a column slice of a wider projection output (non-unit row stride).
    x = torch.randn(T, dim + 5, generator=gen)[:, 2 : 2 + dim]
    weight = torch.randn(dim, width, generator=gen) * 0.5
    bias = torch.randn(dim, generator=gen) * 0.1
    num_slots = 2 * num_rows + 2
    if sd_layout:
        # vLLM's default SD cache layout (state_len, dim), seen transposed.
        state = torch.randn(num_slots, state_len, dim, generator=gen).transpose(1, 2)
    else:
        state = torch.randn(num_slots, dim, state_len, generator=gen)
    state_idx = torch.arange(1, num_rows + 1, dtype=torch.int32)  # slot 0: null
    return idx_mapping, parent, qsl, x, weight, bias, state, state_idx


def _path(parent_row, node):
    path = [node]
    while path[-1] != 0:
        path.append(int(parent_row[path[-1] - 1]))
    return path[::-1]


def _reference(x, state, slot, rows, weight, bias, activation):
    """Upstream's update over the given rows from a copy of ``state``:
    (output of the last row, the copy's slot afterwards)."""
    state = state.clone().to(DEVICE)
    out = causal_conv1d_update(
        x[rows].T[None].contiguous().to(DEVICE),  # [1, dim, path_len]
        state,
        weight.to(DEVICE),
        bias.to(DEVICE) if bias is not None else None,
        activation,
        conv_state_indices=torch.tensor([slot], dtype=torch.int32, device=DEVICE),
    )
    return out[0, :, -1].cpu(), state[slot].cpu()


@pytest.mark.parametrize(
    "seed, budgets, width, state_len, dim, has_bias, activation, sd_layout",
    [
        (0, [6, 2, 9], 4, 3, 40, True, "silu", False),
        (1, [7, 4], 4, 7, 260, False, None, True),  # two feature blocks
        (2, [5, 0, 3], 3, 2, 24, True, None, True),
        (3, [8, 3], 2, 4, 24, False, "silu", False),
    ],
)
def test_tree_conv_matches_upstream_on_every_path(
    seed, budgets, width, state_len, dim, has_bias, activation, sd_layout
):
    idx_mapping, parent, qsl, x, weight, bias, state, state_idx = _case(
        seed, budgets, width, state_len, dim, sd_layout
    )
    bias = bias if has_bias else None
    to = lambda t: t.to(DEVICE) if t is not None else None  # noqa: E731
    committed = state.clone()
    state_dev = to(state)
    args = dict(
        x=to(x),
        conv_state=state_dev,
        weight=to(weight),
        bias=to(bias),
        activation=activation,
        state_idx=to(state_idx),
        query_start_loc=to(qsl),
        idx_mapping=to(idx_mapping),
    )
    o = tree_conv.tree_causal_conv1d(**args, parent_idx=to(parent)).cpu()
    assert torch.equal(state_dev.cpu(), committed)  # committed states only read
    for r, n in enumerate(budgets):
        parent_row = parent[int(idx_mapping[r])]
        slot = int(state_idx[r])
        for node in range(1 + n):
            rows = [int(qsl[r]) + i for i in _path(parent_row, node)]
            ref_o, _ = _reference(x, committed, slot, rows, weight, bias, activation)
            torch.testing.assert_close(
                o[int(qsl[r]) + node], ref_o, rtol=1e-6, atol=1e-6
            )

    # A parent table wider than the trees (the engine's is tree_budget wide)
    # with the step's longest query: only the rows' programs run, the same
    # outputs.
    wide = torch.zeros(parent.shape[0], parent.shape[1] + 20, dtype=torch.int64)
    wide[:, : parent.shape[1]] = parent
    o_wide = tree_conv.tree_causal_conv1d(
        **args, parent_idx=to(wide), max_query_len=max(budgets) + 1
    ).cpu()
    assert torch.equal(o_wide, o)

    # Mutant: the same rows read as a chain (parent = i - 1) must differ, or
    # the comparison above could not see a wrong window.
    chain = torch.arange(parent.shape[1]).expand_as(parent).contiguous()
    o_chain = tree_conv.tree_causal_conv1d(**args, parent_idx=to(chain)).cpu()
    assert not torch.allclose(o_chain, o, rtol=1e-3, atol=1e-3)

    # After the walk: one accepted path per row. Row 0 commits in place
    # (final slot == committed slot), the others to fresh slots; one row
    # accepts only the root.
    gen = torch.Generator().manual_seed(seed + 100)
    leaves = [int(torch.randint(0, 1 + n, (1,), generator=gen)) for n in budgets]
    leaves[-1] = 0
    if seed % 2:
        leaves[0] = 0  # in place with the window shifted by one
    paths = [_path(parent[int(idx_mapping[r])], leaf) for r, leaf in enumerate(leaves)]
    accepted = torch.full((len(budgets), max(budgets) + 1), -1, dtype=torch.int64)
    for r, p in enumerate(paths):
        accepted[r, : len(p)] = torch.tensor(p)
    num_accepted = torch.tensor([len(p) for p in paths], dtype=torch.int32)
    final_idx = torch.arange(len(budgets) + 1, 2 * len(budgets) + 1, dtype=torch.int32)
    final_idx[0] = state_idx[0]
    before = state.clone()
    state_dev = to(state.clone())
    out = tree_conv.tree_conv_state_update(
        to(x),
        state_dev,
        width,
        state_idx=to(state_idx),
        final_state_idx=to(final_idx),
        query_start_loc=to(qsl),
        accepted_idx=to(accepted),
        num_accepted=to(num_accepted),
    )
    assert out is None
    state_after = state_dev.cpu()
    written = set()
    for r, p in enumerate(paths):
        slot, final = int(state_idx[r]), int(final_idx[r])
        rows = [int(qsl[r]) + i for i in p]
        _, ref_state = _reference(x, committed, slot, rows, weight, bias, activation)
        # Upstream writes the window (columns 0 .. W - 2) and leaves the rest.
        window, rest = slice(0, width - 1), slice(width - 1, None)
        assert torch.equal(state_after[final, :, window], ref_state[:, window])
        assert torch.equal(state_after[final, :, rest], before[final, :, rest])
        if final == slot:
            assert torch.equal(state_after[final], ref_state)
        written.add(final)
    for s in range(state.shape[0]):
        if s not in written:
            assert torch.equal(state_after[s], before[s])
