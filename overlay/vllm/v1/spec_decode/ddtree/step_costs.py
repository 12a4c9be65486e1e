# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Step costs for the measured budget policy: timing, combining, caching.

After the warm-up the worker times the decode CUDA graphs it captured: the
target's graph for ``n`` requests of ``1 + b`` tokens (with the logits and
argmax of every verified token and the drafter's context K/V precompute of
the step's tokens, which every step runs) and the DFlash drafter's query
graph for ``n`` requests, which runs when the next step verifies drafts. A
step at (``n``, ``b > 0``) costs their sum, a step of no speculation the
target's part alone (`combine_step_costs`; the drafter then only stores the
context). What the host adds around the graphs (input preparation, the
walk, the compaction, Python) is not in the table.

Here, without vLLM: `measure` takes the shapes and a callable that runs one
step of a shape, so that it is tested with a fake one; `cuda_event_timer`
times a callable on the GPU; `timed_batch_sizes` bounds how many shapes are
timed; the JSON cache (`cache_path`, `load_cached_costs`,
`save_cached_costs`) lets a restart with the same model, dtype, GPU,
parallelism and budgets skip the timing.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from vllm.v1.spec_decode.ddtree.policy import StepCostTable, piecewise_linear

# Replays timed per shape, after one untimed warm-up replay.
DEFAULT_REPEATS = 3
CACHE_FORMAT = 1


def timed_batch_sizes(captured: Iterable[int]) -> list[int]:
    """The captured batch sizes worth timing: the powers of two among them
    and the largest (the cost table interpolates between them)."""
    sizes = sorted(set(captured))
    if not sizes:
        return []
    keep = {n for n in sizes if n & (n - 1) == 0}
    keep.add(sizes[-1])
    keep.add(sizes[0])
    return sorted(keep)


def cuda_event_timer(
    repeats: int = DEFAULT_REPEATS, warmup: int = 1
) -> Callable[[Callable[[], None]], float]:
    """A timer for `measure`: runs ``fn`` ``warmup`` times, then ``repeats``
    times between two CUDA events on the current stream; seconds per run.
    Waits for the events (startup only, never in a step)."""
    import torch

    def timer(fn: Callable[[], None]) -> float:
        for _ in range(warmup):
            fn()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000.0 / repeats

    return timer


def measure(
    shapes: Iterable[Any],
    run_step: Callable[[Any], Callable[[], None]],
    timer: Callable[[Callable[[], None]], float],
    log: Callable[[Any, float], None] | None = None,
) -> dict[Any, float]:
    """Seconds per step for every shape: ``run_step(shape)`` prepares the
    shape's inputs and returns the callable that runs one step of it, which
    ``timer`` times; ``log(shape, seconds)`` is called once per shape."""
    out: dict[Any, float] = {}
    for shape in shapes:
        seconds = timer(run_step(shape))
        if not seconds > 0:
            raise ValueError(f"DDTree: timing {shape} gave {seconds} s")
        out[shape] = seconds
        if log is not None:
            log(shape, seconds)
    return out


def combine_step_costs(
    target: Mapping[tuple[int, int], float], drafter: Mapping[int, float]
) -> StepCostTable:
    """The cost table of whole steps: the target's time at (batch size,
    tokens per request), plus, for tree steps (more than one token per
    request), the drafter's query pass at that batch size (piecewise-linear
    between the drafter's timed batch sizes). A step of no speculation
    drafts nothing for the next step (`DDTreeSpeculator` stores the context
    only, which the target's timing includes)."""
    if not drafter:
        raise ValueError("DDTree: no drafter timing to add to the target's")
    batches = np.array(sorted(drafter), dtype=np.float64)
    seconds = np.array([drafter[int(n)] for n in batches], dtype=np.float64)
    return StepCostTable(
        {
            (n, t): s
            + (
                float(piecewise_linear(batches, seconds, np.float64(n)))
                if t > 1
                else 0.0
            )
            for (n, t), s in target.items()
        }
    )


# ----------------------------------------------------------------- the cache
def cache_key(fields: Mapping[str, Any]) -> str:
    blob = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cache_path(cache_root: str, fields: Mapping[str, Any]) -> str:
    """``<cache_root>/ddtree/step_costs/<key>.json``: one file per (model,
    dtype, GPU, parallelism, budgets, ...) as given in ``fields``."""
    return os.path.join(cache_root, "ddtree", "step_costs", cache_key(fields) + ".json")


def save_cached_costs(
    path: str,
    fields: Mapping[str, Any],
    target: Mapping[tuple[int, int], float],
    drafter: Mapping[int, float],
) -> None:
    """Write the timings atomically (a temporary file renamed over the
    target), with the fields they were measured for."""
    payload = {
        "format": CACHE_FORMAT,
        "fields": json.loads(json.dumps(fields, sort_keys=True, default=str)),
        "target": [[n, t, s] for (n, t), s in sorted(target.items())],
        "drafter": [[n, s] for n, s in sorted(drafter.items())],
    }
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_cached_costs(
    path: str, fields: Mapping[str, Any]
) -> tuple[dict[tuple[int, int], float], dict[int, float]] | None:
    """The cached ``(target, drafter)`` timings for ``fields``, or None when
    there is no file, it is for other fields (a key collision) or it does
    not parse."""
    try:
        with open(path) as f:
            payload = json.load(f)
        wanted = json.loads(json.dumps(fields, sort_keys=True, default=str))
        if payload.get("format") != CACHE_FORMAT or payload.get("fields") != wanted:
            return None
        target = {(int(n), int(t)): float(s) for n, t, s in payload["target"]}
        drafter = {int(n): float(s) for n, s in payload["drafter"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not target or not drafter or min([*target.values(), *drafter.values()]) <= 0:
        return None
    return target, drafter
