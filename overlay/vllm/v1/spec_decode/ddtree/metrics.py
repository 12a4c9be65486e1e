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

Per batch size, at the batch sizes ``1, 2, 4, .. 1024`` (label
``batch_size``; a step of ``n`` tree-verifying requests counts at the
smallest label ``>= n``):

- ``vllm:ddtree_budget_by_batch_size`` (gauge): the tree budget the schedule
  gives that batch size (0 = no speculation): the configured schedule, then
  each schedule the measured policy applies;
- ``vllm:ddtree_expected_acceptance_length`` (gauge, measured policy): the
  tau the policy expects there when it chose that budget;
- ``vllm:ddtree_tree_requests_by_batch_size`` and
  ``vllm:ddtree_emitted_tokens_by_batch_size`` (counters): request-steps that
  verified a tree, and the tokens they emitted; their ratio is the observed
  tau at that batch size.
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
METRIC_BUDGET_BY_BATCH = "vllm:ddtree_budget_by_batch_size"
METRIC_EXPECTED_TAU = "vllm:ddtree_expected_acceptance_length"
METRIC_TREE_REQUESTS_BY_BATCH = "vllm:ddtree_tree_requests_by_batch_size"
METRIC_EMITTED_BY_BATCH = "vllm:ddtree_emitted_tokens_by_batch_size"
DDTREE_METRIC_NAMES = (
    METRIC_TREE_BUDGET,
    METRIC_DRAFT_DEPTH,
    METRIC_ACCEPTANCE_LENGTH,
    METRIC_ACCEPTED_PER_DEPTH,
    METRIC_BUDGET_BY_BATCH,
    METRIC_EXPECTED_TAU,
    METRIC_TREE_REQUESTS_BY_BATCH,
    METRIC_EMITTED_BY_BATCH,
)
# The batch sizes the per-batch-size series are kept at.
BATCH_SIZE_LABELS = tuple(2**k for k in range(11))


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


def batch_size_label(num_requests: int) -> int:
    """The label a step of ``num_requests`` tree-verifying requests counts
    at: the smallest of `BATCH_SIZE_LABELS` that is ``>= num_requests``."""
    for label in BATCH_SIZE_LABELS:
        if num_requests <= label:
            return label
    return BATCH_SIZE_LABELS[-1]


def budget_at(schedule: "list | None", batch: int, tree_budget: int) -> int:
    """The budget a ``(first, last, budget[, ...])`` schedule gives ``batch``
    requests: the range holding it, else the last range's before it (as
    upstream's lookup carries it forward); ``tree_budget`` with no schedule."""
    if not schedule:
        return tree_budget
    budget = schedule[0][2]
    for entry in sorted(schedule):
        if entry[0] > batch:
            break
        budget = entry[2]
    return int(budget)


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

        by_batch = [*labelnames, "batch_size"]
        budget_gauge = gauge(
            name=METRIC_BUDGET_BY_BATCH,
            documentation=(
                "DDTree tree budget the schedule gives this batch size (0 = no "
                "speculation)."
            ),
            labelnames=by_batch,
            multiprocess_mode="mostrecent",
        )
        expected_gauge = gauge(
            name=METRIC_EXPECTED_TAU,
            documentation=(
                "DDTree measured budget policy: acceptance length (tokens per "
                "request per step) it expects at this batch size."
            ),
            labelnames=by_batch,
            multiprocess_mode="mostrecent",
        )
        requests_counter = counter(
            name=METRIC_TREE_REQUESTS_BY_BATCH,
            documentation=(
                "DDTree request-steps that verified a tree, by the step's number "
                "of tree-verifying requests (counted at the smallest label >= it)."
            ),
            labelnames=by_batch,
        )
        emitted_counter = counter(
            name=METRIC_EMITTED_BY_BATCH,
            documentation=(
                "DDTree tokens emitted by tree-verifying requests, by batch size "
                "as vllm:ddtree_tree_requests_by_batch_size (their ratio: the "
                "observed acceptance length)."
            ),
            labelnames=by_batch,
        )
        schedule = spec.num_speculative_tokens_per_batch_size
        self.gauge_budget_by_batch: dict[int, dict[int, Any]] = {}
        self.gauge_expected_by_batch: dict[int, dict[int, Any]] = {}
        self.counter_requests_by_batch: dict[int, dict[int, Any]] = {}
        self.counter_emitted_by_batch: dict[int, dict[int, Any]] = {}
        for idx, lv in per_engine_labelvalues.items():
            self.gauge_budget_by_batch[idx] = {
                n: budget_gauge.labels(*lv, str(n)) for n in BATCH_SIZE_LABELS
            }
            self.gauge_expected_by_batch[idx] = {
                n: expected_gauge.labels(*lv, str(n)) for n in BATCH_SIZE_LABELS
            }
            self.counter_requests_by_batch[idx] = {
                n: requests_counter.labels(*lv, str(n)) for n in BATCH_SIZE_LABELS
            }
            self.counter_emitted_by_batch[idx] = {
                n: emitted_counter.labels(*lv, str(n)) for n in BATCH_SIZE_LABELS
            }
            for n, g in self.gauge_budget_by_batch[idx].items():
                g.set(budget_at(schedule, n, self.tree_budget))

    def observe(self, stats: "SpecDecodingStats", engine_idx: int = 0) -> None:
        schedule = getattr(stats, "dynamic_sd_schedule", None)
        if schedule:
            # A schedule the measured policy applied: budget and expected
            # tau at each labelled batch size.
            for n in BATCH_SIZE_LABELS:
                entry = _entry_at(schedule, n)
                self.gauge_budget_by_batch[engine_idx][n].set(entry[2])
                self.gauge_expected_by_batch[engine_idx][n].set(entry[3])
        if stats.num_drafts <= 0:
            return
        label = batch_size_label(stats.num_drafts)
        self.counter_requests_by_batch[engine_idx][label].inc(stats.num_drafts)
        self.counter_emitted_by_batch[engine_idx][label].inc(
            stats.num_drafts + stats.num_accepted_tokens
        )
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


def _entry_at(schedule: list, batch: int) -> tuple:
    """The ``(first, last, budget, tau)`` entry covering ``batch`` (the last
    one before it when none does)."""
    chosen = schedule[0]
    for entry in sorted(schedule):
        if entry[0] > batch:
            break
        chosen = entry
    return tuple(chosen)
