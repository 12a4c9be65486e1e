# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Triton kernels for DDTree's per-step bookkeeping on the V2 model runner.

The verification walk and the KV compaction run every step outside the
captured graphs. As chains of small torch ops they cost dozens of kernel
launches (about 0.4 ms of launch latency per step on an H200), so each is one
launch here:

- ``ddtree_walk``: per request, match every scheduled node against the
  target's token at its parent, keep the nodes whose whole ancestor chain
  matches (pointer jumping), and write the emitted tokens, the number
  accepted and the compaction indices (source and destination rows of the
  accepted path; off-path entries are self-copies of the root); in the same
  launch, the runner's sampled / rejected counts and the restore of the
  request's tree positions.
- ``ddtree_tree_bias``: per request, the ancestor mask of its tree (query
  node i may see node j iff j is i or an ancestor of i), built from the
  parent indices straight into the buffer the attention kernel reads: one
  bit per (i, j) pair, set where i may not see j (`tree_bias_buffer`, the
  attention kernel's packed int32 ``qq_bias``), or the additive float
  bias (0 / -inf). Only the parents are kept per request, not a mask.
- ``ddtree_tree_positions`` / ``ddtree_restore_positions``: every logits
  row's position shifted to its tree position (root + depth) in place, and
  back after the walk (by the walk's own launch when it runs); the shifted
  rows' positions and input ids are kept for the sampler.
- ``ddtree_store_trees``: the drafter's new trees and their node tokens,
  from batch order to per-request state.
- ``KVCompactor``: per (request, layer), copy the accepted path's KV
  entries to the contiguous slots after the root, for all layers of one
  KV-cache group (one slot mapping) in one launch. Entries are copied in
  path order: entry k reads node a_k >= k and writes slot k, and every later
  entry reads a node a_k' > a_k >= k, so no entry reads a slot an earlier
  entry wrote.
- ``compact_rows``: the same move for the rows of up to 8 tensors (the aux
  hidden states the DFlash pass reads) in one launch.
"""

import torch

from vllm.triton_utils import tl, triton


@triton.jit
def _ddtree_walk_kernel(
    target_ptr,  # [num_logits] target token at every logit row
    cu_num_logits_ptr,  # [num_reqs + 1]
    idx_mapping_ptr,  # [num_reqs] batch row -> request state
    query_start_loc_ptr,  # [num_reqs + 1]
    node_tokens_ptr,  # [max_num_reqs, B] draft token of node i + 1
    node_tokens_stride,
    parent_ptr,  # [max_num_reqs, B] parent (verify index, 0 = root)
    parent_stride,
    depth_ptr,  # [max_num_reqs, B + 1] depth, column 0 = root
    depth_stride,
    valid_ptr,  # [max_num_reqs, B]
    valid_stride,
    scratch_ptr,  # [num_reqs, 2, BLOCK] int32 (flags and node indices)
    out_tokens_ptr,  # [num_reqs, D + 1] emitted tokens, -1 padded
    out_tokens_stride,
    num_accepted_ptr,  # [num_reqs] int32
    num_sampled_ptr,  # [num_reqs] int32: num_accepted (0 in a prefill chunk)
    num_rejected_ptr,  # [num_reqs] int32 (COUNTS)
    seq_lens_ptr,  # [num_reqs] (COUNTS)
    prefill_len_ptr,  # [max_num_reqs] prompt length per request state (COUNTS)
    positions_ptr,  # [num_tokens] int64, tree positions restored (RESTORE)
    logits_indices_ptr,  # [num_logits] token of each logits row (RESTORE)
    shift_ptr,  # [num_logits] int64 depth - local position (RESTORE)
    src_row_ptr,  # [num_reqs, D + 1] int64
    dst_row_ptr,  # [num_reqs, D + 1] int64
    DRAFT_DEPTH: tl.constexpr,
    NUM_JUMPS: tl.constexpr,
    BLOCK: tl.constexpr,
    PATH_BLOCK: tl.constexpr,
    COUNTS: tl.constexpr,
    RESTORE: tl.constexpr,
):
    r = tl.program_id(0)
    req = tl.load(idx_mapping_ptr + r).to(tl.int64)
    start = tl.load(cu_num_logits_ptr + r).to(tl.int64)
    num_nodes = tl.load(cu_num_logits_ptr + r + 1).to(tl.int64) - start
    row0 = tl.load(query_start_loc_ptr + r).to(tl.int64)

    i = tl.arange(0, BLOCK)
    in_tree = i < num_nodes
    is_node = (i >= 1) & in_tree
    node = tl.where(is_node, i - 1, 0)
    parent = tl.load(parent_ptr + req * parent_stride + node, mask=is_node, other=0)
    token = tl.load(
        node_tokens_ptr + req * node_tokens_stride + node, mask=is_node, other=-1
    )
    valid = tl.load(valid_ptr + req * valid_stride + node, mask=is_node, other=0)
    target = tl.load(target_ptr + start + i, mask=in_tree, other=-1)
    target_at_parent = tl.load(target_ptr + start + parent, mask=is_node, other=-2)
    matched = is_node & (valid != 0) & (token == target_at_parent)
    accepted = tl.where(i == 0, 1, matched.to(tl.int64))
    jump = tl.where(is_node, parent, 0).to(tl.int64)

    # Pointer jumping: after t rounds, accepted[i] covers i and its 2^t - 1
    # nearest ancestors; the root (index 0) is accepted and points to itself.
    scratch = scratch_ptr + r * 2 * BLOCK
    for _ in tl.static_range(NUM_JUMPS):
        tl.store(scratch + i, accepted)
        tl.store(scratch + BLOCK + i, jump)
        tl.debug_barrier()
        accepted_up = tl.load(scratch + jump).to(tl.int64)
        jump_up = tl.load(scratch + BLOCK + jump).to(tl.int64)
        tl.debug_barrier()
        accepted = accepted & accepted_up
        jump = jump_up
    on_path = (accepted != 0) & in_tree
    num_accepted = tl.sum(on_path.to(tl.int32), axis=0)
    tl.store(num_accepted_ptr + r, num_accepted)
    if COUNTS:
        # Upstream's num_sampled / num_rejected (its
        # get_num_sampled_and_rejected): none of either while the request's
        # prompt is still being prefilled in chunks.
        seq_len = tl.load(seq_lens_ptr + r)
        chunked_prefill = seq_len < tl.load(prefill_len_ptr + req)
        num_sampled = tl.where(chunked_prefill, 0, num_accepted)
        num_rejected = tl.where(
            chunked_prefill, 0, num_nodes.to(tl.int32) - num_sampled
        )
        tl.store(num_sampled_ptr + r, num_sampled)
        tl.store(num_rejected_ptr + r, num_rejected)
    else:
        tl.store(num_sampled_ptr + r, num_accepted)
    if RESTORE:
        # The request's logits rows back to their sequential positions
        # (`ddtree_restore_positions`' work, here for its rows).
        tok = tl.load(logits_indices_ptr + start + i, mask=in_tree, other=0)
        p_pos = positions_ptr + tok.to(tl.int64)
        shift = tl.load(shift_ptr + start + i, mask=in_tree, other=0)
        pos = tl.load(p_pos, mask=in_tree, other=0)
        tl.store(p_pos, pos - shift, mask=in_tree)

    # The accepted node of depth k goes to column k (one per depth).
    depth = tl.load(depth_ptr + req * depth_stride + i, mask=in_tree, other=0)
    col = tl.where(on_path, depth, 0)
    tl.store(out_tokens_ptr + r * out_tokens_stride + col, target, mask=on_path)
    tl.store(src_row_ptr + r * (DRAFT_DEPTH + 1) + col, row0 + i, mask=on_path)
    tl.store(dst_row_ptr + r * (DRAFT_DEPTH + 1) + col, row0 + col, mask=on_path)

    # Columns past the path: -1 tokens, root self-copies.
    k = tl.arange(0, PATH_BLOCK)
    pad = (k >= num_accepted) & (k <= DRAFT_DEPTH)
    tl.store(out_tokens_ptr + r * out_tokens_stride + k, -1, mask=pad)
    tl.store(src_row_ptr + r * (DRAFT_DEPTH + 1) + k, row0, mask=pad)
    tl.store(dst_row_ptr + r * (DRAFT_DEPTH + 1) + k, row0, mask=pad)


def _walk_block(budget: int) -> int:
    return triton.next_power_of_2(budget + 1)


class WalkBuffers:
    """Persistent buffers of `ddtree_walk`, sized for ``max_num_reqs`` batch
    rows: no allocation per step.

    The path (read by the compaction and the GDN commit) and the scratch stay
    on the device for the step: one copy. The emitted tokens and the counts
    (``num_sampled``, ``num_rejected``) leave the step: the runner copies
    them to the host on its output copy stream, which no later step waits
    for, and only the host's wait for that copy (the step's output) orders
    it. Like upstream's staged host buffers (`UvaBufferPool`), they rotate
    through ``num_output_slots`` copies, at least the number of steps in
    flight (``max_concurrent_batches``): the engine schedules a step only
    with fewer steps than that in flight, so a slot is written again only
    after the step that last used it has delivered its output."""

    def __init__(
        self,
        max_num_reqs: int,
        budget: int,
        draft_depth: int,
        device: torch.device,
        num_output_slots: int = 1,
    ):
        self.num_accepted = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self.src_row = torch.zeros(
            max_num_reqs, draft_depth + 1, dtype=torch.int64, device=device
        )
        self.dst_row = torch.zeros_like(self.src_row)
        self.scratch = torch.zeros(
            max_num_reqs, 2, _walk_block(budget), dtype=torch.int32, device=device
        )
        assert num_output_slots >= 1
        self.output_token_ids = [
            torch.full(
                (max_num_reqs, draft_depth + 1), -1, dtype=torch.int64, device=device
            )
            for _ in range(num_output_slots)
        ]
        self.num_sampled = [
            torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
            for _ in range(num_output_slots)
        ]
        self.num_rejected = [torch.zeros_like(n) for n in self.num_sampled]
        self._output_slot = 0

    def next_outputs(
        self, num_reqs: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The next slot's ``(output_token_ids [num_reqs, D + 1],
        num_sampled [num_reqs], num_rejected [num_reqs])``, round robin."""
        slot = self._output_slot
        self._output_slot = (slot + 1) % len(self.output_token_ids)
        return (
            self.output_token_ids[slot][:num_reqs],
            self.num_sampled[slot][:num_reqs],
            self.num_rejected[slot][:num_reqs],
        )

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (
            self.num_accepted,
            self.src_row,
            self.dst_row,
            self.scratch,
            *self.output_token_ids,
            *self.num_sampled,
            *self.num_rejected,
        )


def ddtree_walk(
    target_token_ids: torch.Tensor,
    cu_num_logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    node_tokens: torch.Tensor,
    parent_idx: torch.Tensor,
    depth: torch.Tensor,
    valid: torch.Tensor,
    draft_depth: int,
    buffers: WalkBuffers | None = None,
    num_sampled: torch.Tensor | None = None,
    out_tokens: torch.Tensor | None = None,
    counts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    restore: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk every request's tree in one launch.

    Returns ``(output_token_ids [R, D + 1] (-1 padded), num_accepted [R]
    int32, src_row [R, D + 1], dst_row [R, D + 1])``; rows index the
    flattened verify batch. With ``buffers``, the last three are views of
    them (and the scratch theirs); ``out_tokens`` [R, D + 1] int64, if
    given, receives the emitted tokens (else a new tensor does);
    ``num_sampled [R]`` int32, if given, gets a copy of ``num_accepted``.

    The same launch can do the runner's next two pieces of per-step work:
    ``counts = (num_rejected [R] int32, seq_lens [R], prefill_len
    [max_num_reqs])`` makes ``num_sampled`` / ``num_rejected`` upstream's
    (``get_num_sampled_and_rejected``: 0 and 0 for a request whose prompt is
    still being prefilled in chunks, else ``num_accepted`` and its logits
    rows minus that); ``restore = (positions, logits_indices, shift)`` undoes
    `ddtree_tree_positions` (what `ddtree_restore_positions` does).
    """
    num_reqs = idx_mapping.shape[0]
    budget = parent_idx.shape[1]
    device = target_token_ids.device
    block = _walk_block(budget)
    if out_tokens is None:
        out_tokens = torch.empty(
            num_reqs, draft_depth + 1, dtype=torch.int64, device=device
        )
    assert out_tokens.shape == (num_reqs, draft_depth + 1)
    if counts is not None:
        assert num_sampled is not None, "counts go to the caller's num_sampled"
    if restore is not None:
        positions, logits_indices, shift = restore
        assert positions.dtype == shift.dtype == torch.int64
        assert logits_indices.shape[0] == shift.shape[0]
    if buffers is None:
        num_accepted = torch.empty(num_reqs, dtype=torch.int32, device=device)
        src_row = torch.empty(
            num_reqs, draft_depth + 1, dtype=torch.int64, device=device
        )
        dst_row = torch.empty_like(src_row)
        scratch = torch.empty(num_reqs, 2, block, dtype=torch.int32, device=device)
    else:
        assert buffers.src_row.shape[1] == draft_depth + 1
        assert buffers.scratch.shape[2] == block
        num_accepted = buffers.num_accepted[:num_reqs]
        src_row = buffers.src_row[:num_reqs]
        dst_row = buffers.dst_row[:num_reqs]
        scratch = buffers.scratch
    _ddtree_walk_kernel[(num_reqs,)](
        target_token_ids,
        cu_num_logits,
        idx_mapping,
        query_start_loc,
        node_tokens,
        node_tokens.stride(0),
        parent_idx,
        parent_idx.stride(0),
        depth,
        depth.stride(0),
        valid,
        valid.stride(0),
        scratch,
        out_tokens,
        out_tokens.stride(0),
        num_accepted,
        num_accepted if num_sampled is None else num_sampled,
        *(counts or (num_accepted,) * 3),  # unused without
        *(restore or (num_accepted,) * 3),  # unused without
        src_row,
        dst_row,
        DRAFT_DEPTH=draft_depth,
        NUM_JUMPS=max(1, (draft_depth - 1).bit_length()),
        BLOCK=block,
        PATH_BLOCK=triton.next_power_of_2(draft_depth + 1),
        COUNTS=counts is not None,
        RESTORE=restore is not None,
        num_warps=4 if block >= 128 else 1,
    )
    return out_tokens, num_accepted, src_row, dst_row


@triton.jit
def _ddtree_tree_bias_kernel(
    parent_ptr,  # [max_num_reqs, B] parent (verify index, 0 = root)
    parent_stride,
    idx_mapping_ptr,  # [num_reqs] batch row -> request state
    cu_num_logits_ptr,  # [num_reqs + 1]
    out_ptr,  # [>= num_reqs, B + 1, OUT_COLS]: float32 bias or int32 words
    NUM_NODES: tl.constexpr,  # B + 1
    DRAFT_DEPTH: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,  # power of 2 >= OUT_COLS
    PACKED: tl.constexpr,  # int32 words of 32 key bits (set = masked out)
    OUT_COLS: tl.constexpr,  # NUM_NODES, or ceil(NUM_NODES / 32) if PACKED
):
    r = tl.program_id(0)
    i = tl.program_id(1) * ROWS + tl.arange(0, ROWS)  # query nodes
    j = tl.arange(0, COLS)  # key nodes, or words of 32 key nodes if PACKED
    req = tl.load(idx_mapping_ptr + r).to(tl.int64)
    num_logits = tl.load(cu_num_logits_ptr + r + 1) - tl.load(cu_num_logits_ptr + r)
    # Self and the root, then one ancestor per round: a node's depth is at
    # most DRAFT_DEPTH. Padding nodes hang off the root (depth 1).
    cur = tl.where(i < NUM_NODES, i, 0).to(tl.int64)
    if PACKED:
        # Bit k % 32 of word k // 32 stands for key node k.
        word = j.to(tl.int64)[None, :]
        visible = tl.where(word == cur[:, None] // 32, 1 << (cur[:, None] % 32), 0)
        visible = visible | tl.where(word == 0, 1, 0)
    else:
        visible = (j[None, :] == i[:, None]) | (j[None, :] == 0)
    for _ in range(DRAFT_DEPTH):
        parent = tl.load(
            parent_ptr + req * parent_stride + cur - 1, mask=cur > 0, other=0
        )
        cur = tl.where(cur > 0, parent, 0)
        if PACKED:
            visible = visible | tl.where(
                word == cur[:, None] // 32, 1 << (cur[:, None] % 32), 0
            )
        else:
            visible = visible | (j[None, :] == cur[:, None])
    if PACKED:
        # Set bits: the tree's keys i may not see; none past the last node,
        # none for a request that verifies no tree (prefill, plain decode).
        keys_in_word = tl.minimum(tl.maximum(NUM_NODES - 32 * word, 0), 32)
        masked_out = ((1 << keys_in_word) - 1) & ~visible
        out = tl.where(num_logits <= 1, 0, masked_out).to(tl.int32)
    else:
        # A request that verifies no tree (prefill, plain decode) sees no bias.
        visible = visible | (num_logits <= 1)
        out = tl.where(visible, 0.0, float("-inf"))
    base = out_ptr + r.to(tl.int64) * NUM_NODES * OUT_COLS
    tl.store(
        base + i[:, None] * OUT_COLS + j[None, :],
        out,
        mask=(i[:, None] < NUM_NODES) & (j[None, :] < OUT_COLS),
    )


def tree_bias_words(num_nodes: int) -> int:
    """int32 words per row of a packed tree mask of ``num_nodes`` nodes."""
    return triton.cdiv(num_nodes, 32)


def tree_bias_buffer(
    max_num_reqs: int, num_nodes: int, device: torch.device
) -> torch.Tensor:
    """The persistent per-request tree mask that `ddtree_tree_bias` writes
    and the Triton attention kernel reads as its packed ``qq_bias``: int32
    ``[max_num_reqs, num_nodes, ceil(num_nodes / 32)]``, bit ``j % 32`` of
    word ``j // 32`` of row ``i`` set where node ``i`` may not see node
    ``j``. All zeros: no request is masked."""
    return torch.zeros(
        max_num_reqs,
        num_nodes,
        tree_bias_words(num_nodes),
        dtype=torch.int32,
        device=device,
    )


def ddtree_tree_bias(
    parent_idx: torch.Tensor,
    idx_mapping: torch.Tensor,
    cu_num_logits: torch.Tensor,
    draft_depth: int,
    out: torch.Tensor,
) -> None:
    """Write the batch's tree masks into ``out[:num_reqs]`` in one launch:
    packed bits if ``out`` is int32 (`tree_bias_buffer`), the additive 0 /
    -inf bias if it is float32 ``[R, B + 1, B + 1]`` (the torch reference,
    `ancestor_mask`, is in the tests: tests/ddtree_reference.py)."""
    num_reqs = idx_mapping.shape[0]
    num_nodes = parent_idx.shape[1] + 1
    packed = out.dtype == torch.int32
    out_cols = tree_bias_words(num_nodes) if packed else num_nodes
    assert packed or out.dtype == torch.float32
    assert out.is_contiguous() and out.shape[1:] == (num_nodes, out_cols)
    if num_reqs == 0:
        return
    cols = triton.next_power_of_2(out_cols)
    if packed:
        rows = min(triton.next_power_of_2(num_nodes), 64)
    else:
        rows = max(1, min(cols, 4096 // cols))
    _ddtree_tree_bias_kernel[(num_reqs, triton.cdiv(num_nodes, rows))](
        parent_idx,
        parent_idx.stride(0),
        idx_mapping,
        cu_num_logits,
        out,
        NUM_NODES=num_nodes,
        DRAFT_DEPTH=draft_depth,
        ROWS=rows,
        COLS=cols,
        PACKED=packed,
        OUT_COLS=out_cols,
        num_warps=4,
    )


# ``num_logits`` changes with every batch: not specialised on (see
# _tree_attention_kernel), so that no step compiles a variant of its own.
@triton.jit(do_not_specialize=["num_logits"])
def _ddtree_tree_positions_kernel(
    positions_ptr,  # [num_tokens] int64, shifted (restored) in place
    logits_indices_ptr,  # [num_logits] token of each logits row
    expanded_idx_mapping_ptr,  # [num_logits] request state of each row
    expanded_local_pos_ptr,  # [num_logits] row's index in its request's query
    depth_ptr,  # [max_num_reqs, B + 1] node depths, root (0) first
    depth_stride,
    input_ids_ptr,  # [num_tokens]
    shift_ptr,  # [num_logits] depth - local position (out; in if RESTORE)
    logits_pos_ptr,  # [num_logits] the rows' tree positions (out)
    logits_input_ids_ptr,  # [num_logits] the rows' input ids (out)
    num_logits,
    RESTORE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < num_logits
    tok = tl.load(logits_indices_ptr + i, mask=mask, other=0).to(tl.int64)
    pos = tl.load(positions_ptr + tok, mask=mask, other=0)
    if RESTORE:
        shift = tl.load(shift_ptr + i, mask=mask, other=0)
        tl.store(positions_ptr + tok, pos - shift, mask=mask)
    else:
        req = tl.load(expanded_idx_mapping_ptr + i, mask=mask, other=0).to(tl.int64)
        local = tl.load(expanded_local_pos_ptr + i, mask=mask, other=0).to(tl.int64)
        depth = tl.load(depth_ptr + req * depth_stride + local, mask=mask, other=0)
        # Query row k of a request sits at root + k; its node at root + depth.
        shift = depth - local
        tree_pos = pos + shift
        tl.store(positions_ptr + tok, tree_pos, mask=mask)
        tl.store(shift_ptr + i, shift, mask=mask)
        tl.store(logits_pos_ptr + i, tree_pos, mask=mask)
        ids = tl.load(input_ids_ptr + tok, mask=mask, other=0)
        tl.store(logits_input_ids_ptr + i, ids, mask=mask)


_POSITIONS_BLOCK = 1024


def ddtree_tree_positions(
    positions: torch.Tensor,
    logits_indices: torch.Tensor,
    expanded_idx_mapping: torch.Tensor,
    expanded_local_pos: torch.Tensor,
    depth: torch.Tensor,
    input_ids: torch.Tensor,
    shift: torch.Tensor,
    logits_pos: torch.Tensor,
    logits_input_ids: torch.Tensor,
) -> None:
    """Shift every logits row's position to its tree position in place
    (``positions[logits_indices] += depth - local position``), in one
    launch; write the shifts (for `ddtree_restore_positions` and M-RoPE
    targets), the rows' tree positions and input ids (what the sampler
    reads) into ``shift``, ``logits_pos``, ``logits_input_ids`` (views of
    ``num_logits`` rows). Rows of requests without a tree have depth 0 at
    local position 0: shift 0."""
    num_logits = logits_indices.shape[0]
    assert shift.shape[0] == logits_pos.shape[0] == num_logits
    assert logits_input_ids.shape[0] == num_logits
    assert depth.stride(1) == 1 and positions.dtype == shift.dtype == torch.int64
    if num_logits == 0:
        return
    _ddtree_tree_positions_kernel[(triton.cdiv(num_logits, _POSITIONS_BLOCK),)](
        positions,
        logits_indices,
        expanded_idx_mapping,
        expanded_local_pos,
        depth,
        depth.stride(0),
        input_ids,
        shift,
        logits_pos,
        logits_input_ids,
        num_logits,
        RESTORE=False,
        BLOCK=_POSITIONS_BLOCK,
        num_warps=4,
    )


def ddtree_restore_positions(
    positions: torch.Tensor, logits_indices: torch.Tensor, shift: torch.Tensor
) -> None:
    """Undo `ddtree_tree_positions` (``positions[logits_indices] -= shift``)
    in one launch."""
    num_logits = logits_indices.shape[0]
    assert shift.shape[0] == num_logits
    if num_logits == 0:
        return
    _ddtree_tree_positions_kernel[(triton.cdiv(num_logits, _POSITIONS_BLOCK),)](
        positions,
        logits_indices,
        logits_indices,
        logits_indices,
        shift,
        0,
        positions,
        shift,
        shift,
        shift,
        num_logits,
        RESTORE=True,
        BLOCK=_POSITIONS_BLOCK,
        num_warps=4,
    )


# ``num_logits`` changes with every batch: not specialised on (see
# _tree_attention_kernel), so that no step compiles a variant of its own.
@triton.jit(do_not_specialize=["num_logits"])
def _ddtree_shift_model_positions_kernel(
    positions_ptr,  # [NUM_DIMS, num_tokens] int64, shifted in place
    dim_stride,
    token_stride,
    logits_indices_ptr,  # [num_logits] token of each logits row
    shift_ptr,  # [num_logits] depth - local position
    num_logits,
    NUM_DIMS: tl.constexpr,
    SIGN: tl.constexpr,  # 1: apply, -1: restore
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < num_logits
    tok = tl.load(logits_indices_ptr + i, mask=mask, other=0).to(tl.int64)
    shift = tl.load(shift_ptr + i, mask=mask, other=0) * SIGN
    for d in tl.static_range(NUM_DIMS):
        p = positions_ptr + d * dim_stride + tok * token_stride
        tl.store(p, tl.load(p, mask=mask, other=0) + shift, mask=mask)


def ddtree_shift_model_positions(
    positions: torch.Tensor,
    logits_indices: torch.Tensor,
    shift: torch.Tensor,
    restore: bool = False,
) -> None:
    """``positions[:, logits_indices] += shift`` (``-=`` with ``restore``)
    for a multi-dimensional RoPE target's ``[num_dims, num_tokens]``
    positions, every section alike, in one launch: the tree shifts that
    `ddtree_tree_positions` wrote. Logits rows are distinct tokens."""
    num_logits = logits_indices.shape[0]
    assert positions.dim() == 2 and shift.shape[0] == num_logits
    assert positions.dtype == shift.dtype == torch.int64
    if num_logits == 0:
        return
    _ddtree_shift_model_positions_kernel[(triton.cdiv(num_logits, _POSITIONS_BLOCK),)](
        positions,
        positions.stride(0),
        positions.stride(1),
        logits_indices,
        shift,
        num_logits,
        NUM_DIMS=positions.shape[0],
        SIGN=-1 if restore else 1,
        BLOCK=_POSITIONS_BLOCK,
        num_warps=4,
    )


@triton.jit
def _ddtree_store_trees_kernel(
    idx_mapping_ptr,  # [num_reqs] batch row -> request state
    tree_parent_ptr,  # [>= num_reqs, B] batch-ordered (the drafter's)
    tree_depth_ptr,  # [>= num_reqs, B]
    tree_valid_ptr,  # [>= num_reqs, B]
    tree_tokens_ptr,  # [>= num_reqs, B]
    tree_stride,
    req_parent_ptr,  # [max_num_reqs, B] per request state (the verifier's)
    req_depth_ptr,  # [max_num_reqs, B + 1] (column 0: the root)
    req_valid_ptr,  # [max_num_reqs, B]
    req_stride,
    req_depth_stride,
    req_tokens_ptr,  # [max_num_reqs, B] the runner's draft tokens
    req_tokens_stride,
    BUDGET: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    req = tl.load(idx_mapping_ptr + r).to(tl.int64)
    if req < 0:
        return
    j = tl.arange(0, BLOCK)
    mask = j < BUDGET
    src = r * tree_stride + j
    parent = tl.load(tree_parent_ptr + src, mask=mask)
    depth = tl.load(tree_depth_ptr + src, mask=mask)
    valid = tl.load(tree_valid_ptr + src, mask=mask)
    tokens = tl.load(tree_tokens_ptr + src, mask=mask)
    dst = req * req_stride + j
    tl.store(req_parent_ptr + dst, parent, mask=mask)
    tl.store(req_depth_ptr + req * req_depth_stride + 1 + j, depth, mask=mask)
    tl.store(req_valid_ptr + dst, valid, mask=mask)
    tl.store(req_tokens_ptr + req * req_tokens_stride + j, tokens, mask=mask)


def ddtree_store_trees(
    idx_mapping: torch.Tensor,
    tree_parent_idx: torch.Tensor,
    tree_depth: torch.Tensor,
    tree_valid: torch.Tensor,
    tree_tokens: torch.Tensor,
    req_parent_idx: torch.Tensor,
    req_depth: torch.Tensor,
    req_valid: torch.Tensor,
    req_tokens: torch.Tensor,
) -> None:
    """Move the batch's new trees (batch row ``r``: parents, depths, valid
    flags, node tokens) to request state ``idx_mapping[r]`` in one launch:
    ``req_parent_idx[s] = tree_parent_idx[r]``, ``req_depth[s, 1:] =
    tree_depth[r]``, ``req_valid[s] = tree_valid[r]``, ``req_tokens[s] =
    tree_tokens[r]``. Rows with a negative request state are skipped."""
    num_reqs = idx_mapping.shape[0]
    budget = req_parent_idx.shape[1]
    trees = (tree_parent_idx, tree_depth, tree_valid, tree_tokens)
    assert all(t.shape[1] == budget and t.stride() == trees[0].stride() for t in trees)
    assert req_valid.stride() == req_parent_idx.stride()
    assert req_depth.shape[1] == budget + 1 and req_tokens.shape[1] == budget
    assert trees[0].stride(1) == req_parent_idx.stride(1) == 1
    assert req_depth.stride(1) == req_tokens.stride(1) == 1
    if num_reqs == 0:
        return
    block = triton.next_power_of_2(budget)
    _ddtree_store_trees_kernel[(num_reqs,)](
        idx_mapping,
        *trees,
        tree_parent_idx.stride(0),
        req_parent_idx,
        req_depth,
        req_valid,
        req_parent_idx.stride(0),
        req_depth.stride(0),
        req_tokens,
        req_tokens.stride(0),
        BUDGET=budget,
        BLOCK=block,
        num_warps=4 if block >= 256 else 1,
    )


@triton.jit
def _ddtree_compact_kv_kernel(
    layer_base_ptr,  # [num_layers] int64 data pointers, same shape / strides
    slot_mapping_ptr,  # [num_tokens] slots of the verify batch
    src_row_ptr,  # [num_reqs, D + 1]
    dst_row_ptr,  # [num_reqs, D + 1]
    num_accepted_ptr,  # [num_reqs]
    stride_block,
    stride_head,
    stride_slot,
    stride_elem,
    block_size,
    NUM_HEADS: tl.constexpr,
    ROW_SIZE: tl.constexpr,
    HEAD_BLOCK: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    DRAFT_DEPTH: tl.constexpr,
    ELEM_TYPE: tl.constexpr,
):
    r = tl.program_id(0)
    layer = tl.program_id(1)
    base = tl.load(layer_base_ptr + layer).to(tl.pointer_type(ELEM_TYPE))
    num_accepted = tl.load(num_accepted_ptr + r)
    h = tl.arange(0, HEAD_BLOCK)
    c = tl.arange(0, ROW_BLOCK)
    mask = (h[:, None] < NUM_HEADS) & (c[None, :] < ROW_SIZE)
    offs = h[:, None] * stride_head + c[None, :] * stride_elem
    # Sequential in path order (see the module docstring).
    for k in range(1, num_accepted):
        src_row = tl.load(src_row_ptr + r * (DRAFT_DEPTH + 1) + k)
        dst_row = tl.load(dst_row_ptr + r * (DRAFT_DEPTH + 1) + k)
        if src_row != dst_row:
            src_slot = tl.load(slot_mapping_ptr + src_row).to(tl.int64)
            dst_slot = tl.load(slot_mapping_ptr + dst_row).to(tl.int64)
            src = (src_slot // block_size) * stride_block + (
                src_slot % block_size
            ) * stride_slot
            dst = (dst_slot // block_size) * stride_block + (
                dst_slot % block_size
            ) * stride_slot
            values = tl.load(base + src + offs, mask=mask)
            tl.store(base + dst + offs, values, mask=mask)


# Entries are moved as raw bits: an integer type of the element's width
# (any KV dtype, fp8 and packed quantized caches included).
_BITS_TYPES = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


def _bits_type(t: torch.Tensor):
    size = t.element_size()
    if size not in _BITS_TYPES:
        raise ValueError(f"unsupported element size {size} ({t.dtype})")
    return getattr(tl, _BITS_TYPES[size])


class KVCompactor:
    """Moves the accepted path's KV in the given target layers with one
    launch. The layers must share one slot mapping (one KV-cache group) and
    one layout: shape, strides and element size; the layout is the Triton
    backend's ``(num_blocks, num_kv_heads, block_size, 2 * head_size)``."""

    def __init__(self, kv_caches: list[torch.Tensor]):
        first = kv_caches[0]
        for kv in kv_caches:
            if kv.dim() != 4:
                raise ValueError(
                    f"KV cache layout {tuple(kv.shape)} is not (num_blocks, "
                    "num_kv_heads, block_size, 2 * head_size)"
                )
            if (
                kv.shape != first.shape
                or kv.stride() != first.stride()
                or kv.element_size() != first.element_size()
            ):
                raise ValueError(
                    "target KV caches of one group differ in shape, stride or "
                    f"dtype: {tuple(kv.shape)}/{kv.stride()}/{kv.dtype} vs "
                    f"{tuple(first.shape)}/{first.stride()}/{first.dtype}"
                )
        self.num_layers = len(kv_caches)
        self.shape = tuple(first.shape)
        self.strides = first.stride()
        self.elem_type = _bits_type(first)
        self.layer_base = torch.tensor(
            [kv.data_ptr() for kv in kv_caches], dtype=torch.int64, device=first.device
        )

    def __call__(
        self,
        slot_mapping: torch.Tensor,
        src_row: torch.Tensor,
        dst_row: torch.Tensor,
        num_accepted: torch.Tensor,
    ) -> None:
        num_reqs, path_len = src_row.shape
        _, num_heads, block_size, row_size = self.shape
        _ddtree_compact_kv_kernel[(num_reqs, self.num_layers)](
            self.layer_base,
            slot_mapping,
            src_row,
            dst_row,
            num_accepted,
            self.strides[0],
            self.strides[1],
            self.strides[2],
            self.strides[3],
            block_size,
            NUM_HEADS=num_heads,
            ROW_SIZE=row_size,
            HEAD_BLOCK=triton.next_power_of_2(num_heads),
            ROW_BLOCK=triton.next_power_of_2(row_size),
            DRAFT_DEPTH=path_len - 1,
            ELEM_TYPE=self.elem_type,
            num_warps=4,
        )


@triton.jit
def _move_path_rows(
    base,
    row_stride,
    cols,
    mask,
    src_row_ptr,
    dst_row_ptr,
    r,
    num_accepted,
    DRAFT_DEPTH: tl.constexpr,
):
    # Sequential in path order, as the KV entries.
    for k in range(1, num_accepted):
        src = tl.load(src_row_ptr + r * (DRAFT_DEPTH + 1) + k).to(tl.int64)
        dst = tl.load(dst_row_ptr + r * (DRAFT_DEPTH + 1) + k).to(tl.int64)
        if src != dst:
            values = tl.load(base + src * row_stride + cols, mask=mask)
            tl.store(base + dst * row_stride + cols, values, mask=mask)


@triton.jit
def _ddtree_compact_rows_kernel(
    t0,
    t1,
    t2,
    t3,
    t4,
    t5,
    t6,
    t7,
    row_stride,
    num_cols,
    src_row_ptr,  # [num_reqs, D + 1]
    dst_row_ptr,  # [num_reqs, D + 1]
    num_accepted_ptr,  # [num_reqs]
    NUM_TENSORS: tl.constexpr,
    DRAFT_DEPTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_cols
    n = tl.load(num_accepted_ptr + r)
    _move_path_rows(
        t0, row_stride, cols, mask, src_row_ptr, dst_row_ptr, r, n, DRAFT_DEPTH
    )
    if NUM_TENSORS > 1:
        _move_path_rows(
            t1, row_stride, cols, mask, src_row_ptr, dst_row_ptr, r, n, DRAFT_DEPTH
        )
    if NUM_TENSORS > 2:
        _move_path_rows(
            t2, row_stride, cols, mask, src_row_ptr, dst_row_ptr, r, n, DRAFT_DEPTH
        )
    if NUM_TENSORS > 3:
        _move_path_rows(
            t3, row_stride, cols, mask, src_row_ptr, dst_row_ptr, r, n, DRAFT_DEPTH
        )
    if NUM_TENSORS > 4:
        _move_path_rows(
            t4, row_stride, cols, mask, src_row_ptr, dst_row_ptr, r, n, DRAFT_DEPTH
        )
    if NUM_TENSORS > 5:
        _move_path_rows(
            t5, row_stride, cols, mask, src_row_ptr, dst_row_ptr, r, n, DRAFT_DEPTH
        )
    if NUM_TENSORS > 6:
        _move_path_rows(
            t6, row_stride, cols, mask, src_row_ptr, dst_row_ptr, r, n, DRAFT_DEPTH
        )
    if NUM_TENSORS > 7:
        _move_path_rows(
            t7, row_stride, cols, mask, src_row_ptr, dst_row_ptr, r, n, DRAFT_DEPTH
        )


_ROWS_PER_LAUNCH = 8


def compact_rows(
    tensors: list[torch.Tensor],
    src_row: torch.Tensor,
    dst_row: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """Move the accepted path's rows of every ``[num_tokens, cols]`` tensor
    (``tensor[dst_row] = tensor[src_row]`` for the path entries), all in one
    launch when they share shape, row stride and dtype and are at most 8
    (the target's aux hidden states: one per drafter context layer), else
    one launch per such set of 8."""
    if not tensors:
        return
    num_reqs, path_len = src_row.shape
    sets: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        assert t.dim() == 2 and t.stride(1) == 1
        sets.setdefault((t.shape[1], t.stride(0), t.dtype), []).append(t)
    for (num_cols, row_stride, _), same in sets.items():
        block = min(1024, triton.next_power_of_2(num_cols))
        for i in range(0, len(same), _ROWS_PER_LAUNCH):
            chunk = same[i : i + _ROWS_PER_LAUNCH]
            padded = chunk + [chunk[0]] * (_ROWS_PER_LAUNCH - len(chunk))
            _ddtree_compact_rows_kernel[(num_reqs, triton.cdiv(num_cols, block))](
                *padded,
                row_stride,
                num_cols,
                src_row,
                dst_row,
                num_accepted,
                NUM_TENSORS=len(chunk),
                DRAFT_DEPTH=path_len - 1,
                BLOCK=block,
                num_warps=4,
            )
