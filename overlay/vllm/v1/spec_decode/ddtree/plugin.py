# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DDTree's vLLM general plugin (entry point group ``vllm.general_plugins``,
name ``ddtree``), declared by the wheels of release lines that have vLLM's
speculative-method interface (0.34.0 and later).

vLLM runs `register` in every process before it builds the engine config: it
registers ``method: "ddtree"`` through `register_speculative_method`, with
DDTree's `SpeculatorConfig` named lazily (config modules are imported in
every process), and DDTree's implementations of the neutral tree hooks
(`vllm.v1.spec_decode.tree_hooks`) that the line's patched shared modules
call. It also installs the CLI's one line for an uncaught config error
(`vllm.entrypoints.cli.config_errors`), so that `vllm serve` prints a
DDTree refusal (or any config's) as ``vllm serve: error: <message>``. The
0.26.0 line has neither interface: its patched configs name DDTree
themselves, and nothing there imports this module.
"""

from typing import Any

from vllm.entrypoints.cli.config_errors import install_config_error_excepthook
from vllm.v1.spec_decode import tree_hooks
from vllm.v1.spec_decode.ddtree.config import DDTREE_METHOD

SPECULATOR_CONFIG = (
    "vllm.v1.worker.gpu.spec_decode.ddtree.config.DDTreeSpeculatorConfig"
)


def split_attention_for_builder(vllm_config: Any, *args: Any) -> Any:
    """The ``split_attention_for_builder`` tree hook: DDTree's split tree
    attention for a TRITON_ATTN metadata builder, or None (imported on first
    use: most processes never build attention metadata)."""
    from vllm.v1.spec_decode.ddtree.tree_attention import SplitTreeAttention

    return SplitTreeAttention.for_builder(vllm_config, *args)


def register() -> None:
    from vllm.v1.worker.gpu.spec_decode.speculator_config import (
        register_speculative_method,
    )

    register_speculative_method(DDTREE_METHOD, SPECULATOR_CONFIG)
    tree_hooks.register_tree_hook(
        DDTREE_METHOD, "split_attention_for_builder", split_attention_for_builder
    )
    install_config_error_excepthook()
