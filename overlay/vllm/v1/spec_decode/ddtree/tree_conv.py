# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tree verification through the short causal conv1d of GDN layers.

Each Gated DeltaNet layer (Qwen3.5 / Qwen3.6 / Qwen3-Next) runs a depthwise
causal convolution of width W (4) over ``mixed_qkv`` before the gated delta
rule: token t's output reads the inputs of tokens ``t - W + 1 .. t``, and the
conv state keeps the last ``W - 1`` inputs for the next step. In chain
speculation upstream (`causal_conv1d_update` with ``num_accepted_tokens``)
the W - 1 previous tokens of a draft are the previous rows. In a tree they
are the node's *ancestors*: the conv window of a node of depth d is its
``W - 1`` nearest ancestors on the root -> node path (root included) and,
when ``d < W - 1``, the last ``W - 1 - d`` inputs of the committed state.

`tree_causal_conv1d` gathers that window by walking at most ``W - 1``
parent pointers per (request, node) and applies the same float32 operations
in the same order as `_causal_conv1d_update_kernel`, so every node's output
equals upstream's over its root -> node path. The committed state is only
read (all nodes of a request share it).

After the walk, `tree_conv_state_update` writes the conv state upstream
would have left after the accepted path (the last ``W - 1`` inputs of
committed state + path) into the request's final slot. For that the verify
inputs ``x`` of the ``B + 1`` rows must be kept until the walk. The runner
does that for all layers at once (`gdn_commit`, the same values); this is
the per-layer form of it (the tests' oracle).

Conv state layout (as upstream's non-speculative update and prefill):
``conv_state [slots, dim, state_len]`` (any strides: the SD cache layout is
passed as a transposed view), ``state_len >= W - 1``; the window is columns
``0 .. W - 2``, most recent input last. Columns ``W - 1 ..`` (upstream's
room for chain drafts) are neither read nor written. A state written here
starts at column 0, i.e. the next upstream speculative call must treat it as
``num_accepted_tokens == 1``.
"""

from __future__ import annotations

import torch

from vllm.triton_utils import tl, triton

# Upstream's feature block (`causal_conv1d_update` launches with 256).
_BLOCK_N = 256


@triton.jit
def _tree_conv1d_kernel(
    x,  # [T, dim] verify inputs (any strides)
    stride_x_tok,
    stride_x_dim,
    w,  # [dim, W]
    stride_w_dim,
    stride_w_width,
    bias,  # [dim] (HAS_BIAS)
    conv_state,  # [num_slots, dim, state_len] committed states (read only)
    stride_s_seq,
    stride_s_dim,
    stride_s_tok,
    o,  # [T, dim] contiguous, conv_state's dtype
    state_idx_ptr,  # [R] slot of each batch row's committed state
    query_start_ptr,  # [R + 1] first verify row of each batch row
    parent_ptr,  # [S, B] parent verify index of node i + 1 (0 = root)
    parent_stride,
    idx_mapping_ptr,  # [R] batch row -> request state (tree row)
    dim,
    NUM_TARGETS: tl.constexpr,  # B + 1: one program per verify row
    KERNEL_WIDTH: tl.constexpr,
    WIDTH_BLOCK: tl.constexpr,  # power of 2 >= KERNEL_WIDTH
    HAS_BIAS: tl.constexpr,
    SILU_ACTIVATION: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    i_n = tl.program_id(0)
    i_rt = tl.program_id(1)
    r = i_rt // NUM_TARGETS
    node = (i_rt % NUM_TARGETS).to(tl.int64)
    row0 = tl.load(query_start_ptr + r).to(tl.int64)
    num_rows = tl.load(query_start_ptr + r + 1).to(tl.int64) - row0
    slot = tl.load(state_idx_ptr + r).to(tl.int64)
    if (node >= num_rows) | (slot <= 0):
        return
    req = tl.load(idx_mapping_ptr + r).to(tl.int64)

    # The window as verify indices, oldest first: entry KERNEL_WIDTH - 1 is
    # the node, entry KERNEL_WIDTH - 1 - s its s-th ancestor. Past the root
    # the entries come from the committed window, most recent (column
    # KERNEL_WIDTH - 2) first; they are encoded as -1 - column.
    offs = tl.arange(0, WIDTH_BLOCK)
    window = tl.full([WIDTH_BLOCK], -1, tl.int64)
    cur = node
    col = (KERNEL_WIDTH - 2) + 0 * node
    for s in tl.static_range(KERNEL_WIDTH):
        entry = tl.where(cur >= 0, cur, -1 - col)
        window = tl.where(offs == KERNEL_WIDTH - 1 - s, entry, window)
        col = tl.where(cur >= 0, col, col - 1)
        if s < KERNEL_WIDTH - 1:  # the oldest entry needs no parent
            parent = tl.load(
                parent_ptr + req * parent_stride + cur - 1, mask=cur > 0, other=0
            ).to(tl.int64)
            cur = tl.where(cur > 0, parent, -1)

    idx_feats = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_d = idx_feats < dim
    if HAS_BIAS:
        acc = tl.load(bias + idx_feats, mask=mask_d, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)

    # As _causal_conv1d_update_kernel: acc = bias, then x_j * w_j added
    # oldest first, inputs in the conv state's dtype.
    p_state = conv_state + slot * stride_s_seq + idx_feats * stride_s_dim
    for j in tl.static_range(KERNEL_WIDTH):
        t = tl.sum(tl.where(offs == j, window, 0))
        from_x = t >= 0
        x_j = tl.load(
            x + (row0 + tl.maximum(t, 0)) * stride_x_tok + idx_feats * stride_x_dim,
            mask=mask_d & from_x,
            other=0.0,
        ).to(conv_state.dtype.element_ty)
        s_j = tl.load(
            p_state + tl.maximum(-1 - t, 0) * stride_s_tok,
            mask=mask_d & (t < 0),
            other=0.0,
        )
        w_j = tl.load(
            w + idx_feats * stride_w_dim + j * stride_w_width, mask=mask_d, other=0.0
        )
        acc += tl.where(from_x, x_j, s_j) * w_j

    if SILU_ACTIVATION:
        acc = acc / (1 + tl.exp(-acc))
    p_o = o + (row0 + node) * dim + idx_feats
    tl.store(p_o, acc.to(p_o.dtype.element_ty), mask=mask_d)


@triton.jit
def _tree_conv_state_update_kernel(
    x,  # [T, dim] verify inputs (any strides)
    stride_x_tok,
    stride_x_dim,
    conv_state,  # [num_slots, dim, state_len] committed (read) / final (write)
    stride_s_seq,
    stride_s_dim,
    stride_s_tok,
    state_idx_ptr,  # [R] slot of each batch row's committed state
    final_state_idx_ptr,  # [R] slot to write the final state to
    query_start_ptr,  # [R + 1] first verify row of each batch row
    accepted_ptr,  # [R, M] accepted verify indices, root first
    accepted_stride,
    num_accepted_ptr,  # [R] length of the accepted path (root included)
    dim,
    KERNEL_WIDTH: tl.constexpr,
    STATE_BLOCK: tl.constexpr,  # power of 2 >= KERNEL_WIDTH - 1
    BLOCK_N: tl.constexpr,
):
    i_n = tl.program_id(0)
    r = tl.program_id(1)
    slot = tl.load(state_idx_ptr + r).to(tl.int64)
    final_slot = tl.load(final_state_idx_ptr + r).to(tl.int64)
    n = tl.load(num_accepted_ptr + r).to(tl.int64)
    if (slot <= 0) | (final_slot <= 0) | (n <= 0):
        return
    row0 = tl.load(query_start_ptr + r).to(tl.int64)

    # New column c (0 .. W - 2) holds the input W - 2 - c steps before the
    # accepted leaf: path entry k = n - (W - 1) + c, or, before the root,
    # committed column W - 1 + k (the committed window shifted left by n).
    c = tl.arange(0, STATE_BLOCK)
    in_state = c < KERNEL_WIDTH - 1
    k = n - (KERNEL_WIDTH - 1) + c
    from_x = in_state & (k >= 0)
    from_state = in_state & (k < 0)
    t = tl.load(
        accepted_ptr + r * accepted_stride + tl.maximum(k, 0), mask=from_x, other=0
    ).to(tl.int64)
    idx_feats = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_d = idx_feats < dim
    x_c = tl.load(
        x + ((row0 + t) * stride_x_tok)[:, None] + (idx_feats * stride_x_dim)[None, :],
        mask=from_x[:, None] & mask_d[None, :],
        other=0.0,
    ).to(conv_state.dtype.element_ty)
    p_dim = (idx_feats * stride_s_dim)[None, :]
    s_c = tl.load(
        conv_state
        + slot * stride_s_seq
        + (tl.maximum(KERNEL_WIDTH - 1 + k, 0) * stride_s_tok)[:, None]
        + p_dim,
        mask=from_state[:, None] & mask_d[None, :],
        other=0.0,
    )
    new_state = tl.where(from_x[:, None], x_c, s_c)
    # final_slot may be the committed slot: this program's stores overwrite
    # columns that other threads of the same program load (column c reads
    # committed column c + n), so every load must be done before any store.
    # The whole new window is in registers; the barrier orders the loads of
    # all threads before the stores. Other programs touch other feature
    # blocks or other requests' slots, so no other program reads what this
    # one writes.
    tl.debug_barrier()
    tl.store(
        conv_state + final_slot * stride_s_seq + (c * stride_s_tok)[:, None] + p_dim,
        new_state,
        mask=in_state[:, None] & mask_d[None, :],
    )


def _is_silu(activation: bool | str | None) -> bool:
    if isinstance(activation, bool):
        return activation
    assert activation in (None, "silu", "swish")
    return activation is not None


def tree_causal_conv1d(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: bool | str | None,
    state_idx: torch.Tensor,
    query_start_loc: torch.Tensor,
    parent_idx: torch.Tensor,
    idx_mapping: torch.Tensor,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Causal conv1d (upstream `causal_conv1d_update`) over every request's
    draft tree.

    Rows ``query_start_loc[r] .. query_start_loc[r + 1] - 1`` of ``x [T,
    dim]`` are batch row ``r``'s verify inputs in verify layout (row 0 the
    root, node ``i``'s parent ``parent_idx[idx_mapping[r], i - 1]``).
    ``conv_state [slots, dim, state_len]`` holds the committed windows
    (columns ``0 .. W - 2``, most recent last), ``state_idx [R]`` their slots
    (<= 0: skip the row, its output rows are left unset). ``weight [dim,
    W]``, ``bias [dim]`` or None, ``activation`` "silu" / "swish" / True or
    None, as upstream.

    Returns ``out [T, dim]`` (``x``'s dtype): each row's conv output as if
    the request's tokens were its root -> node path. Not in place (upstream
    writes into ``x``): a node's window reads its ancestors' rows of ``x``.
    ``conv_state`` is only read; one launch, no host synchronisation.
    ``max_query_len``: at most this many verify rows in any batch row (a host
    bound that holds for every replay of a CUDA graph): programs for rows
    past it are not launched (default: the parent table's width).
    """
    num_rows = query_start_loc.shape[0] - 1
    T, dim = x.shape
    width = weight.shape[1]
    assert weight.shape[0] == dim and conv_state.shape[1] == dim
    assert conv_state.shape[2] >= width - 1 and width >= 2
    # Rounded to conv_state's dtype first, as upstream (which computes in x
    # cast to conv_state's dtype and casts back).
    o = torch.empty(T, dim, dtype=conv_state.dtype, device=x.device)
    if num_rows == 0 or T == 0:
        return o.to(x.dtype)
    # Every verify row of a batch row is a target: node t for program t
    # (ragged: nodes past the row's count are skipped in the kernel).
    num_targets = parent_idx.shape[1] + 1
    if max_query_len is not None:
        num_targets = max(min(num_targets, max_query_len), 1)
    block_n = min(_BLOCK_N, triton.next_power_of_2(dim))
    grid = (triton.cdiv(dim, block_n), num_rows * num_targets)
    _tree_conv1d_kernel[grid](
        x,
        x.stride(0),
        x.stride(1),
        weight,
        weight.stride(0),
        weight.stride(1),
        bias if bias is not None else weight,  # unused without
        conv_state,
        conv_state.stride(0),
        conv_state.stride(1),
        conv_state.stride(2),
        o,
        state_idx,
        query_start_loc,
        parent_idx,
        parent_idx.stride(0),
        idx_mapping,
        dim,
        NUM_TARGETS=num_targets,
        KERNEL_WIDTH=width,
        WIDTH_BLOCK=triton.next_power_of_2(width),
        HAS_BIAS=bias is not None,
        SILU_ACTIVATION=_is_silu(activation),
        BLOCK_N=block_n,
        num_warps=4,
    )
    return o.to(x.dtype)


def tree_conv_state_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    width: int,
    state_idx: torch.Tensor,
    final_state_idx: torch.Tensor,
    query_start_loc: torch.Tensor,
    accepted_idx: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """Conv state after the accepted path, written to ``final_state_idx``.

    ``accepted_idx [R, M]`` are batch row ``r``'s accepted verify indices,
    root first (the walk's ``accepted_idx``, M >= the longest path), and
    ``num_accepted [R]`` their count (>= 1; only the last ``W - 1`` are
    read, entries past the count never). ``x``, ``conv_state``,
    ``state_idx`` and ``query_start_loc`` as for `tree_causal_conv1d`.

    Writes columns ``0 .. W - 2`` of ``conv_state[final_state_idx[r]]``
    with what upstream's `causal_conv1d_update` leaves there after the
    path root .. leaf from ``conv_state[state_idx[r]]``: the last ``W - 1``
    inputs of committed window + path. ``final_state_idx[r]`` may equal
    ``state_idx[r]`` (in-place commit) but must not be another row's
    committed slot. Rows with a slot, final slot or count <= 0 are skipped.
    """
    num_rows = query_start_loc.shape[0] - 1
    dim = x.shape[1]
    assert conv_state.shape[1] == dim and conv_state.shape[2] >= width - 1
    if num_rows == 0 or width < 2:
        return
    block_n = min(_BLOCK_N, triton.next_power_of_2(dim))
    grid = (triton.cdiv(dim, block_n), num_rows)
    _tree_conv_state_update_kernel[grid](
        x,
        x.stride(0),
        x.stride(1),
        conv_state,
        conv_state.stride(0),
        conv_state.stride(1),
        conv_state.stride(2),
        state_idx,
        final_state_idx,
        query_start_loc,
        accepted_idx,
        accepted_idx.stride(0),
        num_accepted,
        dim,
        KERNEL_WIDTH=width,
        STATE_BLOCK=triton.next_power_of_2(width - 1),
        BLOCK_N=block_n,
        num_warps=4,
    )
