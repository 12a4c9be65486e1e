# SPDX-License-Identifier: Apache-2.0
"""A Triton kernel's parameters and ``do_not_specialize`` names, read from its
source (tests/unit/test_kernel_specialization.py for our kernels,
tests/in_vllm/test_unified_attention_specialization.py for upstream's)."""

import ast
import pathlib

from repo_paths import OVERLAY

OVERLAY_VLLM = OVERLAY / "vllm"


def unspecialised(path: str | pathlib.Path, kernel: str) -> tuple[list[str], list[str]]:
    """(the kernel's parameters, its do_not_specialize names); ``path`` is
    relative to the overlay's ``vllm/`` or absolute."""
    tree = ast.parse((OVERLAY_VLLM / path).read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == kernel:
            params = [a.arg for a in node.args.args]
            names: list[str] = []
            for dec in node.decorator_list:
                if isinstance(dec, ast.Call) and ast.unparse(dec.func) == "triton.jit":
                    for kw in dec.keywords:
                        if kw.arg == "do_not_specialize":
                            names = list(ast.literal_eval(kw.value))
            return params, names
    raise AssertionError(f"{kernel} not found in {path}")
