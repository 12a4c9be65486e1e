# SPDX-License-Identifier: Apache-2.0
"""tests/helpers/ddtree_venv.py's pruning of wheel layers: the newest few stay, and so
does any layer used recently (a test run may still be running from it)."""

from __future__ import annotations

import os
import time

import ddtree_venv


def test_prune_keeps_the_newest_and_the_recently_used(tmp_path, monkeypatch):
    monkeypatch.setattr(ddtree_venv, "cache_dir", lambda: tmp_path)
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
