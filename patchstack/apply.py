# SPDX-License-Identifier: Apache-2.0
"""`apply`: the pristine sdist tree + the series (`git am`) + overlay/ -> a git
repo (build/src)."""

from __future__ import annotations

import argparse
import io
import re
import subprocess
import time
from pathlib import Path

import git
import unidiff

from patchstack.check import check_all
from patchstack.common import OVERLAY_DIRNAME, DDTreeError, log
from patchstack.lock import Lock
from patchstack.overlay import OVERLAY_TAG, copy_overlay, overlay_state
from patchstack.repo import (
    BASE_TAG,
    configure_repo,
    ensure_base_repo,
    is_dirty,
    run_git,
    stack_tree,
    tree_of,
)
from patchstack.series import read_series


def explain_am_failure(repo: Path, patch_path: Path, stderr: str) -> str:
    """Name the patch, file and hunk that git am could not apply."""
    lines = [f"apply: patch {patch_path.name} does not apply"]
    m = re.search(r"patch failed: (.+):(\d+)", stderr)
    if m:
        fname, line = m.group(1), int(m.group(2))
        hunk_desc = f"at line {line}"
        try:
            ps = unidiff.PatchSet(io.StringIO(patch_path.read_text(encoding="utf-8")))
            for pf in ps:
                if pf.path == fname:
                    for i, h in enumerate(pf, 1):
                        if h.source_start == line:
                            header = f"@@ -{h.source_start},{h.source_length} "
                            header += f"+{h.target_start},{h.target_length} @@"
                            if h.section_header:
                                header += f" {h.section_header}"
                            hunk_desc = f"hunk #{i} {header}"
                            break
        except unidiff.UnidiffParseError:
            pass
        lines.append(f"  file: {fname}")
        lines.append(f"  hunk: {hunk_desc}")
    else:
        m2 = re.search(
            r"error: (.+?): (does not exist in index|already exists in index)", stderr
        )
        if m2:
            lines.append(f"  file: {m2.group(1)} ({m2.group(2)})")
    lines.append("  git says:")
    lines.extend("    " + s for s in stderr.strip().splitlines())
    lines.append(
        f"  the tree is left for inspection in {repo} (git am in progress: "
        "`git am --show-current-patch=diff`, `git am --abort`)"
    )
    return "\n".join(lines)


def cmd_apply(args: argparse.Namespace) -> int:
    apply_stack(
        Lock.load(args.lock),
        args.patches,
        args.overlay,
        args.src.resolve(),
        verify=args.verify,
        force=args.force,
    )
    return 0


def apply_stack(
    lock: Lock,
    patches_dir: Path,
    overlay_dir: Path,
    src: Path,
    *,
    verify: bool = False,
    force: bool = False,
) -> None:
    """Make `src` the pristine tree + the series + the overlay (a clone of the base
    repo, or a tree made by `apply` before, reset: a HEAD of other commits is kept
    under refs/ddtree/backup/)."""
    problems = check_all(lock, patches_dir, overlay_dir)
    if problems:
        raise DDTreeError("apply: `check` failed:\n  " + "\n  ".join(problems))
    t0 = time.monotonic()
    base = ensure_base_repo(lock)
    base_tree = tree_of(base, BASE_TAG)
    if lock.tree("upstream_tree") and base_tree != lock.tree("upstream_tree"):
        raise DDTreeError(
            f"pristine tree {base_tree} differs from upstream_tree "
            f"{lock.tree('upstream_tree')} recorded in {lock.path}"
        )
    if (src / ".git").exists():
        if (src / ".git" / "rebase-apply").exists():
            run_git(src, "am", "--abort")
        if is_dirty(src) and not force:
            raise DDTreeError(
                f"{src} has uncommitted changes; commit them (and `export`) or pass "
                "--force"
            )
        head = run_git(src, "rev-parse", "HEAD").strip()
        upstream = run_git(src, "rev-parse", f"refs/tags/{BASE_TAG}^{{commit}}").strip()
        if head != upstream and not is_applied_state(src, lock, overlay_dir):
            backup = f"refs/ddtree/backup/{time.strftime('%Y%m%d-%H%M%S')}"
            run_git(src, "update-ref", backup, head)
            log(f"previous HEAD saved as {backup}")
        if tree_of(src, BASE_TAG) != base_tree:
            raise DDTreeError(
                f"{src} is based on another upstream tree; move it away or delete it"
            )
        run_git(src, "reset", "-q", "--hard", BASE_TAG)
        run_git(src, "clean", "-q", "-fdx")
    else:
        if src.exists() and any(src.iterdir()):
            raise DDTreeError(f"{src} exists and is not a git repo; remove it first")
        src.parent.mkdir(parents=True, exist_ok=True)
        log(f"cloning the pristine base into {src} ...")
        run_git(base.parent, "clone", "-q", "--no-checkout", str(base), str(src))
        configure_repo(git.Repo(src))
        run_git(src, "checkout", "-q", "-B", "ddtree", BASE_TAG)
    series = read_series(patches_dir)
    for i, name in enumerate(series, 1):
        patch_path = (patches_dir / name).resolve()
        log(f"[{i}/{len(series)}] {name}")
        proc = subprocess.run(
            [
                "git",
                "-C",
                str(src),
                "am",
                "-q",
                "--keep",
                "--committer-date-is-author-date",
                str(patch_path),
            ],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise DDTreeError(
                explain_am_failure(src, patch_path, proc.stderr + proc.stdout)
            )
    head_tree = tree_of(src, "HEAD")
    log(
        f"applied {len(series)} patches in {time.monotonic() - t0:.1f}s; tree "
        f"{head_tree}"
    )
    if verify:
        expected = lock.tree("patched_tree")
        if head_tree != expected:
            raise DDTreeError(
                f"apply --verify: patched tree {head_tree} != patched_tree "
                f"{expected!r} "
                f"in {lock.path} (run `export` after changing patches)"
            )
        log("verify: patched tree matches upstream.lock")
    copied = copy_overlay(src, overlay_dir)
    if copied:
        log(
            f"{OVERLAY_DIRNAME}/: copied {copied} files (commit tagged `{OVERLAY_TAG}`)"
        )


def is_applied_state(src: Path, lock: Lock, overlay_dir: Path) -> bool:
    """Whether HEAD is what `apply` makes of upstream.lock, patches/ and overlay/."""
    try:
        return (
            stack_tree(src) == lock.tree("patched_tree")
            and not overlay_state(src, overlay_dir)[1]
        )
    except DDTreeError:
        return False
