# SPDX-License-Identifier: Apache-2.0
"""DDTree's Triton bookkeeping kernels against the torch reference
implementations (tests/ddtree_reference.py: walk_tree, compaction_indices,
ancestor_mask). On a CPU machine they run in the Triton interpreter
(tests/in_vllm/conftest.py sets it up)."""

import pytest
import torch

kernels = pytest.importorskip("vllm.v1.worker.gpu.spec_decode.ddtree.kernels")
from ddtree_reference import (  # noqa: E402
    ancestor_mask,
    compaction_indices,
    pack_ancestor_bits,
    tree_attention_bias,
    walk_tree,
)
from vllm.v1.spec_decode.ddtree.tree import build_tree  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(num_reqs, budget, depth, vocab, seed, scheduled=None):
    gen = torch.Generator().manual_seed(seed)
    # Peaked draft distributions so that trees have long spines and branches.
    logits = torch.randn(num_reqs, depth, vocab, generator=gen) * 3
    tree = build_tree(logits, budget)
    # Target tokens: mostly follow the tree's top child, sometimes a sibling,
    # sometimes a token outside the tree.
    target = torch.randint(0, vocab, (num_reqs, budget + 1), generator=gen)
    for r in range(num_reqs):
        for i in range(budget):
            parent = int(tree.parent_idx[r, i])
            if torch.rand(1, generator=gen).item() < 0.6:
                target[r, parent] = tree.token_ids[r, i]
    if scheduled is None:
        scheduled = [budget] * num_reqs
    return tree, target, scheduled


def _flatten(tree, target, scheduled, max_reqs, rows_before):
    """Lay the case out as the runner does: per-request state rows picked by
    idx_mapping, logits rows of 1 + n scheduled nodes each."""
    num_reqs, budget = tree.token_ids.shape
    idx_mapping = torch.randperm(max_reqs)[:num_reqs].to(torch.int32)
    node_tokens = torch.zeros(max_reqs, budget, dtype=torch.int64)
    parent = torch.zeros(max_reqs, budget, dtype=torch.int64)
    depth = torch.zeros(max_reqs, budget + 1, dtype=torch.int64)
    valid = torch.zeros(max_reqs, budget, dtype=torch.bool)
    node_tokens[idx_mapping.long()] = tree.token_ids
    parent[idx_mapping.long()] = tree.parent_idx
    depth[idx_mapping.long(), 1:] = tree.depth
    valid[idx_mapping.long()] = tree.valid
    counts = torch.tensor([1 + n for n in scheduled])
    cu = torch.zeros(num_reqs + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(counts, 0)
    flat = torch.cat([target[r, : 1 + scheduled[r]] for r in range(num_reqs)])
    query_start = cu + rows_before
    return idx_mapping, node_tokens, parent, depth, valid, cu, flat, query_start


@pytest.mark.parametrize(
    "num_reqs, budget, depth, vocab",
    [(1, 1, 1, 5), (3, 8, 3, 4), (4, 16, 5, 6), (2, 33, 15, 3), (5, 64, 15, 8)],
)
def test_walk_kernel_matches_the_core_walk(num_reqs, budget, depth, vocab):
    for seed in range(3):
        tree, target, _ = _case(num_reqs, budget, depth, vocab, seed)
        scheduled = [budget] * num_reqs
        if num_reqs > 1:
            scheduled[1] = budget // 2  # a partially scheduled tree
        max_reqs = num_reqs + 3
        idx, tok, par, dep, val, cu, flat, qsl = _flatten(
            tree, target, scheduled, max_reqs, rows_before=0
        )
        to = lambda t: t.to(DEVICE)  # noqa: E731
        out, num_acc, src, dst = kernels.ddtree_walk(
            to(flat),
            to(cu),
            to(idx),
            to(qsl),
            to(tok),
            to(par),
            to(dep),
            to(val),
            depth,
        )
        # Reference: the core walk with unscheduled nodes masked out.
        mask = torch.arange(budget)[None, :] < torch.tensor(scheduled)[:, None]
        ref_tree = tree._replace(valid=tree.valid & mask)
        walk = walk_tree(ref_tree, target)
        plan = compaction_indices(walk, qsl)
        assert num_acc.cpu().tolist() == walk.num_accepted.tolist()
        assert torch.equal(out.cpu(), walk.output_token_ids)
        on_path = torch.arange(depth + 1)[None, :] < walk.num_accepted[:, None]
        assert torch.equal(src.cpu()[on_path], plan.src_token_idx[on_path])
        moved = plan.needs_move
        assert torch.equal(dst.cpu()[moved], plan.dst_token_idx[moved])
        # Every other entry is a self-copy.
        assert torch.equal(src.cpu()[~moved], dst.cpu()[~moved])


def test_walk_kernel_prefill_rows_emit_one_token():
    budget, depth = 4, 3
    tree, target, _ = _case(2, budget, depth, 5, 0)
    idx, tok, par, dep, val, cu, flat, qsl = _flatten(tree, target, [0, budget], 4, 7)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    out, num_acc, src, dst = kernels.ddtree_walk(
        to(flat), to(cu), to(idx), to(qsl), to(tok), to(par), to(dep), to(val), depth
    )
    assert int(num_acc[0]) == 1 and int(out[0, 0]) == int(target[0, 0])
    assert out[0, 1:].cpu().tolist() == [-1] * depth
    assert src[0].cpu().tolist() == [7] * (depth + 1) == dst[0].cpu().tolist()


def test_walk_kernel_counts_and_restore_equal_upstreams_and_the_restore_kernel():
    """The walk's fused extras against what they replace: upstream's
    get_num_sampled_and_rejected on the walk's num_accepted (a prefill chunk
    mid-prompt counts nothing, a finished prompt its one token, trees their
    path), and `ddtree_restore_positions` on the same shifted positions."""
    from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected

    budget, depth = 6, 4
    tree, target, _ = _case(4, budget, depth, 5, 1)
    # Batch rows: a prefill chunk (0 nodes, its prompt not done), a finished
    # prefill (0 nodes), two trees (one partially scheduled).
    scheduled = [0, 0, budget, 3]
    max_reqs = 6
    idx, tok, par, dep, val, cu, flat, qsl = _flatten(
        tree, target, scheduled, max_reqs, rows_before=0
    )
    seq_lens = torch.tensor([40, 12, 30, 31], dtype=torch.int32)
    prefill_len = torch.zeros(max_reqs, dtype=torch.int32)
    prefill_len[idx.long()] = torch.tensor([100, 12, 20, 20], dtype=torch.int32)
    num_logits = int(cu[-1])
    logits_indices = torch.randperm(num_logits + 5)[:num_logits].to(torch.int32)
    shift = torch.randint(-3, 9, (num_logits,), dtype=torch.int64)
    positions = torch.randint(0, 500, (num_logits + 5,), dtype=torch.int64)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    args = [to(t) for t in (flat, cu, idx, qsl, tok, par, dep, val)] + [depth]

    plain_sampled = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    _, plain_acc, _, _ = kernels.ddtree_walk(*args, num_sampled=plain_sampled)
    ref_sampled, ref_rejected = get_num_sampled_and_rejected(
        plain_sampled.clone(), to(seq_lens), to(cu), to(idx), to(prefill_len)
    )
    ref_positions = to(positions.clone())
    kernels.ddtree_restore_positions(ref_positions, to(logits_indices), to(shift))

    num_sampled = torch.full((4,), -7, dtype=torch.int32, device=DEVICE)
    num_rejected = torch.full((4,), -7, dtype=torch.int32, device=DEVICE)
    fused_positions = to(positions.clone())
    _, num_acc, _, _ = kernels.ddtree_walk(
        *args,
        num_sampled=num_sampled,
        counts=(num_rejected, to(seq_lens), to(prefill_len)),
        restore=(fused_positions, to(logits_indices), to(shift)),
    )
    assert num_acc.tolist() == plain_acc.tolist()
    assert num_sampled.tolist() == ref_sampled.tolist()
    assert num_rejected.tolist() == ref_rejected.tolist()
    assert num_sampled.tolist()[:2] == [0, 1]
    assert torch.equal(fused_positions, ref_positions)
    assert not torch.equal(fused_positions, to(positions))


@pytest.mark.parametrize("packed", [True, False], ids=["bits", "float"])
@pytest.mark.parametrize(
    "num_reqs, budget, depth, vocab",
    [
        (1, 1, 1, 5),
        (3, 8, 3, 4),
        (2, 30, 15, 3),  # 31 nodes: one word, its top bit unused
        (2, 31, 15, 3),  # 32 nodes: one full word (bit 31 = the sign bit)
        (2, 33, 15, 3),
        (3, 64, 15, 8),
        (1, 100, 7, 40),
    ],
)
def test_tree_bias_kernel_matches_the_ancestor_mask(
    num_reqs, budget, depth, vocab, packed
):
    tree, target, _ = _case(num_reqs, budget, depth, vocab, seed=budget)
    # Batch row 0 has no tree this step (prefill or plain decode).
    scheduled = [0] + [budget] * (num_reqs - 1)
    max_reqs = num_reqs + 2
    idx, _, par, _, _, cu, _, _ = _flatten(tree, target, scheduled, max_reqs, 0)
    mask = ancestor_mask(tree.parent_idx, depth)
    if packed:
        out = kernels.tree_bias_buffer(max_reqs, budget + 1, torch.device(DEVICE))
        assert out.shape == (max_reqs, budget + 1, (budget + 32) // 32)
        out.fill_(7)
        # Set bits: the pairs masked out; none past the last node.
        ref = pack_ancestor_bits(~mask)
    else:
        out = torch.full((max_reqs, budget + 1, budget + 1), 7.0, device=DEVICE)
        ref = tree_attention_bias(mask, torch.float32)
    kernels.ddtree_tree_bias(par.to(DEVICE), idx.to(DEVICE), cu.to(DEVICE), depth, out)
    ref[0] = 0
    assert torch.equal(out[:num_reqs].cpu(), ref)
    # Rows past the batch are not written.
    assert torch.all(out[num_reqs:] == 7)


@pytest.mark.parametrize("num_layers", [1, 3])
def test_kv_compactor_moves_the_path_in_every_layer(num_layers):
    budget, depth, block_size, heads, row = 16, 5, 16, 2, 8
    tree, target, _ = _case(3, budget, depth, 4, 1)
    scheduled = [budget, budget, budget]
    idx, tok, par, dep, val, cu, flat, qsl = _flatten(tree, target, scheduled, 3, 0)
    walk = walk_tree(tree, target)
    plan = compaction_indices(walk, qsl)
    num_tokens = int(cu[-1])
    # Each request's verify window starts at a different offset in its blocks.
    slots = torch.cat(
        [torch.arange(1 + budget) + 100 * (r + 1) + 5 * r for r in range(3)]
    )
    layers = [
        torch.randn(32, heads, block_size, row, device=DEVICE)
        for _ in range(num_layers)
    ]
    # Non-contiguous like vLLM's NHD layout: (blocks, heads, slots, row) view.
    layers = [x.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) for x in layers]
    expected = []
    for kv in layers:
        ref = kv.clone().cpu()
        s = slots[plan.src_token_idx.view(-1)]
        d = slots[plan.dst_token_idx.view(-1)]
        ref[d // block_size, :, d % block_size] = ref[
            s // block_size, :, s % block_size
        ]
        expected.append(ref)
    compactor = kernels.KVCompactor(layers)
    src = plan.src_token_idx.to(DEVICE)
    dst = plan.dst_token_idx.to(DEVICE)
    compactor(slots.to(DEVICE), src, dst, walk.num_accepted.to(torch.int32).to(DEVICE))
    assert num_tokens == slots.numel()
    for kv, ref in zip(layers, expected):
        assert torch.equal(kv.cpu(), ref)


def test_kv_compactor_refuses_mixed_layers():
    a = torch.zeros(4, 2, 16, 8)
    b = torch.zeros(4, 1, 16, 8)
    with pytest.raises(ValueError, match="differ"):
        kernels.KVCompactor([a, b])
