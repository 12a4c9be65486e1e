# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DDTree tree speculative decoding (arXiv 2604.12989): device-side core.

`tree` holds pure, batched, fixed-shape PyTorch functions (tree build,
verification inputs, verification walk, KV / hidden-state compaction) that
run without host synchronisation and can be captured in CUDA graphs.
"""

from vllm.v1.spec_decode.ddtree.tree import (
    DDTree,
    CompactionPlan,
    WalkResult,
    ancestor_mask,
    build_tree,
    compaction_indices,
    pack_ancestor_bits,
    tree_attention_bias,
    tree_positions,
    walk_tree,
)

__all__ = [
    "DDTree",
    "CompactionPlan",
    "WalkResult",
    "ancestor_mask",
    "build_tree",
    "compaction_indices",
    "pack_ancestor_bits",
    "tree_attention_bias",
    "tree_positions",
    "walk_tree",
]
