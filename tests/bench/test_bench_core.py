# SPDX-License-Identifier: Apache-2.0
"""bench/kernels/ddtree_core.py finds the DDTree core and the torch reference it
times, and its columns run (CPU, tiny shapes: a smoke test, not a timing)."""

import importlib.util
import math
import subprocess
import sys

import torch
from repo_paths import REPO_ROOT as ROOT

from bench.kernels import ddtree_core as core

TORCH_COLUMNS = ("build", "build_fast", "vocab", "tree", "walk", "core", "mask", "full")


def test_columns_give_numbers():
    T = core.load_tree_module()
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


def test_command_line():
    """The script alone (no conftest): the installed vLLM's DDTree, else the
    checkout's overlay/."""
    tree_rel = core.DDTREE_PACKAGE.replace(".", "/") + "/tree.py"
    installed = importlib.util.find_spec("vllm")
    root = ROOT / "overlay" if installed.origin is None else None
    argv = [sys.executable, "-m", "bench.kernels.ddtree_core", "--device", "cpu"]
    argv += ["--vocab", "16"]
    argv += ["--depth", "3", "--requests", "1", "--budgets", "4"]
    argv += ["--stages", "build,walk", "--iters", "1", "--warmup", "0"]
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
