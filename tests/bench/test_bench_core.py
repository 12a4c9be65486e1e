# SPDX-License-Identifier: Apache-2.0
"""bench/kernels/ddtree_core.py finds the DDTree core and the torch reference it
times, and its columns run (CPU, tiny shapes: a smoke test, not a timing)."""

import importlib.util
import math
import shutil
import subprocess
import sys

import torch
from repo_paths import REPO_ROOT as ROOT

from bench.kernels import ddtree_core as core

TORCH_COLUMNS = ("build", "build_fast", "vocab", "tree", "walk", "core", "mask", "full")


def test_columns_give_numbers():
    T = core.load_tree_module(None)
    ref = core.load_reference()
    res = core.bench_case(
        T,
        ref,
        torch.device("cpu"),
        torch.float32,
        num_reqs=2,
        depth=3,
        vocab=16,
        budget=4,
        iters=1,
        warmup=0,
        use_graph=False,
        backend="torch",
        columns=TORCH_COLUMNS,
    )
    for c in TORCH_COLUMNS:
        assert math.isfinite(res[f"{c}_eager_us"]), c


def test_command_line(tmp_path):
    """The script alone (no conftest): the installed vLLM's DDTree, else the
    checkout's overlay/; --src files replace the package's."""
    tree_rel = core.DDTREE_PACKAGE.replace(".", "/") + "/tree.py"
    installed = importlib.util.find_spec("vllm")
    default = ROOT / "overlay" if installed.origin is None else None
    variant = tmp_path / tree_rel
    variant.parent.mkdir(parents=True)
    shutil.copy(ROOT / "overlay" / tree_rel, variant)
    for src, root in ((None, default), (tmp_path, tmp_path)):
        argv = [sys.executable, "-m", "bench.kernels.ddtree_core", "--device", "cpu"]
        argv += ["--vocab", "16"]
        argv += ["--depth", "3", "--requests", "1", "--budgets", "4"]
        argv += ["--stages", "build,walk", "--iters", "1", "--warmup", "0"]
        argv += ["--src", str(src)] if src else []
        # From the checkout's root, as the bench tools run (python3 -m).
        r = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
        assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout}\n{r.stderr}"
        # (vLLM, where installed, may log to stdout before the table)
        lines = r.stdout.splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith("device="))
        head, _, row = lines[at : at + 3]
        assert head.endswith(tree_rel)
        if root is not None:
            assert head.endswith(str(root / tree_rel))
        assert [float(x) for x in row.split()][:2] == [1, 4]


def test_kernel_table_sums_cuda_kernels_per_call():
    """``--kernels``: the profiler's CUDA kernel events summed by name and
    divided by the calls; CPU events left out; off CUDA, no table."""

    class Kind:
        def __init__(self, name):
            self.name = name

    class Event:
        def __init__(self, kind, name, us):
            self.device_type, self.name = Kind(kind), name
            self.device_time_total = us

    events = [
        Event("CUDA", "_vocab_stats_kernel", 30.0),
        Event("CUDA", "_tree_kernel", 50.0),
        Event("CUDA", "_vocab_stats_kernel", 34.0),
        Event("CPU", "aten::empty", 999.0),
        Event("CUDA", "_tree_kernel", 48.0),
    ]
    assert core.kernel_table(events, 2) == {
        "_tree_kernel": 49.0,
        "_vocab_stats_kernel": 32.0,
    }
    assert core.kernel_times(lambda: None, torch.device("cpu"), 1, 0) == {}
