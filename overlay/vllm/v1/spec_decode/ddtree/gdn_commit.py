# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The post-walk commit of every Gated DeltaNet layer in two launches.

After the walk each request keeps its accepted path (root first,
``num_accepted`` nodes, at most ``draft_depth + 1``). Every GDN layer's
committed state must then advance along that path: the recurrent state by
the path's gated delta rule steps, the conv window by the path's inputs.
Only the path's rows matter, so only those are recomputed, for all layers,
requests and heads at once:

1. `_commit_conv_kernel`, one program per (feature block, spec row, layer):
   the post-conv values of the path's rows from the saved pre-conv rows
   (`tree_conv._tree_conv1d_kernel`'s arithmetic on a path: row k's window
   is path rows ``k - W + 1 .. k``, then the committed window), stored in
   place of the pre-conv rows at the front of the spec row's block
   (``x_buf[layer, row0 + k]``, no longer needed after the walk), and the
   conv window after the path written into the committed slot.
2. `_commit_gdn_kernel`, one program per (value block, spec row, layer x
   value head): the gated delta rule over the path's post-conv rows from the
   committed recurrent state (`tree_gdn._tree_gdn_kernel`'s arithmetic),
   the final state written into the committed slot.

Everything that differs per layer is a table built once at bind time
(`GDNCommitTables`): the data pointers of each layer's conv state, recurrent
state, conv weight and bias, ``A_log`` and ``dt_bias`` (the layers' own
tensors, no copies; the strides are shared and checked), and each layer's
KV-cache group (its state slots come from that group's metadata). The
step's inputs are the walk's outputs and the verify-row buffers, read in
the kernels: fixed shapes, no host synchronisation, no allocation.

Exactness: both kernels apply the same float32 operations in the same order
as the per-layer path (`tree_causal_conv1d`, `rearrange_mixed_qkv`,
`tree_gated_delta_rule` with the accepted leaf as target,
`tree_conv_state_update`), so they leave the same states up to float
rounding; the tests compare them with that path
(tests/in_vllm/gdn_commit_reference.py) and with upstream's decode kernels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from vllm.triton_utils import tl, triton

_BLOCK_N = 128

_FLOAT_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}


@triton.jit
def _path_or_committed(
    x,
    stride_x_tok,
    row0,
    q0,
    p_path,
    p_state,
    stride_s_tok,
    idx_feats,
    mask_d,
    pos,
    state_col,
    valid,
    CONV_TYPE: tl.constexpr,
):
    """Conv inputs at path positions ``pos`` ([PATH_BLOCK] or [STATE_BLOCK]):
    the path's pre-conv row where ``pos >= 0``, else the committed window's
    column ``state_col``; 0 where not ``valid``. In the conv state's dtype."""
    from_x = valid & (pos >= 0)
    from_s = valid & (pos < 0)
    t = tl.load(p_path + tl.maximum(pos, 0), mask=from_x, other=0).to(tl.int64) - q0
    from_path = tl.load(
        x + ((row0 + t) * stride_x_tok)[:, None] + idx_feats[None, :],
        mask=from_x[:, None] & mask_d[None, :],
        other=0.0,
    ).to(CONV_TYPE)
    from_state = tl.load(
        p_state[None, :] + (tl.maximum(state_col, 0) * stride_s_tok)[:, None],
        mask=from_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    return tl.where(from_x[:, None], from_path, from_state)


# The slot table's strides follow the step (a [G, n] view of one buffer: its
# group stride is n, 1 at one request, a multiple of 16 at 16, 32, ...):
# left unspecialised, so that one compiled variant serves every batch size
# and a server does not stall on a variant first needed while serving (an
# H200 run of the 27B shape compiled both kernels twice after warm-up).
@triton.jit(do_not_specialize=["slot_group_stride", "slot_stride"])
def _commit_conv_kernel(
    x_buf,  # [L, rows, dim] pre-conv verify rows (in: pre-conv, out: post-conv)
    stride_x_layer,
    stride_x_tok,
    conv_ptrs,  # [L] int64: conv_state [slots, dim, state_len] of each layer
    stride_s_seq,
    stride_s_dim,
    stride_s_tok,
    w_ptrs,  # [L] int64: conv weight [dim, W]
    stride_w_dim,
    stride_w_width,
    bias_ptrs,  # [L] int64: conv bias [dim] (HAS_BIAS)
    slot_ptr,  # [G, >= n] committed slot of each spec row, per KV-cache group
    slot_group_stride,
    slot_stride,
    layer_group_ptr,  # [L] KV-cache group of each layer
    spec_batch_rows_ptr,  # [n] batch row of each spec row
    spec_query_start_ptr,  # [n + 1] first x_buf row of each spec row
    num_accepted_ptr,  # [R] accepted path length per batch row (root included)
    src_row_ptr,  # [R, D + 1] flat verify rows of the path, root first
    src_row_stride,
    query_start_loc_ptr,  # [R + 1] first flat verify row of each batch row
    dim,
    MAX_PATH: tl.constexpr,  # draft_depth + 1
    PATH_BLOCK: tl.constexpr,  # power of 2 >= MAX_PATH
    KERNEL_WIDTH: tl.constexpr,
    STATE_BLOCK: tl.constexpr,  # power of 2 >= KERNEL_WIDTH - 1
    HAS_BIAS: tl.constexpr,
    SILU_ACTIVATION: tl.constexpr,
    CONV_TYPE: tl.constexpr,
    W_TYPE: tl.constexpr,
    BIAS_TYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    i_n = tl.program_id(0)
    i = tl.program_id(1)
    layer = tl.program_id(2).to(tl.int64)
    group = tl.load(layer_group_ptr + layer).to(tl.int64)
    slot = tl.load(slot_ptr + group * slot_group_stride + i * slot_stride).to(tl.int64)
    br = tl.load(spec_batch_rows_ptr + i).to(tl.int64)
    n = tl.load(num_accepted_ptr + br).to(tl.int64)
    if (slot <= 0) | (n <= 0):
        return
    n = tl.minimum(n, MAX_PATH)
    row0 = tl.load(spec_query_start_ptr + i).to(tl.int64)
    q0 = tl.load(query_start_loc_ptr + br).to(tl.int64)
    p_path = src_row_ptr + br * src_row_stride

    conv_state = tl.load(conv_ptrs + layer).to(tl.pointer_type(CONV_TYPE))
    w = tl.load(w_ptrs + layer).to(tl.pointer_type(W_TYPE))
    x = x_buf + layer * stride_x_layer
    idx_feats = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_d = idx_feats < dim
    p_state = conv_state + slot * stride_s_seq + idx_feats * stride_s_dim

    # Path row k's conv: window entry j is path position p = k - (W - 1) + j,
    # from x when p >= 0, else committed column p + W - 1 (as the tree
    # kernel's window of the node at depth k). Bias first, then x_j * w_j
    # added oldest first, inputs in the conv state's dtype.
    k = tl.arange(0, PATH_BLOCK)
    on_path = k < n
    if HAS_BIAS:
        bias = tl.load(bias_ptrs + layer).to(tl.pointer_type(BIAS_TYPE))
        b_row = tl.load(bias + idx_feats, mask=mask_d, other=0.0).to(tl.float32)
        acc = tl.zeros((PATH_BLOCK, BLOCK_N), dtype=tl.float32) + b_row[None, :]
    else:
        acc = tl.zeros((PATH_BLOCK, BLOCK_N), dtype=tl.float32)
    for j in tl.static_range(KERNEL_WIDTH):
        p = k - (KERNEL_WIDTH - 1) + j
        window_j = _path_or_committed(
            x,
            stride_x_tok,
            row0,
            q0,
            p_path,
            p_state,
            stride_s_tok,
            idx_feats,
            mask_d,
            p,
            p + KERNEL_WIDTH - 1,
            on_path,
            CONV_TYPE,
        )
        w_j = tl.load(
            w + idx_feats * stride_w_dim + j * stride_w_width, mask=mask_d, other=0.0
        )
        acc += window_j * w_j[None, :]
    if SILU_ACTIVATION:
        acc = acc / (1 + tl.exp(-acc))
    # Rounded to the conv state's dtype, then to the rows' (as the per-layer
    # path's output tensor and its cast).
    post = acc.to(CONV_TYPE).to(x_buf.dtype.element_ty)

    # The window after the path: column c holds path position
    # n - (W - 1) + c, or committed column n + c before the root.
    c = tl.arange(0, STATE_BLOCK)
    in_state = c < KERNEL_WIDTH - 1
    new_state = _path_or_committed(
        x,
        stride_x_tok,
        row0,
        q0,
        p_path,
        p_state,
        stride_s_tok,
        idx_feats,
        mask_d,
        n - (KERNEL_WIDTH - 1) + c,
        n + c,
        in_state,
        CONV_TYPE,
    )

    # Every load of this program (the path's pre-conv rows, the committed
    # window) before any store: the stores overwrite both. No other program
    # reads this program's feature block of this row block or slot.
    tl.debug_barrier()
    tl.store(
        x + ((row0 + k) * stride_x_tok)[:, None] + idx_feats[None, :],
        post,
        mask=on_path[:, None] & mask_d[None, :],
    )
    tl.store(
        p_state[None, :] + (c * stride_s_tok)[:, None],
        new_state,
        mask=in_state[:, None] & mask_d[None, :],
    )


@triton.jit(do_not_specialize=["slot_group_stride", "slot_stride"])
def _commit_gdn_kernel(
    x_buf,  # [L, rows, dim]: the path's post-conv rows at row0 + k
    stride_x_layer,
    stride_x_tok,
    a_buf,  # [L, rows, HV] (verify rows)
    b_buf,  # [L, rows, HV]
    stride_ab_layer,
    stride_ab_tok,
    ssm_ptrs,  # [L] int64: ssm_state [slots, HV, V, K] of each layer
    stride_h_seq,
    a_log_ptrs,  # [L] int64: A_log [HV]
    dt_bias_ptrs,  # [L] int64: dt_bias [HV]
    slot_ptr,
    slot_group_stride,
    slot_stride,
    layer_group_ptr,
    spec_batch_rows_ptr,
    spec_query_start_ptr,
    num_accepted_ptr,
    src_row_ptr,
    src_row_stride,
    query_start_loc_ptr,
    softplus_beta,
    softplus_threshold,
    MAX_PATH: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_QK_L2NORM_IN_KERNEL: tl.constexpr,
    SSM_TYPE: tl.constexpr,
    A_TYPE: tl.constexpr,
    DT_TYPE: tl.constexpr,
):
    i_v = tl.program_id(0)
    i = tl.program_id(1)
    i_lhv = tl.program_id(2)
    layer = (i_lhv // HV).to(tl.int64)
    i_hv = i_lhv % HV
    group = tl.load(layer_group_ptr + layer).to(tl.int64)
    slot = tl.load(slot_ptr + group * slot_group_stride + i * slot_stride).to(tl.int64)
    br = tl.load(spec_batch_rows_ptr + i).to(tl.int64)
    n = tl.load(num_accepted_ptr + br).to(tl.int64)
    if (slot <= 0) | (n <= 0):
        return
    n = tl.minimum(n, MAX_PATH)
    row0 = tl.load(spec_query_start_ptr + i).to(tl.int64)
    q0 = tl.load(query_start_loc_ptr + br).to(tl.int64)
    i_h = i_hv // (HV // H)

    state = tl.load(ssm_ptrs + layer).to(tl.pointer_type(SSM_TYPE))
    A_log = tl.load(a_log_ptrs + layer).to(tl.pointer_type(A_TYPE))
    dt_bias = tl.load(dt_bias_ptrs + layer).to(tl.pointer_type(DT_TYPE))
    x = x_buf + layer * stride_x_layer
    a = a_buf + layer * stride_ab_layer
    b = b_buf + layer * stride_ab_layer

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < K
    mask_v = o_v < V
    mask_h = mask_v[:, None] & mask_k[None, :]
    p_state = (
        state + slot * stride_h_seq + i_hv * V * K + o_v[:, None] * K + o_k[None, :]
    )
    b_h = tl.load(p_state, mask=mask_h, other=0).to(tl.float32)
    A = tl.load(A_log + i_hv).to(tl.float32)
    bias = tl.load(dt_bias + i_hv).to(tl.float32)

    # As the tree kernel over the path (post-conv q | k | v packed in a row,
    # `rearrange_mixed_qkv`'s split), root first. The state needs no q.
    for j in range(0, n):
        row = row0 + j
        node = tl.load(src_row_ptr + br * src_row_stride + j).to(tl.int64) - q0
        ab_row = row0 + node
        p_x = x + row * stride_x_tok
        b_k = tl.load(p_x + (H + i_h) * K + o_k, mask=mask_k, other=0).to(tl.float32)
        b_v = tl.load(p_x + 2 * H * K + i_hv * V + o_v, mask=mask_v, other=0).to(
            tl.float32
        )
        b_b = tl.load(b + ab_row * stride_ab_tok + i_hv).to(tl.float32)
        x_a = tl.load(a + ab_row * stride_ab_tok + i_hv).to(tl.float32) + bias
        softplus_x = tl.where(
            softplus_beta * x_a <= softplus_threshold,
            (1 / softplus_beta) * tl.log(1 + tl.exp(softplus_beta * x_a)),
            x_a,
        )
        b_g = -tl.exp(A) * softplus_x
        b_beta = tl.sigmoid(b_b)
        if USE_QK_L2NORM_IN_KERNEL:
            b_k = b_k * (tl.rsqrt(tl.sum(b_k * b_k) + 1e-6))
        b_h *= tl.exp(b_g)
        b_v -= tl.sum(b_h * b_k[None, :], 1)
        b_v *= b_beta
        b_h += b_v[:, None] * b_k[None, :]

    tl.store(p_state, b_h.to(p_state.dtype.element_ty), mask=mask_h)


def _tl_float(t: torch.Tensor, what: str) -> Any:
    if t.dtype not in _FLOAT_NAMES:
        raise ValueError(f"DDTree: GDN {what} has dtype {t.dtype}, not a float type.")
    return getattr(tl, _FLOAT_NAMES[t.dtype])


def _ptrs(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.tensor(
        [t.data_ptr() for t in tensors], dtype=torch.int64, device=device
    )


class GDNCommitTables:
    """Per-layer pointer tables of the GDN layers (built once, at bind).

    ``layers`` are the target's GDN layers in buffer order (layer ``l``'s
    verify rows are ``x_buf[l]``), ``conv_states`` / ``ssm_states`` their
    states as the layer's forward sees them (``conv [slots, dim, state_len]``,
    ``ssm [slots, HV, V, K]``), ``layer_group`` each layer's KV-cache group
    index. The tables hold the layers' own tensors' addresses: vLLM
    allocates the states once (views into the KV-cache pages, shared by
    layers of different groups) and loads the weights in place, so the
    addresses stay valid for the engine's life. Layers must agree on shapes,
    strides and dtypes (one model's layers do); anything else is refused
    here, at startup.
    """

    def __init__(
        self,
        layers: Sequence[Any],
        conv_states: Sequence[torch.Tensor],
        ssm_states: Sequence[torch.Tensor],
        layer_group: Sequence[int],
        device: torch.device,
    ):
        first = layers[0]
        conv0, ssm0 = conv_states[0], ssm_states[0]
        w0 = first.conv1d.weight
        self.num_layers = len(layers)
        self.H = first.num_k_heads // first.tp_size
        self.HV = first.num_v_heads // first.tp_size
        self.K = first.head_k_dim
        self.V = first.head_v_dim
        self.dim = w0.shape[0]
        self.width = w0.shape[-1]
        self.has_bias = first.conv1d.bias is not None
        self.silu = _is_silu(first.activation)
        if self.dim != 2 * self.H * self.K + self.HV * self.V:
            raise ValueError(
                f"DDTree: GDN conv dim {self.dim} is not q + k + v "
                f"({self.H} x {self.K}, {self.H} x {self.K}, {self.HV} x {self.V})."
            )
        if tuple(ssm0.shape[1:]) != (self.HV, self.V, self.K) or ssm0.stride()[1:] != (
            self.V * self.K,
            self.K,
            1,
        ):
            raise ValueError(
                f"DDTree: GDN recurrent state {tuple(ssm0.shape)} / "
                f"{ssm0.stride()} is not [slots, {self.HV}, {self.V}, {self.K}] "
                "with contiguous heads."
            )

        def signature(layer: Any, conv: torch.Tensor, ssm: torch.Tensor) -> tuple:
            w = layer.conv1d.weight
            bias = layer.conv1d.bias
            return (
                w.shape[0],
                w.shape[-1],
                w.stride(0),
                w.stride(-1),
                w.dtype,
                None if bias is None else (bias.dtype, bias.stride(0)),
                layer.A_log.dtype,
                layer.A_log.stride(0),
                layer.dt_bias.dtype,
                layer.dt_bias.stride(0),
                _is_silu(layer.activation),
                layer.num_k_heads // layer.tp_size,
                layer.num_v_heads // layer.tp_size,
                layer.head_k_dim,
                layer.head_v_dim,
                tuple(conv.shape[1:]),
                conv.stride(),
                conv.dtype,
                tuple(ssm.shape[1:]),
                ssm.stride(),
                ssm.dtype,
            )

        expected = signature(first, conv0, ssm0)
        for layer, conv, ssm in zip(layers, conv_states, ssm_states):
            got = signature(layer, conv, ssm)
            if got != expected:
                raise ValueError(
                    f"DDTree: GDN layer {layer.prefix} differs from "
                    f"{first.prefix} in shape, stride or dtype of its weights or "
                    f"states ({got} vs {expected}); the one-launch commit needs "
                    "them equal."
                )
        if first.A_log.stride(0) != 1 or first.dt_bias.stride(0) != 1:
            raise ValueError("DDTree: GDN A_log / dt_bias must be contiguous.")
        if self.has_bias and first.conv1d.bias.stride(0) != 1:
            raise ValueError("DDTree: GDN conv bias must be contiguous.")
        assert conv0.shape[1] == self.dim and conv0.shape[2] >= self.width - 1
        self.conv_strides = conv0.stride()
        self.ssm_stride = ssm0.stride(0)
        self.w_strides = (w0.stride(0), w0.stride(-1))
        self.conv_type = _tl_float(conv0, "conv state")
        self.ssm_type = _tl_float(ssm0, "recurrent state")
        self.w_type = _tl_float(w0, "conv weight")
        self.bias_type = (
            _tl_float(first.conv1d.bias, "conv bias") if self.has_bias else tl.float32
        )
        self.a_type = _tl_float(first.A_log, "A_log")
        self.dt_type = _tl_float(first.dt_bias, "dt_bias")
        self.conv_ptrs = _ptrs(conv_states, device)
        self.ssm_ptrs = _ptrs(ssm_states, device)
        self.w_ptrs = _ptrs([layer.conv1d.weight for layer in layers], device)
        self.bias_ptrs = (
            _ptrs([layer.conv1d.bias for layer in layers], device)
            if self.has_bias
            else self.w_ptrs  # unused without a bias
        )
        self.a_log_ptrs = _ptrs([layer.A_log for layer in layers], device)
        self.dt_bias_ptrs = _ptrs([layer.dt_bias for layer in layers], device)
        self.layer_group_list = list(layer_group)
        self.layer_group = torch.tensor(
            self.layer_group_list, dtype=torch.int32, device=device
        )
        self.num_groups = max(self.layer_group_list) + 1


def _is_silu(activation: bool | str | None) -> bool:
    if isinstance(activation, bool):
        return activation
    assert activation in (None, "silu", "swish")
    return activation is not None


def commit_accepted_paths(
    tables: GDNCommitTables,
    x_buf: torch.Tensor,
    a_buf: torch.Tensor,
    b_buf: torch.Tensor,
    slots: torch.Tensor,
    spec_batch_rows: torch.Tensor,
    spec_query_start: torch.Tensor,
    num_accepted: torch.Tensor,
    src_row: torch.Tensor,
    query_start_loc: torch.Tensor,
    draft_depth: int,
    *,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
) -> None:
    """Advance every GDN layer's committed state along the accepted paths.

    ``slots [G, >= n]`` (any strides): spec row ``i``'s committed slot in
    KV-cache group ``g`` (<= 0: skip the row, e.g. CUDA-graph padding).
    ``spec_batch_rows [n]`` and ``spec_query_start [n + 1]``: each spec
    row's batch row and first row in the verify buffers ``x_buf / a_buf /
    b_buf [L, rows, .]``. ``num_accepted [R]`` and ``src_row [R, D + 1]``
    (flat verify rows, root first) are the walk's, ``query_start_loc
    [R + 1]`` the batch's. Two launches; overwrites the path's rows of
    ``x_buf`` with their post-conv values.
    """
    n = spec_batch_rows.shape[0]
    if n == 0:
        return
    L = tables.num_layers
    assert x_buf.shape[0] == L and x_buf.stride(2) == 1
    assert a_buf.stride() == b_buf.stride() and a_buf.stride(2) == 1
    assert src_row.stride(1) == 1
    slot_group_stride = slots.stride(0) if slots.dim() == 2 else 0
    slot_stride = slots.stride(-1)
    max_path = draft_depth + 1
    common = (
        slots,
        slot_group_stride,
        slot_stride,
        tables.layer_group,
        spec_batch_rows,
        spec_query_start,
        num_accepted,
        src_row,
        src_row.stride(0),
        query_start_loc,
    )
    dim = tables.dim
    block_n = min(_BLOCK_N, triton.next_power_of_2(dim))
    s_seq, s_dim, s_tok = tables.conv_strides
    _commit_conv_kernel[(triton.cdiv(dim, block_n), n, L)](
        x_buf,
        x_buf.stride(0),
        x_buf.stride(1),
        tables.conv_ptrs,
        s_seq,
        s_dim,
        s_tok,
        tables.w_ptrs,
        tables.w_strides[0],
        tables.w_strides[1],
        tables.bias_ptrs,
        *common,
        dim,
        MAX_PATH=max_path,
        PATH_BLOCK=triton.next_power_of_2(max_path),
        KERNEL_WIDTH=tables.width,
        STATE_BLOCK=triton.next_power_of_2(max(tables.width - 1, 1)),
        HAS_BIAS=tables.has_bias,
        SILU_ACTIVATION=tables.silu,
        CONV_TYPE=tables.conv_type,
        W_TYPE=tables.w_type,
        BIAS_TYPE=tables.bias_type,
        BLOCK_N=block_n,
        num_warps=4,
    )
    H, HV, K, V = tables.H, tables.HV, tables.K, tables.V
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), 32)
    _commit_gdn_kernel[(triton.cdiv(V, BV), n, L * HV)](
        x_buf,
        x_buf.stride(0),
        x_buf.stride(1),
        a_buf,
        b_buf,
        a_buf.stride(0),
        a_buf.stride(1),
        tables.ssm_ptrs,
        tables.ssm_stride,
        tables.a_log_ptrs,
        tables.dt_bias_ptrs,
        *common,
        softplus_beta,
        softplus_threshold,
        MAX_PATH=max_path,
        H=H,
        HV=HV,
        K=K,
        V=V,
        BK=BK,
        BV=BV,
        USE_QK_L2NORM_IN_KERNEL=True,
        SSM_TYPE=tables.ssm_type,
        A_TYPE=tables.a_type,
        DT_TYPE=tables.dt_type,
        num_warps=4,
    )
