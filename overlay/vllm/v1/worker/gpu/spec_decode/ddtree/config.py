# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DDTree's `SpeculatorConfig` on vLLM's speculative-method interface (vLLM
0.34.0 and later; registered as ``method: "ddtree"`` by
`vllm.v1.spec_decode.ddtree.plugin.register`).

A subclass of DFlash's config: DDTree drafts with a DFlash model, so it
inherits DFlash's draft-model setup, and the resolved ``method`` is "dflash"
(``custom_method`` "ddtree"), which every DFlash path of vLLM serves. DDTree's
own options are ``speculator_options``; they are validated here with the
checks the 0.26.0 line runs from its patched `SpeculativeConfig`
(`vllm.v1.spec_decode.ddtree.config`), and the budget policy's schedule is
vLLM's dynamic one (``num_speculative_tokens_per_batch_size``).

This module imports vLLM 0.34.0's speculator configs: only that line imports
it (through the name the plugin registers).
"""

from typing import TYPE_CHECKING, Any

from vllm.v1.spec_decode.ddtree.config import (
    STREAMING_INPUT_ERROR,
    SpecWithDDTreeOptions,
    ddtree_options,
    ddtree_sampling_params_error,
    resolve_ddtree_method,
    verify_ddtree_drafter,
    verify_ddtree_vllm_config,
    verify_release_line,
)
from vllm.v1.spec_decode.ddtree.startup import not_a_dflash_drafter_line
from vllm.v1.worker.gpu.spec_decode.dflash.config import DFlashSpeculatorConfig

if TYPE_CHECKING:
    from vllm.config import SpeculativeConfig, VllmConfig


MEASURED_POLICY_UNPORTED_ERROR = (
    "DDTree: budget_policy 'measured' times the captured graphs on the worker, "
    "and this build's vLLM 0.34.0 line has no path for the measured schedule "
    "to the scheduler yet (docs/architecture.md, H9); use "
    "budget_policy 'batch' (the default here) or 'fixed'."
)


class VllmConfigWithDDTreeOptions:
    """A `VllmConfig` seen with `SpecWithDDTreeOptions` as its speculative
    config, for the engine-level checks shared with the 0.26.0 line; every
    other attribute is the config's own (read and written through)."""

    def __init__(self, vllm_config: "VllmConfig", spec: SpecWithDDTreeOptions):
        object.__setattr__(self, "_vllm_config", vllm_config)
        object.__setattr__(self, "speculative_config", spec)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_vllm_config"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._vllm_config, name, value)


class DDTreeSpeculatorConfig(DFlashSpeculatorConfig):
    speculator_class = (
        "vllm.v1.worker.gpu.spec_decode.ddtree.speculator.DDTreeSpeculator"
    )
    supported_options = frozenset({"speculator_options"})
    # The tree walk replaces the rejection sampler that watermarking of drafts
    # is built into.
    supports_watermarking = False

    @classmethod
    def configure(cls, spec: "SpeculativeConfig") -> None:
        from vllm.version import __version__ as vllm_version

        options = ddtree_options(spec.speculator_options)
        verify_release_line(vllm_version)
        if options["budget_policy"] == "measured":
            raise ValueError(MEASURED_POLICY_UNPORTED_ERROR)
        view = SpecWithDDTreeOptions(spec, options)
        # Sets num_speculative_tokens = tree_budget (the tokens verified per
        # step), which DFlash's setup below requires.
        resolve_ddtree_method(view)
        try:
            super().configure(spec)
        except ValueError as e:
            # Upstream's refusal of a drafter that is not a DFlash model lists
            # every architecture vLLM supports; DDTree's line names the drafter.
            line = not_a_dflash_drafter_line(str(e), spec.model)
            if line is None:
                raise
            raise ValueError(line) from e
        # The drafter is a DFlash checkpoint; draft_depth from its block size;
        # the budget policy's schedule into num_speculative_tokens_per_batch_size.
        # Unset, the policy is checked and scheduled as the 0.26.0 line's
        # default ("measured") and runs as the schedule that starts from.
        verify_ddtree_drafter(view, unset_policy_runs_as="batch")
        spec.speculator_options = options

    @property
    def num_draft_states(self) -> int:
        # One committed recurrent state per request: the tree verification
        # only reads it and the post-walk commit rewrites it in place.
        return 0

    def unsupported_request_reason(self, params: Any, resumable: bool) -> str | None:
        if resumable:
            return STREAMING_INPUT_ERROR
        return ddtree_sampling_params_error(params)

    def verify_vllm_config(self, vllm_config: "VllmConfig") -> None:
        # The engine-level checks shared with the 0.26.0 line: the TRITON_ATTN
        # target backend, the KV-cache dtype, KV connectors, pipeline stages,
        # the target's attention and hybrid layers.
        spec = self.spec_config
        view = SpecWithDDTreeOptions(spec, ddtree_options(spec.speculator_options))
        verify_ddtree_vllm_config(VllmConfigWithDDTreeOptions(vllm_config, view))
