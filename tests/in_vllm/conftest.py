# SPDX-License-Identifier: Apache-2.0
"""Tests that import the patched vLLM (run inside the wheel's venv).

Without an NVIDIA GPU, the Triton kernels (vLLM's and DDTree's) run in the
Triton interpreter on CPU tensors: both variables must be set before vLLM or
Triton is imported, so this happens when the conftest loads.
"""

import os

import pytest

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
