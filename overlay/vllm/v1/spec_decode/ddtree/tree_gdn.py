# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tree verification through Gated DeltaNet layers (Qwen3.5 / Qwen3.6 / Qwen3-Next).

A GDN layer is a recurrence: token t's output reads the state after tokens
``0..t``. In chain speculation upstream keeps one recurrent state per draft
position (``ssm_state_indices`` per token) and the next step starts from the
accepted position's. A tree breaks both: a node's state follows from its
*parent's*, not from the previous row's, and keeping a state per node costs
``(B + 1) x HV x K x V`` floats per layer and request (B = 64, 48 value
heads of 128 x 128: 65 x 48 x 128 x 128 x 4 bytes = 204 MB per layer).

`tree_gated_delta_rule` computes every node's output without a state per
node. Trees of up to `CHUNK_MAX_NODES` verify rows (the budgets batches of
several requests run) take `_tree_gdn_chunk_kernel`: the chunked (WY) form
of the delta rule, as upstream's chunked prefill computes a chain, with the
causal mask replaced by the ancestor mask. One program per (value block,
batch row, value head) reads the committed state once, solves the tree's
unit lower-triangular system for the corrected values (parents precede
children: as a product of log2(draft depth) factors for bf16 / fp16
inputs, by forward substitution for float32 ones) and forms all outputs
with small matrix products. The form and block size follow the step's
longest query when the caller gives it (the batch policy's small trees sit
in a parent table as wide as ``tree_budget``), and trees of 16 x m nodes
take the root first on its own, so that they fill whole blocks (the default
64 nodes: 64 rows, not 65). The arithmetic is the sequential recurrence's
rearranged, so outputs equal it up to rounding (the tests hold float32
outputs to 2e-5 of upstream's sequential kernel on every root-to-node path,
bf16 ones to their rounding). Larger trees replay each node's path from the
committed state (`_tree_gdn_kernel`: the sequential kernel's operations in
its order, d + 1 state updates for a node at depth d), one program per
(value block, request x node, head). The committed state is only read.

After the walk the accepted path's final state goes into the request's
state slot, so the state memory per request stays one state per layer (plus
the verify inputs kept until the walk). The runner does that for all layers
at once (`gdn_commit`, the same arithmetic); this kernel's ``targets`` /
``final_state_idx`` mode is the per-layer form of it (the tests' oracle).
"""

from __future__ import annotations

import torch

from vllm.triton_utils import tl, triton

# The chunked kernel's two forms (H200, the 27B shape, one GDN layer):
# - bf16 / fp16 inputs: tf32 matrix products, the ancestor mask by repeated
#   squaring and the triangular inverse as log2(depth) products. 24 us at 8
#   requests of 16 rows (the chain's kernel: 139 us) and 18 us for one
#   32-row tree (the path replay: 163 us), outputs within bf16 rounding of
#   the replay's, so it takes trees of up to CHUNK_MAX_NODES rows;
# - float32 inputs (the exactness runs against no speculation): exact
#   float32 products and forward substitution row by row, 87 us at 8 x 16
#   rows; its products of the small node matrices in float32 cost 5-9x
#   that, and from 32 rows on the substitution is slower than the replay,
#   so float32 trees take it up to CHUNK_MAX_NODES_FLOAT32 rows.
# Larger trees take the same system block by block, blocks of BLOCKED_ROWS
# (`_tree_gdn_blocked_kernel`), up to BLOCKED_MAX_NODES rows; beyond that
# (and for the per-layer final-state mode) each node's path is replayed.
# Measured at 64 nodes (the root apart, each block's ancestors by the chase),
# one request: 2 blocks of 32 rows 85 us per layer, one block of 64 rows
# 110 us (73 us with 8 warps, but 1.28x the blocked form at 4 requests). At
# 31 nodes one block of 32 rows takes 15.9 us per layer at one request, 27.2
# at 4, against 18.1 and 40.8 for 2 blocks of 16.
CHUNK_MAX_NODES = 32
CHUNK_MAX_NODES_FLOAT32 = 16
BLOCKED_MAX_NODES = 512
# The blocked kernel's ancestors and log decays: for the whole tree at once
# by repeated squaring first (trees of up to 128 rows), or, with this unset,
# per block by a chase up the parents (one dependent load per level). At 64
# nodes (H200, the 27B shape) the squaring takes 38.7 us per layer at one
# request against the chase's 66.0 with blocks of 16 rows (58.5 against 85.2
# with blocks of 32), 144 against 232 at 8 requests.
BLOCKED_ANCESTORS_FIRST = True
# The precision of the triangular inverse's factor products (bf16 / fp16
# inputs): "ieee" (float32 FMA) or "tf32x3" (three tf32 tensor-core products,
# float32 accuracy).
INVERSE_PRECISION = "ieee"
# The chunked kernels' launch (the fastest of 5 value-block / warp pairs at
# one request). From CHUNK_BATCHED_ROWS batch rows on, the one-block kernel
# (bf16 / fp16) takes value blocks of CHUNK_BLOCK_V_BATCHED: half the programs,
# each doing the value-independent work once for the whole head (H200, the
# 27B shape, us per layer: 4 x 31 nodes 26.7 against 39.1, 4 x 15 13.2
# against 16.2, 8 x 31 57.1 against 61.3, 8 x 15 the same; one request
# 10.0 against 8.3 at 15 nodes).
CHUNK_BLOCK_V = 64
CHUNK_BLOCK_V_BATCHED = 128
CHUNK_BATCHED_ROWS = 4
CHUNK_NUM_WARPS = 4
# Rows per block of the blocked kernel (at most the one-block kernel's
# CHUNK_MAX_NODES / CHUNK_MAX_NODES_FLOAT32). Blocks of 32 rows hold more
# than the registers do (ptxas: 1.7 KB of spill stores per thread against
# 0.3 KB for blocks of 16); at 64 nodes (H200, the 27B shape) 4 blocks of 16
# take 38.6 us per layer at one request against 58.1 for 2 blocks of 32,
# 86.6 against 157.8 at 4 requests, 146.0 against 261.2 at 8.
BLOCKED_ROWS = 16


@triton.jit
def _softplus(x, softplus_beta, softplus_threshold):
    """softplus(x) as upstream's gating: linear past the threshold."""
    return tl.where(
        softplus_beta * x <= softplus_threshold,
        (1 / softplus_beta) * tl.log(1 + tl.exp(softplus_beta * x)),
        x,
    )


@triton.jit
def _token_update(
    q,
    k,
    v,
    a,
    b,
    b_h,  # [BV, BK] the state's value block before the token
    row,  # the token's verify row
    i_h,
    i_hv,
    o_k,
    o_v,
    mask_k,
    mask_v,
    A,  # A_log[i_hv]
    bias,  # dt_bias[i_hv]
    softplus_beta,
    softplus_threshold,
    scale,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    USE_QK_L2NORM_IN_KERNEL: tl.constexpr,
):
    """One token of fused_sigmoid_gating_delta_rule_update_kernel (its
    operations in its order): the state after the token and its output."""
    b_q = tl.load(q + (row * H + i_h) * K + o_k, mask=mask_k, other=0).to(tl.float32)
    b_k = tl.load(k + (row * H + i_h) * K + o_k, mask=mask_k, other=0).to(tl.float32)
    b_v = tl.load(v + (row * HV + i_hv) * V + o_v, mask=mask_v, other=0).to(tl.float32)
    b_b = tl.load(b + row * HV + i_hv).to(tl.float32)
    x = tl.load(a + row * HV + i_hv).to(tl.float32) + bias
    b_g = -tl.exp(A) * _softplus(x, softplus_beta, softplus_threshold)
    b_beta = tl.sigmoid(b_b)
    if USE_QK_L2NORM_IN_KERNEL:
        b_q = b_q * (tl.rsqrt(tl.sum(b_q * b_q) + 1e-6))
        b_k = b_k * (tl.rsqrt(tl.sum(b_k * b_k) + 1e-6))
    b_q = b_q * scale
    b_h *= tl.exp(b_g)
    b_v -= tl.sum(b_h * b_k[None, :], 1)
    b_v *= b_beta
    b_h += b_v[:, None] * b_k[None, :]
    b_o = tl.sum(b_h * b_q[None, :], 1)
    return b_h, b_o


@triton.jit
def _tree_gdn_kernel(
    A_log,  # [HV]
    a,  # [T, HV]
    b,  # [T, HV]
    dt_bias,  # [HV]
    q,  # [T, H, K]
    k,  # [T, H, K]
    v,  # [T, HV, V]
    o,  # [T, HV, V] (STORE_OUTPUT)
    state,  # [num_slots, HV, V, K] committed states (read) / final (write)
    state_stride,  # elements between two slots
    state_idx_ptr,  # [R] slot of each batch row's committed state
    final_state_idx_ptr,  # [R] slot to write the final state to (STORE_FINAL)
    query_start_ptr,  # [R + 1] first verify row of each batch row
    parent_ptr,  # [S, B] parent verify index of node i + 1 (0 = root)
    parent_stride,
    idx_mapping_ptr,  # [R] batch row -> request state (tree row)
    target_ptr,  # [R, NUM_TARGETS] node whose path to replay, -1 = none
    # (HAS_TARGETS); without it target t of a row is node t
    softplus_beta,
    softplus_threshold,
    scale,
    NUM_TARGETS: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    MAX_PATH: tl.constexpr,  # draft_depth + 1 (root included)
    PATH_BLOCK: tl.constexpr,  # power of 2 >= MAX_PATH
    USE_QK_L2NORM_IN_KERNEL: tl.constexpr,
    STORE_OUTPUT: tl.constexpr,
    STORE_FINAL: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_rt = tl.program_id(1)
    i_hv = tl.program_id(2)
    r = i_rt // NUM_TARGETS
    if HAS_TARGETS:
        node = tl.load(target_ptr + i_rt).to(tl.int64)
    else:
        node = (i_rt % NUM_TARGETS).to(tl.int64)
    row0 = tl.load(query_start_ptr + r).to(tl.int64)
    num_rows = tl.load(query_start_ptr + r + 1).to(tl.int64) - row0
    slot = tl.load(state_idx_ptr + r).to(tl.int64)
    if (node < 0) | (node >= num_rows) | (slot <= 0):
        return
    req = tl.load(idx_mapping_ptr + r).to(tl.int64)
    i_h = i_hv // (HV // H)

    # The root -> node path as verify indices, root first: walk up the
    # parents, then right-align so that entry MAX_PATH - 1 is the node.
    offs = tl.arange(0, PATH_BLOCK)
    path = tl.full([PATH_BLOCK], -1, tl.int64)
    cur = node
    for s in range(MAX_PATH):
        path = tl.where(offs == MAX_PATH - 1 - s, cur, path)
        parent = tl.load(
            parent_ptr + req * parent_stride + cur - 1, mask=cur > 0, other=0
        ).to(tl.int64)
        cur = tl.where(cur > 0, parent, -1)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < K
    mask_v = o_v < V
    mask_h = mask_v[:, None] & mask_k[None, :]
    p_state = state + i_hv * V * K + o_v[:, None] * K + o_k[None, :]
    b_h = tl.load(p_state + slot * state_stride, mask=mask_h, other=0).to(tl.float32)
    b_o = tl.zeros([BV], dtype=tl.float32)
    A = tl.load(A_log + i_hv).to(tl.float32)
    bias = tl.load(dt_bias + i_hv).to(tl.float32)

    # As fused_sigmoid_gating_delta_rule_update_kernel, token by token.
    for j in range(MAX_PATH):
        t = tl.sum(tl.where(offs == j, path, 0))
        if t >= 0:
            b_h, b_o = _token_update(
                *(q, k, v, a, b, b_h, row0 + t, i_h, i_hv, o_k, o_v, mask_k, mask_v),
                *(A, bias, softplus_beta, softplus_threshold, scale),
                H,
                HV,
                K,
                V,
                USE_QK_L2NORM_IN_KERNEL,
            )

    if STORE_OUTPUT:
        p_o = o + ((row0 + node) * HV + i_hv) * V + o_v
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=mask_v)
    if STORE_FINAL:
        final_slot = tl.load(final_state_idx_ptr + r).to(tl.int64)
        if final_slot > 0:
            p_ht = p_state + final_slot * state_stride
            tl.store(p_ht, b_h.to(p_ht.dtype.element_ty), mask=mask_h)


@triton.jit
def _root_step(
    A_log,
    a,
    b,
    dt_bias,
    q,
    k,
    v,
    o,
    b_h,  # [BV, BK] the committed state's value block
    row,  # the root's verify row
    i_h,
    i_hv,
    o_k,
    o_v,
    mask_k,
    mask_v,
    softplus_beta,
    softplus_threshold,
    scale,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    USE_QK_L2NORM_IN_KERNEL: tl.constexpr,
):
    """The root's token as the sequential kernel takes it (its operations in
    its order): stores the root's output and returns the state after it,
    from which the root's subtrees start."""
    b_h, b_o = _token_update(
        *(q, k, v, a, b, b_h, row, i_h, i_hv, o_k, o_v, mask_k, mask_v),
        tl.load(A_log + i_hv).to(tl.float32),
        tl.load(dt_bias + i_hv).to(tl.float32),
        *(softplus_beta, softplus_threshold, scale),
        H,
        HV,
        K,
        V,
        USE_QK_L2NORM_IN_KERNEL,
    )
    p_o = o + (row * HV + i_hv) * V + o_v
    tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=mask_v)
    return b_h


@triton.jit
def _unit_lower_solve(
    lower,  # [BN, BN] strictly lower triangular in node order
    rhs,  # [BN, BV]
    n,  # arange(BN)
    num_rows,  # rows in use (the others are zero)
    PRODUCTS: tl.constexpr,
    INVERSE_FACTORS: tl.constexpr,  # f: lower^(2^(f + 1)) = 0
    DOT_PRECISION: tl.constexpr,
    INVERSE_PRECISION: tl.constexpr,  # the factors' products ("ieee", "tf32x3")
):
    """``(I + lower)^-1 rhs``: as a product of INVERSE_FACTORS + 1 factors, or by
    forward substitution row by row (float32: exact order of operations)."""
    if PRODUCTS:
        # (I - L)(I + L^2)...(I + L^(2^f)) = I - L^(2^(f + 1)): the inverse
        # of I + L once that power is 0 (the caller's f; L^BN = 0 always).
        eye_f = tl.where(n[:, None] == n[None, :], 1.0, 0.0)
        inv = eye_f - lower
        power = lower
        for _ in range(INVERSE_FACTORS):
            power = tl.dot(power, power, input_precision=INVERSE_PRECISION)
            inv = tl.dot(inv, eye_f + power, input_precision=INVERSE_PRECISION)
        u = tl.dot(inv, rhs, input_precision=DOT_PRECISION)
    else:
        # Forward substitution in node order.
        u = rhs
        for i in range(1, num_rows):
            l_row = tl.sum(tl.where(n[:, None] == i, lower, 0.0), 0)  # [BN]
            u_i = tl.sum(tl.where(n[:, None] == i, u, 0.0), 0) - tl.sum(
                l_row[:, None] * u, 0
            )
            u = tl.where(n[:, None] == i, u_i[None, :], u)
    return u


@triton.jit
def _tree_gdn_chunk_kernel(
    A_log,  # [HV]
    a,  # [T, HV]
    b,  # [T, HV]
    dt_bias,  # [HV]
    q,  # [T, H, K]
    k,  # [T, H, K]
    v,  # [T, HV, V]
    o,  # [T, HV, V]
    state,  # [num_slots, HV, V, K] committed states (read only)
    state_stride,  # elements between two slots
    state_idx_ptr,  # [R] slot of each batch row's committed state
    query_start_ptr,  # [R + 1] first verify row of each batch row
    parent_ptr,  # [S, B] parent verify index of node i + 1 (0 = root)
    parent_stride,
    idx_mapping_ptr,  # [R] batch row -> request state (tree row)
    softplus_beta,
    softplus_threshold,
    scale,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BN: tl.constexpr,  # power of 2 >= the system's rows, at least 16 (tl.dot)
    MAX_PATH: tl.constexpr,  # draft_depth + 1 (root included)
    ROOT_APART: tl.constexpr,  # 1: the root first on its own, row n = node n + 1
    PRODUCTS: tl.constexpr,  # squaring / inverse products (else row loops)
    PATH_SQUARINGS: tl.constexpr,  # 2^PATH_SQUARINGS >= longest path's edges
    INVERSE_FACTORS: tl.constexpr,  # f: L^(2^(f + 1)) = 0
    USE_QK_L2NORM_IN_KERNEL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" (float32 models) or "tf32"
    INVERSE_PRECISION: tl.constexpr,  # the inverse's factors (bf16 / fp16)
):
    """All nodes of one (value block, batch row, value head) at once, in the
    chunked (WY) form of the delta rule with the causal mask replaced by the
    ancestor mask: one read of the committed state, a triangular solve over
    the tree's nodes and two small matrix products, instead of one state
    update per node and ancestor."""
    i_v = tl.program_id(0)
    r = tl.program_id(1)
    i_hv = tl.program_id(2)
    row0 = tl.load(query_start_ptr + r).to(tl.int64)
    num_rows = tl.load(query_start_ptr + r + 1).to(tl.int64) - row0
    slot = tl.load(state_idx_ptr + r).to(tl.int64)
    if (num_rows <= 0) | (slot <= 0):
        return
    req = tl.load(idx_mapping_ptr + r).to(tl.int64)
    i_h = i_hv // (HV // H)

    # Row n of the system is node n + ROOT_APART: with the root taken first
    # on its own (below), a tree of 2^m nodes fills 2^m rows, not 2^(m + 1).
    n = tl.arange(0, BN)
    valid = n < num_rows - ROOT_APART
    p_parent = parent_ptr + req * parent_stride + ROOT_APART - 1  # [row + this]
    # anc[i, j]: row j's node is on row i's node's path (i itself included;
    # the root apart: below the root). Parents precede their children (every
    # prefix of the rank order is a tree), so anc is lower triangular.
    eye = n[:, None] == n[None, :]
    if PRODUCTS:
        # From one load of the parents' rows (-1: none in the system): the
        # reflexive parent relation raised to the longest path by repeated
        # squaring (paths of 2^s edges after s squarings). Its entries are
        # 0 / 1 and the sums at most BN, exact in tf32.
        has_parent = valid & (n + ROOT_APART > 0)
        parent = tl.load(p_parent + n, mask=has_parent, other=0) - ROOT_APART
        parent = tl.where(has_parent, parent, -1)
        anc_f = tl.where(eye | (parent[:, None] == n[None, :]), 1.0, 0.0)
        for _ in range(PATH_SQUARINGS):
            anc_f = tl.minimum(tl.dot(anc_f, anc_f, input_precision="tf32"), 1.0)
        anc = anc_f > 0.5
    else:
        # One ancestor per iteration.
        anc = eye
        cur = n.to(tl.int64)
        for _ in range(MAX_PATH - 1 - ROOT_APART):
            has_parent = valid & (cur + ROOT_APART > 0)
            up = tl.load(p_parent + cur, mask=has_parent)
            cur = tl.where(has_parent, (up - ROOT_APART).to(tl.int64), -1)
            anc = anc | (n[None, :] == cur[:, None])
    anc = anc & valid[:, None] & valid[None, :]

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < K
    mask_v = o_v < V
    rows = row0 + ROOT_APART + n
    mask_nk = valid[:, None] & mask_k[None, :]
    b_q = tl.load(
        q + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=mask_nk, other=0
    ).to(tl.float32)
    b_k = tl.load(
        k + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=mask_nk, other=0
    ).to(tl.float32)
    mask_nv = valid[:, None] & mask_v[None, :]
    b_v = tl.load(
        v + (rows[:, None] * HV + i_hv) * V + o_v[None, :], mask=mask_nv, other=0
    ).to(tl.float32)
    b_b = tl.load(b + rows * HV + i_hv, mask=valid, other=0).to(tl.float32)
    x = tl.load(a + rows * HV + i_hv, mask=valid, other=0).to(tl.float32)
    x += tl.load(dt_bias + i_hv).to(tl.float32)
    softplus_x = _softplus(x, softplus_beta, softplus_threshold)
    b_g = -tl.exp(tl.load(A_log + i_hv).to(tl.float32)) * softplus_x
    b_beta = tl.sigmoid(b_b)
    if USE_QK_L2NORM_IN_KERNEL:
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, 1) + 1e-6)[:, None]
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 1) + 1e-6)[:, None]
    b_q = b_q * scale

    # Log decay from the root through each node (inclusive), and the decay
    # from node j to node i on i's path.
    cum_g = tl.sum(tl.where(anc, b_g[None, :], 0.0), 1)
    decay = tl.exp(tl.where(anc, cum_g[:, None] - cum_g[None, :], float("-inf")))

    p_h = state + slot * state_stride + i_hv * V * K
    b_h = tl.load(
        p_h + o_v[:, None] * K + o_k[None, :],
        mask=mask_v[:, None] & mask_k[None, :],
        other=0,
    ).to(tl.float32)  # [BV, BK]
    if ROOT_APART:
        # S0 below: the state after the root.
        b_h = _root_step(
            *(A_log, a, b, dt_bias, q, k, v, o, b_h, row0, i_h, i_hv),
            *(o_k, o_v, mask_k, mask_v, softplus_beta, softplus_threshold, scale),
            H,
            HV,
            K,
            V,
            USE_QK_L2NORM_IN_KERNEL,
        )
    h_t = tl.trans(b_h)  # [BK, BV]
    k_h = tl.dot(b_k, h_t, input_precision=DOT_PRECISION)  # row i: S0 k_i
    q_h = tl.dot(b_q, h_t, input_precision=DOT_PRECISION)  # row i: S0 q_i
    kk = tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PRECISION)
    qk = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION)

    # The delta rule's corrected values u_i = beta_i (v_i - h_{i-1} k_i),
    # h_{i-1} the decayed state after i's parent, satisfy
    # (I + L) u = beta (v - exp(cum_g) S0 k) with
    # L[i, j] = beta_i exp(cum_g_i - cum_g_j) (k_i . k_j) over i's strict
    # ancestors j.
    strict = anc & (n[:, None] != n[None, :])
    lower = tl.where(strict, b_beta[:, None] * decay * kk, 0.0)
    rhs = b_beta[:, None] * (b_v - tl.exp(cum_g)[:, None] * k_h)
    u = _unit_lower_solve(
        *(lower, rhs, n, num_rows - ROOT_APART, PRODUCTS, INVERSE_FACTORS),
        DOT_PRECISION,
        INVERSE_PRECISION,
    )

    # o_i = h_i q_i = exp(cum_g_i) S0 q_i + sum over i's path (i included) of
    # exp(cum_g_i - cum_g_j) (q_i . k_j) u_j.
    attn = tl.where(anc, qk * decay, 0.0)
    b_o = tl.exp(cum_g)[:, None] * q_h + tl.dot(attn, u, input_precision=DOT_PRECISION)
    p_o = o + (rows[:, None] * HV + i_hv) * V + o_v[None, :]
    tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=mask_nv)


@triton.jit
def _block_ancestors(path, nodes, LEVELS: tl.constexpr, PATH_BLOCK: tl.constexpr):
    """anc[i, j]: node ``nodes[j]`` is on the path of row ``i`` of ``path``
    ([rows, PATH_BLOCK]: the node, its parent, ..., -1 past the last of
    ``LEVELS``; so ``nodes`` marks columns of no node below -1)."""
    s_offs = tl.arange(0, PATH_BLOCK)
    node = tl.sum(tl.where(s_offs[None, :] == 0, path, 0), 1)
    anc = nodes[None, :] == node[:, None]
    for s in range(1, LEVELS):
        up = tl.sum(tl.where(s_offs[None, :] == s, path, 0), 1)
        anc = anc | (nodes[None, :] == up[:, None])
    return anc


@triton.jit
def _tree_gdn_blocked_kernel(
    A_log,  # [HV]
    a,  # [T, HV]
    b,  # [T, HV]
    dt_bias,  # [HV]
    q,  # [T, H, K]
    k,  # [T, H, K]
    v,  # [T, HV, V]
    o,  # [T, HV, V]
    state,  # [num_slots, HV, V, K] committed states (read only)
    state_stride,  # elements between two slots
    state_idx_ptr,  # [R] slot of each batch row's committed state
    query_start_ptr,  # [R + 1] first verify row of each batch row
    parent_ptr,  # [S, B] parent verify index of node i + 1 (0 = root)
    parent_stride,
    idx_mapping_ptr,  # [R] batch row -> request state (tree row)
    softplus_beta,
    softplus_threshold,
    scale,
    u_ws,  # [T, HV, V] float32 scratch: the corrected values of done blocks
    g_ws,  # [T, HV] float32 scratch: their log decays from the root
    anc_ws,  # [R, BN_ALL, BN_ALL] int8 scratch (ANCESTORS_FIRST): anc
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BC: tl.constexpr,  # rows per block, a power of 2 >= 16 (tl.dot)
    MAX_PATH: tl.constexpr,  # draft_depth + 1 (root included)
    PATH_BLOCK: tl.constexpr,  # power of 2 >= MAX_PATH
    ROOT_APART: tl.constexpr,  # 1: the root first on its own, row n = node n + 1
    ANCESTORS_FIRST: tl.constexpr,  # the whole tree's anc / log decays first
    BN_ALL: tl.constexpr,  # (ANCESTORS_FIRST) power of 2 >= the rows, >= BC
    PATH_SQUARINGS: tl.constexpr,  # (ANCESTORS_FIRST) as the one-block kernel's
    PRODUCTS: tl.constexpr,  # the diagonal blocks' inverse as products
    INVERSE_FACTORS: tl.constexpr,  # f: L_pp^(2^(f + 1)) = 0
    USE_QK_L2NORM_IN_KERNEL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" (float32 models) or "tf32"
    INVERSE_PRECISION: tl.constexpr,  # the inverse's factors (bf16 / fp16)
):
    """`_tree_gdn_chunk_kernel`'s system for trees of more rows than one
    block holds, solved block by block in node order. Parents precede their
    children, so the ancestors of block p's nodes lie in blocks 0..p and
    (I + L) u = rhs splits into (I + L_pp) u_p = rhs_p - sum_{q < p} L_pq u_q:
    each block's corrected values are found after the earlier blocks', from
    [BC, BC] matrices only (the whole system's would not fit in registers
    at 65 rows and more). The done blocks' values and log decays go through
    a scratch buffer that the same program reads back."""
    i_v = tl.program_id(0)
    r = tl.program_id(1)
    i_hv = tl.program_id(2)
    row0 = tl.load(query_start_ptr + r).to(tl.int64)
    num_rows = tl.load(query_start_ptr + r + 1).to(tl.int64) - row0
    slot = tl.load(state_idx_ptr + r).to(tl.int64)
    if (num_rows <= 0) | (slot <= 0):
        return
    req = tl.load(idx_mapping_ptr + r).to(tl.int64)
    i_h = i_hv // (HV // H)

    c = tl.arange(0, BC)
    s_offs = tl.arange(0, PATH_BLOCK)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < K
    mask_v = o_v < V
    p_h = state + slot * state_stride + i_hv * V * K
    b_h = tl.load(
        p_h + o_v[:, None] * K + o_k[None, :],
        mask=mask_v[:, None] & mask_k[None, :],
        other=0,
    ).to(tl.float32)  # [BV, BK]
    if ROOT_APART:
        # S0 below: the state after the root.
        b_h = _root_step(
            *(A_log, a, b, dt_bias, q, k, v, o, b_h, row0, i_h, i_hv),
            *(o_k, o_v, mask_k, mask_v, softplus_beta, softplus_threshold, scale),
            H,
            HV,
            K,
            V,
            USE_QK_L2NORM_IN_KERNEL,
        )
    h_t = tl.trans(b_h)  # [BK, BV]
    neg_a = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    bias = tl.load(dt_bias + i_hv).to(tl.float32)

    # Row n of the system is node n + ROOT_APART: with the root apart, a
    # tree of 2^m nodes fills whole blocks.
    num_nodes = num_rows - ROOT_APART
    p_parent = parent_ptr + req * parent_stride + ROOT_APART - 1  # [row + this]
    if ANCESTORS_FIRST:
        # The whole tree's ancestor relation at once, as the one-block kernel
        # builds it (one load of the parents, repeated squaring), and every
        # row's log decay from it, into scratch that the blocks read back:
        # no chase up the parents per block. Programs of the same batch row
        # write the same values.
        m = tl.arange(0, BN_ALL)
        valid_m = m < num_nodes
        has_parent = valid_m & (m + ROOT_APART > 0)
        parent = tl.load(p_parent + m, mask=has_parent, other=0) - ROOT_APART
        parent = tl.where(has_parent, parent, -1)
        anc_f = tl.where(
            (m[:, None] == m[None, :]) | (parent[:, None] == m[None, :]), 1.0, 0.0
        )
        for _ in range(PATH_SQUARINGS):
            anc_f = tl.minimum(tl.dot(anc_f, anc_f, input_precision="tf32"), 1.0)
        x = tl.load(a + (row0 + ROOT_APART + m) * HV + i_hv, mask=valid_m, other=0)
        x = x.to(tl.float32) + bias
        softplus_x = _softplus(x, softplus_beta, softplus_threshold)
        g_m = tl.where(valid_m, neg_a * softplus_x, 0.0)
        cum_m = tl.sum(tl.where(anc_f > 0.5, g_m[None, :], 0.0), 1)
        tl.store(g_ws + (row0 + ROOT_APART + m) * HV + i_hv, cum_m, mask=valid_m)
        p_anc = anc_ws + r * BN_ALL * BN_ALL
        tl.store(p_anc + m[:, None] * BN_ALL + m[None, :], (anc_f > 0.5).to(tl.int8))
        tl.debug_barrier()
    for p in range(0, tl.cdiv(num_nodes, BC)):
        nodes = p * BC + c
        valid = nodes < num_nodes
        rows = row0 + ROOT_APART + nodes
        if ANCESTORS_FIRST:
            cum_g = tl.load(g_ws + rows * HV + i_hv, mask=valid, other=0.0)
        else:
            # Each row's path as rows (the root's too unless apart), the row
            # first: one parent load per level for the whole block.
            path = tl.full([BC, PATH_BLOCK], -1, tl.int64)
            cur = tl.where(valid, nodes, -1).to(tl.int64)
            for s in range(MAX_PATH - ROOT_APART):
                path = tl.where(s_offs[None, :] == s, cur[:, None], path)
                has_parent = cur + ROOT_APART > 0
                up = tl.load(p_parent + cur, mask=has_parent)
                cur = tl.where(has_parent, (up - ROOT_APART).to(tl.int64), -1)
            # Log decay from the system's initial state through each node
            # (inclusive).
            on_path = path >= 0
            x = tl.load(
                a + (row0 + ROOT_APART + path) * HV + i_hv, mask=on_path, other=0
            )
            x = x.to(tl.float32) + bias
            softplus_x = _softplus(x, softplus_beta, softplus_threshold)
            cum_g = tl.sum(tl.where(on_path, neg_a * softplus_x, 0.0), 1)  # [BC]

        mask_ck = valid[:, None] & mask_k[None, :]
        b_q = tl.load(
            q + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=mask_ck, other=0
        ).to(tl.float32)
        b_k = tl.load(
            k + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=mask_ck, other=0
        ).to(tl.float32)
        mask_cv = valid[:, None] & mask_v[None, :]
        b_v = tl.load(
            v + (rows[:, None] * HV + i_hv) * V + o_v[None, :], mask=mask_cv, other=0
        ).to(tl.float32)
        b_beta = tl.sigmoid(
            tl.load(b + rows * HV + i_hv, mask=valid, other=0).to(tl.float32)
        )
        if USE_QK_L2NORM_IN_KERNEL:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, 1) + 1e-6)[:, None]
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 1) + 1e-6)[:, None]
        b_q = b_q * scale

        k_h = tl.dot(b_k, h_t, input_precision=DOT_PRECISION)
        q_h = tl.dot(b_q, h_t, input_precision=DOT_PRECISION)
        rhs = b_beta[:, None] * (b_v - tl.exp(cum_g)[:, None] * k_h)
        b_o = tl.exp(cum_g)[:, None] * q_h
        # The earlier blocks' part: their corrected values are known.
        for pq in range(0, p):
            nodes_q = pq * BC + c
            rows_q = row0 + ROOT_APART + nodes_q
            k_q = tl.load(
                k + (rows_q[:, None] * H + i_h) * K + o_k[None, :],
                mask=mask_k[None, :],
                other=0,
            ).to(tl.float32)
            if USE_QK_L2NORM_IN_KERNEL:
                k_q = k_q * tl.rsqrt(tl.sum(k_q * k_q, 1) + 1e-6)[:, None]
            cum_g_q = tl.load(g_ws + rows_q * HV + i_hv)
            u_q = tl.load(
                u_ws + (rows_q[:, None] * HV + i_hv) * V + o_v[None, :],
                mask=mask_v[None, :],
                other=0,
            )
            if ANCESTORS_FIRST:
                anc_q = tl.load(
                    p_anc + nodes[:, None] * BN_ALL + nodes_q[None, :],
                    mask=valid[:, None],
                    other=0,
                )
                anc_q = anc_q != 0
            else:
                anc_q = _block_ancestors(
                    path, nodes_q, MAX_PATH - ROOT_APART, PATH_BLOCK
                )
            decay_q = tl.exp(
                tl.where(anc_q, cum_g[:, None] - cum_g_q[None, :], float("-inf"))
            )
            kk_q = tl.dot(b_k, tl.trans(k_q), input_precision=DOT_PRECISION)
            qk_q = tl.dot(b_q, tl.trans(k_q), input_precision=DOT_PRECISION)
            lower_q = b_beta[:, None] * decay_q * kk_q
            rhs -= tl.dot(lower_q, u_q, input_precision=DOT_PRECISION)
            b_o += tl.dot(qk_q * decay_q, u_q, input_precision=DOT_PRECISION)
        # The block's own nodes, as `_tree_gdn_chunk_kernel` solves a tree.
        if ANCESTORS_FIRST:
            anc = tl.load(
                p_anc + nodes[:, None] * BN_ALL + nodes[None, :],
                mask=valid[:, None] & valid[None, :],
                other=0,
            )
            anc = anc != 0
        else:
            anc = _block_ancestors(
                path, tl.where(valid, nodes, -2), MAX_PATH - ROOT_APART, PATH_BLOCK
            )
        decay = tl.exp(tl.where(anc, cum_g[:, None] - cum_g[None, :], float("-inf")))
        kk = tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PRECISION)
        qk = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION)
        strict = anc & (c[:, None] != c[None, :])
        lower = tl.where(strict, b_beta[:, None] * decay * kk, 0.0)
        u = _unit_lower_solve(
            lower,
            rhs,
            c,
            tl.minimum(num_nodes - p * BC, BC),
            PRODUCTS,
            INVERSE_FACTORS,
            DOT_PRECISION,
            INVERSE_PRECISION,
        )
        tl.store(u_ws + (rows[:, None] * HV + i_hv) * V + o_v[None, :], u, mask=mask_cv)
        if not ANCESTORS_FIRST:  # (otherwise the whole tree's are there)
            tl.store(g_ws + rows * HV + i_hv, cum_g, mask=valid)
        # The next blocks read these back, through other threads' loads.
        tl.debug_barrier()
        b_o += tl.dot(tl.where(anc, qk * decay, 0.0), u, input_precision=DOT_PRECISION)
        p_o = o + (rows[:, None] * HV + i_hv) * V + o_v[None, :]
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=mask_cv)


def tree_gated_delta_rule(
    A_log: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor,
    state_idx: torch.Tensor,
    query_start_loc: torch.Tensor,
    parent_idx: torch.Tensor,
    idx_mapping: torch.Tensor,
    draft_depth: int,
    *,
    targets: torch.Tensor | None = None,
    final_state_idx: torch.Tensor | None = None,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    max_query_len: int | None = None,
) -> torch.Tensor | None:
    """Gated delta rule over every request's draft tree.

    Rows ``query_start_loc[r] .. query_start_loc[r + 1] - 1`` of the flat
    inputs (``q, k [T, H, K]``, ``v [T, HV, V]``, ``a, b [T, HV]``) are batch
    row ``r``'s verify tokens in verify layout (row 0 the root, node ``i``'s
    parent ``parent_idx[idx_mapping[r], i - 1]``). ``state [slots, HV, V, K]``
    holds the committed states, ``state_idx [R]`` their slots (<= 0: skip
    the row).

    Without ``targets``: returns ``o [T, HV, V]``, each row's output after
    its root -> node path. With ``targets [R, M]`` (verify indices, -1 for
    none) and ``final_state_idx [R]``: writes the state after each target's
    path into ``state[final_state_idx[r]]`` (M = 1: the walk's last accepted
    node) and returns None. Committed states are only read, so the final
    write may target the committed slot itself once the outputs are done.

    ``max_query_len``: at most this many verify rows in any batch row of
    this call (a host bound, e.g. the step's attention metadata's; under a
    CUDA graph it must hold for every replay). The kernel's form and block
    follow it (default: the parent table's width), so the batch policy's
    smaller trees in a table as wide as ``tree_budget`` take the form of
    their own size.
    """
    num_rows = query_start_loc.shape[0] - 1
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    assert HV % H == 0
    assert state.shape[1:] == (HV, V, K) and state.stride(1) == V * K
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), 32)
    if scale is None:
        scale = K**-0.5
    store_final = targets is not None
    if targets is None:
        # Every verify row of a batch row is a target: node t for program t
        # (ragged: nodes past the row's count are skipped in the kernel).
        num_targets = parent_idx.shape[1] + 1
        if max_query_len is not None:
            num_targets = max(min(num_targets, max_query_len), 1)
        # Zeros: rows no program writes (CUDA-graph padding, skipped rows)
        # must not feed garbage into the layer's output projection.
        o = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    else:
        assert final_state_idx is not None
        targets = targets.contiguous()
        num_targets = targets.shape[1]
        o = v  # unused (STORE_OUTPUT off)
    if num_rows == 0:
        return None if store_final else o
    max_path = draft_depth + 1
    # Arguments both kernels take, in their order.
    inputs = (A_log, a.contiguous(), b.contiguous(), dt_bias, q.contiguous())
    inputs += (k.contiguous(), v.contiguous(), o, state, state.stride(0), state_idx)
    tree = (query_start_loc, parent_idx, parent_idx.stride(0), idx_mapping)
    gating = (softplus_beta, softplus_threshold, scale)
    shape = dict(H=H, HV=HV, K=K, V=V, BK=BK, BV=BV)
    max_nodes = parent_idx.shape[1]
    if max_query_len is not None:
        max_nodes = max(min(max_nodes, max_query_len - 1), 0)
    # The chunked kernels take the root on its own first when a tree of
    # 16 x m nodes would otherwise need one row past a power of 2 or a
    # block (the default 64 nodes: 64 rows, not 65 in 128 or in 3 x 32).
    root_apart = int(max_nodes >= 16 and max_nodes % 16 == 0)
    # The system's rows, a power of 2 of at least 16 (tl.dot).
    num_nodes = triton.next_power_of_2(max(max_nodes + 1 - root_apart, 16))
    exact = v.dtype == torch.float32
    chunk_max_nodes = CHUNK_MAX_NODES_FLOAT32 if exact else CHUNK_MAX_NODES
    # Chains of strict ancestors in the system: at most draft_depth edges
    # (draft_depth - 1 with the root apart). So the strict-ancestor matrix
    # L has L^(edges + 1) = 0 and (I + L)^-1 = (I - L)(I + L^2)...
    # (I + L^(2^f)) once 2^(f + 1) > edges, whatever the block's size.
    edges = draft_depth - root_apart
    depth_factors = max(edges.bit_length() - 1, 0)
    chunk_bv = min(triton.next_power_of_2(V), CHUNK_BLOCK_V)
    if not store_final and chunk_max_nodes < num_nodes <= BLOCKED_MAX_NODES:
        block_rows = min(BLOCKED_ROWS, chunk_max_nodes)
        # Scratch for the done blocks (each program reads back only what it
        # wrote itself): no zeroing needed.
        u_ws = torch.empty(v.shape, dtype=torch.float32, device=v.device)
        g_ws = torch.empty(v.shape[:2], dtype=torch.float32, device=v.device)
        ancestors_first = BLOCKED_ANCESTORS_FIRST and num_nodes <= 128
        bn_all = num_nodes if ancestors_first else 1
        anc_ws = torch.empty(
            num_rows if ancestors_first else 1,
            bn_all,
            bn_all,
            dtype=torch.int8,
            device=v.device,
        )
        _tree_gdn_blocked_kernel[(triton.cdiv(V, chunk_bv), num_rows, HV)](
            *inputs,
            *tree,
            *gating,
            u_ws,
            g_ws,
            anc_ws,
            **dict(shape, BV=chunk_bv),
            BC=block_rows,
            MAX_PATH=max_path,
            PATH_BLOCK=triton.next_power_of_2(max_path),
            ROOT_APART=root_apart,
            ANCESTORS_FIRST=ancestors_first,
            BN_ALL=bn_all,
            PATH_SQUARINGS=max(edges - 1, 0).bit_length(),
            PRODUCTS=not exact,
            INVERSE_FACTORS=min(block_rows.bit_length() - 2, depth_factors),
            USE_QK_L2NORM_IN_KERNEL=use_qk_l2norm_in_kernel,
            DOT_PRECISION="ieee" if exact else "tf32",
            INVERSE_PRECISION=INVERSE_PRECISION,
            num_warps=CHUNK_NUM_WARPS,
        )
        return o
    if not store_final and num_nodes <= chunk_max_nodes:
        if not exact and num_rows >= CHUNK_BATCHED_ROWS:
            chunk_bv = min(triton.next_power_of_2(V), CHUNK_BLOCK_V_BATCHED)
        _tree_gdn_chunk_kernel[(triton.cdiv(V, chunk_bv), num_rows, HV)](
            *inputs,
            *tree,
            *gating,
            **dict(shape, BV=chunk_bv),
            BN=num_nodes,
            MAX_PATH=max_path,
            ROOT_APART=root_apart,
            PRODUCTS=not exact,
            PATH_SQUARINGS=max(edges - 1, 0).bit_length(),
            INVERSE_FACTORS=min(num_nodes.bit_length() - 2, depth_factors),
            USE_QK_L2NORM_IN_KERNEL=use_qk_l2norm_in_kernel,
            DOT_PRECISION="ieee" if exact else "tf32",
            INVERSE_PRECISION=INVERSE_PRECISION,
            num_warps=CHUNK_NUM_WARPS,
        )
        return o
    grid = (triton.cdiv(V, BV), num_rows * num_targets, HV)
    _tree_gdn_kernel[grid](
        *inputs,
        final_state_idx if final_state_idx is not None else state_idx,
        *tree,
        targets if targets is not None else idx_mapping,  # unused without
        *gating,
        NUM_TARGETS=num_targets,
        HAS_TARGETS=store_final,
        **shape,
        MAX_PATH=max_path,
        PATH_BLOCK=triton.next_power_of_2(max_path),
        USE_QK_L2NORM_IN_KERNEL=use_qk_l2norm_in_kernel,
        STORE_OUTPUT=not store_final,
        STORE_FINAL=store_final,
        num_warps=4,
    )
    return None if store_final else o
