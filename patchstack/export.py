# SPDX-License-Identifier: Apache-2.0
"""`export`: patches/ and overlay/ rewritten from the commits above `upstream`;
with --dry-run, the drift gate between them and the tree."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from patchstack.common import OVERLAY_DIRNAME, DDTreeError, log
from patchstack.lock import Lock
from patchstack.overlay import overlay_state, write_overlay
from patchstack.repo import BASE_TAG, is_dirty, run_git, stack_tree, tree_of

FORMAT_PATCH_ARGS = (
    "--keep-subject",
    "--no-stat",
    "--no-signature",
    "--zero-commit",
    "--full-index",
    "--no-numbered",
    "--no-renames",
    "--no-color",
    "--encoding=UTF-8",
)


def slugify(subject: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", subject.lower()).strip("-")
    return (slug[:64].rstrip("-") or "patch") + ".patch"


def render_patches(src: Path) -> list[tuple[str, bytes]]:
    """Format the commits above `upstream` as (file name, bytes), in order.

    Only edits to files of the pristine tree make patches: new files belong to the
    overlay (`export` writes them to overlay/), so a commit that only adds or edits
    those (the overlay commit of `apply`) gives no patch."""
    revs = run_git(src, "rev-list", "--reverse", f"{BASE_TAG}..HEAD").split()
    pristine = set(run_git(src, "ls-tree", "-r", "--name-only", BASE_TAG).splitlines())
    out: list[tuple[str, bytes]] = []
    names: set[str] = set()
    for rev in revs:
        subject = run_git(src, "log", "-1", "--format=%s", rev).strip()
        if subject.startswith(("fixup!", "squash!", "amend!")):
            raise DDTreeError(
                f"commit {rev[:10]} is '{subject}'; run "
                f"`git -C {src} rebase -i --autosquash {BASE_TAG}` first"
            )
        if len(run_git(src, "rev-list", "--parents", "-1", rev).split()) != 2:
            raise DDTreeError(f"commit {rev[:10]} is a merge; keep the stack linear")
        touched = run_git(
            src,
            "diff-tree",
            "--no-commit-id",
            "--name-only",
            "-r",
            "--no-renames",
            f"{rev}~1",
            rev,
        ).splitlines()
        upstream_paths = [f for f in touched if f in pristine]
        if not upstream_paths:
            continue
        name = slugify(subject)
        if name in names:
            raise DDTreeError(f"two commits give the same patch name {name}")
        names.add(name)
        text = subprocess.run(
            [
                "git",
                "-C",
                str(src),
                "format-patch",
                "--stdout",
                *FORMAT_PATCH_ARGS,
                f"{rev}~1..{rev}",
                "--",
                *upstream_paths,
            ],
            capture_output=True,
            check=True,
        ).stdout
        out.append((name, text))
    return out


def export_drift(
    lock: Lock,
    patches_dir: Path,
    rendered: list[tuple[str, bytes]],
    upstream_tree: str,
    head_tree: str,
) -> tuple[list[str], list[str]]:
    """(drift descriptions, stale patch files): `rendered` against patches_dir, lock."""
    drift: list[str] = []
    for name, data in rendered:
        p = patches_dir / name
        if not p.exists() or p.read_bytes() != data:
            drift.append(name)
    new_names = {n for n, _ in rendered}
    stale = sorted(
        p.name for p in patches_dir.glob("*.patch") if p.name not in new_names
    )
    drift.extend(f"{n} (would be removed)" for n in stale)
    series_path = patches_dir / "series"
    old_series = series_path.read_text() if series_path.exists() else ""
    if [
        line
        for line in old_series.splitlines()
        if line.strip() and not line.startswith("#")
    ] != [n for n, _ in rendered]:
        drift.append("series")
    if lock.tree("patched_tree") != head_tree:
        drift.append(
            f"upstream.lock patched_tree ({lock.tree('patched_tree')!r} -> {head_tree})"
        )
    if lock.tree("upstream_tree") != upstream_tree:
        drift.append(f"upstream.lock upstream_tree -> {upstream_tree}")
    return drift, stale


def write_patches(
    patches_dir: Path, rendered: list[tuple[str, bytes]], stale: list[str]
) -> None:
    """Write the rendered patches and the series (keeping its comment lines)."""
    series_path = patches_dir / "series"
    old_series = series_path.read_text() if series_path.exists() else ""
    patches_dir.mkdir(parents=True, exist_ok=True)
    for name, data in rendered:
        (patches_dir / name).write_bytes(data)
    for name in stale:
        (patches_dir / name).unlink()
    comments = "".join(
        line + "\n" for line in old_series.splitlines() if line.startswith("#")
    )
    series_path.write_text(comments + "".join(f"{name}\n" for name, _ in rendered))


def cmd_export(args: argparse.Namespace) -> int:
    lock = Lock.load(args.lock)
    src: Path = args.src.resolve()
    if not (src / ".git").exists():
        raise DDTreeError(f"{src} is not a patched tree; run `apply` first")
    if (src / ".git" / "rebase-apply").exists():
        raise DDTreeError(f"{src}: git am in progress; finish or abort it first")
    if is_dirty(src):
        raise DDTreeError(f"{src} has uncommitted changes; commit them first")
    rendered = render_patches(src)
    head_tree = stack_tree(src)
    upstream_tree = tree_of(src, BASE_TAG)
    drift, stale = export_drift(lock, args.patches, rendered, upstream_tree, head_tree)
    head_overlay, overlay_drift = overlay_state(src, args.overlay)
    if args.dry_run:
        if drift or overlay_drift:
            print(
                f"export --dry-run: drift between build tree and patches/ or "
                f"{OVERLAY_DIRNAME}/:",
                file=sys.stderr,
            )
            for d in drift + overlay_drift:
                print(f"  {d}", file=sys.stderr)
            return 1
        log(
            f"export --dry-run: no drift ({len(rendered)} patches, "
            f"{len(head_overlay)} {OVERLAY_DIRNAME}/ files)"
        )
        return 0
    written = write_overlay(src, args.overlay, head_overlay)
    write_patches(args.patches, rendered, stale)
    lock.set_tree("upstream_tree", upstream_tree)
    lock.set_tree("patched_tree", head_tree)
    log(
        f"exported {len(rendered)} patches and {len(head_overlay)} {OVERLAY_DIRNAME}/ "
        "files; "
        f"patched_tree {head_tree}"
    )
    for d in drift:
        log(f"  updated: {d}")
    for rel in written:
        log(f"  updated: {OVERLAY_DIRNAME}/{rel}")
    return 0
