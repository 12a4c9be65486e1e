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
    DDTREE_METHOD,
    DDTREE_OPTION_DEFAULTS,
    STREAMING_INPUT_ERROR,
    ddtree_options,
    ddtree_sampling_params_error,
    is_drafter_attention_config,
    resolve_ddtree_method,
    verify_ddtree_drafter,
    verify_ddtree_vllm_config,
    verify_release_line,
)
from vllm.v1.worker.gpu.spec_decode.dflash.config import DFlashSpeculatorConfig

if TYPE_CHECKING:
    from vllm.config import SpeculativeConfig, VllmConfig


class SpecWithDDTreeOptions:
    """A `SpeculativeConfig` seen with DDTree's options as attributes and
    "ddtree" as its method: the checks shared with the 0.26.0 line, whose
    patched config has the options as fields, read and write both alike
    (options into the dict, anything else into the config)."""

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


# The measured policy times the captured decode graphs on the worker; on
# this line nothing carries the schedule it picks to the scheduler, which
# reads num_speculative_tokens_per_batch_size once, from the config.
MEASURED_POLICY_UNPORTED_ERROR = (
    "DDTree: budget_policy 'measured' needs its worker-measured schedule "
    "carried to the scheduler, which this build's vLLM {version} cannot do; "
    "use budget_policy 'batch' (the default here) or 'fixed'."
)


def tree_verification_unported_error(vllm_version: str) -> str:
    return (
        f"DDTree: this build's vLLM {vllm_version} V2 model runner has no tree "
        "verification hooks yet (the sampler's tree walk, tree positions and "
        "tree attention bias: docs/architecture-0.34.0.md); serve DDTree with "
        "the vllm-ddtree build on vLLM 0.26.0, or serve with method 'dflash'."
    )


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
            raise ValueError(
                MEASURED_POLICY_UNPORTED_ERROR.format(version=vllm_version)
            )
        if options["budget_policy"] is None:
            # "measured", the default where it can run, cannot here.
            options["budget_policy"] = "batch"
        view = SpecWithDDTreeOptions(spec, options)
        # Sets num_speculative_tokens = tree_budget (the tokens verified per
        # step), which DFlash's setup below requires.
        resolve_ddtree_method(view)
        super().configure(spec)
        # The drafter is a DFlash checkpoint; draft_depth from its block size;
        # the budget policy's schedule into num_speculative_tokens_per_batch_size.
        verify_ddtree_drafter(view)
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
        from vllm.version import __version__ as vllm_version

        spec = self.spec_config
        view = SpecWithDDTreeOptions(spec, ddtree_options(spec.speculator_options))
        verify_ddtree_vllm_config(VllmConfigWithDDTreeOptions(vllm_config, view))
        if not is_drafter_attention_config(vllm_config.attention_config):
            # After the checks above, so that a bad config is named first.
            raise ValueError(tree_verification_unported_error(vllm_version))
