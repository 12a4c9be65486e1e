# SPDX-License-Identifier: Apache-2.0
"""The runner parts that bench/engine/profile.py's profiles time by range
(`STEP_PHASES`) exist in this vLLM under the names listed, as methods of
the classes themselves, and `_label_phases` wraps each once."""

import importlib
import importlib.util

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")

from bench.engine import profile as e2e  # noqa: E402


@pytest.mark.parametrize("phase", e2e.STEP_PHASES, ids=lambda p: f"{p[0]}-{p[2]}")
def test_every_phase_names_a_method_of_its_class(phase):
    _, module, cls_name, method = phase
    cls = getattr(importlib.import_module(module), cls_name)
    assert callable(cls.__dict__.get(method))


def test_label_phases_wraps_each_method_once(monkeypatch):
    classes = {}
    for _, module, cls_name, method in e2e.STEP_PHASES:
        cls = getattr(importlib.import_module(module), cls_name)
        classes[cls, method] = cls.__dict__[method]
        # Restored after the test (the wrappers stay otherwise).
        monkeypatch.setattr(cls, method, cls.__dict__[method])
    e2e._label_phases()
    e2e._label_phases()
    for (cls, method), orig in classes.items():
        wrapped = cls.__dict__[method]
        assert getattr(wrapped, "_labelled", False) and wrapped.__wrapped__ is orig
