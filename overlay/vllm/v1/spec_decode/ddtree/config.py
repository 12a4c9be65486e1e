# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Configuration of DDTree tree speculative decoding.

DDTree (arXiv 2604.12989) drafts with a DFlash model and verifies a tree of
``tree_budget`` nodes per step instead of a chain. The method stays
``"ddtree"`` in the resolved config (``SpeculativeConfig.use_ddtree()``); the
upstream code paths that serve any DFlash drafter (aux hidden states, the
draft model loader, context K/V precompute, the scheduler's lookahead) ask
``SpeculativeConfig.use_dflash()``, which is true for both methods. The
scheduler sees ``num_speculative_tokens = tree_budget`` (tokens verified per
step), while the DFlash pass predicts ``draft_depth`` positions.

Every check here raises ``ValueError`` with one readable line, so that a bad
configuration stops ``LLM(...)`` or ``vllm serve`` at startup.
"""

import importlib.util
import math
import os
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger
from vllm.v1.spec_decode.ddtree.policy import (
    candidate_budgets,
    describe_schedule,
    power_of_two_budgets,
)

if TYPE_CHECKING:
    from vllm.config import SpeculativeConfig, VllmConfig

logger = init_logger(__name__)

DDTREE_METHOD = "ddtree"
DEFAULT_TREE_BUDGET = 64

# DDTree's own options, with their defaults: fields of the patched
# SpeculativeConfig on the 0.26.0 line; the keys of ``speculator_options`` where
# vLLM's speculative-method interface registers DDTree (0.34.0 and later).
DDTREE_OPTION_DEFAULTS: dict[str, Any] = {
    "tree_budget": None,
    "draft_depth": None,
    "budget_policy": None,
    "verify_tokens_per_step": 128,
    "budget_replan_interval": 10.0,
    "acceptance_prior": 0.8,
    "acceptance_prior_weight": 256,
}


def ddtree_options(speculator_options: object) -> dict[str, Any]:
    """DDTree's options from ``speculator_options``, defaults filled in; a
    one-line refusal of anything else."""
    if speculator_options is None:
        speculator_options = {}
    if not isinstance(speculator_options, dict):
        raise ValueError(
            "DDTree: speculator_options must be a mapping of DDTree's options "
            f"({', '.join(DDTREE_OPTION_DEFAULTS)}), got "
            f"{type(speculator_options).__name__}."
        )
    unknown = sorted(set(speculator_options) - set(DDTREE_OPTION_DEFAULTS))
    if unknown:
        raise ValueError(
            f"DDTree: unknown speculator_options {', '.join(map(repr, unknown))}; "
            f"DDTree takes {', '.join(DDTREE_OPTION_DEFAULTS)}."
        )
    return {**DDTREE_OPTION_DEFAULTS, **speculator_options}


class SpecWithDDTreeOptions:
    """A `SpeculativeConfig` of vLLM's speculative-method interface seen with
    DDTree's options (its ``speculator_options``) as attributes and "ddtree"
    as its method: the code shared with the 0.26.0 line, whose patched config
    has the options as fields, reads and writes both alike (options into the
    dict, anything else into the config)."""

    method = DDTREE_METHOD

    def __init__(self, spec: "SpeculativeConfig", options: dict[str, Any]):
        object.__setattr__(self, "_spec", spec)
        object.__setattr__(self, "_options", options)

    def __getattr__(self, name: str) -> Any:
        options = self.__dict__["_options"]
        if name in options:
            return options[name]
        return getattr(self.__dict__["_spec"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in DDTREE_OPTION_DEFAULTS:
            self._options[name] = value
        else:
            setattr(self._spec, name, value)

    def use_ddtree(self) -> bool:
        return True


def ddtree_speculative_config(spec: Any) -> Any:
    """``spec`` with DDTree's options as attributes (``tree_budget``,
    ``draft_depth``, ...): the 0.26.0 line's patched config itself, or a
    `SpecWithDDTreeOptions` view of a config whose custom method is DDTree
    (its ``speculator_options``, resolved by DDTree's `SpeculatorConfig`)."""
    if spec is None or hasattr(spec, "tree_budget"):
        return spec
    return SpecWithDDTreeOptions(spec, ddtree_options(spec.speculator_options))


def is_ddtree(spec: "SpeculativeConfig | None") -> bool:
    """Whether ``spec`` runs DDTree: its method is "ddtree" (the 0.26.0 line's
    patched config keeps it), or its custom method is (vLLM's speculative-method
    interface, where ``method`` becomes the base method, "dflash")."""
    return spec is not None and DDTREE_METHOD in (
        spec.method,
        getattr(spec, "custom_method", None),
    )


# The Triton unified-attention kernel takes the per-request tree bias; the
# other backends have no per-request mask that works inside CUDA graphs.
DDTREE_TARGET_ATTENTION_BACKEND = "TRITON_ATTN"
# Hybrid targets whose linear-attention layers are Qwen's Gated DeltaNet
# (`QwenGatedDeltaNetAttention`), the only ones DDTree's tree kernels cover.
DDTREE_HYBRID_ARCHITECTURES = (
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
    "Qwen3NextForCausalLM",
)
# DFlash-family drafters (vLLM 0.28+) whose drafts are not independent
# per-position distributions: DFlash2 and LiLiCorr score each position's top-K
# candidates given the previous position's pick (a candidate selector), and
# XPress refines the drafted chain. A DDTree tree is the best prefix tree of
# the product of per-depth distributions, which these drafters do not define.
# The names as the checkpoint gives them; EAGLEConfig may add a "DFlash" prefix.
DDTREE_CHAIN_ONLY_DRAFTERS = {
    "DFlash2DraftModel": "scores each position's candidates given the previous "
    "position's pick (DFlash2's candidate selector)",
    "DFlash2BeamDraftModel": "scores each position's candidates given the "
    "previous position's pick (DFlash2's candidate selector)",
    "LiLiCorrDraftModel": "scores each position's candidates given the previous "
    "position's pick (its candidate head)",
    "Qwen3XPressModel": "refines the drafted chain (XPress)",
}
# KV-cache dtypes the tree verification takes. The target's KV goes through
# TRITON_ATTN's core unified kernel, which adds the per-request tree bias
# for unquantised, FP8 per-tensor and INT8 / FP8 per-token-head caches; the
# compaction copies whole (block, head, slot) rows, inline per-token-head
# scales included (per-tensor scales do not move). INT4 per-token-head runs
# a packed kernel that takes no per-request bias; the other vLLM dtypes are
# not TRITON_ATTN's.
DDTREE_KV_CACHE_DTYPES = (
    "auto",
    "float16",
    "bfloat16",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
    "int8_per_token_head",
    "fp8_per_token_head",
)
# Targets whose ALiBi bias is set in the model code, not in the HF config
# (``ModelConfig.uses_alibi`` covers Bloom, Falcon, MPT and the config flag).
DDTREE_ALIBI_ARCHITECTURES = ("Step1ForCausalLM",)
DDTREE_BUDGET_POLICIES = ("batch", "fixed", "measured")
# ``VLLM_DDTREE_BACKEND``: the tree-build implementation (tree.py).
DDTREE_BUILD_BACKENDS = ("auto", "torch", "triton")


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"DDTree: {name} must be a positive integer, got {value!r}.")
    return value


# The vLLM release lines whose DDTree has passed its GPU exactness and speed
# checks. A build on another line (CPU-checked only) refuses DDTree unless
# the user opts in, so that nobody serves an unverified tree path unknowingly.
GPU_CHECKED_VLLM_LINES = ("0.26",)
ALLOW_UNVERIFIED_LINE_ENV = "VLLM_DDTREE_ALLOW_UNVERIFIED_LINE"


def verify_release_line(vllm_version: str) -> None:
    """One-line refusal of DDTree on a vLLM line without GPU checks, unless
    ``VLLM_DDTREE_ALLOW_UNVERIFIED_LINE=1``."""
    line = ".".join(vllm_version.split("+")[0].split(".")[:2])
    if line in GPU_CHECKED_VLLM_LINES:
        return
    if os.environ.get(ALLOW_UNVERIFIED_LINE_ENV) == "1":
        logger.warning_once(
            "DDTree on vLLM %s: this release line has passed its CPU checks "
            "only, not its GPU exactness and speed checks (%s=1).",
            vllm_version,
            ALLOW_UNVERIFIED_LINE_ENV,
        )
        return
    raise ValueError(
        f"DDTree: this build's vLLM {vllm_version} release line has passed its "
        "CPU checks only, not its GPU exactness and speed checks; use the "
        "vllm-ddtree build on vLLM 0.26.0, serve with method 'dflash', or set "
        f"{ALLOW_UNVERIFIED_LINE_ENV}=1 to try it."
    )


def resolve_ddtree_method(spec: "SpeculativeConfig") -> None:
    """Validate the DDTree fields and size the step by the tree budget.

    Called first thing in ``SpeculativeConfig.__post_init__`` when the method
    is ``"ddtree"`` or a DDTree field is set, before the draft model config
    is created.
    """
    if (
        spec.method == DDTREE_METHOD
        and spec.tree_budget is not None
        and spec.num_speculative_tokens == spec.tree_budget
    ):
        # Already resolved: a copy (``replace()`` runs __post_init__ again).
        return
    if spec.method != DDTREE_METHOD:
        raise ValueError(
            "DDTree: tree_budget and draft_depth are only valid with "
            f"method='ddtree', got method={spec.method!r}."
        )
    from vllm.version import __version__ as vllm_version

    verify_release_line(vllm_version)
    if spec.model is None:
        raise ValueError(
            "DDTree: speculative_config needs 'model', the path of a DFlash "
            "draft checkpoint."
        )
    # Here, not only in the engine-level checks: the drafter's own parallel
    # config fails upstream's validation of a pipeline-parallel speculative
    # config (a DFlash model is not pipeline-parallel) before those run.
    _verify_pipeline_parallel_size(
        getattr(spec.target_parallel_config, "pipeline_parallel_size", 1)
    )
    if spec.num_speculative_tokens is not None:
        raise ValueError(
            "DDTree: do not set num_speculative_tokens; set tree_budget (tokens "
            "verified per step) and draft_depth (positions the DFlash pass "
            f"predicts) instead (got num_speculative_tokens="
            f"{spec.num_speculative_tokens})."
        )
    if spec.tree_budget is None:
        spec.tree_budget = DEFAULT_TREE_BUDGET
    _check_positive_int("tree_budget", spec.tree_budget)
    if spec.draft_depth is not None:
        _check_positive_int("draft_depth", spec.draft_depth)
    if spec.draft_sample_method != "greedy":
        raise ValueError(
            "DDTree: draft_sample_method must be 'greedy' (the tree is built "
            "from the draft log-probabilities; it is lossless for any target "
            f"sampling), got {spec.draft_sample_method!r}."
        )
    if getattr(spec, "enable_adaptive_verification", False):
        # vLLM 0.33+: per-request trimming of the verified drafts from the
        # drafter's confidences. DDTree's budget policy sizes the tree; two
        # policies must not both act on one step.
        raise ValueError(
            "DDTree: enable_adaptive_verification trims each request's "
            "verified drafts, which DDTree's budget_policy sizes; unset "
            "enable_adaptive_verification (budget_policy decides under DDTree)."
        )
    if spec.rejection_sample_method != "standard":
        raise ValueError(
            "DDTree: rejection_sample_method must be 'standard' (the tree walk "
            f"replaces rejection sampling), got {spec.rejection_sample_method!r}."
        )
    # The scheduler, the KV lookahead and the CUDA-graph sizes all count the
    # tokens verified per step: that is the tree budget.
    spec.num_speculative_tokens = spec.tree_budget


def verify_ddtree_drafter(
    spec: "SpeculativeConfig", unset_policy_runs_as: str | None = None
) -> None:
    """Check the draft model and fix ``draft_depth`` once it is loaded.

    ``unset_policy_runs_as``: the policy an unset ``budget_policy`` becomes
    once checked and scheduled as the default ("measured"), where the default
    cannot run (the 0.34.0 line: "batch", the schedule it starts from)."""
    draft_model_config = spec.draft_model_config
    if draft_model_config is None:
        raise ValueError("DDTree: the draft model config could not be created.")
    hf_config = draft_model_config.hf_config
    # EAGLEConfig prefixes every architecture with "DFlash", so look at the
    # checkpoint's own config (kept as ``.model``) to tell a real drafter.
    checkpoint_config = getattr(hf_config, "model", None) or hf_config
    architectures = list(getattr(checkpoint_config, "architectures", None) or [])
    is_dflash = (
        any(a.startswith("DFlash") or a.endswith("DFlash") for a in architectures)
        or getattr(checkpoint_config, "dflash_config", None) is not None
    )
    if not is_dflash:
        raise ValueError(
            "DDTree: the draft model must be a DFlash drafter (e.g. "
            "DFlashDraftModel with a dflash_config), got architectures "
            f"{architectures}."
        )
    names = architectures + list(getattr(hf_config, "architectures", None) or [])
    for name in names:
        why = DDTREE_CHAIN_ONLY_DRAFTERS.get(
            name, DDTREE_CHAIN_ONLY_DRAFTERS.get(name.removeprefix("DFlash"))
        )
        if why is not None:
            raise ValueError(
                f"DDTree: the drafter {name} {why}, so it gives no per-position "
                "distributions to build a tree from; serve it with method "
                "'dflash'."
            )
    block_size = _draft_block_size(hf_config)
    max_depth = block_size - 1 if block_size else None
    if spec.draft_depth is None:
        if max_depth is None:
            raise ValueError(
                "DDTree: the drafter config has no block_size; set draft_depth."
            )
        spec.draft_depth = max_depth
    elif max_depth is not None and spec.draft_depth > max_depth:
        raise ValueError(
            f"DDTree: draft_depth={spec.draft_depth} exceeds the drafter's "
            f"block_size - 1 = {max_depth}."
        )
    _apply_budget_policy(spec)
    if spec.budget_policy is None and unset_policy_runs_as is not None:
        spec.budget_policy = unset_policy_runs_as
    logger.info(
        "DDTree tree speculative decoding: tree_budget=%d nodes verified per "
        "step, draft_depth=%d DFlash positions, budget policy %s.",
        spec.tree_budget,
        spec.draft_depth,
        _describe_schedule(spec),
    )


def budget_schedule(
    tree_budget: int,
    draft_depth: int,
    verify_tokens_per_step: int,
    max_batch_size: int = 1024,
) -> list[tuple[int, int, int]]:
    """The tree budget for each batch size, as (first, last, budget) ranges.

    Verification cost is flat in the number of query tokens until the target
    becomes compute-bound, then grows linearly; a tree that grows with the
    batch turns that into lost throughput. The budget is the largest
    power-of-two step below ``verify_tokens_per_step / batch - 1`` (few
    distinct budgets: each needs its own decode CUDA graphs), capped by
    ``tree_budget``, and never below ``draft_depth`` nodes: a tree of D nodes
    verifies as many tokens per request as the DFlash chain of length D and,
    being the optimal D-node tree for the drafter, expects at least the
    chain's acceptance. The floor is D itself, not a power of two above it:
    a batch of 32 then verifies 32 x (1 + 15) = 512 tokens, inside vLLM's
    largest captured CUDA graph, where 16-node trees (544 tokens) ran without
    CUDA graphs (H200, tinypair: 10.4 ms per step against the chain's 6.8 ms).

    The default cap, 128 tokens, comes from the same GPU: at 8 requests,
    32-node trees (264 tokens a step) lost to the chain (0.99x; 11.7 ms per
    step against its 7.5 ms under the profiler) while 15-node trees at 32
    requests and 64-node trees at 1 request beat it; 128 keeps 64 nodes for
    one request, 32 for two or three, and the floor from four on.
    """
    floor = min(tree_budget, draft_depth)
    choices = power_of_two_budgets(tree_budget, draft_depth)
    schedule: list[tuple[int, int, int]] = []
    for batch in range(1, max_batch_size + 1):
        raw = verify_tokens_per_step // batch - 1
        budget = max(c for c in choices if c <= max(raw, floor))
        if schedule and schedule[-1][2] == budget:
            schedule[-1] = (schedule[-1][0], batch, budget)
        else:
            schedule.append((batch, batch, budget))
    return schedule


def _apply_budget_policy(spec: "SpeculativeConfig") -> None:
    """Check the policy and set its starting schedule. Unset (``None``), the
    policy is "measured" unless the user pinned a schedule ("batch" keeps
    it); whether "measured" can run on this engine (CUDA graphs, async
    scheduling, one data-parallel rank) is known only with the whole engine
    config: `_resolve_default_budget_policy` decides there, and until then
    the schedule is the one "measured" starts from."""
    assert spec.tree_budget is not None and spec.draft_depth is not None
    if spec.budget_policy is None and spec.num_speculative_tokens_per_batch_size:
        spec.budget_policy = "batch"
    if spec.budget_policy is not None and (
        spec.budget_policy not in DDTREE_BUDGET_POLICIES
    ):
        raise ValueError(
            "DDTree: budget_policy must be 'batch', 'fixed' or 'measured', got "
            f"{spec.budget_policy!r}."
        )
    if spec.budget_policy in ("measured", None):
        _verify_measured_policy(spec)
    if spec.num_speculative_tokens_per_batch_size is not None:
        return  # The user's own schedule pins the budget per batch size.
    if spec.budget_policy == "fixed":
        return
    _check_positive_int("verify_tokens_per_step", spec.verify_tokens_per_step)
    schedule = budget_schedule(
        spec.tree_budget, spec.draft_depth, spec.verify_tokens_per_step
    )
    # The measured policy starts from the batch policy's schedule and always
    # runs as a dynamic schedule: it may move any batch size to any of its
    # budgets, no speculation included.
    if len(schedule) > 1 or spec.budget_policy in ("measured", None):
        spec.num_speculative_tokens_per_batch_size = schedule


def _verify_measured_policy(spec: "SpeculativeConfig") -> None:
    if spec.num_speculative_tokens_per_batch_size is not None:
        raise ValueError(
            "DDTree: budget_policy 'measured' chooses the budget per batch size "
            "itself; drop num_speculative_tokens_per_batch_size, or keep it with "
            "budget_policy 'batch' to pin the schedule."
        )
    interval = spec.budget_replan_interval
    if (
        isinstance(interval, bool)
        or not isinstance(interval, (int, float))
        or not 0 < interval < math.inf
    ):
        raise ValueError(
            "DDTree: budget_replan_interval must be a positive number of "
            f"seconds, got {interval!r}."
        )
    prior = spec.acceptance_prior
    if (
        isinstance(prior, bool)
        or not isinstance(prior, (int, float))
        or not (0 < prior < 1)
    ):
        raise ValueError(
            "DDTree: acceptance_prior must be a per-depth acceptance probability "
            f"strictly between 0 and 1, got {prior!r}."
        )
    weight = spec.acceptance_prior_weight
    if isinstance(weight, bool) or not isinstance(weight, int) or weight < 0:
        raise ValueError(
            "DDTree: acceptance_prior_weight must be a non-negative integer "
            f"(request-steps), got {weight!r}."
        )


def capture_budgets(spec: "SpeculativeConfig") -> list[int]:
    """Tree budgets whose decode CUDA graphs the target needs: those of the
    schedule, and for the measured policy every budget it may switch to at
    runtime (`policy.candidate_budgets`, 0 = a plain decode step)."""
    budgets = {k for _, _, k in spec.num_speculative_tokens_per_batch_size or ()}
    if spec.budget_policy == "measured":
        assert spec.tree_budget is not None and spec.draft_depth is not None
        budgets.update(candidate_budgets(spec.tree_budget, spec.draft_depth))
    return sorted(budgets)


def _describe_schedule(spec: "SpeculativeConfig") -> str:
    schedule = spec.num_speculative_tokens_per_batch_size
    if spec.budget_policy in ("measured", None):
        assert spec.tree_budget is not None and spec.draft_depth is not None
        return (
            ("measured" if spec.budget_policy else "measured, the default")
            + " (budgets "
            + ", ".join(map(str, candidate_budgets(spec.tree_budget, spec.draft_depth)))
            + " by batch size, 0 = no speculation; until the step costs are "
            "measured: " + describe_schedule(schedule or [], 1024) + ")"
        )
    if not schedule:
        return f"fixed (tree_budget={spec.tree_budget} at every batch size)"
    return "by batch size: " + describe_schedule(schedule, 1024)


def _draft_block_size(hf_config: object) -> int | None:
    for owner in (hf_config, getattr(hf_config, "dflash_config", None)):
        if owner is None:
            continue
        value = getattr(owner, "block_size", None)
        if value is None and isinstance(owner, dict):
            value = owner.get("block_size")
        if isinstance(value, int) and value > 1:
            return value
    return None


def is_drafter_attention_config(attention_config: object) -> bool:
    """Whether an attention config is the DFlash drafter's: upstream derives
    the drafter's VllmConfig from the target's with ``use_non_causal`` set
    (DFlash drafters attend to their block non-causally), which a causal
    target's never has."""
    return bool(getattr(attention_config, "use_non_causal", False))


def verify_ddtree_vllm_config(vllm_config: "VllmConfig") -> None:
    """Engine-level checks: the V2 model runner, the Triton target backend
    (and ``VLLM_DDTREE_TREE_ATTENTION``), and what the tree verification
    cannot do (pipeline stages, KV-cache dtypes other than the kernels', KV
    connectors, windowed or ALiBi target attention, Gated DeltaNet hybrids
    only)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.spec_decode.ddtree.tree_attention import verify_tree_attention

    attention_config = vllm_config.attention_config
    if is_drafter_attention_config(attention_config):
        # The DFlash drafter's own config, derived from the target's when the
        # drafter loads (with the drafter's backend, `speculative_config.
        # attention_backend`, or None: chosen automatically). The tree is the
        # target's to verify; the drafter attends as in the chain (on an
        # H100/H200 FlashAttention: its context K/V store is one C++ op per
        # layer, where TRITON_ATTN's is a Triton launch each).
        return
    # (vLLM 0.34.0 and later have the V2 model runner only, and no switch.)
    if not getattr(vllm_config, "use_v2_model_runner", True):
        raise ValueError(
            "DDTree runs on the V2 model runner only; unset "
            "VLLM_USE_V2_MODEL_RUNNER=0 or use method='dflash'."
        )
    triton = AttentionBackendEnum[DDTREE_TARGET_ATTENTION_BACKEND]
    if attention_config.backend is None:
        attention_config.backend = triton
        logger.info(
            "DDTree: using the %s attention backend (per-request tree attention).",
            DDTREE_TARGET_ATTENTION_BACKEND,
        )
    elif attention_config.backend != triton:
        raise ValueError(
            "DDTree needs the TRITON_ATTN attention backend for the target "
            f"(per-request tree attention), got {attention_config.backend.name}."
        )
    _verify_tree_build_backend()
    _verify_pipeline_parallel(vllm_config)
    _verify_kv_cache_dtype(vllm_config)
    verify_tree_attention(vllm_config)
    _verify_kv_transfer(vllm_config)
    _verify_drafting_slots(vllm_config)
    _resolve_default_budget_policy(vllm_config)
    _verify_measured_budget_policy(vllm_config)
    if vllm_config.model_config is not None:
        _verify_target_attention(vllm_config)
        _verify_ddtree_target(vllm_config)


def _verify_drafting_slots(vllm_config: "VllmConfig") -> None:
    """Upstream reserves ``max_num_seqs * (draft_depth - 1)`` drafting slots
    out of ``max_num_batched_tokens`` and stops later, in a multi-line
    validation error that names num_speculative_tokens. `vllm serve` on an
    H100/H200 defaults to 1024 sequences and 8192 batched tokens, which a
    15-deep DFlash pass overruns: say it here, on one line, with the knobs."""
    scheduler_config = getattr(vllm_config, "scheduler_config", None)
    spec = getattr(vllm_config, "speculative_config", None)
    if scheduler_config is None or spec is None:
        return
    if getattr(scheduler_config, "max_num_scheduled_tokens", None) is not None:
        return  # set by the user: upstream checks it
    slots_per_seq = spec.max_num_new_slots_for_drafting
    max_num_seqs = scheduler_config.max_num_seqs
    batched = scheduler_config.max_num_batched_tokens
    if slots_per_seq * max_num_seqs < batched:
        return
    fitting_seqs = (
        batched - 1
    ) // slots_per_seq  # > 0 here: the product reached batched
    # The README's quickstart value where it fits, else the largest that does.
    example = min(256, fitting_seqs)
    raise ValueError(
        f"DDTree: max_num_seqs={max_num_seqs} requests x {slots_per_seq} "
        f"drafting slots each leave none of "
        f"max_num_batched_tokens={batched} to schedule; pass --max-num-seqs "
        f"(at most {fitting_seqs}; e.g. {example}) or a larger "
        f"--max-num-batched-tokens."
    )


# Without async scheduling the V2 runner reports every request's drafts as
# tree_budget placeholders and the scheduler verifies all of them, whatever
# its per-batch-size schedule says; only the async scheduler sizes the next
# step's drafts by the schedule.
ASYNC_SCHEDULING_ERROR = (
    "DDTree: budget_policy 'measured' needs async scheduling (without it "
    "every request verifies tree_budget nodes whatever the schedule); drop "
    "--no-async-scheduling or use budget_policy 'fixed'."
)


def _measured_policy_blocker(vllm_config: "VllmConfig") -> tuple[str, str] | None:
    """Why the measured policy cannot run on this engine config, or None:
    (the reason, for the default's fall-back line; the one-line error, for
    an explicit choice). It times the captured full decode CUDA graphs at
    startup and changes the scheduler's per-batch-size budget at runtime:
    it needs those graphs, async scheduling, and one scheduler per set of
    workers (data-parallel ranks picking different budgets would diverge;
    upstream turns dynamic schedules off under data parallelism for that
    reason)."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is not None and getattr(model_config, "enforce_eager", False):
        return (
            "times the decode CUDA graphs at startup, and enforce_eager is set",
            "DDTree: budget_policy 'measured' times the decode CUDA graphs at "
            "startup, and enforce_eager turns them off; drop --enforce-eager or "
            "use budget_policy 'batch'.",
        )
    compilation_config = getattr(vllm_config, "compilation_config", None)
    mode = getattr(compilation_config, "cudagraph_mode", None)
    if mode is not None and not mode.has_full_cudagraphs():
        return (
            "times the full decode CUDA graphs at startup, and cudagraph_mode "
            f"{mode.name} has none",
            "DDTree: budget_policy 'measured' times the full decode CUDA graphs "
            f"at startup, and cudagraph_mode {mode.name} has none; drop "
            "cudagraph_mode or use budget_policy 'batch'.",
        )
    scheduler_config = getattr(vllm_config, "scheduler_config", None)
    if getattr(scheduler_config, "async_scheduling", None) is False:
        return (
            "needs async scheduling, and --no-async-scheduling is set",
            ASYNC_SCHEDULING_ERROR,
        )
    parallel_config = getattr(vllm_config, "parallel_config", None)
    dp = getattr(parallel_config, "data_parallel_size", 1)
    if dp > 1:
        return (
            f"does not support data parallelism (data_parallel_size={dp})",
            f"DDTree: budget_policy 'measured' does not support data parallelism "
            f"(data_parallel_size={dp}): each rank would pick its own budgets and "
            "the ranks' steps would diverge; use budget_policy 'batch' or "
            "'fixed'.",
        )
    return None


def _resolve_default_budget_policy(vllm_config: "VllmConfig") -> None:
    """An unset budget_policy: "measured" where it can run, else "batch",
    with a startup line that says why."""
    spec = getattr(vllm_config, "speculative_config", None)
    # (A config without the field has nothing to resolve.)
    if not hasattr(spec, "budget_policy") or spec.budget_policy is not None:
        return
    blocker = _measured_policy_blocker(vllm_config)
    reason = blocker[0] if blocker else None
    tp = getattr(
        getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1
    )
    if reason is None and tp > 1:
        # It supports tensor parallelism (the ranks time the same graphs and
        # share rank 0's table) but has not run so: opt in explicitly.
        reason = (
            f"has not yet run under tensor parallelism (tensor_parallel_size={tp}; "
            "set budget_policy 'measured' to use it)"
        )
    if reason is None:
        spec.budget_policy = "measured"
        return
    spec.budget_policy = "batch"
    schedule = spec.num_speculative_tokens_per_batch_size
    if schedule is not None and len(schedule) <= 1:
        # What the batch policy keeps: a schedule only where the budget
        # changes with the batch size.
        spec.num_speculative_tokens_per_batch_size = None
    logger.info(
        "DDTree: budget policy batch, not the default measured, which %s; schedule %s.",
        reason,
        _describe_schedule(spec),
    )


def _verify_measured_budget_policy(vllm_config: "VllmConfig") -> None:
    """Refuse "measured" (chosen, or resolved by
    `_resolve_default_budget_policy`, which runs first) where it cannot run
    (`_measured_policy_blocker`), in one line."""
    spec = getattr(vllm_config, "speculative_config", None)
    if getattr(spec, "budget_policy", None) == "measured":
        blocker = _measured_policy_blocker(vllm_config)
        if blocker is not None:
            raise ValueError(blocker[1])
        return
    scheduler_config = getattr(vllm_config, "scheduler_config", None)
    if getattr(scheduler_config, "async_scheduling", None) is False and getattr(
        spec, "num_speculative_tokens_per_batch_size", None
    ):
        logger.warning(
            "DDTree: without async scheduling every request verifies "
            "tree_budget=%s nodes per step; the per-batch-size budget "
            "schedule applies only with async scheduling (drop "
            "--no-async-scheduling).",
            getattr(spec, "tree_budget", None),
        )


def _verify_tree_build_backend() -> None:
    """``VLLM_DDTREE_BACKEND`` is read when the first tree is built, inside
    the engine (tree.py); a bad value would stop it there, mid-start or at
    the first decode step. Checked here instead."""
    backend = os.environ.get("VLLM_DDTREE_BACKEND", "auto")
    if backend not in DDTREE_BUILD_BACKENDS:
        raise ValueError(
            f"DDTree: VLLM_DDTREE_BACKEND={backend!r} is not a tree-build "
            "backend; set it to 'auto', 'torch' or 'triton', or unset it."
        )
    if backend == "triton" and importlib.util.find_spec("triton") is None:
        raise ValueError(
            "DDTree: VLLM_DDTREE_BACKEND='triton' but Triton is not "
            "importable here; unset it (the torch backend builds the same "
            "tree)."
        )


def _verify_pipeline_parallel(vllm_config: "VllmConfig") -> None:
    parallel_config = getattr(vllm_config, "parallel_config", None)
    _verify_pipeline_parallel_size(
        getattr(parallel_config, "pipeline_parallel_size", 1)
    )


def _verify_pipeline_parallel_size(pp: int) -> None:
    """Only the last pipeline stage has the verifier (tree positions, tree
    attention bias, compaction); the earlier stages would run the tree's
    nodes as a chain of consecutive tokens."""
    if pp > 1:
        raise ValueError(
            f"DDTree does not support pipeline parallelism (pipeline_parallel_"
            f"size={pp}): only the last stage verifies the tree, the others "
            "would attend over its nodes as a chain; use --tensor-parallel-size "
            "instead of --pipeline-parallel-size."
        )


def _verify_kv_cache_dtype(vllm_config: "VllmConfig") -> None:
    cache_config = getattr(vllm_config, "cache_config", None)
    dtype = getattr(cache_config, "cache_dtype", "auto")
    if dtype in DDTREE_KV_CACHE_DTYPES:
        return
    if dtype == "int4_per_token_head":
        reason = "its packed INT4 attention kernel takes no per-request tree bias"
    else:
        reason = "the TRITON_ATTN backend that verifies the tree does not take it"
    raise ValueError(
        f"DDTree does not support kv_cache_dtype={dtype!r} ({reason}); pass "
        "--kv-cache-dtype auto, bfloat16, float16, fp8, fp8_e4m3, fp8_e5m2, "
        "int8_per_token_head or fp8_per_token_head, or use method='dflash'."
    )


def _verify_kv_transfer(vllm_config: "VllmConfig") -> None:
    """A verify step writes the whole tree at consecutive KV slots, rejected
    nodes included; the accepted path is compacted after sampling, outside
    the forward. A connector that saves layer by layer (``save_kv_layer``,
    inside the forward) sends the tree before that. Connectors that store
    later (the native offloading connector defers its stores to the next
    step's start and counts only computed tokens) may be safe, but none has
    been run against the compaction: all are refused. ``--kv-offloading-size``
    becomes a connector later in ``VllmConfig.__post_init__``, after this
    hook: refused here too."""
    kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
    if kv_transfer_config is not None:
        connector = getattr(kv_transfer_config, "kv_connector", None)
        raise ValueError(
            f"DDTree does not support KV connectors (kv_transfer_config with "
            f"kv_connector={connector!r}): none has been checked against the "
            "tree's KV compaction (a per-layer saver sends a verify step's KV, "
            "the whole tree, before the accepted path is compacted); remove "
            "--kv-transfer-config, or use method='dflash'."
        )
    cache_config = getattr(vllm_config, "cache_config", None)
    offloading_size = getattr(cache_config, "kv_offloading_size", None)
    if offloading_size is not None:
        backend = getattr(cache_config, "kv_offloading_backend", None)
        raise ValueError(
            f"DDTree does not support KV offloading (kv_offloading_size="
            f"{offloading_size}, backend {backend!r}): it runs as a KV "
            "connector, and none has been checked against the tree's KV "
            "compaction; remove --kv-offloading-size, or use method='dflash'."
        )


def _windows(value: Any) -> list[int]:
    """The window sizes in a config value: an int or a per-layer list."""
    values = value if isinstance(value, (list, tuple)) else [value]
    return [int(v) for v in values if isinstance(v, int) and v > 0]


def sliding_window_error(
    architecture: object, what: str, window: int, max_model_len: int
) -> str:
    return (
        f"DDTree cannot verify trees on {architecture}: its sliding-window "
        f"attention ({what}) is shorter than max_model_len={max_model_len}, "
        "and the window is measured in KV slots, where tree nodes do not sit "
        f"at their positions; pass --max-model-len {window} (or less), or use "
        "method='dflash'."
    )


def chunked_attention_error(architecture: object, what: str) -> str:
    return (
        f"DDTree cannot verify trees on {architecture}: its chunked local "
        f"attention ({what}) splits the sequence by KV slot, where tree nodes "
        "do not sit at their positions; use method='dflash' (or no "
        "speculative decoding)."
    )


def alibi_error(architecture: object) -> str:
    return (
        f"DDTree cannot verify trees on {architecture}: its ALiBi position "
        "bias is computed from KV slot distances, where tree nodes do not sit "
        "at their positions; use method='dflash' (or no speculative decoding)."
    )


def _verify_target_attention(vllm_config: "VllmConfig") -> None:
    """Masks and biases computed from KV slot offsets: a tree node at slot
    ``root + i`` has position ``root + depth``, and ``i >= depth``.

    - sliding windows (``sliding_window``, per-layer
      ``interleaved_sliding_window``, the R-SWA ``rswa_window``): a node
      would lose the ``i - depth`` oldest keys of its window. A window at
      least ``max_model_len`` never binds (a query's slot distance to any key
      is below ``max_model_len``), so it is allowed;
    - chunked local attention (``attention_chunk_size``, ``chunked_attention``
      layer types): chunk boundaries by slot, always refused;
    - ALiBi: a bias by slot distance, always refused.

    Only the target: a DFlash drafter's sliding-window layers keep full KV
    (patch ``dflash-swa-draft-layers-keep-full-kv``). The layers themselves
    are checked again once built (`verify_ddtree_target_layers`), for what
    a model sets in code rather than in its config.
    """
    model_config = vllm_config.model_config
    architecture = getattr(model_config, "architecture", None)
    hf_text = getattr(model_config, "hf_text_config", None)
    max_model_len = getattr(model_config, "max_model_len", None)
    layer_types = list(getattr(hf_text, "layer_types", None) or [])

    chunk = getattr(model_config, "attention_chunk_size", None)
    if chunk is None:
        chunk = getattr(hf_text, "attention_chunk_size", None)
    if chunk:
        raise ValueError(
            chunked_attention_error(architecture, f"attention_chunk_size={chunk}")
        )
    if "chunked_attention" in layer_types:
        raise ValueError(
            chunked_attention_error(architecture, "layer_types 'chunked_attention'")
        )

    if bool(getattr(model_config, "uses_alibi", False)) or (
        architecture in DDTREE_ALIBI_ARCHITECTURES
    ):
        raise ValueError(alibi_error(architecture))

    if not isinstance(max_model_len, int):
        return
    for name, value in (
        ("sliding_window", getattr(hf_text, "sliding_window", None)),
        (
            "interleaved_sliding_window",
            getattr(hf_text, "interleaved_sliding_window", None),
        ),
        ("rswa_window", getattr(model_config, "rswa_window", None)),
    ):
        windows = _windows(value)
        if windows and min(windows) < max_model_len:
            window = min(windows)
            raise ValueError(
                sliding_window_error(
                    architecture, f"{name}={window}", window, max_model_len
                )
            )


def verify_ddtree_target_layers(vllm_config: "VllmConfig") -> None:
    """The config check (`_verify_target_attention`) again, on the target's
    attention layers once they are built and before the drafter loads
    (called from the DDTree speculator's ``load_model``): a window, a chunk
    or an ALiBi bias that a model sets in its code, not in its config,
    stops the engine here instead of verifying trees wrongly."""
    from vllm.model_executor.layers.attention.attention import Attention

    model_config = vllm_config.model_config
    architecture = getattr(model_config, "architecture", None)
    max_model_len = model_config.max_model_len
    forward_context = vllm_config.compilation_config.static_forward_context
    for name, layer in forward_context.items():
        # Decoder self-attention only (an encoder's windows see no tree).
        if not isinstance(layer, Attention):
            continue
        if getattr(layer, "attn_type", "decoder") != "decoder":
            continue
        impl = getattr(layer, "impl", None)
        chunk = getattr(layer, "attention_chunk_size", None)
        if chunk or getattr(impl, "chunk_lookback", -1) >= 0:
            what = f"layer {name}" + (f", chunk {chunk}" if chunk else "")
            raise ValueError(chunked_attention_error(architecture, what))
        if getattr(impl, "alibi_slopes", None) is not None:
            raise ValueError(alibi_error(architecture))
        window = getattr(layer, "sliding_window", None)
        if isinstance(window, int) and 0 < window < max_model_len:
            raise ValueError(
                sliding_window_error(
                    architecture,
                    f"layer {name}: sliding_window={window}",
                    window,
                    max_model_len,
                )
            )


def _verify_ddtree_target(vllm_config: "VllmConfig") -> None:
    """Hybrid (linear-attention) and M-RoPE / XD-RoPE targets: only Gated
    DeltaNet hybrids, and without what the tree path cannot keep (prefix
    caching of the recurrent state; pipeline stages are refused for every
    target by `_verify_pipeline_parallel`)."""
    model_config = vllm_config.model_config
    hybrid = bool(getattr(model_config, "is_hybrid", False))
    multi_rope = bool(getattr(model_config, "uses_mrope", False)) or (
        (getattr(model_config, "uses_xdrope_dim", 0) or 0) > 0
    )
    if not (hybrid or multi_rope):
        return
    architecture = getattr(model_config, "architecture", None)
    problems = []
    if hybrid and architecture not in DDTREE_HYBRID_ARCHITECTURES:
        problems.append(
            "its linear-attention layers must be Gated DeltaNet ("
            + ", ".join(DDTREE_HYBRID_ARCHITECTURES)
            + f"), got {architecture}"
        )
    cache_config = getattr(vllm_config, "cache_config", None)
    mamba_cache_mode = getattr(cache_config, "mamba_cache_mode", "none")
    if hybrid and (
        mamba_cache_mode != "none"
        or getattr(cache_config, "enable_prefix_caching", False)
    ):
        problems.append(
            "prefix caching must be off (the tree path keeps one committed "
            f"recurrent state per request; got mamba_cache_mode="
            f"{mamba_cache_mode!r}): pass --no-enable-prefix-caching"
        )
    if problems:
        raise ValueError(
            f"DDTree cannot run {architecture}: " + "; ".join(problems) + "."
        )
    # Said once at startup so that a user of a real hybrid knows how far the
    # path has been checked: the kernels against upstream's sequential ones,
    # the engine on dummy weights only (its dummy drafter accepts nothing).
    logger.warning(
        "DDTree: %s path for %s. Checked on a GPU with a dummy-weight "
        "Qwen3.5-shaped hybrid only (float32 greedy outputs equal to no "
        "speculation; bf16 runs), not with real weights.",
        "hybrid Gated DeltaNet" if hybrid else "M-RoPE",
        architecture,
    )


def mamba_num_spec_tokens(speculative_config: "SpeculativeConfig | None") -> int:
    """Draft positions the mamba / linear-attention state is sized for.

    Upstream chain speculation keeps one recurrent state per draft position
    (``num_speculative_tokens + 1`` state slots per request, the
    ``MambaSpec``'s ``num_speculative_blocks``) and ``num_speculative_tokens``
    extra conv-window columns. DDTree keeps ONE committed state per request
    and layer: the tree verification only reads it and the post-walk update
    (`vllm.v1.spec_decode.ddtree.gdn_verify`) rewrites it in place, so it
    needs neither (0). A tree of B nodes would otherwise reserve B + 1 state
    slots per request and layer.
    """
    if speculative_config is None or is_ddtree(speculative_config):
        return 0
    return speculative_config.num_speculative_tokens


def ddtree_sampling_params_error(params: object) -> str | None:
    """Why DDTree cannot serve a request with these parameters, or None.

    The target samples every tree node with the request's own parameters
    (temperature, top-k / top-p, min-p, logit bias, penalties on the node's
    ancestor path, seeds) and logprobs are returned for the emitted tokens,
    so upstream's spec-decode refusal of min_p / logit_bias does not apply
    on the 0.26.0 line (the caller skips it). Two request features see the
    verified tokens as a chain and would be wrong for a tree, so they are
    refused with one readable line instead.
    """
    if getattr(params, "structured_outputs", None) is not None:
        return (
            "DDTree does not support structured outputs (guided decoding): "
            "the grammar would have to be advanced along every tree branch. "
            "Use method='dflash' (or no speculative decoding) for such "
            "requests."
        )
    if getattr(params, "bad_words", None):
        return (
            "DDTree does not support bad_words (they are matched against the "
            "verified tokens as a chain, not along tree branches); use "
            "method='dflash'."
        )
    return None


def verify_ddtree_sampling_params(params: object) -> None:
    """Per-request checks (called from ``SamplingParams.verify``):
    `ddtree_sampling_params_error` as a ``ValueError``."""
    error = ddtree_sampling_params_error(params)
    if error is not None:
        raise ValueError(error)


# A session whose next input is prefilled in more than one chunk keeps the
# previous turn's draft placeholders (async scheduling sets them when the
# turn ends and only a finished prompt resets them), so the scheduler gives
# a request draft tokens and a prefill chunk in one step. The tree bias
# would then fall on the chunk's first rows instead of the tree (a dense
# target verifies wrongly) and the Gated DeltaNet tree path of a hybrid
# stops the engine. Refused per request instead.
STREAMING_INPUT_ERROR = (
    "DDTree does not support streaming input (resumable requests): a "
    "session's next input can be scheduled with the previous turn's "
    "draft tokens, which the tree verification cannot take; use "
    "method='dflash' or no speculative decoding for streaming sessions."
)


def verify_ddtree_streaming_input() -> None:
    """Per-request check of a streaming-input (resumable) request, called
    from ``InputProcessor.process_inputs``: `STREAMING_INPUT_ERROR`."""
    raise ValueError(STREAMING_INPUT_ERROR)
