# SPDX-License-Identifier: Apache-2.0
"""The neutral tree-hook registry and the 0.34.0 line's plugin-first rules:
the registry's behaviour, no upstream file of that line's stack (the primary
one, at the repository root) importing a DDTree module, and the plugin entry
point its upstream.lock declares naming a `register` function of the overlay.
Needs neither vLLM nor a patched tree (overlay/ is on sys.path, see
conftest.py)."""

import ast
import re
from pathlib import Path

import pytest
import tomllib
from repo_paths import REPO_ROOT

from vllm.v1.spec_decode import tree_hooks

# The 0.34.0 line is the primary one: its upstream.lock and patches/ are the
# repository root's.
LINE_0_34 = REPO_ROOT
OVERLAY = REPO_ROOT / "overlay"


@pytest.fixture()
def fresh_registry(monkeypatch):
    monkeypatch.setattr(tree_hooks, "_hooks", {})
    monkeypatch.setattr(tree_hooks, "_owners", {})


def test_a_registered_hook_is_found_and_an_absent_one_is_none(fresh_registry):
    def split(*args):
        return None

    assert tree_hooks.get_tree_hook("split_attention_for_builder") is None
    tree_hooks.register_tree_hook("ddtree", "split_attention_for_builder", split)
    assert tree_hooks.get_tree_hook("split_attention_for_builder") is split
    # A plugin loaded twice in one process registers the same function again.
    tree_hooks.register_tree_hook("ddtree", "split_attention_for_builder", split)
    assert tree_hooks.registered_tree_hooks() == {
        "split_attention_for_builder": "ddtree"
    }


def test_a_hook_has_one_owner_and_a_known_name(fresh_registry):
    tree_hooks.register_tree_hook("ddtree", "split_attention_for_builder", print)
    with pytest.raises(ValueError, match="already registered by method 'ddtree'"):
        tree_hooks.register_tree_hook("other_tree", "split_attention_for_builder", repr)
    with pytest.raises(ValueError, match="already registered"):
        tree_hooks.register_tree_hook("ddtree", "split_attention_for_builder", repr)
    with pytest.raises(ValueError, match="Unknown tree hook 'tree_walk'"):
        tree_hooks.register_tree_hook("ddtree", "tree_walk", print)
    with pytest.raises(ValueError, match="Unknown tree hook"):
        tree_hooks.get_tree_hook("tree_walk")


def test_tree_hooks_imports_nothing_from_vllm():
    """Every process and line imports the registry: it must stay neutral."""
    tree = ast.parse((OVERLAY / "vllm/v1/spec_decode/tree_hooks.py").read_text())
    imported = [
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    ] + [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert imported and not [m for m in imported if m and m.startswith("vllm")]


def _added_lines(patch: Path) -> dict[str, list[str]]:
    """The lines a patch adds, by upstream file."""
    added: dict[str, list[str]] = {}
    current = None
    for line in patch.read_text().splitlines():
        if line.startswith("+++ b/"):
            current = line.removeprefix("+++ b/")
            added.setdefault(current, [])
        elif line.startswith("+") and not line.startswith("+++") and current:
            added[current].append(line[1:])
    return added


DDTREE_IMPORT = re.compile(r"^\s*(from|import)\s+[\w.]*\bddtree\b")


def test_no_upstream_file_of_the_0_34_line_imports_a_ddtree_module():
    """Plugin-first: the shared modules the 0.34.0 stack patches call the
    neutral hooks; only overlay modules import DDTree's (the pristine sdist
    has none, so the patched tree's imports are the patches' added lines)."""
    series = [
        name
        for name in (LINE_0_34 / "patches" / "series").read_text().splitlines()
        if name and not name.startswith("#")
    ]
    assert series
    offenders = []
    hook_users = set()
    for name in series:
        for path, lines in _added_lines(LINE_0_34 / "patches" / name).items():
            offenders += [
                f"{name}: {path}: {ln.strip()}"
                for ln in lines
                if DDTREE_IMPORT.match(ln)
            ]
            if any("tree_hooks import" in ln for ln in lines):
                hook_users.add(path)
    assert offenders == []
    assert "vllm/v1/attention/backends/triton_attn.py" in hook_users


def test_the_0_34_lock_declares_the_plugin_register_of_the_overlay():
    with open(LINE_0_34 / "upstream.lock", "rb") as f:
        lock = tomllib.load(f)
    entry_points = lock["ddtree"]["entry_points"]
    assert entry_points == {
        "vllm.general_plugins": {"ddtree": "vllm.v1.spec_decode.ddtree.plugin:register"}
    }
    module, attr = entry_points["vllm.general_plugins"]["ddtree"].split(":")
    source = OVERLAY / (module.replace(".", "/") + ".py")
    functions = {
        node.name: node
        for node in ast.parse(source.read_text()).body
        if isinstance(node, ast.FunctionDef)
    }
    assert attr in functions
    # vLLM calls a general plugin with no arguments.
    assert not functions[attr].args.args
