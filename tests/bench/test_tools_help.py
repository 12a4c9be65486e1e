# SPDX-License-Identifier: Apache-2.0
"""Every GPU tool of bench/engine, bench/kernels and the pairs' runners answers
``--help`` on a CPU host, run as the docs run it (``python3 -m``: its
``__main__`` guard calls main)."""

import runpy
import sys

import pytest

TOOLS = [
    "bench.engine.sampling",
    "bench.engine.step_cost",
    "bench.kernels.tree_attention",
    "bench.kernels.tree_gdn",
    "bench.pairs.run_pairs",
    "bench.pairs.run_policy",
]


@pytest.mark.parametrize("module", TOOLS)
def test_help(module, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", [module, "--help"])
    # Run afresh as __main__, as python3 -m does (not over an imported copy).
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(SystemExit) as stop:
        runpy.run_module(module, run_name="__main__")
    assert stop.value.code == 0
    assert "usage:" in capsys.readouterr().out
