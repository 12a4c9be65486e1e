# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The measured budget policy on the V2 model runner's worker.

`DDTreeBudgetPlanner` (the verifier's ``budget`` when ``budget_policy`` is
"measured") does three things:

1. once, after the warm-up (`start`, called by the worker): time the decode
   CUDA graphs that were captured for every candidate budget and the DFlash
   drafter's graphs (`step_costs`), or read the timings cached by an earlier
   start with the same model, dtype, GPU, parallelism and budgets; zero the
   acceptance counters (the warm-up's dummy requests must not count); plan
   from the prior and log the schedule;
2. every step that verified trees (`observe_walk`, from the verifier's
   ``sample``): add the walk to the per-rank counters on the device; every
   ``budget_replan_interval`` seconds queue a non-blocking copy of them, and
   on a later step, once it has landed, re-plan; a changed schedule is
   logged. The first intervals are shorter (`FIRST_REPLAN_INTERVAL`,
   doubling up to ``budget_replan_interval``), so that a fresh server leaves
   the prior's plan within seconds of traffic;
3. every step (`begin_step`, called by the runner before the forward):
   time the step before on the host clock (the interval between two
   steps' starts) and add it to `policy.ServedStepCosts` with the table's
   cost of its shape; a re-plan adds to the table what the served steps
   add per step, so that what the graph timings leave out (host work,
   steps that mix in a prefill chunk) weighs in the choice;
4. hand the current schedule to the scheduler: the runner puts `update` (a
   versioned `DynamicSDScheduleUpdate`) into every ``ModelRunnerOutput``; the
   scheduler rebuilds its per-batch-size lookup when the version changes,
   and forwards the schedule with the expected tau per batch size to the
   metrics.

Nothing here waits for the device in a step: the counters are read through
the snapshot (`AcceptanceCounters`), and a re-plan is a few milliseconds of
numpy on the host every interval.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from vllm.logger import init_logger
from vllm.v1.spec_decode.ddtree import policy, step_costs
from vllm.v1.spec_decode.ddtree.acceptance import AcceptanceCounters

if TYPE_CHECKING:
    # The 0.26.0 line's patched vllm/v1/spec_decode/dynamic/utils.py; on
    # other lines the measured policy is refused at startup, so this module
    # must import without it.
    from vllm.v1.spec_decode.dynamic.utils import DynamicSDScheduleUpdate

logger = init_logger(__name__)

# Seconds from `begin` to the first re-plan; each later interval doubles the
# one before, up to ``budget_replan_interval``. The prior (worth
# ``acceptance_prior_weight`` request-steps per rank) tempers plans from few
# counts, and a plan that does not change publishes nothing.
FIRST_REPLAN_INTERVAL = 1.0
# A longer interval between two steps' starts is not a step's cost but an
# idle engine (or a prefill long enough to say nothing about speculation).
MAX_SERVED_STEP_SECONDS = 1.0


class DDTreeBudgetPlanner:
    def __init__(
        self,
        vllm_config: Any,
        device: torch.device,
        clock: Callable[[], float] = time.monotonic,
    ):
        spec = vllm_config.speculative_config
        self.vllm_config = vllm_config
        self.tree_budget: int = spec.tree_budget
        self.draft_depth: int = spec.draft_depth
        self.budgets = policy.candidate_budgets(self.tree_budget, self.draft_depth)
        self.prior = policy.prior_rank_acceptance(
            self.tree_budget, self.draft_depth, spec.acceptance_prior
        )
        self.prior_weight = int(spec.acceptance_prior_weight)
        self.interval = float(spec.budget_replan_interval)
        scheduler_config = vllm_config.scheduler_config
        if getattr(scheduler_config, "async_scheduling", None) is False:
            # Resolved by now (the config check saw only an explicit False).
            from vllm.v1.spec_decode.ddtree.config import ASYNC_SCHEDULING_ERROR

            raise ValueError(ASYNC_SCHEDULING_ERROR)
        self.max_batch_size: int = scheduler_config.max_num_seqs
        self.max_num_batched_tokens: int = scheduler_config.max_num_batched_tokens
        self.acceptance = AcceptanceCounters(self.tree_budget, device)
        # Filled by `start` (or `set_costs`): the step-cost table, the budgets
        # it covers and the largest captured batch size of each.
        self.costs: policy.StepCostTable | None = None
        self.timed_budgets: list[int] = []
        self.max_batch_per_budget: dict[int, int] = {}
        # The schedule the scheduler starts from (the config's), then ours.
        self.schedule: policy.Schedule = [
            (int(a), int(b), int(k))
            for a, b, k in spec.num_speculative_tokens_per_batch_size or ()
        ]
        self.choices: list[policy.BudgetChoice] = []
        # Served steps against the table (`begin_step`): the last step's start
        # (clock), batch size, whether it verified drafts and table seconds.
        self.served = policy.ServedStepCosts()
        self._last_step: tuple[float, int, bool, float] | None = None
        self._table_seconds: dict[tuple[int, int], float] = {}
        self.update: DynamicSDScheduleUpdate | None = None
        self._version = 0
        self._clock = clock
        self._next_snapshot = math.inf  # no re-plan before `start`
        self._snapshot_interval = self.interval
        self.started = False
        self.log_enabled = True

    # ------------------------------------------------------------ per step
    def observe_walk(
        self,
        num_accepted: torch.Tensor,
        src_row: torch.Tensor,
        query_start_loc: torch.Tensor,
        cu_num_logits: torch.Tensor,
    ) -> None:
        """Count one step's walk (device work only) and move the re-plan
        along: queue a snapshot when the interval is over, re-plan once a
        queued one has landed."""
        self.acceptance.count(num_accepted, src_row, query_start_loc, cu_num_logits)
        self._tick()

    def begin_step(
        self,
        num_reqs: int,
        num_draft_tokens_np: Any,
        next_num_draft_tokens: int,
    ) -> bool:
        """At the start of every step that runs the model: the step before
        ends here (its served time, host clock only), this one starts with
        ``num_reqs`` requests verifying the largest of
        ``num_draft_tokens_np`` (the runner's per-request draft counts, a
        numpy array; None: no drafts). A step without drafts moves the
        re-plan along (`observe_walk` does on the others). Returns whether
        this step drafts for the next: the scheduler gives the next step
        ``next_num_draft_tokens`` per request (async scheduling: the
        placeholders it sets from this step's batch size,
        ``SchedulerOutput.num_spec_tokens_to_schedule``). Before `start`
        (the warm-up's steps, which carry no such number) always."""
        if not self.started:
            return True
        now = self._clock()
        if self._last_step is not None:
            start, batch, speculating, table_seconds = self._last_step
            if now - start <= MAX_SERVED_STEP_SECONDS:
                self.served.observe(batch, speculating, now - start, table_seconds)
        budget = (
            0 if num_draft_tokens_np is None else num_draft_tokens_np.max(initial=0)
        )
        self._last_step = (
            now,
            num_reqs,
            budget > 0,
            self._table_cost(num_reqs, budget),
        )
        if budget == 0:
            self._tick()
        return next_num_draft_tokens > 0

    def _table_cost(self, num_reqs: int, budget: int) -> float:
        """The table's seconds for a step's shape (remembered: a step's
        shapes repeat)."""
        key = (num_reqs, budget)
        seconds = self._table_seconds.get(key)
        if seconds is None:
            assert self.costs is not None
            seconds = self.costs.cost(num_reqs, 1 + budget)
            self._table_seconds[key] = seconds
        return seconds

    def _tick(self) -> None:
        """Queue a snapshot of the counters when the interval is over;
        re-plan once a queued one has landed."""
        if self.acceptance.pending:
            if self.acceptance.snapshot_ready():
                self._replan()
        elif self._clock() >= self._next_snapshot:
            self.acceptance.snapshot()
            self._snapshot_interval = min(self.interval, 2 * self._snapshot_interval)
            self._next_snapshot = self._clock() + self._snapshot_interval

    # --------------------------------------------------------------- plan
    def set_costs(
        self,
        target: dict[tuple[int, int], float],
        drafter: dict[int, float],
        max_batch_per_budget: dict[int, int],
    ) -> None:
        """Take the timings (target per (batch, tokens), drafter per batch)
        and the largest captured batch size per budget; budgets without a
        timed graph drop out of the options (0 cannot)."""
        self.costs = step_costs.combine_step_costs(target, drafter)
        self._table_seconds.clear()
        timed_tokens = set(self.costs.token_counts)
        self.timed_budgets = [b for b in self.budgets if 1 + b in timed_tokens]
        if 0 not in self.timed_budgets:
            raise ValueError(
                "DDTree: budget_policy 'measured' found no one-token decode "
                "CUDA graph to time (the no-speculation option); use "
                "budget_policy 'batch'."
            )
        self.max_batch_per_budget = dict(max_batch_per_budget)

    def plan_from_counts(self, accepted, verified) -> list[policy.BudgetChoice]:
        assert self.costs is not None
        return policy.plan(
            self.timed_budgets,
            self.costs,
            accepted,
            verified,
            self.prior,
            self.max_batch_size,
            self.prior_weight,
            self.max_num_batched_tokens,
            self.max_batch_per_budget,
            self.served,
        )

    def begin(self) -> None:
        """Counting starts from zero and the first plan comes from the prior
        (the costs are set)."""
        self.acceptance.counts.zero_()
        zeros = [0] * self.tree_budget
        self._publish(self.plan_from_counts(zeros, zeros), None)
        self._snapshot_interval = min(self.interval, FIRST_REPLAN_INTERVAL)
        self._next_snapshot = self._clock() + self._snapshot_interval
        self._last_step = None
        self.started = True

    def _replan(self) -> None:
        """From the landed snapshot (host memory, no device access)."""
        if self.costs is None:
            return
        accepted_np, verified_np = self.acceptance.host_np
        accepted, verified = accepted_np.tolist(), verified_np.tolist()
        observed = dict(policy.summarize_counts(accepted, verified))
        observed["served"] = self.served.describe()
        self._publish(self.plan_from_counts(accepted, verified), observed)
        # Recent steps weigh most in the next plan.
        self.served.decay()

    def _publish(
        self,
        choices: list[policy.BudgetChoice],
        observed: Any,
    ) -> None:
        schedule = policy.as_schedule(choices)
        self.choices = choices
        if self.update is not None and schedule == self.schedule:
            return
        self.schedule = schedule
        self._version += 1
        from vllm.v1.spec_decode.dynamic.utils import DynamicSDScheduleUpdate

        self.update = DynamicSDScheduleUpdate(
            version=self._version,
            schedule=schedule,
            expected_acceptance_length=[c.expected_tau for c in choices],
        )
        if not self.log_enabled:
            return
        described = ", ".join(
            (f"{c.first}-{c.last}" if c.last < self.max_batch_size else f">={c.first}")
            + f": {c.budget} (tau {c.expected_tau:.2f})"
            for c in choices
        )
        if observed is None:
            logger.info(
                "DDTree measured budget policy: schedule by batch size %s "
                "(0 = no speculation; tau from the prior until counted).",
                described,
            )
        else:
            logger.info(
                "DDTree measured budget policy re-planned after %d tree "
                "request-steps (observed tau %.2f; served steps over the "
                "startup timings: %s): schedule by batch size %s.",
                observed["tree_steps"],
                1.0 + observed["accepted_per_step"],
                observed["served"],
                described,
            )

    # ------------------------------------------------------------ startup
    def start(self, runner: Any) -> None:
        """After the warm-up: step costs (cached or timed on the captured
        graphs), then `begin`. Called on every worker; tensor-parallel ranks
        time the same graphs in the same order (their replays all-reduce)
        and share rank 0's decision to use the cache and its timings."""
        from vllm.distributed.parallel_state import get_tp_group

        tp = get_tp_group()
        self.log_enabled = tp.rank_in_group == 0
        fields = cost_cache_fields(runner, self.budgets)
        path = step_costs.cache_path(_cache_root(), fields)
        cached = None
        if self.log_enabled:
            cached = step_costs.load_cached_costs(path, fields)
        if tp.world_size > 1:
            cached = tp.broadcast_object(cached, src=0)
        target_shapes, drafter_shapes = captured_decode_shapes(runner, self.budgets)
        max_batch = max_batch_per_tokens(target_shapes)
        if cached is not None:
            target, drafter = cached
            if self.log_enabled:
                logger.info("DDTree: step costs read from %s.", path)
        else:
            target, drafter = measure_step_costs(
                runner, target_shapes, drafter_shapes, self.log_enabled
            )
            if tp.world_size > 1:
                target, drafter = tp.broadcast_object((target, drafter), src=0)
            if self.log_enabled:
                step_costs.save_cached_costs(path, fields, target, drafter)
                logger.info("DDTree: step costs cached in %s.", path)
        self.set_costs(
            target,
            drafter,
            {b: max_batch.get(1 + b, 0) for b in self.budgets},
        )
        self.begin()


# ------------------------------------------------- the runner's CUDA graphs
def captured_decode_shapes(
    runner: Any, budgets: list[int]
) -> tuple[dict[tuple[int, int], Any], dict[int, Any]]:
    """The FULL decode graphs to time: the target's per (batch size, 1 +
    budget) for the candidate budgets, and the drafter's per batch size,
    each thinned to `step_costs.timed_batch_sizes`."""
    from vllm.config.compilation import CUDAGraphMode

    tokens = {1 + b for b in budgets}
    target: dict[tuple[int, int], Any] = {}
    manager = runner.cudagraph_manager
    for desc in getattr(manager, "graphs", {}):
        if (
            desc.cg_mode == CUDAGraphMode.FULL
            and desc.uniform_token_count in tokens
            and desc.num_active_loras == 0
            and desc.num_reqs
        ):
            target[(desc.num_reqs, desc.uniform_token_count)] = desc
    kept: dict[tuple[int, int], Any] = {}
    for t in sorted({t for _, t in target}):
        for n in step_costs.timed_batch_sizes(n for n, tt in target if tt == t):
            kept[(n, t)] = target[(n, t)]
    drafter: dict[int, Any] = {}
    query_manager = getattr(runner.speculator, "query_cudagraph_manager", None)
    for desc in getattr(query_manager, "graphs", {}):
        if desc.cg_mode == CUDAGraphMode.FULL and desc.num_reqs:
            drafter[desc.num_reqs] = desc
    drafter = {n: drafter[n] for n in step_costs.timed_batch_sizes(drafter)}
    if not kept or not drafter:
        raise ValueError(
            "DDTree: budget_policy 'measured' found no decode CUDA graphs to "
            f"time (target: {len(kept)}, drafter: {len(drafter)}); it needs "
            "full decode CUDA graphs (cudagraph_mode FULL_AND_PIECEWISE, the "
            "default, or FULL_DECODE_ONLY); use budget_policy 'batch'."
        )
    return kept, drafter


def max_batch_per_tokens(shapes: dict[tuple[int, int], Any]) -> dict[int, int]:
    out: dict[int, int] = {}
    for n, t in shapes:
        out[t] = max(out.get(t, 0), n)
    return out


def measure_step_costs(
    runner: Any,
    target_shapes: dict[tuple[int, int], Any],
    drafter_shapes: dict[int, Any],
    log: bool,
    timer: Callable[[Callable[[], None]], float] | None = None,
) -> tuple[dict[tuple[int, int], float], dict[int, float]]:
    """Time the graphs: for a target shape, its replay plus the logits and
    argmax of every verified token and the drafter's context K/V precompute
    of the step's tokens (outside the drafter's graph); for a drafter shape,
    its replay. Inputs are prepared as for the capture (dummy requests whose
    context is their own query: short contexts)."""
    timer = timer or step_costs.cuda_event_timer()

    def log_target(shape: tuple[int, int], seconds: float) -> None:
        if log:
            logger.info(
                "DDTree step cost: target %d requests x %d tokens (budget %d): %.3f ms",
                shape[0],
                shape[1],
                shape[1] - 1,
                seconds * 1e3,
            )

    def log_drafter(n: int, seconds: float) -> None:
        if log:
            logger.info(
                "DDTree step cost: drafter %d requests: %.3f ms", n, seconds * 1e3
            )

    with torch.inference_mode():
        target = step_costs.measure(
            sorted(target_shapes),
            lambda shape: _target_step(runner, target_shapes[shape]),
            timer,
            log_target,
        )
        drafter = step_costs.measure(
            sorted(drafter_shapes),
            lambda n: _drafter_step(runner.speculator, drafter_shapes[n]),
            timer,
            log_drafter,
        )
    return target, drafter


def _target_step(runner: Any, desc: Any) -> Callable[[], None]:
    from vllm.v1.worker.gpu.cudagraph_utils import prepare_inputs_to_capture

    num_reqs, num_tokens = desc.num_reqs, desc.num_tokens
    runner.model_state.prepare_dummy_inputs(num_reqs, num_tokens)
    prepare_inputs_to_capture(
        num_reqs,
        num_tokens,
        runner.model_state,
        runner.input_buffers,
        runner.block_tables,
        runner.attn_groups,
        runner.kv_cache_config,
    )
    runner.input_buffers.is_padding.fill_(True)
    manager = runner.cudagraph_manager
    model = runner.model
    drafter = runner.speculator.model
    positions = runner.speculator.context_positions[:num_tokens]

    def step() -> None:
        output = manager.run_fullgraph(desc)
        hidden, aux = output if isinstance(output, tuple) else (output, [])
        model.compute_logits(hidden).argmax(dim=-1)
        context = torch.cat(aux, dim=-1) if aux else hidden
        drafter.precompute_and_store_context_kv(
            drafter.combine_hidden_states(context), positions
        )

    return step


def _drafter_step(speculator: Any, desc: Any) -> Callable[[], None]:
    from vllm.v1.worker.gpu.spec_decode.dflash.cudagraph import (
        _prepare_dflash_inputs_to_capture,
    )

    _prepare_dflash_inputs_to_capture(
        desc.num_reqs,
        desc.num_tokens,
        speculator.input_buffers,
        speculator.block_tables,
        speculator.attn_groups,
        speculator.kv_cache_config,
        speculator.max_model_len,
        skip_attn=False,
        causal=speculator._group_causal,
    )
    manager = speculator.query_cudagraph_manager
    return lambda: manager.run_fullgraph(desc)


def cost_cache_fields(runner: Any, budgets: list[int]) -> dict[str, Any]:
    """What the timings depend on: the cache key."""
    import vllm

    config = runner.vllm_config
    spec = config.speculative_config
    model = config.model_config
    return {
        "model": model.model,
        "revision": getattr(model, "revision", None),
        "dtype": str(model.dtype),
        "kv_cache_dtype": str(config.cache_config.cache_dtype),
        "gpu": torch.cuda.get_device_name(runner.device),
        "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
        "drafter": spec.model,
        "tree_budget": spec.tree_budget,
        "draft_depth": spec.draft_depth,
        "budgets": list(budgets),
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "cudagraph_capture_sizes": list(
            config.compilation_config.cudagraph_capture_sizes or []
        ),
        "vllm": vllm.__version__,
    }


def _cache_root() -> str:
    import vllm.envs as envs

    return envs.VLLM_CACHE_ROOT
