# SPDX-License-Identifier: Apache-2.0
"""Tests that import the patched vLLM (run inside the wheel's venv).

Without an NVIDIA GPU, the Triton kernels (vLLM's and DDTree's) run in the
Triton interpreter on CPU tensors: both variables must be set before vLLM or
Triton is imported, so this happens when the conftest loads.
"""

import os
import sys
from pathlib import Path

import pytest

# tests/: the torch reference implementations (ddtree_reference.py); the
# checkout's root: the bench package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[2]))

# The tiny trained pair (target + DFlash drafter): ../shared/models/tinypair
# beside the checkout, or $TINYPAIR_DIR.
TINYPAIR = Path(
    os.environ.get("TINYPAIR_DIR")
    or Path(__file__).resolve().parents[3] / "shared" / "models" / "tinypair"
).resolve()

# A build on a release line without GPU checks (vLLM 0.33.0 today) refuses
# DDTree at startup unless opted in; these tests exercise that line's code
# too (the refusal itself is tested with the variable removed).
os.environ.setdefault("VLLM_DDTREE_ALLOW_UNVERIFIED_LINE", "1")

if not os.path.exists("/dev/nvidiactl") and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def cpu_uva_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a GPU, vLLM's UVA staging buffers (pinned host memory mapped
    into the device) become plain CPU tensors, so that the V2 runner's real
    sampling states (PenaltiesState, SamplingStates, RequestState) can be
    built on the CPU. A no-op with CUDA."""
    import torch

    if torch.cuda.is_available():
        return
    from vllm.v1.worker.gpu import buffer_utils

    # vLLM 0.33 reads the device view through a method, `uva(n)`; vLLM 0.26
    # through an attribute, `uva`.
    uva_is_method = callable(getattr(buffer_utils.UvaBuffer, "uva", None))

    def cpu_buffer(self, size, dtype):
        self.cpu = torch.zeros(size, dtype=dtype)
        self.np = self.cpu.numpy()
        if uva_is_method:
            self._uva = self.cpu
        else:
            self.uva = self.cpu

    monkeypatch.setattr(buffer_utils.UvaBuffer, "__init__", cpu_buffer)


def find_tinypair(root: Path = TINYPAIR) -> Path:
    """The tiny pair's directory. Missing: skipped on a developer machine,
    a failure in CI (CI=true), where ../shared is always laid beside the
    checkout and a silent skip would hide the tests that need it."""
    if (root / "target").is_dir() and (root / "drafter").is_dir():
        return root
    message = f"tinypair not found at {root} (../shared/models or $TINYPAIR_DIR)"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message + "; CI must have it")
    pytest.skip(message)


@pytest.fixture(scope="session")
def tinypair() -> Path:
    return find_tinypair()


@pytest.fixture(scope="module")
def target_model_config(tinypair: Path):
    """The tiny pair's target as a float32 ModelConfig."""
    from vllm.config import ModelConfig

    return ModelConfig(
        model=str(tinypair / "target"), dtype="float32", max_model_len=2048
    )
