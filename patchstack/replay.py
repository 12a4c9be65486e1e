# SPDX-License-Identifier: Apache-2.0
"""The scratch repo of `rebase`: each release's vllm/ as a commit, and one patch of
the stack replayed from the old onto the new: its fate (clean, merged three-way,
conflict, already upstream), the hunks that do not apply as they are, the
conflict regions and what upstream changed in the patch's files."""

from __future__ import annotations

import io
import subprocess
import tarfile
import tempfile
from pathlib import Path

import unidiff

from patchstack.common import DDTreeError
from patchstack.fetch import cache_dir
from patchstack.repo import BASE_ENV, run_git
from patchstack.series import patch_message

FATES = ("clean", "merged", "conflict", "already-upstream")
FATE_TEXT = {
    "clean": "clean (applies as is)",
    "merged": "merged three-way",
    "conflict": "CONFLICT",
    "already-upstream": "already upstream (empty after merge)",
}


def git_env_for(repo: Path, rev: str) -> dict[str, str]:
    """Committer date = author date, as `git am --committer-date-is-author-date`."""
    date = run_git(repo, "log", "-1", "--format=%aD", rev).strip()
    return {"GIT_COMMITTER_DATE": date}


def vllm_tree_commit(
    repo: Path, vllm_tree: str, parent: str | None, message: str
) -> str:
    """A commit whose tree holds only `vllm/` = vllm_tree."""
    root = subprocess.run(
        ["git", "-C", str(repo), "mktree"],
        input=f"040000 tree {vllm_tree}\tvllm\n",
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    argv = ["commit-tree", root, "-m", message]
    if parent:
        argv += ["-p", parent]
    return run_git(repo, *argv, env=BASE_ENV).strip()


def sdist_vllm_tree(repo: Path, sdist: Path) -> str:
    """Write the sdist's vllm/ into repo's object store; return its tree id."""
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        work = Path(tmp) / "tree"
        with tarfile.open(sdist) as tf:
            members = [
                m
                for m in tf.getmembers()
                if len(parts := m.name.split("/")) > 1 and parts[1] == "vllm"
            ]
            if not members:
                raise DDTreeError(f"{sdist.name} has no vllm/ directory")
            tf.extractall(Path(tmp) / "x", members=members, filter="data")
        (top,) = list((Path(tmp) / "x").iterdir())
        top.rename(work)
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index"), "GIT_WORK_TREE": str(work)}
        run_git(repo, "add", "-A", "-f", "vllm", env=env)
        tree = run_git(repo, "write-tree", env=env).strip()
    return run_git(repo, "rev-parse", f"{tree}:vllm").strip()


def single_hunk_patches(patch_text: str) -> list[tuple[str, int, str, str]]:
    """(file, hunk number, hunk header, one-hunk patch text) for each hunk."""
    out = []
    for pf in unidiff.PatchSet(io.StringIO(patch_text)):
        head = str(pf.patch_info) if pf.patch_info else ""
        if not head.startswith("diff --git"):
            head = f"diff --git {pf.source_file} {pf.target_file}\n"
        head = head[head.index("diff --git") :]
        if "\n--- " not in "\n" + head:
            head += f"--- {pf.source_file}\n+++ {pf.target_file}\n"
        for i, h in enumerate(pf, 1):
            header = (
                f"@@ -{h.source_start},{h.source_length} "
                f"+{h.target_start},{h.target_length} @@"
            )
            if h.section_header:
                header += f" {h.section_header}"
            out.append((pf.path, i, header, head + str(h)))
    return out


def conflict_regions(path: Path, rel: str) -> list[dict]:
    """The <<<<<<< ... >>>>>>> regions of a conflicted file (diff3 style)."""
    regions: list[dict] = []
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return [
            {
                "file": rel,
                "line": 0,
                "text": "(deleted on one side: modify/delete conflict)",
            }
        ]
    start = None
    for n, line in enumerate(lines, 1):
        if line.startswith("<<<<<<< "):
            start = n
        elif line.startswith(">>>>>>> ") and start is not None:
            regions.append(
                {
                    "file": rel,
                    "line": start,
                    "text": "\n".join(lines[start - 1 : n]) + "\n",
                }
            )
            start = None
    return regions


def replay_patch(scratch: Path, patch_path: Path, pre_image: str) -> dict:
    """Replay one patch on the current HEAD of scratch and classify it."""
    text = patch_path.read_text(encoding="utf-8")
    rec: dict = {
        "patch": patch_path.name,
        "subject": patch_message(text)[0],
        "files": sorted({pf.path for pf in unidiff.PatchSet(io.StringIO(text))}),
    }
    check = subprocess.run(
        ["git", "-C", str(scratch), "apply", "--check", str(patch_path)],
        capture_output=True,
        text=True,
    )
    if check.returncode == 0:
        run_git(
            scratch,
            "am",
            "-q",
            "--keep",
            "--committer-date-is-author-date",
            str(patch_path),
        )
        rec["fate"] = "clean"
        return rec
    failing = []
    for rel, i, header, one in single_hunk_patches(text):
        r = subprocess.run(
            ["git", "-C", str(scratch), "apply", "--check", "-"],
            input=one,
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            failing.append({"file": rel, "hunk": i, "header": header})
    rec["hunks_not_applying"] = failing
    pick = subprocess.run(
        [
            "git",
            "-C",
            str(scratch),
            "-c",
            "merge.conflictStyle=diff3",
            "cherry-pick",
            "--no-commit",
            pre_image,
        ],
        capture_output=True,
        text=True,
    )
    if pick.returncode == 0:
        if not run_git(scratch, "diff", "--cached", "--name-only", "HEAD").strip():
            rec["fate"] = "already-upstream"
            run_git(scratch, "reset", "-q", "--hard", "HEAD")
        else:
            run_git(
                scratch,
                "commit",
                "-q",
                "--no-verify",
                "-C",
                pre_image,
                env=git_env_for(scratch, pre_image),
            )
            rec["fate"] = "merged"
        subprocess.run(
            ["git", "-C", str(scratch), "cherry-pick", "--quit"], capture_output=True
        )
        return rec
    unmerged = run_git(scratch, "diff", "--name-only", "--diff-filter=U").split()
    if not unmerged:
        raise DDTreeError(
            f"rebase: cherry-pick of {patch_path.name} failed:\n"
            f"{(pick.stderr + pick.stdout).strip()}"
        )
    regions: list[dict] = []
    status = {
        line[3:]: line[:2]
        for line in run_git(
            scratch, "status", "--porcelain", "--untracked-files=no"
        ).splitlines()
    }
    for rel in unmerged:
        found = conflict_regions(scratch / rel, rel)
        if not found or found[0]["line"] == 0:  # modify/delete, add/add without markers
            found = [
                {
                    "file": rel,
                    "line": 0,
                    "text": f"(no conflict markers: git status "
                    f"{status.get(rel, '??')}; e.g. upstream deleted or renamed the "
                    "file)\n",
                }
            ]
        regions.extend(found)
    rec["fate"] = "conflict"
    rec["conflict"] = {"files": unmerged, "regions": regions}
    run_git(scratch, "reset", "-q", "--hard", "HEAD")
    run_git(scratch, "clean", "-q", "-fd")
    subprocess.run(
        ["git", "-C", str(scratch), "cherry-pick", "--quit"], capture_output=True
    )
    return rec


def upstream_changes(scratch: Path, files: list[str], with_diff: bool) -> dict:
    """How upstream changed `files` between the releases (numstat, optional diff)."""
    stat = []
    for line in run_git(
        scratch, "diff", "--numstat", "old-base", "new-base", "--", *files
    ).splitlines():
        added, removed, name = line.split("\t", 2)
        stat.append(
            {
                "file": name,
                "added": int(added) if added.isdigit() else added,
                "removed": int(removed) if removed.isdigit() else removed,
            }
        )
    out: dict = {"stat": stat}
    if with_diff:
        diff = run_git(scratch, "diff", "old-base", "new-base", "--", *files)
        out["diff_lines"] = len(diff.splitlines())
        out["diff"] = diff
    return out
