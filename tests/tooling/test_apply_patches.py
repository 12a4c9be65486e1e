# SPDX-License-Identifier: Apache-2.0
"""Tests for apply_patches.py: check, fetch (sha256), apply failures, export drift."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import REPO_ROOT

from patchstack.check import check_all
from patchstack.cli import resolve_line
from patchstack.common import (
    DEFAULT_LOCK,
    DEFAULT_PATCHES,
    DEFAULT_SRC,
    LINES_DIR,
    DDTreeError,
)
from patchstack.fetch import fetch_artifact, verify_sha256
from patchstack.lint import RUFF_CONFIG, lint_patched_files, ruff_config_drift
from patchstack.lock import Lock
from patchstack.overlay import OVERLAY_SUBJECT, overlay_files
from patchstack.repo import new_files, stack_tree
from patchstack.series import read_series, series_hash

TOOL = [sys.executable, str(REPO_ROOT / "apply_patches.py")]
# The line whose stack `stack_copy` copies (tests/conftest.py); the names, hunks
# and pins below are its own.
STACK_LINE = LINES_DIR / "0.26.0"
FIRST_PATCH = "dflash-swa-draft-layers-keep-full-kv.patch"


def run_tool(
    *argv: str | Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TOOL, *map(str, argv)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )


def tool(
    lock: Path, patches: Path, *argv: str | Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return run_tool("--lock", lock, "--patches", patches, *argv, env=env)


def git(repo: Path, *argv: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *argv], check=True, capture_output=True, text=True
    ).stdout


# ------------------------------------------------------------------ check


def test_check_passes_on_repo() -> None:
    r = run_tool("check")
    assert r.returncode == 0, r.stderr


def test_line_picks_its_lock_patches_and_tree() -> None:
    """--line VERSION reads lines/VERSION/ and keeps overlay/ shared; without it
    every path is the repo root's, as before lines existed."""
    for line in sorted(p.name for p in LINES_DIR.iterdir()):
        args = argparse.Namespace(
            line=line, lock=None, patches=None, overlay=None, src=None, config=None
        )
        resolve_line(args)
        root = LINES_DIR / line
        assert args.lock == root / "upstream.lock"
        assert args.patches == root / "patches"
        assert args.overlay == REPO_ROOT / "overlay"
        assert args.src == REPO_ROOT / "build" / f"src-{line}"
        assert Lock.load(args.lock).upstream["version"] == line
        r = run_tool("--line", line, "check")
        assert r.returncode == 0, r.stderr
    args = argparse.Namespace(
        line=None, lock=None, patches=None, overlay=None, src=None, config=None
    )
    resolve_line(args)
    assert (args.lock, args.patches, args.overlay, args.src, args.config) == (
        DEFAULT_LOCK,
        DEFAULT_PATCHES,
        REPO_ROOT / "overlay",
        DEFAULT_SRC,
        RUFF_CONFIG,
    )


def test_unknown_line_is_one_line_error() -> None:
    r = run_tool("--line", "0.0.1", "check")
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and "--line 0.0.1: no " in r.stderr


def test_first_patch_is_listed_first() -> None:
    assert read_series(STACK_LINE / "patches")[0] == FIRST_PATCH


def test_series_entry_without_file(stack_copy: tuple[Path, Path]) -> None:
    lock, patches = stack_copy
    with open(patches / "series", "a") as f:
        f.write("no-such-change.patch\n")
    r = tool(lock, patches, "check")
    assert r.returncode == 1
    assert "no-such-change.patch has no file" in r.stderr


def test_unlisted_and_duplicate(stack_copy: tuple[Path, Path]) -> None:
    lock, patches = stack_copy
    (patches / "stray.patch").write_text((patches / FIRST_PATCH).read_text())
    with open(patches / "series", "a") as f:
        f.write(FIRST_PATCH + "\n")
    r = tool(lock, patches, "check")
    assert r.returncode == 1
    assert "stray.patch is not listed" in r.stderr
    assert f"duplicate entry {FIRST_PATCH}" in r.stderr


@pytest.mark.parametrize("header", ["Why", "Origin", "Forwarded", "Test"])
def test_missing_header(stack_copy: tuple[Path, Path], header: str) -> None:
    lock, patches = stack_copy
    p = patches / FIRST_PATCH
    p.write_text(re.sub(rf"^{header}:.*\n", "", p.read_text(), flags=re.M))
    r = tool(lock, patches, "check")
    assert r.returncode == 1
    assert f"header '{header}:' missing" in r.stderr


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("csrc/attention/attention_kernels.cu", "needs a compiler"),
        ("CMakeLists.txt", "needs a compiler"),
        ("setup.py", "needs a compiler"),
        ("docs/README.md", "only Python/Triton files under vllm/"),
    ],
)
def test_refused_paths(stack_copy: tuple[Path, Path], path: str, reason: str) -> None:
    lock, patches = stack_copy
    p = patches / FIRST_PATCH
    p.write_text(
        p.read_text().replace("vllm/model_executor/models/qwen3_dflash.py", path)
    )
    r = tool(lock, patches, "check")
    assert r.returncode == 1
    assert path in r.stderr and reason in r.stderr


NEW_FILE_PATCH = (
    "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
    "From: vllm-ddtree <ddtree@vllm.invalid>\n"
    "Date: Sun, 29 Nov 2026 12:00:00 +0000\n"
    "Subject: ddtree: add module\n\n"
    "Why: x\nOrigin: vendor\nForwarded: not-needed\nTest: none\n\n"
    "diff --git a/vllm/v1/spec_decode/ddtree_new.py "
    "b/vllm/v1/spec_decode/ddtree_new.py\n"
    "new file mode 100644\n"
    "index 0000000..e69de29\n"
    "--- /dev/null\n"
    "+++ b/vllm/v1/spec_decode/ddtree_new.py\n"
    "@@ -0,0 +1 @@\n"
    "+# SPDX-License-Identifier: Apache-2.0\n"
)


def test_patch_adding_a_file_is_refused(stack_copy: tuple[Path, Path]) -> None:
    lock, patches = stack_copy
    (patches / "add-module.patch").write_text(NEW_FILE_PATCH)
    with open(patches / "series", "a") as f:
        f.write("add-module.patch\n")
    r = tool(lock, patches, "check")
    assert r.returncode == 1
    assert "adds vllm/v1/spec_decode/ddtree_new.py" in r.stderr
    assert "overlay/vllm/v1/spec_decode/ddtree_new.py" in r.stderr


def test_check_reports_the_stack_size() -> None:
    r = run_tool("check")
    assert r.returncode == 0, r.stderr
    total = re.search(
        r"check: (\d+) patches ok: (\d+) added and (\d+) removed lines in "
        r"(\d+) upstream files; overlay/: (\d+) files",
        r.stdout,
    )
    assert total, r.stdout
    stats: dict = {}
    check_all(
        Lock.load(DEFAULT_LOCK),
        DEFAULT_PATCHES,
        None,
        stats,
    )
    assert int(total[2]) == sum(s.added for s in stats.values())
    assert int(total[5]) == len(overlay_files(REPO_ROOT / "overlay"))


def test_check_refuses_a_malformed_entry_point(stack_copy: tuple[Path, Path]) -> None:
    lock, patches = stack_copy
    lock.write_text(
        lock.read_text() + '\n[ddtree.entry_points."vllm.general_plugins"]\n'
        'ddtree = "not an object reference"\n'
    )
    r = tool(lock, patches, "check")
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert "ddtree.entry_points.vllm.general_plugins.ddtree: want" in r.stderr


@pytest.mark.parametrize(
    ("rel", "text", "message"),
    [
        (
            "vllm/config/speculative.py",
            "# SPDX-License-Identifier: Apache-2.0\n",
            "overwrites an upstream file",
        ),
        (
            "vllm/v1/spec_decode/ddtree/notes.txt",
            "x\n",
            "only Python files under vllm/",
        ),
        (
            "tools/helper.py",
            "# SPDX-License-Identifier: Apache-2.0\n",
            "only Python files under vllm/",
        ),
        ("vllm/v1/spec_decode/ddtree/extra.py", "import torch\n", "first line must be"),
        (
            "vllm/v1/newpkg/mod.py",
            "# SPDX-License-Identifier: Apache-2.0\n",
            "vllm/v1/newpkg/: new package without __init__.py",
        ),
    ],
)
def test_overlay_rules(
    stack_copy: tuple[Path, Path], rel: str, text: str, message: str
) -> None:
    lock, patches = stack_copy
    path = patches.parent / "overlay" / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    r = tool(lock, patches, "check")
    assert r.returncode == 1
    assert f"overlay/{rel.split('/mod.py')[0]}" in r.stderr and message in r.stderr


def test_patch_may_not_edit_an_overlay_file(stack_copy: tuple[Path, Path]) -> None:
    lock, patches = stack_copy
    p = patches / FIRST_PATCH
    p.write_text(
        p.read_text().replace(
            "vllm/model_executor/models/qwen3_dflash.py",
            "vllm/v1/spec_decode/ddtree/tree.py",
        )
    )
    r = tool(lock, patches, "check")
    assert r.returncode == 1
    assert (
        "a file of overlay/; edit overlay/vllm/v1/spec_decode/ddtree/tree.py"
        in r.stderr
    )


def test_unparsable_patch(stack_copy: tuple[Path, Path]) -> None:
    lock, patches = stack_copy
    p = patches / FIRST_PATCH
    p.write_text(p.read_text().replace("@@ -217,6 +217,10 @@", "@@ -217,6 +217,99 @@"))
    r = tool(lock, patches, "check")
    assert r.returncode == 1
    assert "does not parse" in r.stderr


# ------------------------------------------------------------------ sha256


def test_wrong_sha256_is_refused(stack_copy: tuple[Path, Path], tmp_path: Path) -> None:
    lock, patches = stack_copy
    real = fetch_artifact(Lock.load(lock), "sdist")
    cache = tmp_path / "cache"
    cache.mkdir()
    os.symlink(real, cache / real.name)
    wrong = "0" * 64
    text = lock.read_text()
    good = Lock.load(lock).artifact("sdist").sha256
    lock.write_text(text.replace(good, wrong))
    r = tool(lock, patches, "fetch", env={"VLLM_DDTREE_CACHE": str(cache)})
    assert r.returncode == 1
    msg = [line for line in r.stderr.splitlines() if "sha256 mismatch" in line]
    assert len(msg) == 1, r.stderr
    assert real.name in msg[0] and wrong in msg[0] and good in msg[0]
    # apply must refuse the file too (nothing is extracted from it)
    r = tool(
        lock,
        patches,
        "apply",
        "--src",
        tmp_path / "src",
        env={"VLLM_DDTREE_CACHE": str(cache)},
    )
    assert r.returncode == 1 and "sha256 mismatch" in r.stderr
    assert not (tmp_path / "src").exists()


def test_verify_sha256_unit(tmp_path: Path) -> None:
    f = tmp_path / "a.bin"
    f.write_bytes(b"abc")
    good = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    verify_sha256(f, good)
    with pytest.raises(DDTreeError, match=f"a.bin.*{good[:8]}.*got {good}"):
        verify_sha256(f, good[:8] + "0" * 56)


# ------------------------------------------------------------------ apply / export


def test_corrupted_hunk_names_patch_file_and_hunk(
    stack_copy: tuple[Path, Path], tmp_path: Path
) -> None:
    lock, patches = stack_copy
    p = patches / FIRST_PATCH
    text = p.read_text()
    assert "         self.causal = causal\n" in text
    p.write_text(
        text.replace(
            "         self.causal = causal\n", "         self.causal = not_causal\n"
        )
    )
    src = tmp_path / "src"
    r = tool(lock, patches, "apply", "--src", src)
    assert r.returncode == 1
    assert f"patch {FIRST_PATCH} does not apply" in r.stderr
    assert "file: vllm/model_executor/models/qwen3_dflash.py" in r.stderr
    assert "hunk: hunk #1 @@ -217,6 +217,10 @@" in r.stderr
    # the tree is left for inspection, git am stopped on the patch
    assert (src / ".git" / "rebase-apply").exists()


def test_apply_verify_and_no_drift(
    stack_copy: tuple[Path, Path], tmp_path: Path
) -> None:
    lock, patches = stack_copy
    src = tmp_path / "src"
    r = tool(lock, patches, "apply", "--src", src, "--verify")
    assert r.returncode == 0, r.stderr
    assert git(src, "log", "--format=%s", "-1", "upstream").startswith("vLLM 0.26.0")
    r = tool(lock, patches, "export", "--src", src, "--dry-run")
    assert r.returncode == 0, r.stderr
    # a second apply reuses the tree and gives the same result
    r = tool(lock, patches, "apply", "--src", src, "--verify")
    assert r.returncode == 0, r.stderr


def test_drift_and_export_round_trip(
    stack_copy: tuple[Path, Path], tmp_path: Path
) -> None:
    lock, patches = stack_copy
    src = tmp_path / "src"
    assert tool(lock, patches, "apply", "--src", src).returncode == 0
    target = src / "vllm/model_executor/models/qwen3_dflash.py"
    target.write_text(
        target.read_text().replace(
            "Keep full KV allocation; SWA remains a compute-time limit.",
            "Keep the full KV allocation; SWA stays a compute-time limit.",
        )
    )
    # The first patch's commit is the oldest one above the pristine base.
    first = git(src, "rev-list", "--reverse", "upstream..HEAD").split()[0]
    git(src, "commit", "-q", "-a", "--fixup", first)
    r = tool(lock, patches, "export", "--src", src, "--dry-run")
    assert r.returncode == 1
    git(
        src,
        "-c",
        "sequence.editor=true",
        "rebase",
        "-q",
        "-i",
        "--autosquash",
        "upstream",
    )
    r = tool(lock, patches, "export", "--src", src, "--dry-run")
    assert r.returncode == 1
    assert FIRST_PATCH in r.stderr and "patched_tree" in r.stderr
    before = (patches / FIRST_PATCH).read_text()
    r = tool(lock, patches, "export", "--src", src)
    assert r.returncode == 0, r.stderr
    after = (patches / FIRST_PATCH).read_text()
    assert before != after and "SWA stays a compute-time limit" in after
    # author, date and message survive the round trip
    assert before.split("\ndiff --git")[0] == after.split("\ndiff --git")[0]
    r = tool(lock, patches, "export", "--src", src, "--dry-run")
    assert r.returncode == 0, r.stderr
    src2 = tmp_path / "src2"
    r = tool(lock, patches, "apply", "--src", src2, "--verify")
    assert r.returncode == 0, r.stderr


def test_new_commit_becomes_a_new_patch(
    stack_copy: tuple[Path, Path], tmp_path: Path
) -> None:
    lock, patches = stack_copy
    src = tmp_path / "src"
    assert tool(lock, patches, "apply", "--src", src).returncode == 0
    edited = src / "vllm/v1/spec_decode/utils.py"
    edited.write_text(edited.read_text() + "# an edit of an upstream file\n")
    git(src, "add", str(edited))
    git(
        src,
        "commit",
        "-q",
        "-m",
        "ddtree: Add package\n\nWhy: w\nOrigin: vendor\nForwarded: not-needed\nTest: "
        "none",
    )
    assert tool(lock, patches, "export", "--src", src).returncode == 0
    series = read_series(patches)
    assert series[0] == FIRST_PATCH and series[-1] == "ddtree-add-package.patch"
    assert len(series) == len(read_series(STACK_LINE / "patches")) + 1
    assert tool(lock, patches, "check").returncode == 0


def test_lock_version_is_consistent() -> None:
    lock = Lock.load(DEFAULT_LOCK)
    assert re.fullmatch(r"0\.34\.0\+ddtree\.\d+", lock.version)
    assert lock.upstream["tag"] == "v0.34.0"
    assert lock.upstream["commit"] == "62d4bc3c7"
    assert lock.upstream["base_image"] == "vllm/vllm-openai:v0.34.0"
    lock = Lock.load(STACK_LINE / "upstream.lock")
    assert re.fullmatch(r"0\.26\.0\+ddtree\.\d+", lock.version)
    assert lock.upstream["tag"] == "v0.26.0"
    assert lock.upstream["commit"] == "ffd46bfab"
    assert lock.upstream["base_image"] == "vllm/vllm-openai:v0.26.0"


# ------------------------------------------------------------------ overlay


OVERLAY_FILE = "vllm/v1/spec_decode/ddtree/config.py"


def test_apply_copies_the_overlay_after_the_patches(
    stack_copy: tuple[Path, Path], tmp_path: Path
) -> None:
    lock, patches = stack_copy
    overlay = patches.parent / "overlay"
    src = tmp_path / "src"
    r = tool(lock, patches, "apply", "--src", src, "--verify")
    assert r.returncode == 0, r.stderr
    files = overlay_files(overlay)
    assert new_files(src) == sorted(files)
    for rel, path in files.items():
        assert (src / rel).read_bytes() == path.read_bytes(), rel
    # one commit on top of the patches, tagged; the patches alone are patched_tree
    assert git(src, "log", "-1", "--format=%s") == OVERLAY_SUBJECT + "\n"
    assert git(src, "rev-parse", "HEAD") == git(src, "rev-parse", "overlay^{commit}")
    assert stack_tree(src) == git(src, "rev-parse", "HEAD~1^{tree}").strip()
    # an overlay file that an upstream file already occupies is refused
    clash = overlay / "vllm/config/speculative.py"
    clash.parent.mkdir(parents=True)
    clash.write_text("# SPDX-License-Identifier: Apache-2.0\n")
    r = tool(lock, patches, "apply", "--src", tmp_path / "src2")
    assert r.returncode == 1 and "overwrites an upstream file" in r.stderr


def test_overlay_edit_in_build_tree_round_trip(
    stack_copy: tuple[Path, Path], tmp_path: Path
) -> None:
    """An overlay file edited in build/src: the drift gate names it, export writes
    it back to overlay/ (not into a patch), and the lock does not change."""
    lock, patches = stack_copy
    overlay = patches.parent / "overlay"
    src = tmp_path / "src"
    assert tool(lock, patches, "apply", "--src", src).returncode == 0
    lock_before = lock.read_text()
    target = src / OVERLAY_FILE
    target.write_text(target.read_text() + "# edited in the build tree\n")
    git(src, "commit", "-q", "-a", "-m", "tweak the config module")
    r = tool(lock, patches, "export", "--src", src, "--dry-run")
    assert r.returncode == 1
    assert f"overlay/{OVERLAY_FILE} (differs from src/{OVERLAY_FILE})" in r.stderr
    series_before = (patches / "series").read_text()
    r = tool(lock, patches, "export", "--src", src)
    assert r.returncode == 0, r.stderr
    assert (overlay / OVERLAY_FILE).read_text().endswith("# edited in the build tree\n")
    assert (patches / "series").read_text() == series_before  # no patch for it
    assert lock.read_text() == lock_before  # patched_tree covers the patches only
    assert tool(lock, patches, "export", "--src", src, "--dry-run").returncode == 0


def test_overlay_edit_on_disk_is_drift_and_never_clobbered(
    stack_copy: tuple[Path, Path], tmp_path: Path
) -> None:
    lock, patches = stack_copy
    overlay = patches.parent / "overlay"
    src = tmp_path / "src"
    assert tool(lock, patches, "apply", "--src", src).returncode == 0
    edited = overlay / OVERLAY_FILE
    edited.write_text(edited.read_text() + "# edited in overlay/\n")
    (overlay / "vllm/v1/spec_decode/ddtree/extra.py").write_text(
        "# SPDX-License-Identifier: Apache-2.0\n"
    )
    r = tool(lock, patches, "export", "--src", src, "--dry-run")
    assert r.returncode == 1
    assert f"overlay/{OVERLAY_FILE} (differs from" in r.stderr
    assert "overlay/vllm/v1/spec_decode/ddtree/extra.py (would be removed" in r.stderr
    # export with a patch edit in build/src keeps the overlay/ edits (newer)
    up = src / "vllm/model_executor/models/qwen3_dflash.py"
    up.write_text(
        up.read_text().replace("Keep full KV allocation;", "Keep the full KV;")
    )
    git(
        src,
        "commit",
        "-q",
        "-a",
        "-m",
        "dflash: Comment\n\nWhy: w\nOrigin: vendor\nForwarded: no\nTest: none",
    )
    r = tool(lock, patches, "export", "--src", src)
    assert r.returncode == 0, r.stderr
    assert edited.read_text().endswith("# edited in overlay/\n")
    assert (overlay / "vllm/v1/spec_decode/ddtree/extra.py").is_file()
    assert (patches / "dflash-comment.patch").is_file()
    # the build tree edits the same file too: export refuses to lose either edit
    target = src / OVERLAY_FILE
    target.write_text(target.read_text() + "# edited in the build tree\n")
    git(src, "commit", "-q", "-a", "-m", "tweak the config module")
    r = tool(lock, patches, "export", "--src", src)
    assert r.returncode == 1 and "was edited since `apply`, and" in r.stderr
    assert edited.read_text().endswith("# edited in overlay/\n")
    # apply takes overlay/ as it is
    assert tool(lock, patches, "apply", "--src", src, "--force").returncode == 0
    assert (src / OVERLAY_FILE).read_text().endswith("# edited in overlay/\n")
    assert tool(lock, patches, "export", "--src", src, "--dry-run").returncode == 0


def test_export_splits_a_mixed_commit(
    stack_copy: tuple[Path, Path], tmp_path: Path
) -> None:
    """A commit that edits an upstream file and adds a module: the edit becomes a
    patch, the module goes to overlay/."""
    lock, patches = stack_copy
    overlay = patches.parent / "overlay"
    src = tmp_path / "src"
    assert tool(lock, patches, "apply", "--src", src).returncode == 0
    up = src / "vllm/model_executor/models/qwen3_dflash.py"
    up.write_text(
        up.read_text().replace("Keep full KV allocation;", "Keep the full KV;")
    )
    new = src / "vllm/v1/spec_decode/ddtree/extra.py"
    new.write_text("# SPDX-License-Identifier: Apache-2.0\n")
    git(src, "add", "-A")
    git(
        src,
        "commit",
        "-q",
        "-m",
        "ddtree: Mixed change\n\nWhy: w\nOrigin: vendor\nForwarded: no\nTest: none",
    )
    r = tool(lock, patches, "export", "--src", src)
    assert r.returncode == 0, r.stderr
    text = (patches / "ddtree-mixed-change.patch").read_text()
    assert "qwen3_dflash.py" in text and "extra.py" not in text
    assert (overlay / "vllm/v1/spec_decode/ddtree/extra.py").is_file()
    assert tool(lock, patches, "check").returncode == 0
    r = tool(lock, patches, "apply", "--src", tmp_path / "src2", "--verify")
    assert r.returncode == 0, r.stderr
    assert (
        tool(
            lock, patches, "export", "--src", tmp_path / "src2", "--dry-run"
        ).returncode
        == 0
    )


def test_series_hash_covers_the_overlay(stack_copy: tuple[Path, Path]) -> None:
    lock, patches = stack_copy
    before = series_hash(patches)
    f = patches.parent / "overlay" / OVERLAY_FILE
    f.write_text(f.read_text() + "\n")
    assert series_hash(patches) != before


# ------------------------------------------------------------------ lint


def test_lint_passes_on_the_repo(src_tree: Path) -> None:
    # The Makefile's LINT_PATHS.
    paths = ["overlay", "tests", "apply_patches.py", "patchstack", "bench"]
    r = run_tool("lint", "--src", src_tree, *paths)
    assert r.returncode == 0, r.stderr
    assert "clean" in r.stdout


def test_ruff_toml_is_upstreams(src_tree: Path, tmp_path: Path) -> None:
    assert ruff_config_drift(src_tree, REPO_ROOT / "ruff.toml") == []
    changed = tmp_path / "ruff.toml"
    changed.write_text(
        (REPO_ROOT / "ruff.toml").read_text().replace('"E731",', "")
        + "\nline-length = 100\n"
    )
    drift = ruff_config_drift(src_tree, changed)
    assert any(d.startswith("lint.ignore: upstream") for d in drift), drift
    assert "format.line-length: not upstream's" in drift


def test_lint_takes_only_the_added_lines_of_patched_files(tmp_path: Path) -> None:
    """A pristine file's own diagnostics are accepted; a patch's new ones and a
    patch that unformats a formatted file are not."""
    repo = tmp_path / "src"
    (repo / "vllm").mkdir(parents=True)
    (repo / "pyproject.toml").write_text('[tool.ruff.lint]\nselect = ["E", "F", "I"]\n')
    old = "import os\n\n\ndef f():\n    return 1\n"  # F401 upstream already has
    (repo / "vllm/x.py").write_text(old)
    (repo / "vllm/y.py").write_text("def g():\n    return 2\n")
    git(repo.parent, "init", "-q", str(repo))
    for key, value in (("user.name", "t"), ("user.email", "t@t.invalid")):
        git(repo, "config", key, value)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "pristine")
    git(repo, "tag", "upstream")
    (repo / "vllm/x.py").write_text(old + "\n\ndef h():\n    return 3\n")
    git(repo, "commit", "-q", "-a", "-m", "clean edit")
    assert lint_patched_files(repo) == ([], 1)
    (repo / "vllm/y.py").write_text("import sys\n\ndef g():\n    return  2\n")
    git(repo, "commit", "-q", "-a", "-m", "bad edit")
    problems, num_files = lint_patched_files(repo)
    assert num_files == 2
    assert any("vllm/y.py: F401" in p and "import sys" in p for p in problems), problems
    assert any("vllm/y.py: not formatted" in p for p in problems), problems
    assert not any("vllm/x.py" in p for p in problems), problems


def test_make_targets_take_the_line_and_test_checks_every_line() -> None:
    """`make wheel LINE=v` builds that line's wheel from build/src-v; `make
    test` (without LINE) ends with the line-check of every line in lines/."""

    def make_n(*argv: str) -> str:
        r = subprocess.run(
            ["make", "-n", *argv, f"PYTHON={sys.executable}"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, r.stderr
        return r.stdout

    default = make_n("-B", "wheel")
    assert "apply_patches.py apply --src build/src --verify" in default
    assert "--line" not in default
    lines = sorted(p.name for p in LINES_DIR.iterdir())
    assert lines
    for line in lines:
        out = make_n("-B", "wheel", f"LINE={line}")
        assert f"--line {line} apply --src build/src-{line} --verify" in out
        assert f"== wheel {line}+ddtree." in out
        out = make_n("line-check", f"LINE={line}")
        for cmd in ("check", f"apply --src build/src-{line} --verify", "lint"):
            assert f"apply_patches.py --line {line} {cmd}" in out
        assert f"--line {line} export --src build/src-{line} --dry-run" in out
    test = make_n("test")
    assert "apply_patches.py check" in test
    for line in lines:
        assert f"apply_patches.py --line {line} check" in test
