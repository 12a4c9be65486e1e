# SPDX-License-Identifier: Apache-2.0
"""What an in-process vLLM engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
can say about how many requests it runs: its KV cache's capacity and the
most requests its scheduler had running. The benchmarks record both, so a
row measured at a concurrency the engine could not hold says so."""

from __future__ import annotations

from bench.common import progress


def engine_core(llm):
    """The engine core of an in-process engine, or None."""
    return getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)


def engine_max_concurrency(llm) -> float | None:
    """The engine's capacity in concurrent requests of ``max_model_len``
    tokens (vLLM's "Maximum concurrency" startup figure; on a hybrid target
    the chain keeps a recurrent state per draft position)."""
    core = engine_core(llm)
    if core is None:
        return None
    try:
        from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

        return round(
            get_max_concurrency_for_kv_cache_config(
                core.vllm_config, core.scheduler.kv_cache_config
            ),
            2,
        )
    except (ImportError, AttributeError, TypeError) as e:
        # step_cost's rows then take vLLM's startup line (engine_rows).
        progress("engine_probe", f"no KV-cache capacity from the engine: {e!r}")
        return None


class RunningProbe:
    """The most requests the scheduler of an in-process engine had running
    after any step while active (``with probe:``); None without one."""

    def __init__(self, llm):
        core = engine_core(llm)
        self.max_running: int | None = None
        self.active = False
        if core is None:
            return
        scheduler, schedule = core.scheduler, core.scheduler.schedule

        def probed_schedule(*args, **kwargs):
            out = schedule(*args, **kwargs)
            if self.active:
                self.max_running = max(self.max_running or 0, len(scheduler.running))
            return out

        scheduler.schedule = probed_schedule

    def __enter__(self) -> RunningProbe:
        self.active = True
        return self

    def __exit__(self, *exc) -> None:
        self.active = False
