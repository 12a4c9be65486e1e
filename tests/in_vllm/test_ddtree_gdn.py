# SPDX-License-Identifier: Apache-2.0
"""Tree-aware gated delta rule (DDTree through GDN layers) against upstream's
sequential kernel run over every root-to-node path. On a CPU machine both run
in the Triton interpreter (tests/in_vllm/conftest.py sets it up)."""

import pytest
import torch

tree_gdn = pytest.importorskip("vllm.v1.spec_decode.ddtree.tree_gdn")
from vllm.third_party.flash_linear_attention.ops.fused_sigmoid_gating import (  # noqa: E402
    fused_sigmoid_gating_delta_rule_update,
)
from vllm.v1.spec_decode.ddtree.tree import build_tree  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, HV, K, V = 2, 4, 16, 48  # V not a power of 2: the last value block masked


def _inputs(gen, T, k_scale=1.0):
    """A GDN layer's verify inputs for T rows."""
    return dict(
        A_log=torch.randn(HV, generator=gen) * 0.5,
        a=torch.randn(T, HV, generator=gen),
        b=torch.randn(T, HV, generator=gen),
        dt_bias=torch.randn(HV, generator=gen) * 0.1,
        q=torch.randn(T, H, K, generator=gen),
        k=torch.randn(T, H, K, generator=gen) * k_scale,
        v=torch.randn(T, HV, V, generator=gen),
    )


def _case(seed, budgets, depth, l2norm):
    gen = torch.Generator().manual_seed(seed)
    num_rows = len(budgets)
    budget = max(budgets)
    # Trees of the core build: bushy (flat draft distributions) or spiny.
    tree = build_tree(torch.randn(num_rows, depth, 5, generator=gen) * 2, budget)
    max_reqs = num_rows + 2
    idx_mapping = torch.randperm(max_reqs, generator=gen)[:num_rows].to(torch.int32)
    parent = torch.zeros(max_reqs, budget, dtype=torch.int64)
    parent[idx_mapping.long()] = tree.parent_idx
    counts = torch.tensor([1 + n for n in budgets])
    qsl = torch.zeros(num_rows + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(counts, 0)
    T = int(qsl[-1])
    inputs = _inputs(gen, T, k_scale=1.0 if l2norm else 0.3)
    state = torch.randn(2 * num_rows + 2, HV, V, K, generator=gen) * 0.1
    state_idx = torch.arange(1, num_rows + 1, dtype=torch.int32)  # slot 0: null
    return tree, idx_mapping, parent, qsl, inputs, state, state_idx


def _path(parent_row, node):
    path = [node]
    while path[-1] != 0:
        path.append(int(parent_row[path[-1] - 1]))
    return path[::-1]


def _reference(inputs, state0, rows, l2norm, every_row=False):
    """Upstream's sequential kernel over the given rows, from state0: the
    last row's output (``every_row``: each row's) and the final state."""
    sel = {n: t[rows] for n, t in inputs.items() if n in ("a", "b", "q", "k", "v")}
    o, states = fused_sigmoid_gating_delta_rule_update(
        A_log=inputs["A_log"].to(DEVICE),
        a=sel["a"][None].to(DEVICE),
        b=sel["b"][None].to(DEVICE),
        dt_bias=inputs["dt_bias"].to(DEVICE),
        q=sel["q"][None].to(DEVICE),
        k=sel["k"][None].to(DEVICE),
        v=sel["v"][None].to(DEVICE),
        initial_state=state0[None].to(DEVICE),
        inplace_final_state=False,
        use_qk_l2norm_in_kernel=l2norm,
    )
    return (o[0] if every_row else o[0, -1]).cpu(), states[-1].cpu()


@pytest.mark.parametrize(
    "seed, budgets, depth, l2norm",
    [(0, [1], 1, False), (1, [6, 3], 3, True), (2, [8, 8, 2], 4, False)],
)
def test_tree_gdn_matches_the_sequential_kernel_on_every_path(
    seed, budgets, depth, l2norm
):
    tree, idx_mapping, parent, qsl, inputs, state, state_idx = _case(
        seed, budgets, depth, l2norm
    )
    to = lambda t: t.to(DEVICE)  # noqa: E731
    committed = state.clone()
    o = tree_gdn.tree_gated_delta_rule(
        **{n: to(t) for n, t in inputs.items()},
        state=to(state),
        state_idx=to(state_idx),
        query_start_loc=to(qsl),
        parent_idx=to(parent),
        idx_mapping=to(idx_mapping),
        draft_depth=depth,
        use_qk_l2norm_in_kernel=l2norm,
    ).cpu()
    for r, n in enumerate(budgets):
        parent_row = parent[int(idx_mapping[r])]
        for node in range(1 + n):
            rows = [int(qsl[r]) + i for i in _path(parent_row, node)]
            ref_o, _ = _reference(inputs, committed[int(state_idx[r])], rows, l2norm)
            torch.testing.assert_close(
                o[int(qsl[r]) + node], ref_o, rtol=1e-5, atol=1e-5
            )

    # After the walk: the state after one accepted node per row goes to a
    # fresh slot; the committed slots stay as they were.
    gen = torch.Generator().manual_seed(seed + 100)
    accepted = torch.tensor(
        [[int(torch.randint(0, 1 + n, (1,), generator=gen))] for n in budgets]
    )
    final_idx = torch.arange(len(budgets) + 1, 2 * len(budgets) + 1, dtype=torch.int32)
    state_dev = to(state.clone())
    out = tree_gdn.tree_gated_delta_rule(
        **{n: to(t) for n, t in inputs.items()},
        state=state_dev,
        state_idx=to(state_idx),
        query_start_loc=to(qsl),
        parent_idx=to(parent),
        idx_mapping=to(idx_mapping),
        draft_depth=depth,
        targets=to(accepted),
        final_state_idx=to(final_idx),
        use_qk_l2norm_in_kernel=l2norm,
    )
    assert out is None
    state_after = state_dev.cpu()
    for r in range(len(budgets)):
        parent_row = parent[int(idx_mapping[r])]
        rows = [int(qsl[r]) + i for i in _path(parent_row, int(accepted[r, 0]))]
        _, ref_state = _reference(inputs, committed[int(state_idx[r])], rows, l2norm)
        torch.testing.assert_close(
            state_after[int(final_idx[r])], ref_state, rtol=1e-5, atol=1e-5
        )
        assert torch.equal(state_after[int(state_idx[r])], committed[int(state_idx[r])])


@pytest.mark.parametrize(
    "seed, budgets, depth, scale",
    [
        # Draft-depth 15 trees of the production budgets: spiny (peaked
        # drafts: one long path) and bushy (flat drafts), a 15-node tree next
        # to a 3-node one, and a 9-node one.
        (3, [15, 3], 15, 4.0),
        (4, [15, 15], 15, 0.3),
        (5, [9], 15, 1.5),
        # The largest tree the bf16 form takes in one block with the root
        # (31 nodes + root = 32 rows; two blocks of 16 in float32), and 32
        # nodes, which fill it with the root taken apart.
        (6, [31], 15, 1.5),
        (8, [32, 7], 15, 1.5),
        # 16 nodes, the root apart: one block of 16 in both dtypes.
        (9, [16], 15, 1.5),
        # The default budget at one request (64 nodes, the root apart: 4
        # blocks of 16 rows; 2 of 32 among the other settings below), and a
        # 20-node tree batched with it.
        (7, [64, 20], 15, 1.5),
    ],
)
@pytest.mark.parametrize("strong", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_tree_gdn_matches_the_sequential_kernel(
    seed, budgets, depth, scale, strong, dtype, monkeypatch
):
    """The chunked (WY) kernel, in one block or block by block for trees
    of more rows, against upstream's sequential kernel over every
    root-to-node path, and against the path-replay kernel; a batch row
    without a state slot (CUDA-graph padding) gets zeros. ``strong``: nearly
    parallel keys, beta near 1 and almost no decay, so that long paths'
    terms of the triangular inverse matter. float32 inputs take the forward
    substitution (to 2e-5), bf16 ones the inverse as products of its factors
    (to bf16 rounding of the output; the reference runs on the same
    bf16-rounded inputs in float32)."""
    gen = torch.Generator().manual_seed(seed)
    num_rows = len(budgets)
    budget = max(budgets)
    exact = dtype == torch.float32
    tree = build_tree(torch.randn(num_rows, depth, 5, generator=gen) * scale, budget)
    # One padding row (slot 0) after the real ones.
    idx_mapping = torch.arange(num_rows + 1, dtype=torch.int32)
    parent = torch.zeros(num_rows + 1, budget, dtype=torch.int64)
    parent[:num_rows] = tree.parent_idx
    counts = torch.tensor([1 + n for n in budgets] + [1])
    qsl = torch.zeros(num_rows + 2, dtype=torch.int32)
    qsl[1:] = torch.cumsum(counts, 0)
    T = int(qsl[-1])
    inputs = _inputs(gen, T)
    if strong:
        inputs["A_log"] = torch.full((HV,), -4.0)
        inputs["b"] = torch.full((T, HV), 4.0)
        inputs["k"] = torch.randn(1, H, K, generator=gen) + 0.05 * inputs["k"]
    for n in ("a", "b", "q", "k", "v"):
        inputs[n] = inputs[n].to(dtype)
    state = torch.randn(num_rows + 1, HV, V, K, generator=gen) * 0.1
    state_idx = torch.tensor(list(range(1, num_rows + 1)) + [0], dtype=torch.int32)
    to = lambda t: t.to(DEVICE)  # noqa: E731

    def run():
        return tree_gdn.tree_gated_delta_rule(
            **{n: to(t) for n, t in inputs.items()},
            state=to(state),
            state_idx=to(state_idx),
            query_start_loc=to(qsl),
            parent_idx=to(parent),
            idx_mapping=to(idx_mapping),
            draft_depth=depth,
            use_qk_l2norm_in_kernel=True,
        ).cpu()

    o = run()
    assert o.dtype == dtype
    tol = 2e-5 if exact else 2e-2
    reference_inputs = {n: t.float() for n, t in inputs.items()}
    for r, n in enumerate(budgets):
        # Every node of the small trees; of the larger ones (slow in the
        # interpreter) the 8 deepest and the 4 shallowest.
        by_depth = sorted(range(1 + n), key=lambda i: -len(_path(parent[r], i)))
        nodes = by_depth if n <= 20 else by_depth[:8] + by_depth[-4:]
        # One sequential run per path to a checked node that no deeper checked
        # node's path covers: it is causal, so its output at each row is that
        # node's (the interpreter's launches are most of this test's time).
        ref_o: dict[int, torch.Tensor] = {}
        for node in nodes:
            if node not in ref_o:
                path = _path(parent[r], node)
                rows = [int(qsl[r]) + i for i in path]
                outs, _ = _reference(reference_inputs, state[r + 1], rows, True, True)
                ref_o.update(zip(path, outs))
        for node in nodes:
            torch.testing.assert_close(
                o[int(qsl[r]) + node].float(), ref_o[node], rtol=tol, atol=tol
            )
    assert torch.count_nonzero(o[int(qsl[num_rows]) :]) == 0
    # The other launch settings: the triangular inverse's factor products in
    # the other precision, the blocked kernel's other block size (16 or 32
    # rows; float32 takes 16 either way) and the one-block kernel's value
    # blocks of the other batch sizes.
    with monkeypatch.context() as m:
        precision = "ieee" if tree_gdn.INVERSE_PRECISION == "tf32x3" else "tf32x3"
        m.setattr(tree_gdn, "INVERSE_PRECISION", precision)
        m.setattr(tree_gdn, "BLOCKED_ROWS", 16 if tree_gdn.BLOCKED_ROWS == 32 else 32)
        batched = 1 if num_rows + 1 < tree_gdn.CHUNK_BATCHED_ROWS else 1 << 20
        m.setattr(tree_gdn, "CHUNK_BATCHED_ROWS", batched)
        torch.testing.assert_close(run().float(), o.float(), rtol=tol, atol=tol)
    # The blocked kernel with each block's ancestors by a chase up the
    # parents (the same kernel for trees of one block).
    monkeypatch.setattr(tree_gdn, "BLOCKED_ANCESTORS_FIRST", False)
    torch.testing.assert_close(run().float(), o.float(), rtol=tol, atol=tol)
    # The path replay.
    monkeypatch.setattr(tree_gdn, "CHUNK_MAX_NODES", 0)
    monkeypatch.setattr(tree_gdn, "CHUNK_MAX_NODES_FLOAT32", 0)
    monkeypatch.setattr(tree_gdn, "BLOCKED_MAX_NODES", 0)
    torch.testing.assert_close(run().float(), o.float(), rtol=tol, atol=tol)


def _small_trees_in_a_wide_table(seed: int, dtype: torch.dtype):
    """Two 15-node trees in a parent table as wide as the engine's
    ``tree_budget`` (64) and in one of their own width; returns the call on
    them: ``run(parent table, max_query_len)``."""
    gen = torch.Generator().manual_seed(seed)
    budget, depth = 15, 15
    tree = build_tree(torch.randn(2, depth, 5, generator=gen) * 1.5, budget)
    qsl = torch.tensor([0, 16, 32], dtype=torch.int32)
    inputs = {n: t.to(dtype) if t.dim() > 1 else t for n, t in _inputs(gen, 32).items()}
    state = torch.randn(3, HV, V, K, generator=gen) * 0.1
    wide = torch.zeros(2, 64, dtype=torch.int64)
    wide[:, :budget] = tree.parent_idx
    narrow = tree.parent_idx.to(torch.int64)
    to = lambda t: t.to(DEVICE)  # noqa: E731

    def run(parent, max_query_len=None):
        return tree_gdn.tree_gated_delta_rule(
            **{n: to(t) for n, t in inputs.items()},
            state=to(state),
            state_idx=to(torch.tensor([1, 2], dtype=torch.int32)),
            query_start_loc=to(qsl),
            parent_idx=to(parent),
            idx_mapping=to(torch.arange(2, dtype=torch.int32)),
            draft_depth=depth,
            use_qk_l2norm_in_kernel=True,
            max_query_len=max_query_len,
        ).cpu()

    return run, wide, narrow


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_small_tree_in_a_wide_parent_table(dtype):
    """The engine's parent table is as wide as ``tree_budget`` while the
    batch policy verifies smaller trees: a 15-node tree in a 64-column
    table (the blocked kernel's form, one block) gives the outputs of the
    same tree in a 15-column table (the one-block kernel)."""
    run, wide, narrow = _small_trees_in_a_wide_table(11, dtype)
    narrow_o = run(narrow)
    wide_o = run(wide)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(wide_o.float(), narrow_o.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_longest_query_picks_the_form_of_the_trees(dtype, monkeypatch):
    """With the step's longest query given, 15-node trees in a 64-column
    table take the one-block kernel (the blocked one is not launched) and
    give the outputs of the table-wide form."""
    run, wide, _ = _small_trees_in_a_wide_table(12, dtype)
    table_o = run(wide)

    class NotLaunched:
        def __getitem__(self, grid):
            raise AssertionError("the blocked kernel was launched")

    monkeypatch.setattr(tree_gdn, "_tree_gdn_blocked_kernel", NotLaunched())
    with pytest.raises(AssertionError, match="blocked kernel"):
        run(wide)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        run(wide, 16).float(), table_o.float(), rtol=tol, atol=tol
    )


def test_sixty_four_nodes_in_one_block(monkeypatch):
    """The bf16 form in one 64-row block (a 64-node tree once the root is
    taken apart) against upstream's sequential kernel on the deepest and
    shallowest paths and against the blocked form."""
    gen = torch.Generator().manual_seed(13)
    budget, depth = 64, 15
    tree = build_tree(torch.randn(1, depth, 5, generator=gen) * 1.5, budget)
    qsl = torch.tensor([0, 65], dtype=torch.int32)
    inputs = _inputs(gen, 65)
    for n in ("a", "b", "q", "k", "v"):
        inputs[n] = inputs[n].to(torch.bfloat16)
    state = torch.randn(2, HV, V, K, generator=gen) * 0.1
    parent = tree.parent_idx.to(torch.int64)
    to = lambda t: t.to(DEVICE)  # noqa: E731

    def run():
        return tree_gdn.tree_gated_delta_rule(
            **{n: to(t) for n, t in inputs.items()},
            state=to(state),
            state_idx=to(torch.tensor([1], dtype=torch.int32)),
            query_start_loc=to(qsl),
            parent_idx=to(parent),
            idx_mapping=to(torch.zeros(1, dtype=torch.int32)),
            draft_depth=depth,
            use_qk_l2norm_in_kernel=True,
        ).cpu()

    blocked_o = run()
    monkeypatch.setattr(tree_gdn, "CHUNK_MAX_NODES", 64)
    o = run()
    torch.testing.assert_close(o.float(), blocked_o.float(), rtol=2e-2, atol=2e-2)
    reference_inputs = {n: t.float() for n, t in inputs.items()}
    by_depth = sorted(range(65), key=lambda i: -len(_path(parent[0], i)))
    for node in by_depth[:6] + by_depth[-3:]:
        ref_o, _ = _reference(reference_inputs, state[1], _path(parent[0], node), True)
        torch.testing.assert_close(o[node].float(), ref_o, rtol=2e-2, atol=2e-2)
