# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DDTree metrics: Prometheus series and the periodic spec-decode log line.

DDTree reuses vLLM's spec-decode accounting unchanged. Per request and step
the scheduler records ``num_draft_tokens`` = the tree nodes it verified (the
tree budget, fewer near ``max_model_len``) and ``num_accepted_tokens`` = the
tokens emitted minus the bonus token = the depth the walk reached. Hence

- ``vllm:spec_decode_num_accepted_tokens / vllm:spec_decode_num_drafts + 1``
  is DDTree's acceptance length tau (emitted tokens per step, root included);
- ``vllm:spec_decode_num_accepted_tokens_per_pos{position="k"}`` counts the
  steps whose accepted path reached depth ``k + 1``: per-depth acceptance.
  The path is never deeper than ``draft_depth``, so for DDTree those counters
  stop at ``min(tree_budget, draft_depth)`` positions instead of one series
  per tree node (256 mostly-zero series at a budget of 256);
- ``vllm:spec_decode_num_draft_tokens`` counts verified tree nodes, so the
  "draft acceptance rate" (accepted / drafted) is low by construction for a
  tree: most nodes are siblings that cannot all be accepted.

On top of these, DDTree exports (every series derived from the stats the
scheduler already sends; no new engine-core data):

- ``vllm:ddtree_tree_budget`` (gauge): tree nodes verified per request in the
  last step that verified trees: the budget in use. Starts at the configured
  ``tree_budget``.
- ``vllm:ddtree_draft_depth`` (gauge): the DFlash draft depth.
- ``vllm:ddtree_acceptance_length`` (histogram): tokens emitted per request
  per tree step (accepted path + bonus token), buckets 1 .. draft_depth + 1.
- ``vllm:ddtree_num_accepted_tokens_per_depth{depth="d"}`` (counter): steps
  whose accepted path reached depth ``d`` (1 .. draft_depth), the per-depth
  acceptance by its own name.
"""

from typing import TYPE_CHECKING, Any

import prometheus_client

from vllm.v1.metrics.utils import create_metric_per_engine

if TYPE_CHECKING:
    from vllm.config import SpeculativeConfig
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

METRIC_TREE_BUDGET = "vllm:ddtree_tree_budget"
METRIC_DRAFT_DEPTH = "vllm:ddtree_draft_depth"
METRIC_ACCEPTANCE_LENGTH = "vllm:ddtree_acceptance_length"
METRIC_ACCEPTED_PER_DEPTH = "vllm:ddtree_num_accepted_tokens_per_depth"
DDTREE_METRIC_NAMES = (
    METRIC_TREE_BUDGET,
    METRIC_DRAFT_DEPTH,
    METRIC_ACCEPTANCE_LENGTH,
    METRIC_ACCEPTED_PER_DEPTH,
)


def is_ddtree(spec: "SpeculativeConfig | None") -> bool:
    return spec is not None and bool(getattr(spec, "use_ddtree", lambda: False)())


def _depth(spec: "SpeculativeConfig") -> int:
    budget = int(spec.num_speculative_tokens or spec.tree_budget or 0)
    depth = spec.draft_depth if spec.draft_depth is not None else budget
    return max(1, min(budget, int(depth)))


def num_acceptance_positions(spec: "SpeculativeConfig | None", default: int) -> int:
    """Per-position acceptance series to keep: ``default`` (one per
    speculative token) except for DDTree, where position k means depth k + 1
    and the accepted path is at most ``min(tree_budget, draft_depth)`` deep."""
    if not is_ddtree(spec):
        return default
    assert spec is not None
    return min(default, _depth(spec))


def log_label(spec: "SpeculativeConfig | None") -> str:
    """What the periodic spec-decode log line says about the method."""
    if not is_ddtree(spec):
        return ""
    assert spec is not None
    return f" (DDTree, tree_budget={spec.tree_budget}, draft_depth={_depth(spec)})"


def budget_in_use(stats: "SpecDecodingStats") -> int:
    """Most tree nodes verified for one request in this step (0: no tree).

    ``num_draft_tokens_per_pos[i]`` counts the requests with more than ``i``
    draft tokens, so the last non-zero position is the largest tree."""
    per_pos = stats.num_draft_tokens_per_pos
    for i in range(len(per_pos) - 1, -1, -1):
        if per_pos[i] > 0:
            return i + 1
    return 0


def acceptance_length_counts(stats: "SpecDecodingStats") -> list[int]:
    """``counts[k]``: requests of this step that accepted exactly ``k`` nodes
    (emitted ``k + 1`` tokens), recovered from the cumulative per-position
    counters (``per_pos[i]`` = requests with more than ``i`` accepted)."""
    per_pos = list(stats.num_accepted_tokens_per_pos)
    cumulative = [stats.num_drafts, *per_pos, 0]
    counts = [cumulative[k] - cumulative[k + 1] for k in range(len(per_pos) + 1)]
    while len(counts) > 1 and counts[-1] == 0:
        counts.pop()
    return counts


def _metric_classes(counter_cls: Any) -> tuple[Any, Any, Any]:
    if counter_cls is prometheus_client.Counter:
        return (
            prometheus_client.Counter,
            prometheus_client.Gauge,
            prometheus_client.Histogram,
        )
    # The Ray stat logger swaps in its own wrappers with the same API.
    from vllm.v1.metrics.ray_wrappers import (
        RayCounterWrapper,
        RayGaugeWrapper,
        RayHistogramWrapper,
    )

    return RayCounterWrapper, RayGaugeWrapper, RayHistogramWrapper


class DDTreeProm:
    """DDTree's own Prometheus series, fed from ``SpecDecodingStats``.

    Created by ``SpecDecodingProm`` when the speculative config is DDTree and
    observed with the same stats, per engine."""

    def __init__(
        self,
        spec: "SpeculativeConfig",
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
        counter_cls: Any = prometheus_client.Counter,
    ):
        counter, gauge, histogram = _metric_classes(counter_cls)
        self.tree_budget = int(spec.tree_budget or spec.num_speculative_tokens)
        self.draft_depth = _depth(spec)

        self.gauge_tree_budget = create_metric_per_engine(
            gauge(
                name=METRIC_TREE_BUDGET,
                documentation=(
                    "DDTree tree budget in use: tree nodes verified per request "
                    "in the last step that verified trees (configured "
                    "tree_budget until then)."
                ),
                labelnames=labelnames,
                multiprocess_mode="mostrecent",
            ),
            per_engine_labelvalues,
        )
        self.gauge_draft_depth = create_metric_per_engine(
            gauge(
                name=METRIC_DRAFT_DEPTH,
                documentation="DDTree draft depth (DFlash positions per draft).",
                labelnames=labelnames,
                multiprocess_mode="mostrecent",
            ),
            per_engine_labelvalues,
        )
        for idx in per_engine_labelvalues:
            self.gauge_tree_budget[idx].set(self.tree_budget)
            self.gauge_draft_depth[idx].set(self.draft_depth)

        self.histogram_acceptance_length = create_metric_per_engine(
            histogram(
                name=METRIC_ACCEPTANCE_LENGTH,
                documentation=(
                    "DDTree acceptance length: tokens emitted per request per "
                    "tree step (accepted path plus the bonus token)."
                ),
                labelnames=labelnames,
                buckets=[float(n) for n in range(1, self.draft_depth + 2)],
            ),
            per_engine_labelvalues,
        )
        per_depth = counter(
            name=METRIC_ACCEPTED_PER_DEPTH,
            documentation=(
                "DDTree steps whose accepted path reached this depth "
                "(per-depth acceptance = this / vllm:spec_decode_num_drafts)."
            ),
            labelnames=[*labelnames, "depth"],
        )
        self.counter_accepted_per_depth = {
            idx: [per_depth.labels(*lv, str(d)) for d in range(1, self.draft_depth + 1)]
            for idx, lv in per_engine_labelvalues.items()
        }

    def observe(self, stats: "SpecDecodingStats", engine_idx: int = 0) -> None:
        if stats.num_drafts <= 0:
            return
        budget = budget_in_use(stats)
        if budget > 0:
            self.gauge_tree_budget[engine_idx].set(budget)
        histogram = self.histogram_acceptance_length[engine_idx]
        for accepted, count in enumerate(acceptance_length_counts(stats)):
            for _ in range(count):
                histogram.observe(accepted + 1)
        per_pos = stats.num_accepted_tokens_per_pos
        for d, counter in enumerate(self.counter_accepted_per_depth[engine_idx]):
            if d < len(per_pos) and per_pos[d]:
                counter.inc(per_pos[d])
