# SPDX-License-Identifier: Apache-2.0
"""Tests for apply_patches.py: check, fetch (sha256), apply failures, export drift."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import apply_patches

REPO_ROOT = Path(__file__).resolve().parent.parent
TOOL = [sys.executable, str(REPO_ROOT / "apply_patches.py")]
FIRST_PATCH = "dflash-swa-draft-layers-keep-full-kv.patch"


def run_tool(*argv: str | Path, env: dict[str, str] | None = None
             ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TOOL, *map(str, argv)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )


def tool(lock: Path, patches: Path, *argv: str | Path,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_tool("--lock", lock, "--patches", patches, *argv, env=env)


def git(repo: Path, *argv: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *argv], check=True,
                          capture_output=True, text=True).stdout


# ------------------------------------------------------------------ check


def test_check_passes_on_repo() -> None:
    r = run_tool("check")
    assert r.returncode == 0, r.stderr


def test_first_patch_is_listed_first() -> None:
    assert apply_patches.read_series(apply_patches.DEFAULT_PATCHES)[0] == FIRST_PATCH


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
    p.write_text(p.read_text().replace("vllm/model_executor/models/qwen3_dflash.py", path))
    r = tool(lock, patches, "check")
    assert r.returncode == 1
    assert path in r.stderr and reason in r.stderr


def test_new_files_under_vllm_are_allowed(stack_copy: tuple[Path, Path]) -> None:
    lock, patches = stack_copy
    (patches / "add-module.patch").write_text(
        "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
        "From: vllm-ddtree <ddtree@vllm.invalid>\n"
        "Date: Sun, 29 Nov 2026 12:00:00 +0000\n"
        "Subject: ddtree: add module\n\n"
        "Why: x\nOrigin: vendor\nForwarded: not-needed\nTest: none\n\n"
        "diff --git a/vllm/v1/spec_decode/ddtree/tree.py b/vllm/v1/spec_decode/ddtree/tree.py\n"
        "new file mode 100644\n"
        "index 0000000..e69de29\n"
        "--- /dev/null\n"
        "+++ b/vllm/v1/spec_decode/ddtree/tree.py\n"
        "@@ -0,0 +1 @@\n"
        "+# SPDX-License-Identifier: Apache-2.0\n"
    )
    with open(patches / "series", "a") as f:
        f.write("add-module.patch\n")
    r = tool(lock, patches, "check")
    assert r.returncode == 0, r.stderr


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
    real = apply_patches.fetch_artifact(apply_patches.Lock.load(apply_patches.DEFAULT_LOCK),
                                        "sdist")
    cache = tmp_path / "cache"
    cache.mkdir()
    os.symlink(real, cache / real.name)
    wrong = "0" * 64
    text = lock.read_text()
    good = apply_patches.Lock.load(lock).artifact("sdist").sha256
    lock.write_text(text.replace(good, wrong))
    r = tool(lock, patches, "fetch", env={"VLLM_DDTREE_CACHE": str(cache)})
    assert r.returncode == 1
    msg = [line for line in r.stderr.splitlines() if "sha256 mismatch" in line]
    assert len(msg) == 1, r.stderr
    assert real.name in msg[0] and wrong in msg[0] and good in msg[0]
    # apply must refuse the file too (nothing is extracted from it)
    r = tool(lock, patches, "apply", "--src", tmp_path / "src",
             env={"VLLM_DDTREE_CACHE": str(cache)})
    assert r.returncode == 1 and "sha256 mismatch" in r.stderr
    assert not (tmp_path / "src").exists()


def test_verify_sha256_unit(tmp_path: Path) -> None:
    f = tmp_path / "a.bin"
    f.write_bytes(b"abc")
    good = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    apply_patches.verify_sha256(f, good)
    with pytest.raises(apply_patches.DDTreeError, match=f"a.bin.*{good[:8]}.*got {good}"):
        apply_patches.verify_sha256(f, good[:8] + "0" * 56)


# ------------------------------------------------------------------ apply / export


def test_corrupted_hunk_names_patch_file_and_hunk(stack_copy: tuple[Path, Path],
                                                 tmp_path: Path) -> None:
    lock, patches = stack_copy
    p = patches / FIRST_PATCH
    text = p.read_text()
    assert "         self.causal = causal\n" in text
    p.write_text(text.replace("         self.causal = causal\n",
                              "         self.causal = not_causal\n"))
    src = tmp_path / "src"
    r = tool(lock, patches, "apply", "--src", src)
    assert r.returncode == 1
    assert f"patch {FIRST_PATCH} does not apply" in r.stderr
    assert "file: vllm/model_executor/models/qwen3_dflash.py" in r.stderr
    assert "hunk: hunk #1 @@ -217,6 +217,10 @@" in r.stderr
    # the tree is left for inspection, git am stopped on the patch
    assert (src / ".git" / "rebase-apply").exists()


def test_apply_verify_and_no_drift(stack_copy: tuple[Path, Path], tmp_path: Path) -> None:
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


def test_drift_and_export_round_trip(stack_copy: tuple[Path, Path], tmp_path: Path) -> None:
    lock, patches = stack_copy
    src = tmp_path / "src"
    assert tool(lock, patches, "apply", "--src", src).returncode == 0
    target = src / "vllm/model_executor/models/qwen3_dflash.py"
    target.write_text(target.read_text().replace(
        "Keep full KV allocation; SWA remains a compute-time limit.",
        "Keep the full KV allocation; SWA stays a compute-time limit."))
    # The first patch's commit is the oldest one above the pristine base.
    first = git(src, "rev-list", "--reverse", "upstream..HEAD").split()[0]
    git(src, "commit", "-q", "-a", "--fixup", first)
    r = tool(lock, patches, "export", "--src", src, "--dry-run")
    assert r.returncode == 1
    git(src, "-c", "sequence.editor=true", "rebase", "-q", "-i", "--autosquash", "upstream")
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


def test_new_commit_becomes_a_new_patch(stack_copy: tuple[Path, Path], tmp_path: Path) -> None:
    lock, patches = stack_copy
    src = tmp_path / "src"
    assert tool(lock, patches, "apply", "--src", src).returncode == 0
    new = src / "vllm/v1/spec_decode/ddtree_example/__init__.py"
    new.parent.mkdir(parents=True)
    new.write_text("# SPDX-License-Identifier: Apache-2.0\n")
    git(src, "add", str(new))
    git(src, "commit", "-q", "-m",
        "ddtree: Add package\n\nWhy: w\nOrigin: vendor\nForwarded: not-needed\nTest: none")
    assert tool(lock, patches, "export", "--src", src).returncode == 0
    series = apply_patches.read_series(patches)
    assert series[0] == FIRST_PATCH and series[-1] == "ddtree-add-package.patch"
    assert len(series) == len(apply_patches.read_series(apply_patches.DEFAULT_PATCHES)) + 1
    assert tool(lock, patches, "check").returncode == 0


def test_lock_version_is_consistent() -> None:
    lock = apply_patches.Lock.load(apply_patches.DEFAULT_LOCK)
    assert re.fullmatch(r"0\.26\.0\+ddtree\.\d+", lock.version)
    assert lock.upstream["tag"] == "v0.26.0"
    assert lock.upstream["commit"] == "ffd46bfab"
    assert lock.upstream["base_image"] == "vllm/vllm-openai:v0.26.0"
