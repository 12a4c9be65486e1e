# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures for vllm-ddtree tests.

The files we own are imported from ``overlay/`` where they stand: pytest.ini's
``pythonpath`` puts it first on ``sys.path``, so ``vllm`` is a namespace
package holding only our modules (``vllm.v1.spec_decode.ddtree.tree`` and
friends need torch, not the rest of vLLM, which this interpreter does not
have). Tests that import the patched vLLM itself live in tests/in_vllm and run
in the wheel's venv, under tests/in_vllm/pytest.ini.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from repo_paths import REPO_ROOT

# Triton kernels (the DDTree core's Triton backend) run in the interpreter on
# CPU tensors where there is no GPU; this must happen before Triton loads.
try:
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass


def patched_src() -> Path:
    return Path(
        os.environ.get("VLLM_DDTREE_SRC", REPO_ROOT / "build" / "src")
    ).resolve()


@pytest.fixture(scope="session")
def src_tree() -> Path:
    src = patched_src()
    if not (src / ".git").exists():
        pytest.fail(f"{src} is not a patched tree; run `make apply` first")
    return src


# The fixtures that use the patch tool (patchstack: GitPython and unidiff) import
# it: the DDTree core tests also run on a GPU host that has torch and Triton but
# not the patch tool.
@pytest.fixture(scope="session")
def lock():
    from patchstack.common import DEFAULT_LOCK
    from patchstack.lock import Lock

    return Lock.load(DEFAULT_LOCK)


@pytest.fixture(scope="session")
def our_wheel(lock) -> Path:
    from patchstack.wheel import wheel_name

    wheel = REPO_ROOT / "dist" / wheel_name(lock)
    if not wheel.is_file():
        pytest.fail(f"{wheel} missing; run `make wheel` first")
    return wheel


@pytest.fixture(scope="session")
def wheel_venv(our_wheel: Path) -> Path:
    """A cached venv with our wheel and all its dependencies (torch, ...)."""
    import ddtree_venv

    return ddtree_venv.ensure_venv(our_wheel)


# The release line whose stack the patch-tool tests copy, corrupt and replay
# (tests/tooling/test_apply_patches.py names its patches, hunks and pins).
STACK_COPY_LINE = REPO_ROOT / "lines" / "0.26.0"


@pytest.fixture()
def stack_copy(tmp_path: Path) -> tuple[Path, Path]:
    """Copies of the 0.26.0 line's upstream.lock and patches/, and of overlay/
    (beside patches/, where the tool looks for it), that a test may corrupt."""
    from patchstack.common import OVERLAY_DIRNAME

    lock = tmp_path / "upstream.lock"
    shutil.copy(STACK_COPY_LINE / "upstream.lock", lock)
    patches = tmp_path / "patches"
    shutil.copytree(STACK_COPY_LINE / "patches", patches)
    shutil.copytree(
        REPO_ROOT / OVERLAY_DIRNAME,
        tmp_path / OVERLAY_DIRNAME,
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    return lock, patches


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    # `-m gpu` selects the GPU tests; on a machine without CUDA they skip.
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
