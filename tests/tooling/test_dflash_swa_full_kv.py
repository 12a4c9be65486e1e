# SPDX-License-Identifier: Apache-2.0
"""Patch dflash-swa-draft-layers-keep-full-kv (upstream issue #50169).

A Qwen3 DFlash draft layer with a sliding window must report a FullAttentionSpec (so the
KV cache manager never recycles the precomputed context blocks) while its attention impl
still applies the window. The pristine upstream file is probed too: it reports a
SlidingWindowSpec, which shows that the test catches the bug.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import ddtree_venv
import pytest
from repo_paths import TEST_HELPERS

REL = "vllm/model_executor/models/qwen3_dflash.py"


@pytest.mark.slow
def test_swa_draft_layer_keeps_full_kv(
    wheel_venv: Path, src_tree: Path, tmp_path: Path
) -> None:
    pristine = tmp_path / "qwen3_dflash_upstream.py"
    pristine.write_bytes(
        subprocess.run(
            ["git", "-C", str(src_tree), "show", f"upstream:{REL}"],
            check=True,
            capture_output=True,
        ).stdout
    )
    probe = TEST_HELPERS / "dflash_swa_probe.py"
    proc = subprocess.run(
        [
            str(ddtree_venv.venv_python(wheel_venv)),
            str(probe),
            str(src_tree / REL),
            str(pristine),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("PROBE ")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    r = json.loads(lines[-1].removeprefix("PROBE "))
    # patched: full allocation, window applied at compute time
    assert r["0:32"]["spec"] == "FullAttentionSpec"
    assert r["0:32"]["spec_sliding_window"] is None
    assert r["0:32"]["impl_sliding_window"] not in (None, -1, [-1, -1], "(-1, -1)")
    assert r["0:32"]["layer_sliding_window"] == 32
    # full-attention layers are unchanged
    assert r["0:None"]["spec"] == "FullAttentionSpec"
    assert r["1:None"] == r["0:None"]
    # upstream: the sliding layer asks for a SlidingWindowSpec (the bug)
    assert r["1:32"]["spec"] == "SlidingWindowSpec"
    assert r["1:32"]["impl_sliding_window"] == r["0:32"]["impl_sliding_window"]
