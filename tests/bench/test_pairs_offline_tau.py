# SPDX-License-Identifier: Apache-2.0
"""bench/pairs/offline_tau.py: offline tau of the committed pairs at
temperature 0 and 1, and how its rows replace those of pairs.json."""

from __future__ import annotations

import functools
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
from bench.pairs import offline_tau


def test_merge_replaces_the_same_pair_and_temperature_only():
    rows = [
        {"pair": "dense-8b", "offline_heldout_tau_t0": {"chain_k15_tau": 2.0}},
        {"pair": "hybrid-27b", "offline_heldout_tau_t0": {"chain_k15_tau": 3.0}},
        {"pair": "dense-8b", "method": "chain", "tok_s": 1.0},
    ]
    new = [
        {"pair": "dense-8b", "offline_heldout_tau_t0": {"chain_k15_tau": 2.5}},
        {"pair": "dense-8b", "offline_heldout_tau_t1": {"chain_k15_tau": 1.5}},
    ]
    got = offline_tau.merge_rows(rows, new)
    assert got == [rows[1], rows[2], new[0], new[1]]


def test_committed_dense_pair_at_both_temperatures(tmp_path, capsys, monkeypatch):
    """Two held-out prompts of the committed dense pair on the CPU, 32 new
    tokens each (the tool's 256 cost a CPU minute more): the rows land in the
    file, the sampled continuation accepts less than the greedy one (a tiny
    target's samples at T = 1 are far less predictable), and the tree accepts
    at least as much as the chain at each temperature."""
    short = functools.partial(offline_tau.evaluate, new_tokens=32)
    monkeypatch.setattr(offline_tau, "evaluate", short)
    out = tmp_path / "pairs.json"
    out.write_text(json.dumps([{"pair": "dense-8b", "method": "nospec"}]))
    offline_tau.main(
        ["--pairs", "dense-8b", "--prompts", "2", "--cpu", "--out", str(out)]
    )
    rows = json.loads(out.read_text())
    t0 = rows[1]["offline_heldout_tau_t0"]
    t1 = rows[2]["offline_heldout_tau_t1"]
    assert rows[0] == {"pair": "dense-8b", "method": "nospec"}
    assert (t0["temperature"], t1["temperature"]) == (0.0, 1.0)
    assert t0["prompts"] == t1["prompts"] == 2
    assert 1.0 <= t1["chain_k15_tau"] < t0["chain_k15_tau"]
    for t in (t0, t1):
        assert t["chain_k15_tau"] <= t["ddtree_tau"]["16"] <= t["ddtree_tau"]["256"]
    assert capsys.readouterr().out.count("TAU ") == 2
