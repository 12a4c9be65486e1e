# SPDX-License-Identifier: Apache-2.0
"""Counts of the eager work a piece of the per-step code dispatches: the
Triton kernel launches (by kernel name) and the torch operators (aten
overloads, outside those launches). Used by the tests that bound the
per-step work (test_ddtree_launch_counts.py).

Both counts are of the host's dispatch, not of device time: measured on
CPU they are the same numbers a GPU run dispatches (the Triton interpreter
launches through ``InterpretedFunction.run`` where a GPU launches through
``JITFunction.run``; the torch operators are dispatched alike), so a bound
checked here holds there. The Triton interpreter's own copies of a
launch's arguments are not counted: they are no part of a GPU launch.
"""

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass
class DispatchCounts:
    launches: Counter = field(default_factory=Counter)  # kernel name -> count
    ops: list[str] = field(default_factory=list)  # aten overloads, in order

    @property
    def num_launches(self) -> int:
        return sum(self.launches.values())


class _OpCounter(TorchDispatchMode):
    def __init__(self, counts: DispatchCounts):
        super().__init__()
        self.counts = counts
        self.in_launch = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.in_launch:
            self.counts.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _launch_classes() -> list[type]:
    from triton.runtime.jit import JITFunction

    classes: list[type] = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # a Triton without the interpreter
        pass
    else:
        classes.append(InterpretedFunction)
    return classes


@contextmanager
def count_dispatch():
    """Yields a `DispatchCounts` filled while the block runs."""
    counts = DispatchCounts()
    mode = _OpCounter(counts)
    with pytest.MonkeyPatch.context() as patch:
        for cls in _launch_classes():

            def counted(self, *args, _run=cls.run, **kwargs):
                if kwargs.get("warmup"):
                    return _run(self, *args, **kwargs)
                counts.launches[self.__name__] += 1
                mode.in_launch += 1
                try:
                    return _run(self, *args, **kwargs)
                finally:
                    mode.in_launch -= 1

            patch.setattr(cls, "run", counted)
        with mode:
            yield counts
