# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The "measured" budget policy: the tree budget with the most tokens per
second at each batch size, from measured step costs and counted acceptance.

Plain Python and numpy (no torch, no vLLM): the worker feeds it the per-rank counters
it keeps on the device and the step-cost table it measures at startup, and
publishes the schedule it returns.

Expected tokens per step. The draft tree keeps its nodes in rank order (the
tree build pops the most probable prefix first), and a node's ancestors all
have a smaller rank: a prefix is at least as probable as its extension. The
first ``b`` nodes are therefore the optimal ``b``-node tree (one draft serves
every budget) and, with greedy or sampled verification alike, the walk over
those ``b`` nodes accepts exactly the nodes of rank ``< b`` that the walk
over the whole tree accepts (the accepted path leaves the prefix at its first
node of rank ``>= b`` and never comes back, ranks growing along a path). So

    tau(b) = 1 + sum_{r < b} P(rank r accepted)

and ``P(rank r accepted)`` is estimated from the steps that verified rank
``r``, whatever their budget: ``accepted[r] / verified[r]``, with a prior
(`prior_rank_acceptance`) worth ``prior_weight`` request-steps until enough
are seen.

Step cost. `StepCostTable` holds measured step times at (batch size, tokens
verified per request) points and interpolates piecewise-linearly in tokens
and in batch size; budget ``b`` verifies ``1 + b`` tokens per request, and
budget 0 (no speculation) is the one-token decode step.

Served steps. The table times CUDA-graph replays; a served step adds what
the host does around them and the steps that mix a new prompt's prefill
into the batch, which cost more with speculation than without (H200,
Qwen3.6-27B shape: served DDTree steps 1.1-2.6x the table from 1 to 64
requests, steps without speculation 1.06-1.16x). `ServedStepCosts` keeps
the served step times against the table's, per batch size and for steps
with and without speculation, and adds what the served steps add
(`ServedStepCosts.cost_fn`). A kind of step never served keeps the table's
cost: the optimistic guess, so that an option that the table favours is
tried and then judged by its own served steps.

The choice (`choose_budgets`): for each batch size, the budget with the
largest ``batch * tau(b) / cost(batch, 1 + b)``, budget 0 having ``tau = 1``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

# (first batch size, last batch size, budget): upstream's dynamic
# speculative-decoding schedule (``num_speculative_tokens_per_batch_size``).
Schedule = list[tuple[int, int, int]]

# The prior's per-depth acceptance: the probability that the drafter's most
# probable token at a depth is the target's, given the path so far. 0.8 sits
# in the range the DDTree paper's DFlash chains imply on Qwen3-8B (tau 4.28 on
# MT-Bench, 6.61 on HumanEval, 7.79 on MATH-500 at 15 positions, i.e.
# sum_{d<=15} a^d: a = 0.77, 0.86, 0.89 per depth). It
# is deliberately on the hopeful side: a batch size the policy sends to
# budget 0 verifies no tree, so a pessimistic prior could keep speculation
# off before a single tree had been counted; an optimistic one lets the
# counts correct it.
DEFAULT_PRIOR_ACCEPTANCE = 0.8
# Request-steps the prior is worth per rank: about a second of decoding at
# a few hundred tokens per second. Counted acceptance outweighs it quickly.
DEFAULT_PRIOR_WEIGHT = 256


def power_of_two_budgets(tree_budget: int, draft_depth: int) -> list[int]:
    """The tree budgets the "batch" policy may pick: ``tree_budget``, the
    floor ``min(tree_budget, draft_depth)``, and the powers of two between
    twice the floor and ``tree_budget``. Few on purpose: each budget needs
    its own decode CUDA graphs."""
    floor = min(tree_budget, draft_depth)
    allowed = {tree_budget, floor}
    step = 1
    while step < tree_budget:
        if step >= 2 * floor:
            allowed.add(step)
        step *= 2
    return sorted(allowed)


def candidate_budgets(tree_budget: int, draft_depth: int) -> list[int]:
    """The options of the "measured" policy: no speculation (0), the budgets
    ``2^k - 1`` below the "batch" policy's floor ``min(tree_budget,
    draft_depth)`` (1, 3, 7 for the default 64 / 15), and the "batch"
    policy's tree budgets.

    The small trees are for large batches, where a step's cost grows with
    the tokens it verifies: at 32 requests on a Qwen3-8B shape (H200) a
    16-token-per-request step took 17.6 ms against 6.1 ms for one token; on
    a Qwen3.6-27B shape, whose Gated DeltaNet layers cost per verified
    token, 102 ms at 32 requests against 25 ms for one-token steps of 64.
    4 or 8 tokens per request keep most of the first ranks' acceptance at a
    fraction of that cost. ``1 + b`` is a power of two so that the steps'
    token counts fall on the captured CUDA-graph sizes."""
    floor = min(tree_budget, draft_depth)
    small = []
    tokens = 2
    while tokens - 1 < floor:
        small.append(tokens - 1)
        tokens *= 2
    return [0, *small, *power_of_two_budgets(tree_budget, draft_depth)]


# ----------------------------------------------------------------- acceptance
def prior_rank_acceptance(
    tree_budget: int, draft_depth: int, per_depth: float = DEFAULT_PRIOR_ACCEPTANCE
) -> list[float]:
    """Acceptance probability of each rank under a calibrated model drafter.

    At every depth the drafter's ``k``-th most probable token (``k = 0, 1,
    ...``) has probability ``a (1 - a)^k`` (``a = per_depth``), and is the
    target's with that same probability (a calibrated drafter). A prefix of
    depth ``d`` whose tokens have ranks ``k_1 .. k_d`` then has probability
    ``a^d (1 - a)^(k_1 + .. + k_d)``, which is both its rank key in the tree
    build and its acceptance probability. The result lists the
    ``tree_budget`` largest such probabilities (depth at most
    ``draft_depth``), largest first: entry ``r`` is the prior for rank ``r``.
    """
    if not 0.0 < per_depth < 1.0:
        raise ValueError(f"per-depth acceptance must be in (0, 1), got {per_depth}")
    miss = 1.0 - per_depth
    # Prefixes of depth d with rank sum s: C(s + d - 1, d - 1) of them, each
    # with probability a^d (1 - a)^s. No more than tree_budget are needed
    # from any (d, s), and s beyond tree_budget cannot make the cut (the
    # depth-1 prefixes of rank sum 0 .. tree_budget - 1 already fill it).
    groups: list[tuple[float, int]] = []
    for depth in range(1, draft_depth + 1):
        for rank_sum in range(tree_budget):
            count = math.comb(rank_sum + depth - 1, depth - 1)
            prob = per_depth**depth * miss**rank_sum
            groups.append((prob, min(count, tree_budget)))
    groups.sort(key=lambda g: -g[0])
    out: list[float] = []
    for prob, count in groups:
        out.extend([prob] * min(count, tree_budget - len(out)))
        if len(out) == tree_budget:
            break
    return out


def rank_acceptance(
    accepted: Sequence[float],
    verified: Sequence[float],
    prior: Sequence[float],
    prior_weight: float = DEFAULT_PRIOR_WEIGHT,
) -> list[float]:
    """Estimated acceptance probability of each rank: counted acceptance
    (``accepted[r]`` of ``verified[r]`` request-steps that verified rank
    ``r``) smoothed with ``prior_weight`` pseudo request-steps of ``prior``.
    With no counts this is the prior; counts take over as they grow."""
    if not (len(accepted) == len(verified) == len(prior)):
        raise ValueError(
            f"per-rank lengths differ: {len(accepted)}, {len(verified)}, {len(prior)}"
        )
    return [
        (a + prior_weight * p) / (v + prior_weight) if v + prior_weight > 0 else p
        for a, v, p in zip(accepted, verified, prior)
    ]


def expected_tau(rates: Sequence[float]) -> list[float]:
    """``tau[b]`` = expected tokens per request per step at budget ``b``
    (``b = 0 .. len(rates)``): the bonus token plus the expected accepted
    nodes among ranks ``< b``."""
    tau = [1.0]
    for rate in rates:
        tau.append(tau[-1] + rate)
    return tau


# ----------------------------------------------------------------------- cost
def piecewise_linear(xs: np.ndarray, ys: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Piecewise-linear through ``(xs, ys)`` (``xs`` increasing), constant
    below the first point, extended along the last segment above the last
    one (step cost keeps growing with the work past the measurements)."""
    if len(xs) == 1:
        return np.full(np.shape(x), ys[0], dtype=np.float64)
    i = np.clip(np.searchsorted(xs, x, side="right") - 1, 0, len(xs) - 2)
    y = ys[i] + (ys[i + 1] - ys[i]) * (x - xs[i]) / (xs[i + 1] - xs[i])
    return np.where(x <= xs[0], ys[0], y)


@dataclass
class StepCostTable:
    """Step time (seconds) at measured (batch size, tokens per request)
    points; ``tokens per request = 1 + budget`` (1: a plain decode step).

    `cost` interpolates piecewise-linearly in batch size along each measured
    token count, then in tokens between the two nearest token counts. Points
    need not form a full grid: each token count has its own batch sizes (the
    CUDA graphs captured for a budget depend on it)."""

    points: dict[tuple[int, int], float]

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("a step-cost table needs at least one point")
        rows: dict[int, list[tuple[int, float]]] = {}
        for (batch, tokens), seconds in self.points.items():
            if batch < 1 or tokens < 1 or not seconds > 0:
                raise ValueError(
                    f"bad step-cost point (batch={batch}, tokens={tokens}): {seconds}"
                )
            rows.setdefault(tokens, []).append((batch, seconds))
        self._tokens = np.array(sorted(rows), dtype=np.float64)
        self._rows = [
            np.array(sorted(rows[int(t)]), dtype=np.float64).T for t in self._tokens
        ]

    @property
    def token_counts(self) -> list[int]:
        return [int(t) for t in self._tokens]

    def cost(self, batch: float | np.ndarray, tokens: float) -> float | np.ndarray:
        """Seconds per step at ``batch`` requests (a number or an array) of
        ``tokens`` tokens each."""
        x = np.asarray(batch, dtype=np.float64)
        per_row = np.stack([piecewise_linear(b, s, x) for b, s in self._rows])
        if len(self._tokens) == 1:
            out = per_row[0]
        else:
            j = int(
                np.clip(
                    np.searchsorted(self._tokens, tokens, "right") - 1,
                    0,
                    len(self._tokens) - 2,
                )
            )
            t0, t1 = self._tokens[j], self._tokens[j + 1]
            lo, hi = per_row[j], per_row[j + 1]
            out = (
                lo
                if tokens <= self._tokens[0]
                else lo + (hi - lo) * (tokens - t0) / (t1 - t0)
            )
        out = np.maximum(out, 1e-9)
        return float(out) if out.ndim == 0 else out

    def to_json(self) -> list[list[float]]:
        return [[b, t, s] for (b, t), s in sorted(self.points.items())]

    @classmethod
    def from_json(cls, rows: Iterable[Sequence[float]]) -> StepCostTable:
        return cls({(int(b), int(t)): float(s) for b, t, s in rows})


# Seconds per step at (batch sizes, tokens per request); batch sizes an array.
CostFn = Callable[[np.ndarray, int], np.ndarray]


# ---------------------------------------------------------- served steps
# Served steps a (batch size, speculation or not) needs before what they
# add to the table counts, and the weight left to the sums at each re-plan
# (recent traffic counts most).
DEFAULT_MIN_SERVED_STEPS = 16
DEFAULT_SERVED_DECAY = 0.5


class ServedStepCosts:
    """Served step times against the step-cost table's, per (batch size,
    whether the step verified drafts).

    `observe` adds one served step: its wall time and the table's cost of
    its shape. What a batch size's steps add to the table is the difference
    of the sums per step (a step that mixes in a prefill chunk weighs by its
    time, as it does in throughput), once ``min_steps`` steps were served
    there. It is added, not scaled: the host work and the prefill chunks a
    step carries need not grow with its tree, and a multiple of the table
    would rate the smaller trees of a batch size too cheap. `cost_fn` adds
    it to the table, linear between the observed batch sizes and constant
    past them; steps with drafts and steps without each their own. `decay`
    scales the sums down (called at each re-plan), so that new steps
    outweigh old ones; it does not forget what no new step replaces: a
    batch size the plan moved away from a kind of step keeps that kind's
    figure (forgetting it would bring back the table's cost, and the plan
    back to the option it left)."""

    def __init__(
        self,
        min_steps: int = DEFAULT_MIN_SERVED_STEPS,
        decay: float = DEFAULT_SERVED_DECAY,
    ):
        if min_steps < 1 or not 0.0 < decay <= 1.0:
            raise ValueError(f"bad served-step settings: {min_steps}, {decay}")
        self.min_steps = min_steps
        self.decay_factor = decay
        # (batch, speculating) -> [served seconds, table seconds, weight,
        # steps]: the first three decayed, the served steps not.
        self.sums: dict[tuple[int, bool], list[float]] = {}

    def observe(
        self, batch: int, speculating: bool, seconds: float, table_seconds: float
    ) -> None:
        acc = self.sums.setdefault((batch, speculating), [0.0, 0.0, 0.0, 0.0])
        acc[0] += seconds
        acc[1] += table_seconds
        acc[2] += 1.0
        acc[3] += 1.0

    def decay(self) -> None:
        for acc in self.sums.values():
            for i in range(3):
                acc[i] *= self.decay_factor

    def extra(self, speculating: bool) -> tuple[np.ndarray, np.ndarray]:
        """Batch sizes with at least ``min_steps`` served steps and the
        seconds their steps add to the table, by batch size."""
        points = sorted(
            (batch, (acc[0] - acc[1]) / acc[2])
            for (batch, spec), acc in self.sums.items()
            if spec == speculating and acc[3] >= self.min_steps
        )
        xs = np.array([b for b, _ in points], dtype=np.float64)
        return xs, np.array([e for _, e in points], dtype=np.float64)

    def cost_fn(self, table: StepCostTable) -> CostFn:
        by_kind = {spec: self.extra(spec) for spec in (False, True)}

        def cost(batches: np.ndarray, tokens: int) -> np.ndarray:
            base = np.asarray(table.cost(batches, tokens), dtype=np.float64)
            xs, es = by_kind[tokens > 1]
            if len(xs) == 0:
                return base
            added = np.interp(np.asarray(batches, dtype=np.float64), xs, es)
            return np.maximum(base + added, 1e-9)

        return cost

    def describe(self) -> str:
        """``with drafts +2.9 ms (1) .. +63.2 ms (64); without +3.4 ms (64)``."""
        parts = []
        for spec, name in ((True, "with drafts"), (False, "without")):
            xs, es = self.extra(spec)
            if len(xs) == 0:
                continue
            ends = [(int(xs[0]), es[0])]
            if len(xs) > 1:
                ends.append((int(xs[-1]), es[-1]))
            parts.append(
                name + " " + " .. ".join(f"{e * 1e3:+.1f} ms ({n})" for n, e in ends)
            )
        return "; ".join(parts) if parts else "none yet"


# --------------------------------------------------------------------- choice
@dataclass(frozen=True)
class BudgetChoice:
    """The budget for the batch sizes ``first .. last`` and what the policy
    expected of it at ``first``: tokens per request per step and tokens per
    second."""

    first: int
    last: int
    budget: int
    expected_tau: float
    tokens_per_second: float


def choose_budgets(
    budgets: Sequence[int],
    tau: Sequence[float],
    cost: CostFn,
    max_batch_size: int,
    max_num_batched_tokens: int | None = None,
    max_batch_per_budget: Mapping[int, int] | None = None,
) -> list[BudgetChoice]:
    """For every batch size ``1 .. max_batch_size`` the budget with the most
    tokens per second, ``batch * tau[b] / cost(batch, 1 + b)``, merged into
    ranges of equal budget.

    ``tau[b]`` for every budget (`expected_tau`; ``tau[0] = 1``). A budget
    whose full decode batch would not fit ``max_num_batched_tokens`` is left
    out at that batch size (the scheduler would cut its drafts); budget 0
    always fits. So is a budget past ``max_batch_per_budget[b]`` requests
    (its largest captured CUDA graph: beyond it the step runs without one,
    far slower than the table's extrapolation). Exact ties go to the
    smaller budget. Vectorised over batch
    sizes: a re-plan over 1024 batch sizes takes well under a millisecond.
    """
    if 0 not in budgets:
        raise ValueError(f"the options must include budget 0, got {list(budgets)}")
    if max(budgets) >= len(tau):
        raise ValueError(f"tau covers budgets < {len(tau)}, got {max(budgets)}")
    options = sorted(budgets)
    batches = np.arange(1, max_batch_size + 1, dtype=np.float64)
    rates = np.empty((len(options), max_batch_size))
    for i, budget in enumerate(options):
        rates[i] = batches * tau[budget] / cost(batches, 1 + budget)
        if budget > 0 and max_num_batched_tokens is not None:
            rates[i][batches * (1 + budget) > max_num_batched_tokens] = -np.inf
        if budget > 0 and max_batch_per_budget is not None:
            rates[i][batches > max_batch_per_budget.get(budget, 0)] = -np.inf
    best = np.argmax(rates, axis=0)  # first maximum: the smaller budget
    starts = [0, *(np.flatnonzero(np.diff(best)) + 1).tolist(), max_batch_size]
    out: list[BudgetChoice] = []
    for first, end in zip(starts, starts[1:]):
        i = int(best[first])
        out.append(
            BudgetChoice(
                first + 1,
                end,
                options[i],
                float(tau[options[i]]),
                float(rates[i, first]),
            )
        )
    return out


def as_schedule(choices: Sequence[BudgetChoice]) -> Schedule:
    return [(c.first, c.last, c.budget) for c in choices]


def describe_schedule(schedule: Sequence[tuple[int, int, int]], top: int) -> str:
    """``1-1: 64, 2-3: 32, >=4: 15`` (``top``: the last batch size the
    schedule is built for, written as an open end)."""
    return ", ".join(
        f"{lo}-{hi}: {budget}" if hi < top else f">={lo}: {budget}"
        for lo, hi, budget in schedule
    )


def max_spec_rows_per_step(max_num_batched_tokens: int, budgets: Sequence[int]) -> int:
    """The most speculative (tree) rows one step verifies: the rows the Gated
    DeltaNet verify buffers need.

    ``budgets``: the tree budget of each batch size ``1 .. max_num_seqs``
    (index ``b - 1``) for the whole run: the scheduler's lookup of the
    budget schedule (vLLM's `build_dynamic_sd_schedule_lookup`), or
    ``tree_budget`` at every batch size where there is none or where it may
    change at runtime (the "measured" policy).

    A step's spec rows are its decode rows (vLLM 0.34.0 counts every decode
    row, drafts or none; 0.26.0 only those with drafts): one row each, at
    most ``max_num_seqs``, plus their draft tokens, and never more than the
    step's tokens, ``max_num_batched_tokens``. A request's drafts were
    proposed at the last step that scheduled it, ``K(b)`` of them, ``b``
    that step's batch size (the scheduler picks the next proposal's budget
    from the step's own batch size). A running request that a step does not
    schedule keeps its drafts, so the drafts of one step may come from
    several earlier steps; but the scheduler passes over a decoding request
    only where it stops (token budget spent, no KV blocks left) or where the
    request is about to finish (pipeline-stage cadence aside, which DDTree
    refuses): every request after it waits too. Number the requests with
    drafts ``1 .. n`` in the running order (append-only: admissions and
    resumed requests go last): the last step that scheduled request ``j``
    also scheduled every request before it (no cut came before ``j``),
    so ``b >= j`` there, and its drafts number at most
    ``K^(j) = max_{b >= j} K(b)``. Hence the drafts of a step are at most
    ``sum_{j=1..max_num_seqs} K^(j)``: for the "batch" policy's 64 / 32 /
    15 schedule at 64 requests, 64 + 2 x 32 + 61 x 15 = 1043, a little
    more than the 64 x 15 of a step whose requests all come from one
    proposal. CUDA-graph padding rows come after the real rows (the
    buffers keep the first rows; the commit reads only the real ones).
    vLLM's kernel warmup builds its decode steps outside the scheduler; the
    warmup patch of each line makes them draft by the schedule too."""
    drafts = 0
    largest_from_here = 0
    for budget in reversed(budgets):
        largest_from_here = max(largest_from_here, budget)
        drafts += largest_from_here
    return min(max_num_batched_tokens, len(budgets) + drafts)


def plan(
    budgets: Sequence[int],
    costs: StepCostTable,
    accepted: Sequence[float],
    verified: Sequence[float],
    prior: Sequence[float],
    max_batch_size: int,
    prior_weight: float = DEFAULT_PRIOR_WEIGHT,
    max_num_batched_tokens: int | None = None,
    max_batch_per_budget: Mapping[int, int] | None = None,
    served: ServedStepCosts | None = None,
) -> list[BudgetChoice]:
    """The whole policy: acceptance estimate, tau per budget, choice (on
    the table's costs plus what the served steps add, if given)."""
    rates = rank_acceptance(accepted, verified, prior, prior_weight)
    tau = expected_tau(rates)
    return choose_budgets(
        budgets,
        tau,
        costs.cost if served is None else served.cost_fn(costs),
        max_batch_size,
        max_num_batched_tokens,
        max_batch_per_budget,
    )


def summarize_counts(
    accepted: Sequence[float], verified: Sequence[float]
) -> Mapping[str, float]:
    """Observed totals for log lines: request-steps that verified a tree and
    accepted nodes per such step."""
    steps = verified[0] if verified else 0
    return {
        "tree_steps": float(steps),
        "accepted_per_step": float(sum(accepted)) / steps if steps else 0.0,
    }
