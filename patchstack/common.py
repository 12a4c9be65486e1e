# SPDX-License-Identifier: Apache-2.0
"""What every module of the tool shares: the repository's layout, the error a
user sees as one message, and the log line."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_LOCK = REPO_ROOT / "upstream.lock"
DEFAULT_PATCHES = REPO_ROOT / "patches"
# The files we own (new modules only), at their paths in the vLLM tree; `apply`
# copies them in after the patches. Default: next to the patches directory.
OVERLAY_DIRNAME = "overlay"
DEFAULT_SRC = REPO_ROOT / "build" / "src"
DEFAULT_DIST = REPO_ROOT / "dist"
DEFAULT_REPORTS = REPO_ROOT / "docs" / "rebase"
# Release lines beside the default one (the repo root: upstream.lock, patches/):
# lines/<vLLM version>/ holds that line's upstream.lock, patches/ and, when vLLM's
# ruff settings differ, ruff.toml. overlay/ is shared by every line.
LINES_DIR = REPO_ROOT / "lines"


class DDTreeError(Exception):
    """A user-facing error: printed as one message, exit status 1."""


def log(msg: str) -> None:
    print(f"[ddtree] {msg}", flush=True)


def default_overlay(patches_dir: Path) -> Path:
    return patches_dir.resolve().parent / OVERLAY_DIRNAME
