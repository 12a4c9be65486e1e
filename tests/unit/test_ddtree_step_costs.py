# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU tests for the measured budget policy's step costs
(overlay/vllm/v1/spec_decode/ddtree/step_costs.py): the timing loop with a
fake step and a fake clock, which batch sizes are timed, combining target
and drafter timings, and the JSON cache."""

from __future__ import annotations

import json

import pytest

from vllm.v1.spec_decode.ddtree import step_costs as S


class FakeClock:
    """A timer whose 'GPU' takes ``cost(shape)`` seconds per run of the
    step: the step advances the clock, the timer reads it."""

    def __init__(self):
        self.now = 0.0
        self.runs = 0

    def timer(self, fn):
        start = self.now
        fn()  # warm-up, not timed
        start = self.now
        for _ in range(3):
            fn()
        return (self.now - start) / 3


def test_measure_times_every_shape_once_prepared():
    clock = FakeClock()
    prepared, logged = [], []

    def run_step(shape):
        n, t = shape
        prepared.append(shape)

        def step():
            clock.now += 1e-3 + 1e-5 * n * t
            clock.runs += 1

        return step

    shapes = [(1, 1), (8, 16), (4, 65)]
    out = S.measure(shapes, run_step, clock.timer, lambda s, v: logged.append(s))
    assert prepared == shapes  # inputs prepared once per shape
    assert logged == shapes  # one log line per shape
    assert clock.runs == 4 * len(shapes)
    for n, t in shapes:
        assert out[(n, t)] == pytest.approx(1e-3 + 1e-5 * n * t)
    with pytest.raises(ValueError, match="timing"):
        S.measure([(1, 1)], lambda s: (lambda: None), clock.timer)  # 0 s


def test_timed_batch_sizes_are_powers_of_two_and_the_ends():
    assert S.timed_batch_sizes([1, 2, 3, 4, 5, 6, 7, 8, 24, 48]) == [1, 2, 4, 8, 48]
    assert S.timed_batch_sizes([3, 6, 9]) == [3, 9]
    assert S.timed_batch_sizes([]) == []


def test_step_cost_is_target_plus_drafter_for_trees():
    target = {(1, 1): 1.0, (8, 1): 2.0, (4, 16): 3.0}
    drafter = {1: 0.5, 8: 1.2}
    table = S.combine_step_costs(target, drafter)
    # No speculation: the target's step alone (nothing drafted for the next).
    assert table.points[(1, 1)] == 1.0
    assert table.points[(8, 1)] == 2.0
    # Tree steps: plus the drafter's query pass at that batch size.
    assert table.points[(4, 16)] == pytest.approx(3.0 + 0.5 + 0.7 * 3 / 7)
    with pytest.raises(ValueError):
        S.combine_step_costs(target, {})


def test_cache_round_trip_and_mismatches(tmp_path):
    fields = {"model": "m", "gpu": "NVIDIA H200", "tensor_parallel_size": 1}
    path = S.cache_path(str(tmp_path), fields)
    assert path.startswith(str(tmp_path / "ddtree" / "step_costs"))
    assert S.load_cached_costs(path, fields) is None  # nothing yet
    target = {(1, 1): 1e-3, (8, 16): 2e-3}
    drafter = {1: 5e-4}
    S.save_cached_costs(path, fields, target, drafter)
    assert S.load_cached_costs(path, fields) == (target, drafter)
    # Other fields (another GPU) give another file; a file whose fields
    # differ (a key collision) is not used.
    other = dict(fields, gpu="NVIDIA H100")
    assert S.cache_path(str(tmp_path), other) != path
    assert S.load_cached_costs(path, other) is None
    # A damaged file is ignored, not an error.
    with open(path, "w") as f:
        f.write("{")
    assert S.load_cached_costs(path, fields) is None
    payload = {"format": 1, "fields": fields, "target": [[1, 1, 0.0]], "drafter": []}
    with open(path, "w") as f:
        json.dump(payload, f)
    assert S.load_cached_costs(path, fields) is None
