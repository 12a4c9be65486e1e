# SPDX-License-Identifier: Apache-2.0
"""The per-layer post-walk GDN commit, as `DDTreeGDN.commit` did it before
the one-launch commit (`vllm.v1.spec_decode.ddtree.gdn_commit`): a test
oracle, not shipped.

Per GDN layer: the whole tree's post-conv rows from the saved pre-conv rows
(`tree_causal_conv1d`), `rearrange_mixed_qkv`, the gated delta rule over the
accepted leaf's path written into the committed slot
(`tree_gated_delta_rule` with ``targets``), then the conv window
(`tree_conv_state_update`). Three kernels and a torch concatenation per
layer."""

from typing import Any

import torch

from vllm.v1.spec_decode.ddtree.gdn_verify import gdn_layer_states
from vllm.v1.spec_decode.ddtree.tree_conv import (
    tree_causal_conv1d,
    tree_conv_state_update,
)
from vllm.v1.spec_decode.ddtree.tree_gdn import tree_gated_delta_rule


def commit_per_layer(
    ctx: Any,
    metadata: dict[str, Any],
    num_accepted: torch.Tensor,
    src_row: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> list[torch.Tensor]:
    """``ctx``: a `DDTreeGDN` after the verify forward (its saved rows and
    step rows), ``metadata``: each GDN layer's GDN metadata of the step.
    Returns each layer's post-conv rows (all verify rows, spec order)."""
    n = ctx.num_spec
    if n == 0:
        return []
    num_reqs = src_row.shape[0]
    rows = ctx.spec_batch_rows[:n]
    # Accepted verify indices (node numbers), root first, per spec row.
    nodes = (src_row - query_start_loc[:num_reqs, None].to(torch.int64))[rows]
    counts = num_accepted[rows].to(torch.int32)
    leaf = nodes.gather(1, (counts.to(torch.int64) - 1).clamp(min=0)[:, None])
    query_start = ctx.spec_query_start[: n + 1]
    tree_rows = ctx.tree_rows[:n]
    num_tokens = ctx.num_spec_tokens
    post_convs = []
    for name, idx in ctx.layer_index.items():
        layer = ctx.layers[name]
        md = metadata[name]
        assert md.num_spec_decodes == n
        slots = md.spec_state_indices_tensor[:n, 0].contiguous()
        conv_state, ssm_state = gdn_layer_states(layer)
        weight = layer.conv1d.weight
        weight = weight.view(weight.size(0), weight.size(-1))
        x = ctx.x_buf[idx, :num_tokens]
        # The forward's post-conv rows, from the same inputs.
        post_conv = tree_causal_conv1d(
            x,
            conv_state,
            weight,
            layer.conv1d.bias,
            layer.activation,
            slots,
            query_start,
            ctx.parent_idx,
            tree_rows,
        )
        post_convs.append(post_conv)
        q, k, v = layer.rearrange_mixed_qkv(post_conv)
        tree_gated_delta_rule(
            layer.A_log,
            ctx.a_buf[idx, :num_tokens],
            ctx.b_buf[idx, :num_tokens],
            layer.dt_bias,
            q[0],
            k[0],
            v[0],
            ssm_state,
            slots,
            query_start,
            ctx.parent_idx,
            tree_rows,
            ctx.draft_depth,
            targets=leaf,
            final_state_idx=slots,
            use_qk_l2norm_in_kernel=True,
        )
        # Last: the recomputation above reads the committed window.
        tree_conv_state_update(
            x,
            conv_state,
            weight.shape[1],
            slots,
            slots,
            query_start,
            nodes,
            counts,
        )
    return post_convs
