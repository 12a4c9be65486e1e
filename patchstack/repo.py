# SPDX-License-Identifier: Apache-2.0
"""Git trees: the pristine base repo of the pinned sdist in the cache (tag
`upstream`), and what reads and writes a tree made from it, such as build/src."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

import git

from patchstack.common import DDTreeError, log
from patchstack.fetch import cache_dir, fetch_artifact
from patchstack.lock import Lock

BASE_TAG = "upstream"
# Fixed identity and dates for the pristine base commit so that it is reproducible.
BASE_ENV = {
    "GIT_AUTHOR_NAME": "vLLM upstream",
    "GIT_AUTHOR_EMAIL": "upstream@vllm.invalid",
    "GIT_COMMITTER_NAME": "vLLM upstream",
    "GIT_COMMITTER_EMAIL": "upstream@vllm.invalid",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00 +0000",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00 +0000",
}
LOCAL_IDENTITY = {"user.name": "vllm-ddtree", "user.email": "ddtree@vllm.invalid"}


def run_git(repo: Path, *argv: str, env: dict[str, str] | None = None) -> str:
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run(
        ["git", "-C", str(repo), *argv],
        capture_output=True,
        text=True,
        env=full_env,
    )
    if proc.returncode != 0:
        raise DDTreeError(f"git {' '.join(argv)} failed:\n{proc.stderr.strip()}")
    return proc.stdout


def run_git_bytes(repo: Path, *argv: str) -> bytes:
    proc = subprocess.run(["git", "-C", str(repo), *argv], capture_output=True)
    if proc.returncode != 0:
        raise DDTreeError(
            f"git {' '.join(argv)} failed:\n{proc.stderr.decode().strip()}"
        )
    return proc.stdout


def configure_repo(repo: git.Repo) -> None:
    with repo.config_writer() as cw:
        for key, value in LOCAL_IDENTITY.items():
            section, option = key.split(".")
            cw.set_value(section, option, value)
        cw.set_value("core", "autocrlf", "false")
        cw.set_value("gc", "auto", "0")


def ensure_base_repo(lock: Lock) -> Path:
    """A bare repo in the cache whose `upstream` tag is the pristine sdist tree."""
    sdist = lock.artifact("sdist")
    base = cache_dir() / f"base-{sdist.sha256[:16]}.git"
    if base.exists():
        try:
            run_git(base, "rev-parse", "--verify", f"refs/tags/{BASE_TAG}")
            return base
        except DDTreeError:
            shutil.rmtree(base)
    sdist_path = fetch_artifact(lock, "sdist")
    log(f"extracting {sdist_path.name} into a pristine base repo ...")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        work = Path(tmp) / "tree"
        with tarfile.open(sdist_path) as tf:
            tf.extractall(Path(tmp) / "x", filter="data")
        (top,) = list((Path(tmp) / "x").iterdir())
        top.rename(work)
        repo = git.Repo.init(work)
        configure_repo(repo)
        run_git(work, "add", "-A", "-f", ".")
        run_git(
            work,
            "commit",
            "-q",
            "--no-verify",
            "-m",
            f"vLLM {lock.upstream['version']} ({lock.upstream['commit']}): pristine "
            "sdist "
            f"{sdist.filename}",
            env=BASE_ENV,
        )
        run_git(work, "tag", BASE_TAG)
        tmp_bare = Path(tmp) / "base.git"
        run_git(work, "clone", "-q", "--bare", str(work), str(tmp_bare))
        tmp_bare.rename(base)
    log(f"base repo ready in {time.monotonic() - t0:.1f}s: {base}")
    return base


def tree_of(repo: Path, rev: str) -> str:
    return run_git(repo, "rev-parse", f"{rev}^{{tree}}").strip()


def is_dirty(repo: Path) -> bool:
    return bool(run_git(repo, "status", "--porcelain", "--untracked-files=no").strip())


def new_files(src: Path, rev: str = "HEAD") -> list[str]:
    """Files of `rev` that the pristine tree does not have (the overlay's files)."""
    out = run_git(
        src, "diff", "--name-only", "--no-renames", "--diff-filter=A", BASE_TAG, rev
    )
    return sorted(out.splitlines())


def stack_tree(src: Path, rev: str = "HEAD") -> str:
    """The tree of `rev` without the new files: the pristine tree plus the patches'
    edits (what upstream.lock's patched_tree records)."""
    added = new_files(src, rev)
    if not added:
        return tree_of(src, rev)
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        run_git(src, "read-tree", rev, env=env)
        subprocess.run(
            ["git", "-C", str(src), "rm", "-q", "--cached", "--", *added],
            check=True,
            capture_output=True,
            env={**os.environ, **env},
        )
        return run_git(src, "write-tree", env=env).strip()
