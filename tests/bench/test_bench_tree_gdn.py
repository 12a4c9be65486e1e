# SPDX-License-Identifier: Apache-2.0
"""bench/kernels/tree_gdn.py's --variants parsing (the timing needs a GPU)."""

from __future__ import annotations

import pytest

from bench.kernels import tree_gdn as bench_tree_gdn


def test_variant_settings_are_typed():
    assert bench_tree_gdn.parse_variant("BLOCKED_ROWS=16,CHUNK_NUM_WARPS=8") == {
        "BLOCKED_ROWS": 16,
        "CHUNK_NUM_WARPS": 8,
    }
    assert bench_tree_gdn.parse_variant("INVERSE_PRECISION=tf32x3") == {
        "INVERSE_PRECISION": "tf32x3"
    }


@pytest.mark.parametrize(
    "text",
    [
        "BLOCKED_ROWS=sixteen",
        "INVERSE_PRECISION=tf32",
        "NOT_A_SETTING=1",
        "CHUNK_BLOCK_V",
    ],
)
def test_bad_variant_settings_are_refused(text):
    with pytest.raises(SystemExit, match="bad variant setting"):
        bench_tree_gdn.parse_variant(text)
