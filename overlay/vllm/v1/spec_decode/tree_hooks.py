# SPDX-License-Identifier: Apache-2.0
"""Hooks through which vLLM's shared modules reach a tree speculative method.

A shared module (an attention backend, a model layer, the model runner) that
needs tree-specific work calls the hook of that name here instead of
importing a method's modules; a tree method registers its implementations
once per process (from its plugin's ``register()``). With nothing
registered, every hook is absent and the shared module runs as upstream's.

This module imports nothing from vLLM, so every process and every release
line can import it.
"""

from collections.abc import Callable
from typing import Any

# The hooks a shared module may call, by name:
# - "split_attention_for_builder": ``(vllm_config, num_heads_q, num_heads_kv,
#   head_size, block_size, kv_cache_dtype, device) -> split | None``, called
#   by the TRITON_ATTN metadata builder. A split has ``build(common_attn_
#   metadata) -> metadata | None``; that metadata has ``applies(attn_metadata,
#   output_scale) -> bool`` and ``forward(query, key_cache, value_cache,
#   output, attn_metadata, scale, logits_soft_cap, sinks)``, which the impl
#   calls in place of the unified kernel when it applies.
TREE_HOOK_NAMES = frozenset({"split_attention_for_builder"})

_hooks: dict[str, Callable[..., Any]] = {}
_owners: dict[str, str] = {}


def register_tree_hook(method: str, name: str, hook: Callable[..., Any]) -> None:
    """Register ``method``'s implementation of the hook ``name``. One method
    owns a hook per process; registering the same function again is a no-op
    (plugins are loaded once per process, but a process may load them twice)."""
    if name not in TREE_HOOK_NAMES:
        raise ValueError(
            f"Unknown tree hook {name!r}; known: {', '.join(sorted(TREE_HOOK_NAMES))}."
        )
    if name in _hooks and (_owners[name] != method or _hooks[name] is not hook):
        raise ValueError(
            f"Tree hook {name!r} is already registered by method {_owners[name]!r}."
        )
    _hooks[name] = hook
    _owners[name] = method


def get_tree_hook(name: str) -> Callable[..., Any] | None:
    """The registered implementation of the hook ``name``, or None."""
    if name not in TREE_HOOK_NAMES:
        raise ValueError(f"Unknown tree hook {name!r}.")
    return _hooks.get(name)


def registered_tree_hooks() -> dict[str, str]:
    """The registered hooks and the method that owns each."""
    return dict(_owners)
