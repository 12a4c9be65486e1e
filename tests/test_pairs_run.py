# SPDX-License-Identifier: Apache-2.0
"""bench/pairs/run_pairs.py's bookkeeping: which prompts each concurrency decodes
and how outputs are compared with no speculation."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "pairs"))

import run_pairs  # noqa: E402


def test_prompts_per_concurrency():
    prompts = [[i] for i in range(100)]
    assert run_pairs.prompts_for(1, prompts, 6) == prompts[:6]
    assert run_pairs.prompts_for(8, prompts, 6) == prompts[:32]  # 4 batches of 8
    assert run_pairs.prompts_for(32, prompts, 6) == prompts  # capped at all


def test_compare_counts_equal_outputs(tmp_path):
    def save(method, toks):
        path = tmp_path / f"tokens_dense-8b_float32_{method}_c8.json"
        path.write_text(json.dumps(toks))

    save("nospec", [[1, 2, 3], [4, 5], [6]])
    save("ddtree", [[1, 2, 3], [4, 9], [6]])
    assert (
        run_pairs.compare(str(tmp_path), "dense-8b", "float32", "ddtree", 8, "nospec")
        == "2/3"
    )
    assert (
        run_pairs.compare(str(tmp_path), "dense-8b", "float32", "chain", 8, "nospec")
        is None
    )


def test_committed_results_have_the_rows_the_yardstick_needs():
    """bench/results/pairs.json: every measured row carries the fields readers
    compare on, and each pair has its embedding check."""
    rows = json.loads(
        (
            Path(__file__).resolve().parent.parent / "bench" / "results" / "pairs.json"
        ).read_text()
    )
    measured = [r for r in rows if "tok_s" in r]
    assert measured
    for r in measured:
        assert {"pair", "dtype", "method", "concurrency", "tok_s", "tau"} <= set(r)
        if r["method"] in ("chain", "chain_v2", "ddtree"):
            assert r["identical_to_nospec"] is not None and r["tau"] > 1
    embedded = {r["pair"] for r in rows if "embedding_max_abs_logit_diff" in r}
    assert embedded == {"dense-8b", "hybrid-27b"}
    assert all(
        r["embedding_max_abs_logit_diff"] <= 1e-3
        for r in rows
        if "embedding_max_abs_logit_diff" in r
    )
