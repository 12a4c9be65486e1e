# SPDX-License-Identifier: Apache-2.0
"""tests/helpers/ddtree_venv.py: the pruning of wheel layers (the newest few stay, and
so does any layer used recently: a test run may still be running from it), the
requirements a line's lock keeps out of the test venv, and one cache folder per
release line."""

from __future__ import annotations

import os
import time
import zipfile
from pathlib import Path

import ddtree_venv


def test_prune_keeps_the_newest_and_the_recently_used(tmp_path):
    now = time.time()
    ages_h = {"a": 0.1, "b": 0.2, "c": 0.3, "d": 0.4, "e": 7.0, "f": 8.0, "g": 9.0}
    for name, age in ages_h.items():
        d = tmp_path / f"wheel-k-{name}"
        d.mkdir()
        os.utime(d, (now - age * 3600, now - age * 3600))
    half_built = tmp_path / "wheel-k-x.tmp1234"
    half_built.mkdir()
    keep = tmp_path / "wheel-k-new"
    keep.mkdir()
    ddtree_venv._prune_layers(keep=keep, count=4)
    left = sorted(p.name for p in tmp_path.iterdir())
    # a-c are the newest three besides `keep`; d is beyond them but in use;
    # e-g are beyond them and idle for over 6 hours.
    assert left == [
        "wheel-k-a",
        "wheel-k-b",
        "wheel-k-c",
        "wheel-k-d",
        "wheel-k-new",
        "wheel-k-x.tmp1234",
    ]


def _fake_wheel(folder: Path, version: str, requires: list[str]) -> Path:
    wheel = folder / f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
    meta = "Metadata-Version: 2.1\nName: vllm\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(f"vllm-{version}.dist-info/METADATA", meta)
    return wheel


def test_the_0_34_0_test_venv_leaves_out_the_pin_pypi_lacks(tmp_path):
    wheel = _fake_wheel(
        tmp_path,
        "0.34.0+ddtree.1",
        [
            "torch==2.14.0",
            "flashinfer-python==0.7.3",
            'xgrammar==0.2.8; platform_machine == "x86_64"',
            'pytest; extra == "test"',
        ],
    )
    skipped = ddtree_venv.skipped_requirements(wheel)
    assert skipped == ["flashinfer-python"]
    assert ddtree_venv.requirements_without(wheel, skipped) == [
        "torch==2.14.0",
        'xgrammar==0.2.8; platform_machine == "x86_64"',
    ]
    # Names compare normalised (PEP 503).
    assert ddtree_venv.requirements_without(wheel, ["FlashInfer_Python"]) == [
        "torch==2.14.0",
        'xgrammar==0.2.8; platform_machine == "x86_64"',
    ]


def test_the_0_26_0_line_skips_nothing_and_each_line_has_its_cache(
    tmp_path, monkeypatch
):
    """Each line's venvs live in a folder named by its vLLM version, whichever
    line is the primary one."""
    monkeypatch.setenv("VLLM_DDTREE_CACHE", str(tmp_path / "vllm-ddtree"))
    line_0_26 = _fake_wheel(tmp_path, "0.26.0+ddtree.1", ["torch==2.11.0"])
    primary = _fake_wheel(tmp_path, "0.34.0+ddtree.1", ["torch==2.14.0"])
    assert ddtree_venv.skipped_requirements(line_0_26) == []
    assert ddtree_venv.cache_dir(line_0_26) == tmp_path / "vllm-ddtree-0.26.0"
    assert ddtree_venv.cache_dir(primary) == tmp_path / "vllm-ddtree-0.34.0"
