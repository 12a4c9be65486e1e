# SPDX-License-Identifier: Apache-2.0
"""DDTree's per-step code must not synchronise the host with the device.

A static check over the overlay (the files we own, where they stand): the
functions that run every decoding step (tree build, the verifier around the
target forward, the DFlash
override, the sampling and bookkeeping kernels' wrappers) must not call the
operations that copy a device value to the host or wait for the device.
Reading a CPU tensor (the scheduler's own numbers) is fine and is what the
runner does; this check is about the code we add."""

import ast

import pytest
from repo_paths import OVERLAY

# Files of ours that run in the decoding loop, and the functions in them
# that run every step (setup code such as __init__ / bind may allocate).
PER_STEP = {
    "vllm/v1/spec_decode/ddtree/tree.py": None,  # every function
    "vllm/v1/worker/gpu/spec_decode/ddtree/verifier.py": {
        "prepare_verify",
        "prepare_model_positions",
        "sample",
        "compact",
        "store_trees",
        "attach_bias",
    },
    # Hybrid (Gated DeltaNet) targets: the layer hooks run inside the
    # captured forward, prepare_step / commit around it.
    "vllm/v1/spec_decode/ddtree/gdn_verify.py": {
        "prepare_step",
        "attach",
        "_spec_rows",
        "conv",
        "recurrent",
        "commit",
        "save_verify_inputs",
        "spec_decode_rows",
        "gdn_layer_states",
    },
    "vllm/v1/worker/gpu/spec_decode/ddtree/speculator.py": {
        "_generate_draft",
        "propose",
        "_store_context",
        # The V2 runner's verifier hooks (vLLM 0.34.0 line): the model
        # state's metadata hook, the verify inputs, the walk as the sampler.
        "attach_tree_bias",
        "prepare_verify",
        "__call__",
    },
    # The measured budget policy's per-step part: counting, the snapshot
    # schedule and the re-plan from a landed snapshot (host numbers).
    "vllm/v1/worker/gpu/spec_decode/ddtree/budget.py": {
        "observe_walk",
        "begin_step",
        "_table_cost",
        "_tick",
        "_replan",
        "_publish",
        "plan_from_counts",
    },
    # The one-launch GDN commit after the walk (its tables are built at bind).
    "vllm/v1/spec_decode/ddtree/gdn_commit.py": {"commit_accepted_paths"},
    "vllm/v1/worker/gpu/spec_decode/ddtree/kernels.py": {
        "ddtree_walk",
        "ddtree_tree_bias",
        "ddtree_tree_positions",
        "ddtree_restore_positions",
        "ddtree_store_trees",
        "__call__",
        "compact_rows",
    },
    "vllm/v1/spec_decode/ddtree/sampling.py": None,
    # The measured budget policy's counters: updated every step; the snapshot
    # is queued and polled without waiting (an event query).
    "vllm/v1/spec_decode/ddtree/acceptance.py": {
        "count_accepted_ranks_torch",
        "count_accepted_ranks",
        "count",
        "snapshot",
        "snapshot_ready",
    },
    # The split tree attention: every target attention layer (`applies`,
    # `forward`), the metadata build of each step (`build`).
    "vllm/v1/spec_decode/ddtree/tree_attention.py": {
        "tree_attention",
        "fa3_prefix_attention",
        "split_tree_attention",
        "applies",
        "forward",
        "build",
    },
    "vllm/v1/worker/gpu/spec_decode/ddtree/sampling.py": {
        "apply",
        "apply_penalties",
        "_apply_tree",
        "upstream",
        "counting_tree_paths",
        "sample_nodes",
        "paths_fn",
        "node_logprobs",
    },
}
# Overlay files that run no per-step code: configuration and startup checks,
# metrics fed from the scheduler's host-side stats, Triton kernels and their
# launchers (`tree_triton`, `tree_gdn`, `tree_conv`: device code, called from
# the per-step functions above).
NOT_PER_STEP = {
    "vllm/v1/spec_decode/ddtree/__init__.py",
    "vllm/v1/spec_decode/ddtree/config.py",
    # The general plugin (registration when vLLM loads plugins), its config
    # class (resolved once per engine) and the tree-hook registry (read where
    # a backend's metadata builder is made, at startup).
    "vllm/v1/spec_decode/ddtree/plugin.py",
    "vllm/v1/spec_decode/tree_hooks.py",
    "vllm/v1/worker/gpu/spec_decode/ddtree/config.py",
    "vllm/v1/spec_decode/ddtree/metrics.py",
    # Plain Python over host numbers, run when the budget policy re-plans.
    "vllm/v1/spec_decode/ddtree/policy.py",
    # Startup only: timing the captured graphs, the step-cost cache.
    "vllm/v1/spec_decode/ddtree/step_costs.py",
    "vllm/v1/spec_decode/ddtree/startup.py",
    # The CLI's one line for a config error (an excepthook, at startup).
    "vllm/entrypoints/cli/config_errors.py",
    "vllm/v1/spec_decode/ddtree/tree_triton.py",
    "vllm/v1/spec_decode/ddtree/tree_gdn.py",
    "vllm/v1/spec_decode/ddtree/tree_conv.py",
    "vllm/v1/worker/gpu/spec_decode/ddtree/__init__.py",
}
# Host round trips: a device tensor's value to Python, or a device wait.
FORBIDDEN_ATTRS = {"item", "tolist", "cpu", "numpy", "synchronize", "nonzero"}
FORBIDDEN_CALLS = {"bool", "int", "float"}  # on a tensor, these sync too


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _violations(func: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(func):
        if isinstance(node, ast.Call):
            target = node.func
            if (
                isinstance(target, ast.Attribute)
                and target.attr in FORBIDDEN_ATTRS
                # numpy mirrors kept by the runner (`*_np`) and its CPU
                # tensors (`*_cpu*`, e.g. seq_lens_cpu_upper_bound) live on
                # the host.
                and not ast.unparse(target.value).endswith("_np")
                and "_cpu" not in ast.unparse(target.value)
            ):
                found.append(f"line {node.lineno}: .{target.attr}()")
            # int(x) / float(x) / bool(x) on something that is not a literal
            # or a shape: flag for review (they would sync on a device tensor).
            if (
                isinstance(target, ast.Name)
                and target.id in FORBIDDEN_CALLS
                and node.args
                and not isinstance(node.args[0], ast.Constant)
                and "shape" not in ast.unparse(node.args[0])
                and "stride" not in ast.unparse(node.args[0])
            ):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        # A fresh pinned host buffer per step: allocate it once (setup code).
        if isinstance(node, ast.Call) and any(
            kw.arg == "pin_memory"
            and not (isinstance(kw.value, ast.Constant) and kw.value.value is False)
            for kw in node.keywords
        ):
            found.append(f"line {node.lineno}: pinned allocation")
    return found


@pytest.mark.parametrize("relpath", sorted(PER_STEP))
def test_per_step_code_has_no_host_sync(relpath: str) -> None:
    path = OVERLAY / relpath
    if not path.exists():
        pytest.fail(f"{path} missing")
    tree = ast.parse(path.read_text())
    wanted = PER_STEP[relpath]
    checked = 0
    problems = []
    for func in _functions(tree):
        if wanted is not None and func.name not in wanted:
            continue
        checked += 1
        problems += [f"{func.name}: {v}" for v in _violations(func)]
    assert checked, f"no per-step function found in {relpath}"
    assert not problems, f"{relpath}: " + "; ".join(problems)


def test_every_overlay_file_is_classified() -> None:
    """A new overlay file must be added to PER_STEP or NOT_PER_STEP."""
    files = {
        p.relative_to(OVERLAY).as_posix()
        for p in OVERLAY.rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert files == set(PER_STEP) | NOT_PER_STEP
    assert not set(PER_STEP) & NOT_PER_STEP


def test_the_check_catches_a_sync() -> None:
    bad = ast.parse(
        "def step(x):\n    n = x.sum().item()\n    return int(x.max()) + n\n"
    )
    func = next(_functions(bad))
    assert len(_violations(func)) == 2
    host = ast.parse("def step(b):\n    return b.seq_lens_cpu_upper_bound.numpy()\n")
    assert _violations(next(_functions(host))) == []
    device = ast.parse("def step(b):\n    return b.seq_lens.numpy()\n")
    assert _violations(next(_functions(device))) == ["line 2: .numpy()"]
    pinned = ast.parse(
        "def step(x):\n    h = torch.empty(4, pin_memory=True)\n"
        "    return h.copy_(x, non_blocking=True)\n"
    )
    assert _violations(next(_functions(pinned))) == ["line 2: pinned allocation"]
