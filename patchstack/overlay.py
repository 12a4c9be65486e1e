# SPDX-License-Identifier: Apache-2.0
"""overlay/: the files we own, copied into the tree as one commit on top of the
patches (`apply`) and brought back from it (`export`)."""

from __future__ import annotations

import shutil
from pathlib import Path

from patchstack.common import OVERLAY_DIRNAME, DDTreeError
from patchstack.repo import new_files, run_git, run_git_bytes

OVERLAY_SUBJECT = (
    "overlay: the files vllm-ddtree owns (overlay/, not applied by git am)"
)
OVERLAY_TAG = "overlay"
# Fixed identity and dates for the overlay commit, as for the base commit.
OVERLAY_ENV = {
    "GIT_AUTHOR_NAME": "vllm-ddtree",
    "GIT_AUTHOR_EMAIL": "ddtree@vllm.invalid",
    "GIT_COMMITTER_NAME": "vllm-ddtree",
    "GIT_COMMITTER_EMAIL": "ddtree@vllm.invalid",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00 +0000",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00 +0000",
}


def overlay_files(overlay_dir: Path) -> dict[str, Path]:
    """The overlay's files: path in the vLLM tree -> file (``__pycache__`` left out)."""
    if not overlay_dir.is_dir():
        return {}
    out: dict[str, Path] = {}
    for path in sorted(overlay_dir.rglob("*")):
        rel = path.relative_to(overlay_dir)
        if "__pycache__" in rel.parts or path.is_dir():
            continue
        out[rel.as_posix()] = path
    return out


def copy_overlay(src: Path, overlay_dir: Path) -> int:
    """Copy the overlay into the tree as one commit on top of the patches."""
    files = overlay_files(overlay_dir)
    if not files:
        return 0
    for rel, path in files.items():
        dest = src / rel
        if dest.exists():
            raise DDTreeError(
                f"apply: {OVERLAY_DIRNAME}/{rel} would overwrite {dest}; "
                "the overlay may only add files"
            )
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, dest)
    run_git(src, "add", "-f", "--", *files)
    run_git(src, "commit", "-q", "--no-verify", "-m", OVERLAY_SUBJECT, env=OVERLAY_ENV)
    run_git(src, "tag", "-f", OVERLAY_TAG)
    return len(files)


def overlay_state(src: Path, overlay_dir: Path) -> tuple[dict[str, bytes], list[str]]:
    """(the new files of build/src HEAD, drift against overlay/ as descriptions)."""
    head = {rel: run_git_bytes(src, "show", f"HEAD:{rel}") for rel in new_files(src)}
    outside = [rel for rel in head if not rel.startswith("vllm/")]
    if outside:
        raise DDTreeError(
            f"{src}: new files outside vllm/ ({', '.join(outside)}); "
            f"{OVERLAY_DIRNAME}/ holds new files under vllm/ only"
        )
    disk = overlay_files(overlay_dir)
    drift = []
    for rel in sorted(set(head) | set(disk)):
        where = f"{OVERLAY_DIRNAME}/{rel}"
        if rel not in disk:
            drift.append(f"{where} (would be added: new in {src.name})")
        elif rel not in head:
            drift.append(f"{where} (would be removed: not in {src.name})")
        elif disk[rel].read_bytes() != head[rel]:
            drift.append(f"{where} (differs from {src.name}/{rel})")
    return head, drift


def applied_overlay(src: Path, rel: str) -> bytes | None:
    """`rel` as `apply` copied it (the commit tagged `overlay`), if it did."""
    try:
        return run_git_bytes(src, "show", f"refs/tags/{OVERLAY_TAG}:{rel}")
    except DDTreeError:
        return None


def write_overlay(src: Path, overlay_dir: Path, head: dict[str, bytes]) -> list[str]:
    """Bring build/src's edits of overlay files to overlay/, three-way against the
    copy `apply` made: a file changed only in build/src is written, one changed
    only in overlay/ (edited there since `apply`) is kept, one changed in both is
    refused (either edit would be lost). Returns the files written or removed."""
    disk = overlay_files(overlay_dir)
    changes: list[tuple[str, bytes | None]] = []
    for rel in sorted(set(head) | set(disk)):
        new = head.get(rel)
        old = disk[rel].read_bytes() if rel in disk else None
        applied = applied_overlay(src, rel)
        if new in (old, applied):
            continue
        if old != applied:
            raise DDTreeError(
                f"export: {OVERLAY_DIRNAME}/{rel} was edited since `apply`, and "
                f"{src}/{rel} too; keep one edit (commit the other into it) before "
                "exporting"
            )
        changes.append((rel, new))
    for rel, new in changes:
        dest = overlay_dir / rel
        if new is None:
            dest.unlink()
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(new)
    return [rel for rel, _ in changes]
