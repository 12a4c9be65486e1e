# SPDX-License-Identifier: Apache-2.0
"""The patched upstream unified attention kernels take their per-batch counts
unspecialised, as DDTree's own per-step kernels do
(tests/unit/test_kernel_specialization.py): DDTree serves the target on
TRITON_ATTN, where a batch of a new size class (1 sequence, a multiple of 16,
or neither) would compile a kernel variant mid-serving. Read from the
installed source (the Triton interpreter drops the option)."""

import importlib.util
import pathlib

import pytest
from kernel_source import unspecialised

MODULE = "vllm.v1.attention.ops.triton_unified_attention"


@pytest.mark.parametrize(
    "kernel, per_batch",
    [
        ("kernel_unified_attention", ["num_seqs", "qq_bias_len"]),
        ("reduce_segments", ["num_seqs"]),
    ],
)
def test_unified_attention_per_batch_counts_are_not_specialised(kernel, per_batch):
    path = pathlib.Path(importlib.util.find_spec(MODULE).origin)
    params, names = unspecialised(path, kernel)
    assert set(per_batch) <= set(params), f"{kernel} has no {per_batch}"
    assert set(per_batch) <= set(names), f"{kernel} specialises on {per_batch}"
    assert set(names) <= set(params), f"{kernel}: unknown {set(names) - set(params)}"
