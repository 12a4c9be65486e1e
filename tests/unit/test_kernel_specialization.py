# SPDX-License-Identifier: Apache-2.0
"""DDTree's Triton kernels that run every step with per-batch counts take
them unspecialised (``@triton.jit(do_not_specialize=[...])``): Triton
compiles a variant per argument that is 1, a multiple of 16 or neither, and a
variant first met in serving stalls the engine while it compiles. Read from
the source (the Triton interpreter, which CI runs, drops the option)."""

import pytest
from kernel_source import unspecialised

# (file, kernel) -> parameters that change from one batch to the next.
PER_BATCH = {
    ("v1/spec_decode/ddtree/tree_attention.py", "_tree_attention_kernel"): [
        "num_seqs",
        "prefix_lse_stride_0",
        "out_lse_stride_0",
    ],
    (
        "v1/worker/gpu/spec_decode/ddtree/kernels.py",
        "_ddtree_tree_positions_kernel",
    ): ["num_logits"],
    (
        "v1/worker/gpu/spec_decode/ddtree/kernels.py",
        "_ddtree_shift_model_positions_kernel",
    ): ["num_logits"],
    # The post-walk commit's slot table: a [G, n] view, n the step's spec rows.
    ("v1/spec_decode/ddtree/gdn_commit.py", "_commit_conv_kernel"): [
        "slot_group_stride",
        "slot_stride",
    ],
    ("v1/spec_decode/ddtree/gdn_commit.py", "_commit_gdn_kernel"): [
        "slot_group_stride",
        "slot_stride",
    ],
}


@pytest.mark.parametrize("path, kernel", list(PER_BATCH))
def test_per_batch_counts_are_not_specialised(path, kernel):
    params, names = unspecialised(path, kernel)
    wanted = PER_BATCH[(path, kernel)]
    assert set(wanted) <= set(params), f"{kernel} has no {set(wanted) - set(params)}"
    assert set(wanted) <= set(names), f"{kernel} specialises on {wanted}: {names}"
    assert set(names) <= set(params), f"{kernel}: unknown {set(names) - set(params)}"
