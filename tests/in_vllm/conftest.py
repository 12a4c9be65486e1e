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

# tests/: the torch reference implementations (ddtree_reference.py).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if not os.path.exists("/dev/nvidiactl") and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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

    def cpu_buffer(self, size, dtype):
        self.cpu = torch.zeros(size, dtype=dtype)
        self.np = self.cpu.numpy()
        self.uva = self.cpu

    monkeypatch.setattr(buffer_utils.UvaBuffer, "__init__", cpu_buffer)
