# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures for vllm-ddtree tests.

`load_patched_module(relpath)` imports one file of the patched vLLM tree
($VLLM_DDTREE_SRC, default <repo>/build/src) by path, under a private module
name, without importing the `vllm` package: for code that only needs torch.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

# Triton kernels (the DDTree core's Triton backend) run in the interpreter on
# CPU tensors where there is no GPU; this must happen before Triton loads.
try:
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))



def _tooling():
    """apply_patches (needs GitPython and unidiff), imported only by the
    fixtures that use it: the DDTree core tests also run on a GPU host that
    has torch and Triton but not the patch tooling."""
    import apply_patches

    return apply_patches


def patched_src() -> Path:
    return Path(os.environ.get("VLLM_DDTREE_SRC", REPO_ROOT / "build" / "src")).resolve()


def load_patched_module(relpath: str) -> ModuleType:
    """Import `<patched tree>/<relpath>` as a standalone module (no `vllm` import)."""
    path = patched_src() / relpath
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found; run `make apply` (or set VLLM_DDTREE_SRC)"
        )
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    name = "_ddtree_patched_" + relpath.replace("/", "_").removesuffix(".py") + "_" + digest
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


@pytest.fixture(name="load_patched_module")
def load_patched_module_fixture() -> Callable[[str], ModuleType]:
    return load_patched_module


@pytest.fixture(scope="session")
def src_tree() -> Path:
    src = patched_src()
    if not (src / ".git").exists():
        pytest.fail(f"{src} is not a patched tree; run `make apply` first")
    return src


@pytest.fixture(scope="session")
def lock():
    tool = _tooling()
    return tool.Lock.load(tool.DEFAULT_LOCK)


@pytest.fixture(scope="session")
def our_wheel(lock) -> Path:
    wheel = REPO_ROOT / "dist" / _tooling().wheel_name(lock)
    if not wheel.is_file():
        pytest.fail(f"{wheel} missing; run `make wheel` first")
    return wheel


@pytest.fixture(scope="session")
def wheel_venv(our_wheel: Path) -> Path:
    """A cached venv with our wheel and all its dependencies (torch, ...)."""
    import ddtree_venv

    return ddtree_venv.ensure_venv(our_wheel)


@pytest.fixture()
def stack_copy(tmp_path: Path) -> tuple[Path, Path]:
    """Copies of upstream.lock, patches/ and overlay/ (beside patches/, where the
    tool looks for it) that a test may corrupt."""
    lock = tmp_path / "upstream.lock"
    tool = _tooling()
    shutil.copy(tool.DEFAULT_LOCK, lock)
    patches = tmp_path / "patches"
    shutil.copytree(tool.DEFAULT_PATCHES, patches)
    shutil.copytree(
        REPO_ROOT / tool.OVERLAY_DIRNAME,
        tmp_path / tool.OVERLAY_DIRNAME,
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    return lock, patches


@pytest.fixture
def ddtree_tree() -> ModuleType:
    """The DDTree core (vllm/v1/spec_decode/ddtree/tree.py), torch only."""
    return load_patched_module("vllm/v1/spec_decode/ddtree/tree.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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
