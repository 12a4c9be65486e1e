#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""vllm-ddtree patch-stack tool.

Subcommands:
  fetch            download the pinned sdist and wheel into the cache, verify sha256
  check            validate patches/series, every patch and overlay/
  apply            pristine sdist tree + series + overlay/ -> git repo (build/src)
  export           rewrite patches/ and overlay/ from the commits above `upstream`
  wheel            official wheel + patched vllm/ files -> dist/<our wheel>
  rebase           replay the stack onto another vLLM release; Markdown + JSON report
  lint             ruff with vLLM's settings: our files, and the lines patches add
  version          print our version (for the Makefile)
  series-hash      print the sha256 of the series (for image labels)
"""

from __future__ import annotations

import argparse
import base64
import copy
import csv
import email.parser
import email.policy
import hashlib
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

import git
import tomllib
import unidiff

REPO_ROOT = Path(__file__).resolve().parent
DEFAULT_LOCK = REPO_ROOT / "upstream.lock"
DEFAULT_PATCHES = REPO_ROOT / "patches"
# The files we own (new modules only), at their paths in the vLLM tree; `apply`
# copies them in after the patches. Default: next to the patches directory.
OVERLAY_DIRNAME = "overlay"
OVERLAY_SUBJECT = (
    "overlay: the files vllm-ddtree owns (overlay/, not applied by git am)"
)
OVERLAY_TAG = "overlay"
SPDX_LINE = "# SPDX-License-Identifier: Apache-2.0"
DEFAULT_SRC = REPO_ROOT / "build" / "src"
DEFAULT_DIST = REPO_ROOT / "dist"
DEFAULT_REPORTS = REPO_ROOT / "docs" / "rebase"
# Release lines beside the default one (the repo root: upstream.lock, patches/):
# lines/<vLLM version>/ holds that line's upstream.lock, patches/ and, when vLLM's
# ruff settings differ, ruff.toml. overlay/ is shared by every line.
LINES_DIR = REPO_ROOT / "lines"
BASE_TAG = "upstream"
REQUIRED_HEADERS = ("Why", "Origin", "Forwarded", "Test")
# Fixed identity and dates for the pristine base commit so that it is reproducible.
BASE_ENV = {
    "GIT_AUTHOR_NAME": "vLLM upstream",
    "GIT_AUTHOR_EMAIL": "upstream@vllm.invalid",
    "GIT_COMMITTER_NAME": "vLLM upstream",
    "GIT_COMMITTER_EMAIL": "upstream@vllm.invalid",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00 +0000",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00 +0000",
}
OVERLAY_ENV = {
    "GIT_AUTHOR_NAME": "vllm-ddtree",
    "GIT_AUTHOR_EMAIL": "ddtree@vllm.invalid",
    "GIT_COMMITTER_NAME": "vllm-ddtree",
    "GIT_COMMITTER_EMAIL": "ddtree@vllm.invalid",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00 +0000",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00 +0000",
}
LOCAL_IDENTITY = {"user.name": "vllm-ddtree", "user.email": "ddtree@vllm.invalid"}
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
COMPILED_PATHS = ("csrc/", "CMakeLists.txt", "setup.py", "cmake/")


class DDTreeError(Exception):
    """A user-facing error: printed as one message, exit status 1."""


def log(msg: str) -> None:
    print(f"[ddtree] {msg}", flush=True)


# --------------------------------------------------------------------------- lock


@dataclass
class Artifact:
    filename: str
    url: str
    sha256: str


@dataclass
class Lock:
    path: Path
    data: dict

    @classmethod
    def load(cls, path: Path) -> Lock:
        try:
            with open(path, "rb") as f:
                return cls(path, tomllib.load(f))
        except FileNotFoundError as e:
            raise DDTreeError(f"lock file not found: {path}") from e
        except tomllib.TOMLDecodeError as e:
            raise DDTreeError(f"{path}: invalid TOML: {e}") from e

    @property
    def upstream(self) -> dict:
        return self.data["upstream"]

    @property
    def version(self) -> str:
        version = self.data["ddtree"]["version"]
        expected = f"{self.upstream['version']}+ddtree.{self.data['ddtree']['build']}"
        if version != expected:
            raise DDTreeError(
                f"{self.path}: ddtree.version {version!r} does not match "
                f"upstream.version + ddtree.build ({expected!r})"
            )
        return version

    def artifact(self, kind: str) -> Artifact:
        a = self.upstream[kind]
        return Artifact(a["filename"], a.get("url", ""), a["sha256"].lower())

    @property
    def precompiled(self) -> bool:
        return bool(self.upstream.get("precompiled", True))

    def tree(self, key: str) -> str:
        return str(self.data["ddtree"].get(key, ""))

    def set_tree(self, key: str, value: str) -> None:
        """Rewrite one `key = "..."` line of [ddtree] in place (keeps comments)."""
        text = self.path.read_text()
        pattern = re.compile(rf'^{key}[ \t]*=[ \t]*"[^"\n]*"[ \t]*$', re.M)
        if not pattern.search(text):
            raise DDTreeError(f'{self.path}: no `{key} = "..."` line to update')
        text = pattern.sub(f'{key} = "{value}"', text, count=1)
        self.path.write_text(text)
        self.data["ddtree"][key] = value


# ------------------------------------------------------------------------- fetch


def cache_dir() -> Path:
    d = Path(
        os.environ.get("VLLM_DDTREE_CACHE", Path.home() / ".cache" / "vllm-ddtree")
    )
    d.mkdir(parents=True, exist_ok=True)
    return d


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_sha256(path: Path, expected: str) -> None:
    actual = sha256_file(path)
    if actual != expected:
        raise DDTreeError(
            f"sha256 mismatch for {path.name} ({path}): expected {expected}, got "
            f"{actual}; "
            "refusing to use it"
        )


PYPI_SIMPLE = "https://pypi.org/simple/{project}/"


def pypi_index(project: str) -> dict[str, dict]:
    """Map filename -> {url, sha256, yanked}, from PyPI's JSON simple API."""
    url = PYPI_SIMPLE.format(project=project)
    req = urllib.request.Request(
        url, headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            index = json.load(r)
    except (OSError, ValueError) as e:
        raise DDTreeError(f"cannot read the package index {url}: {e}") from e
    return {
        f["filename"]: {
            "url": f["url"],
            "sha256": str(f.get("hashes", {}).get("sha256", "")).lower(),
            "yanked": bool(f.get("yanked")),
        }
        for f in index.get("files", [])
    }


def newest_release(project: str = "vllm") -> str:
    """The newest final release of ``project`` on PyPI: the highest version
    among its sdists that is not yanked and is digits and dots only (no
    pre-, post- or dev-release)."""
    best: tuple[tuple[int, ...], str] | None = None
    pattern = re.compile(rf"{re.escape(project)}-(\d+(?:\.\d+)*)\.tar\.gz")
    for name, entry in pypi_index(project).items():
        m = pattern.fullmatch(name)
        if m is None or entry["yanked"]:
            continue
        key = tuple(int(x) for x in m.group(1).split("."))
        if best is None or key > best[0]:
            best = (key, m.group(1))
    if best is None:
        raise DDTreeError(
            f"no final release of {project} on {PYPI_SIMPLE.format(project=project)}"
        )
    return best[1]


def resolve_url(filename: str) -> str:
    """Find a file's URL through PyPI's JSON simple API."""
    project = filename.split("-", 1)[0]
    entry = pypi_index(project).get(filename)
    if entry is None:
        raise DDTreeError(
            f"{filename} not found on {PYPI_SIMPLE.format(project=project)}"
        )
    return entry["url"]


def download(url: str, dest: Path) -> None:
    part = dest.with_name(dest.name + ".part")
    log(f"downloading {url}")
    with urllib.request.urlopen(url, timeout=120) as r, open(part, "wb") as f:
        total = int(r.headers.get("Content-Length") or 0)
        done, last = 0, 0.0
        while chunk := r.read(1 << 20):
            f.write(chunk)
            done += len(chunk)
            if time.monotonic() - last > 2:
                last = time.monotonic()
                pct = f" ({100 * done // total}%)" if total else ""
                log(f"  {done >> 20} MiB{pct}")
    part.rename(dest)


def fetch_artifact(lock: Lock, kind: str) -> Path:
    """Return the verified cached artifact, downloading it if absent."""
    art = lock.artifact(kind)
    dest = cache_dir() / art.filename
    if not dest.exists():
        tmp = dest.with_name(dest.name + ".download")
        download(art.url or resolve_url(art.filename), tmp)
        try:
            verify_sha256(tmp, art.sha256)
        except DDTreeError:
            tmp.unlink()
            raise
        tmp.rename(dest)
    else:
        verify_sha256(dest, art.sha256)
    return dest


def cmd_fetch(args: argparse.Namespace) -> int:
    lock = Lock.load(args.lock)
    for kind in ("sdist", "wheel"):
        path = fetch_artifact(lock, kind)
        log(f"{kind}: {path} (sha256 ok)")
    return 0


# ------------------------------------------------------------------------- check


def read_series(patches_dir: Path) -> list[str]:
    series = patches_dir / "series"
    if not series.exists():
        raise DDTreeError(f"{series} is missing")
    names = []
    for line in series.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line)
    return names


def patch_message(text: str) -> tuple[str, str]:
    """Return (subject, body) of a git format-patch file."""
    m = re.search(r"^(---|diff --git .*)$", text, re.M)
    if not m:
        raise DDTreeError("no diff after the commit message")
    head = text[: m.start()]
    msg = email.parser.Parser(policy=email.policy.compat32).parsestr(head)
    subject = str(msg.get("Subject", "")).replace("\n", " ").strip()
    for key in ("From", "Date"):
        if not msg.get(key):
            raise DDTreeError(f"missing '{key}:' header")
    return subject, str(msg.get_payload())


def header_fields(body: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in body.splitlines():
        m = re.match(r"^(Why|Origin|Forwarded|Test):\s*(.*?)\s*$", line)
        if m and m.group(1) not in fields:
            fields[m.group(1)] = m.group(2)
    return fields


FORWARDED_VALUES = ("no", "not-needed", "not yet, candidate")


@dataclass
class PatchStats:
    """What one patch changes in upstream files."""

    files: set[str]
    added: int
    removed: int


def check_patch(
    path: Path,
    precompiled: bool,
    overlay: dict[str, Path] | None = None,
    stats: PatchStats | None = None,
) -> list[str]:
    """Return the problems found in one patch file (and fill `stats`)."""
    problems: list[str] = []
    text = path.read_text(encoding="utf-8")
    try:
        subject, body = patch_message(text)
    except DDTreeError as e:
        return [f"{path.name}: {e}"]
    if not subject:
        problems.append(f"{path.name}: empty Subject")
    fields = header_fields(body)
    for key in REQUIRED_HEADERS:
        if not fields.get(key):
            problems.append(f"{path.name}: header '{key}:' missing or empty")
    origin = fields.get("Origin", "")
    if origin and not (origin == "vendor" or origin.startswith("https://")):
        problems.append(f"{path.name}: Origin must be an upstream PR URL or 'vendor'")
    fwd = fields.get("Forwarded", "")
    if fwd and not (fwd in FORWARDED_VALUES or fwd.startswith("https://")):
        problems.append(
            f"{path.name}: Forwarded must be 'no', 'not-needed', "
            "'not yet, candidate' or a URL"
        )
    try:
        patchset = unidiff.PatchSet(io.StringIO(text))
    except unidiff.UnidiffParseError as e:
        return problems + [f"{path.name}: diff does not parse: {e}"]
    if len(patchset) == 0:
        problems.append(f"{path.name}: contains no diff")
    for pf in patchset:
        for p in {pf.source_file, pf.target_file} - {"/dev/null"}:
            rel = re.sub(r"^[ab]/", "", p)
            if precompiled and (
                rel.startswith(COMPILED_PATHS) or rel in COMPILED_PATHS
            ):
                problems.append(
                    f"{path.name}: touches {rel}, which needs a compiler; "
                    "refused while upstream.lock says precompiled = true"
                )
            elif not (rel.startswith("vllm/") and rel.endswith(".py")):
                problems.append(
                    f"{path.name}: touches {rel}; only Python/Triton files under vllm/ "
                    "may be patched"
                )
            elif overlay is not None and rel in overlay:
                problems.append(
                    f"{path.name}: touches {rel}, a file of {OVERLAY_DIRNAME}/; "
                    f"edit {OVERLAY_DIRNAME}/{rel} instead"
                )
        if pf.is_added_file:
            problems.append(
                f"{path.name}: adds {pf.path}; patches edit upstream files only, "
                f"new files go in {OVERLAY_DIRNAME}/{pf.path}"
            )
        if pf.is_binary_file:
            problems.append(f"{path.name}: binary diff for {pf.path}")
        if stats is not None:
            stats.files.add(pf.path)
            stats.added += pf.added
            stats.removed += pf.removed
    return problems


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


def upstream_files(lock: Lock) -> set[str]:
    """Every file of the pinned pristine sdist tree."""
    base = ensure_base_repo(lock)
    return set(run_git(base, "ls-tree", "-r", "--name-only", BASE_TAG).splitlines())


def check_overlay(overlay_dir: Path, upstream: set[str]) -> list[str]:
    """The overlay holds only new Python files under vllm/, each in a package."""
    problems: list[str] = []
    files = overlay_files(overlay_dir)
    upstream_dirs = {str(Path(f).parent) for f in upstream}
    name = OVERLAY_DIRNAME
    for rel, path in files.items():
        if path.is_symlink() or not path.is_file():
            problems.append(f"{name}/{rel}: not a regular file")
            continue
        if not (rel.startswith("vllm/") and rel.endswith(".py")):
            problems.append(f"{name}/{rel}: only Python files under vllm/ may be added")
            continue
        if rel in upstream:
            problems.append(
                f"{name}/{rel}: overwrites an upstream file; change it with a "
                "patch instead"
            )
            continue
        first = path.read_text(encoding="utf-8").split("\n", 1)[0]
        if first != SPDX_LINE:
            problems.append(f"{name}/{rel}: first line must be '{SPDX_LINE}'")
        # Every directory the overlay adds is a package of its own.
        parent = Path(rel).parent
        while str(parent) not in upstream_dirs and str(parent) != ".":
            init = (parent / "__init__.py").as_posix()
            if init not in files:
                problems.append(
                    f"{name}/{parent.as_posix()}/: new package without __init__.py"
                )
            parent = parent.parent
    return sorted(set(problems))


def check_all(
    lock: Lock,
    patches_dir: Path,
    overlay_dir: Path | None = None,
    stats: dict[str, PatchStats] | None = None,
) -> list[str]:
    problems: list[str] = []
    series = read_series(patches_dir)
    seen: set[str] = set()
    for name in series:
        if name in seen:
            problems.append(f"series: duplicate entry {name}")
        seen.add(name)
        if not (patches_dir / name).is_file():
            problems.append(f"series: entry {name} has no file patches/{name}")
    on_disk = {p.name for p in patches_dir.glob("*.patch")}
    for name in sorted(on_disk - seen):
        problems.append(f"series: patches/{name} is not listed in the series")
    overlay = overlay_files(overlay_dir) if overlay_dir is not None else {}
    for name in dict.fromkeys(series):
        if (patches_dir / name).is_file():
            st = PatchStats(set(), 0, 0)
            problems.extend(
                check_patch(patches_dir / name, lock.precompiled, overlay, st)
            )
            if stats is not None:
                stats[name] = st
    if overlay:
        problems.extend(check_overlay(overlay_dir, upstream_files(lock)))
    return problems


def cmd_check(args: argparse.Namespace) -> int:
    lock = Lock.load(args.lock)
    _ = lock.version  # validates the version fields
    stats: dict[str, PatchStats] = {}
    problems = check_all(lock, args.patches, args.overlay, stats)
    for p in problems:
        print(f"check: {p}", file=sys.stderr)
    if problems:
        return 1
    for name, st in stats.items():
        log(f"  {name}: +{st.added} -{st.removed} in {len(st.files)} file(s)")
    files = set().union(*(st.files for st in stats.values())) if stats else set()
    added = sum(st.added for st in stats.values())
    removed = sum(st.removed for st in stats.values())
    overlay = overlay_files(args.overlay)
    overlay_lines = sum(len(p.read_bytes().splitlines()) for p in overlay.values())
    log(
        f"check: {len(stats)} patches ok: {added} added and {removed} removed lines in "
        f"{len(files)} upstream files; {OVERLAY_DIRNAME}/: {len(overlay)} files, "
        f"{overlay_lines} lines"
    )
    return 0


# ------------------------------------------------------------------------- apply


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


def is_dirty(repo: Path) -> bool:
    return bool(run_git(repo, "status", "--porcelain", "--untracked-files=no").strip())


def cmd_apply(args: argparse.Namespace) -> int:
    lock = Lock.load(args.lock)
    problems = check_all(lock, args.patches, args.overlay)
    if problems:
        raise DDTreeError("apply: `check` failed:\n  " + "\n  ".join(problems))
    t0 = time.monotonic()
    src: Path = args.src.resolve()
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
        if is_dirty(src) and not args.force:
            raise DDTreeError(
                f"{src} has uncommitted changes; commit them (and `export`) or pass "
                "--force"
            )
        head = run_git(src, "rev-parse", "HEAD").strip()
        upstream = run_git(src, "rev-parse", f"refs/tags/{BASE_TAG}^{{commit}}").strip()
        if head != upstream and not is_applied_state(src, lock, args.overlay):
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
    series = read_series(args.patches)
    for i, name in enumerate(series, 1):
        patch_path = (args.patches / name).resolve()
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
    if args.verify:
        expected = lock.tree("patched_tree")
        if head_tree != expected:
            raise DDTreeError(
                f"apply --verify: patched tree {head_tree} != patched_tree "
                f"{expected!r} "
                f"in {lock.path} (run `export` after changing patches)"
            )
        log("verify: patched tree matches upstream.lock")
    copied = copy_overlay(src, args.overlay)
    if copied:
        log(
            f"{OVERLAY_DIRNAME}/: copied {copied} files (commit tagged `{OVERLAY_TAG}`)"
        )
    return 0


def is_applied_state(src: Path, lock: Lock, overlay_dir: Path) -> bool:
    """Whether HEAD is what `apply` makes of upstream.lock, patches/ and overlay/."""
    try:
        return (
            stack_tree(src) == lock.tree("patched_tree")
            and not overlay_state(src, overlay_dir)[1]
        )
    except DDTreeError:
        return False


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


# ------------------------------------------------------------------------ export


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


# ------------------------------------------------------------------------ rebase

FATES = ("clean", "merged", "conflict", "already-upstream")
FATE_TEXT = {
    "clean": "clean (applies as is)",
    "merged": "merged three-way",
    "conflict": "CONFLICT",
    "already-upstream": "already upstream (empty after merge)",
}
MD_DIFF_LINES = 150  # upstream diff lines per conflicted patch in the Markdown report
MD_REGION_LINES = 40  # lines per conflict region in the Markdown report


def release_lock(lock: Lock, version: str, index: dict[str, dict]) -> Lock:
    """An in-memory lock for upstream `version` (artifacts, sha256s from the index)."""
    old = lock.upstream["version"]
    if version == old:
        raise DDTreeError(f"rebase: {version} is already the pinned release")
    data = copy.deepcopy(lock.data)
    up = data["upstream"]
    for kind in ("sdist", "wheel"):
        art = lock.artifact(kind)
        name = art.filename.replace(f"-{old}-", f"-{version}-", 1).replace(
            f"-{old}.tar.gz", f"-{version}.tar.gz", 1
        )
        project = art.filename.split("-", 1)[0]
        entry = index.get(name)
        if entry is None:
            raise DDTreeError(
                f"rebase: {name} is not on {PYPI_SIMPLE.format(project=project)}; "
                f"is {version} a released version?"
            )
        if not re.fullmatch(r"[0-9a-f]{64}", entry.get("sha256", "")):
            raise DDTreeError(f"rebase: the package index lists no sha256 for {name}")
        if entry.get("yanked"):
            log(f"warning: {name} is yanked on PyPI")
        up[kind] = {"filename": name, "url": entry["url"], "sha256": entry["sha256"]}
    up["version"] = version
    up["tag"] = lock.upstream["tag"].replace(old, version)
    up["base_image"] = lock.upstream["base_image"].replace(old, version)
    up["commit"] = ""
    data["ddtree"].update(
        build=1, version=f"{version}+ddtree.1", upstream_tree="", patched_tree=""
    )
    return Lock(lock.path, data)


def commit_id_from_version_py(text: str) -> str:
    m = re.search(
        r"^__commit_id__ = commit_id = ['\"]g?([0-9a-f]{7,40})['\"]", text, re.M
    )
    return m.group(1) if m else ""


def wheel_commit(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        return commit_id_from_version_py(z.read("vllm/_version.py").decode())


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


def md_block(text: str, limit: int, lang: str = "diff") -> str:
    lines = text.splitlines()
    shown = "\n".join(lines[:limit]).replace("```", "`\u200b``")
    more = (
        f"\n\n_({len(lines) - limit} more lines; {len(lines)} in all: see the JSON "
        "report)_"
        if len(lines) > limit
        else ""
    )
    return f"```{lang}\n{shown}\n```{more}\n"


def release_line(version: str, series: list[str]) -> dict | None:
    """The release line of `version` in lines/, if there is one: where its stack
    was resolved by hand, and which of this series' patches it no longer has
    (their change is upstream's by then)."""
    root = LINES_DIR / version
    if not (root / "upstream.lock").is_file():
        return None
    line_series = read_series(root / "patches")
    return {
        "dir": root.relative_to(REPO_ROOT).as_posix(),
        "patches": len(line_series),
        "already_upstream": [name for name in series if name not in line_series],
    }


def render_markdown(report: dict) -> str:
    fr, to = report["from"], report["to"]
    s = report["summary"]
    to_commit = to["commit"] or "not known: wheel not fetched"
    wheel_state = (
        "verified" if to["wheel"]["verified"] else "from the index; not downloaded"
    )
    out = [
        f"# Rebase check: vLLM {fr['version']} -> {to['version']}",
        "",
        f"Generated by `apply_patches.py rebase --onto {to['version']}` "
        f"(series sha256 `{report['series_sha256'][:16]}`, {len(report['patches'])} "
        "patches).",
        "",
        "| | from | to |",
        "|---|---|---|",
        f"| release | {fr['version']} (`{fr['tag']}`) | {to['version']} "
        f"(`{to['tag']}`) |",
        f"| commit | `{fr['commit']}` | `{to_commit}` |",
        f"| sdist | `{fr['sdist']['filename']}` | `{to['sdist']['filename']}` |",
        f"| sdist sha256 | `{fr['sdist']['sha256']}` | `{to['sdist']['sha256']}` "
        "(verified) |",
        f"| wheel sha256 | `{fr['wheel']['sha256']}` | `{to['wheel']['sha256']}` "
        f"({wheel_state}) |",
        "",
        f"**Result: {report['result']}** — "
        + ", ".join(f"{s[f]} {FATE_TEXT[f].split(' (')[0]}" for f in FATES)
        + f"; {OVERLAY_DIRNAME}/: {s['overlay'] - s['overlay_collisions']} files ours, "
        f"{s['overlay_collisions']} collisions. "
        + (
            "`upstream.lock` and `patches/` were rewritten."
            if report["written"]
            else "Nothing was rewritten"
            + (
                " (dry run)."
                if report["rewritable"]
                else " (conflicts must be resolved first)."
            )
        ),
        "",
    ]
    line = report.get("line")
    if line is not None:
        dropped = ", ".join(f"`{n}`" for n in line["already_upstream"]) or "none"
        out += [
            f"The release line `{line['dir']}/` holds this stack resolved by hand on "
            f"{to['version']} (`apply_patches.py --line {to['version']}`): "
            f"{line['patches']} patches; dropped as already upstream: {dropped}. "
            "The fates below are the replay of this series as it is.",
            "",
        ]
    out += [
        "| # | patch | fate | files |",
        "|---|---|---|---|",
    ]
    for i, p in enumerate(report["patches"], 1):
        files = ", ".join(f"`{f}`" for f in p["files"])
        out.append(f"| {i} | `{p['patch']}` | {FATE_TEXT[p['fate']]} | {files} |")
    out.append("")
    if report["overlay"]:
        out += [
            f"{OVERLAY_DIRNAME}/ (ours, not applied by git: copied as they are; a "
            f"collision is a file that vLLM {to['version']} has at the same path):",
            "",
            "| file | lines | fate |",
            "|---|---|---|",
        ]
        out += [
            f"| `{o['file']}` | {o['lines']} | "
            f"{'COLLISION' if o['fate'] == 'collision' else 'ours'} |"
            for o in report["overlay"]
        ]
        out.append("")
    for i, p in enumerate(report["patches"], 1):
        out += [
            f"## {i}. {p['subject']} — {FATE_TEXT[p['fate']]}",
            "",
            f"`{p['patch']}`",
            "",
        ]
        if p.get("note"):
            out += [f"Note: {p['note']}", ""]
        if p.get("hunks_not_applying"):
            out.append("Hunks that do not apply as is:")
            out.append("")
            for h in p["hunks_not_applying"]:
                out.append(f"- `{h['file']}` hunk #{h['hunk']} `{h['header']}`")
            out.append("")
        stat = p["upstream"]["stat"]
        if stat:
            out.append(
                "Upstream changes to the patched files between the releases: "
                + ", ".join(
                    f"`{x['file']}` +{x['added']}/-{x['removed']}" for x in stat
                )
                + "."
            )
        else:
            out.append(
                "Upstream did not change the patched files between the releases."
            )
        out.append("")
        if p["fate"] == "conflict":
            c = p["conflict"]
            out += ["Conflicted files: " + ", ".join(f"`{f}`" for f in c["files"]), ""]
            for r in c["regions"]:
                out += [
                    f"Conflict at `{r['file']}:{r['line']}` (ours = {to['version']}, "
                    f"base = pre-image on {fr['version']}, theirs = the patch):",
                    "",
                    md_block(r["text"], MD_REGION_LINES, "text"),
                ]
            up = p["upstream"]
            out += [
                f"Upstream diff of the conflicted files, {fr['version']} -> "
                f"{to['version']} ({up['diff_lines']} lines):",
                "",
                md_block(up["diff"], MD_DIFF_LINES),
            ]
    return "\n".join(out).rstrip() + "\n"


def rebase(
    lock: Lock,
    patches_dir: Path,
    version: str,
    report_dir: Path,
    *,
    write: bool = False,
    fetch_wheel: bool = False,
    scratch: Path | None = None,
    index_fn=None,
    overlay_dir: Path | None = None,
) -> dict:
    """Replay the stack onto `version`; write reports; rewrite when clean and `write`.

    The overlay's files are not applied by git: they are copied as they are. Each is
    reported as ours, or as a collision where the new release has a file at its path."""
    overlay_dir = overlay_dir or default_overlay(patches_dir)
    problems = check_all(lock, patches_dir, overlay_dir)
    if problems:
        raise DDTreeError("rebase: `check` failed:\n  " + "\n  ".join(problems))
    series = read_series(patches_dir)
    index_fn = index_fn or pypi_index
    project = lock.artifact("sdist").filename.split("-", 1)[0]
    log(
        f"rebase: vLLM {lock.upstream['version']} -> {version}: looking up {project} "
        "on PyPI"
    )
    new = release_lock(lock, version, index_fn(project))
    new_sdist = fetch_artifact(new, "sdist")
    log(f"sdist {new_sdist.name}: sha256 {new.artifact('sdist').sha256} ok")
    wheel_cached = (cache_dir() / new.artifact("wheel").filename).exists()
    wheel_verified = False
    if write or fetch_wheel or wheel_cached:
        whl = fetch_artifact(new, "wheel")
        wheel_verified = True
        new.upstream["commit"] = wheel_commit(whl)
        log(f"wheel {whl.name}: sha256 ok, commit {new.upstream['commit']}")
    old_base = ensure_base_repo(lock)
    if lock.tree("upstream_tree") and tree_of(old_base, BASE_TAG) != lock.tree(
        "upstream_tree"
    ):
        raise DDTreeError(
            f"pristine tree of {lock.upstream['version']} differs from "
            f"upstream_tree in {lock.path}"
        )
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(dir=cache_dir(), prefix="rebase-") as tmp:
        work = scratch.resolve() if scratch else Path(tmp) / "scratch"
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
        run_git(work, "init", "-q")
        configure_repo(git.Repo(work))
        (work / ".git/objects/info/alternates").write_text(
            str((old_base / "objects").resolve()) + "\n"
        )
        old_vllm = run_git(old_base, "rev-parse", f"{BASE_TAG}:vllm").strip()
        old_c = vllm_tree_commit(
            work, old_vllm, None, f"vLLM {lock.upstream['version']}: vllm/ of the sdist"
        )
        run_git(work, "tag", "old-base", old_c)
        log(
            f"[scratch] {work}: applying the stack on {lock.upstream['version']} "
            "(pre-images) ..."
        )
        run_git(work, "checkout", "-q", "-B", "stack", "old-base")
        for name in series:
            proc = subprocess.run(
                [
                    "git",
                    "-C",
                    str(work),
                    "am",
                    "-q",
                    "--keep",
                    "--committer-date-is-author-date",
                    str((patches_dir / name).resolve()),
                ],
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                raise DDTreeError(
                    f"rebase: the stack does not apply on its own base "
                    f"{lock.upstream['version']}; fix that first (`make apply`):\n"
                    + explain_am_failure(
                        work, patches_dir / name, proc.stderr + proc.stdout
                    )
                )
        pre_images = run_git(work, "rev-list", "--reverse", "old-base..stack").split()
        assert len(pre_images) == len(series)
        log(f"[scratch] importing vllm/ of {new_sdist.name} ...")
        new_c = vllm_tree_commit(
            work,
            sdist_vllm_tree(work, new_sdist),
            old_c,
            f"vLLM {version}: vllm/ of the sdist",
        )
        run_git(work, "tag", "new-base", new_c)
        run_git(work, "checkout", "-q", "-B", "rebased", "new-base")
        records: list[dict] = []
        skipped: dict[str, set[str]] = {}  # conflicted (so skipped) patch -> its files
        for i, (name, pre) in enumerate(zip(series, pre_images), 1):
            rec = replay_patch(work, (patches_dir / name).resolve(), pre)
            overlap = [n for n, files in skipped.items() if files & set(rec["files"])]
            if overlap and rec["fate"] != "clean":
                rec["note"] = (
                    "earlier conflicted (so skipped) patches touch the same files ("
                    + ", ".join(overlap)
                    + "); this result may depend on them"
                )
            if rec["fate"] == "conflict":
                skipped[name] = set(rec["files"])
            rec["upstream"] = upstream_changes(
                work, rec["files"], with_diff=rec["fate"] == "conflict"
            )
            log(f"[{i}/{len(series)}] {name}: {FATE_TEXT[rec['fate']]}")
            records.append(rec)
        new_paths = set(
            run_git(work, "ls-tree", "-r", "--name-only", "new-base").splitlines()
        )
        overlay_records = [
            {
                "file": rel,
                "lines": len(path.read_bytes().splitlines()),
                "fate": "collision" if rel in new_paths else "ours",
            }
            for rel, path in overlay_files(overlay_dir).items()
        ]
        collisions = [o["file"] for o in overlay_records if o["fate"] == "collision"]
        for rel in collisions:
            log(
                f"[{OVERLAY_DIRNAME}] {rel}: COLLISION (vLLM {version} has a file "
                "there)"
            )
        log(
            f"[{OVERLAY_DIRNAME}] {len(overlay_records) - len(collisions)} files ours "
            "(copied, not applied by git)"
        )
        summary = {f: sum(r["fate"] == f for r in records) for f in FATES}
        summary["overlay"] = len(overlay_records)
        summary["overlay_collisions"] = len(collisions)
        rewritable = summary["conflict"] == 0 and not collisions
        problems_text = (
            [f"{summary['conflict']} conflicted"] if summary["conflict"] else []
        )
        if collisions:
            problems_text.append(f"{len(collisions)} {OVERLAY_DIRNAME}/ collisions")
        result = (
            "clean"
            if summary["clean"] == len(records) and not collisions
            else "no conflicts"
            if rewritable
            else ", ".join(problems_text)
        )
        report = {
            "tool": "apply_patches.py rebase",
            "from": {
                "version": lock.upstream["version"],
                "tag": lock.upstream["tag"],
                "commit": lock.upstream["commit"],
                "sdist": {
                    "filename": lock.artifact("sdist").filename,
                    "sha256": lock.artifact("sdist").sha256,
                },
                "wheel": {
                    "filename": lock.artifact("wheel").filename,
                    "sha256": lock.artifact("wheel").sha256,
                },
                "upstream_tree": lock.tree("upstream_tree"),
            },
            "to": {
                "version": version,
                "tag": new.upstream["tag"],
                "commit": new.upstream["commit"] or None,
                "sdist": {**new.upstream["sdist"], "verified": True},
                "wheel": {**new.upstream["wheel"], "verified": wheel_verified},
            },
            "series_sha256": series_hash(patches_dir, overlay_dir),
            "patches": records,
            "overlay": overlay_records,
            "summary": summary,
            "result": result,
            "rewritable": rewritable,
            "written": False,
            "line": release_line(version, series),
        }
        if write and rewritable:
            run_git(work, "tag", BASE_TAG, "new-base")
            rendered = render_patches(work)
            write_release(lock, new, patches_dir, rendered, work, overlay_dir)
            report["written"] = True
            report["to"]["upstream_tree"] = new.tree("upstream_tree")
            report["to"]["patched_tree"] = new.tree("patched_tree")
    log(
        f"replayed {len(series)} patches in {time.monotonic() - t0:.1f}s: "
        + ", ".join(f"{summary[f]} {f}" for f in FATES)
    )
    report_dir.mkdir(parents=True, exist_ok=True)
    md, js = report_dir / f"{version}.md", report_dir / f"{version}.json"
    md.write_text(render_markdown(report))
    js.write_text(json.dumps(report, indent=2) + "\n")
    log(f"reports: {md} {js}")
    return report


def set_lock_value(text: str, section: str, key: str, value: str | int) -> str:
    """Rewrite `key = ...` inside [section] of a TOML text, keeping everything else."""
    m = re.search(rf"^\[{re.escape(section)}\][ \t]*$", text, re.M)
    if not m:
        raise DDTreeError(f"lock has no [{section}] table")
    end = re.search(r"^\[", text[m.end() :], re.M)
    body_end = m.end() + end.start() if end else len(text)
    body = text[m.end() : body_end]
    rendered = json.dumps(value) if isinstance(value, str) else str(value)
    body, n = re.subn(
        rf"^{re.escape(key)}[ \t]*=.*$",
        f"{key} = {rendered}".replace("\\", "\\\\"),
        body,
        count=1,
        flags=re.M,
    )
    if n != 1:
        raise DDTreeError(f"lock has no `{key}` in [{section}]")
    return text[: m.end()] + body + text[body_end:]


def write_release(
    old: Lock,
    new: Lock,
    patches_dir: Path,
    rendered: list[tuple[str, bytes]],
    scratch: Path,
    overlay_dir: Path,
) -> None:
    """Rewrite upstream.lock and patches/ for the new release; restore on failure."""
    saved_lock = old.path.read_text()
    saved = {p.name: p.read_bytes() for p in patches_dir.iterdir() if p.is_file()}
    try:
        base = ensure_base_repo(new)
        upstream_tree = tree_of(base, BASE_TAG)
        if (
            run_git(base, "rev-parse", f"{BASE_TAG}:vllm").strip()
            != run_git(scratch, "rev-parse", "new-base:vllm").strip()
        ):
            raise DDTreeError(
                "rebase: the scratch vllm/ tree differs from the full sdist's"
            )
        text = saved_lock
        up = new.upstream
        for key in ("tag", "commit", "version", "base_image"):
            text = set_lock_value(text, "upstream", key, up[key])
        for kind in ("sdist", "wheel"):
            for key in ("filename", "url", "sha256"):
                text = set_lock_value(text, f"upstream.{kind}", key, up[kind][key])
        text = set_lock_value(text, "ddtree", "build", 1)
        text = set_lock_value(text, "ddtree", "version", new.data["ddtree"]["version"])
        text = set_lock_value(text, "ddtree", "upstream_tree", upstream_tree)
        text = set_lock_value(text, "ddtree", "patched_tree", "")
        old.path.write_text(text)
        _, stale = export_drift(Lock.load(old.path), patches_dir, rendered, "", "")
        write_patches(patches_dir, rendered, stale)
        # Prove it the ordinary way: apply the rewritten stack on the full new sdist
        # tree.
        with tempfile.TemporaryDirectory(
            dir=cache_dir(), prefix="rebase-apply-"
        ) as tmp:
            src = Path(tmp) / "src"
            cmd_apply(
                argparse.Namespace(
                    lock=old.path,
                    patches=patches_dir,
                    src=src,
                    verify=False,
                    force=False,
                    overlay=overlay_dir,
                )
            )
            if render_patches(src) != rendered:
                raise DDTreeError(
                    "rebase: re-exporting the applied stack gives other patches"
                )
            patched_tree = stack_tree(src)
        written = Lock.load(old.path)
        written.set_tree("patched_tree", patched_tree)
        new.data["ddtree"].update(
            upstream_tree=upstream_tree, patched_tree=patched_tree
        )
        log(
            f"rewrote {old.path.name} ({up['version']}, commit {up['commit']}) and "
            f"{len(rendered)} patches; patched_tree {patched_tree}"
        )
        for name in stale:
            log(f"  dropped {name} (already upstream)")
    except BaseException:
        old.path.write_text(saved_lock)
        for p in patches_dir.iterdir():
            if p.is_file() and p.name not in saved:
                p.unlink()
        for name, data in saved.items():
            (patches_dir / name).write_bytes(data)
        raise


def cmd_rebase(args: argparse.Namespace) -> int:
    lock = Lock.load(args.lock)
    _ = lock.version  # validates the version fields
    if args.onto == "latest":
        args.onto = newest_release("vllm")
        log(f"rebase: the newest vLLM release on PyPI is {args.onto}")
        if args.onto == lock.upstream["version"]:
            log(f"rebase: the stack is pinned to {args.onto} already; nothing to do")
            return 0
    report = rebase(
        lock,
        args.patches,
        args.onto,
        args.report_dir,
        write=args.write,
        fetch_wheel=args.fetch_wheel,
        scratch=args.scratch,
        overlay_dir=args.overlay,
    )
    if report["rewritable"]:
        if not args.write:
            log(
                "dry run: nothing rewritten (pass --write to rewrite upstream.lock and "
                "patches/)"
            )
        return 0
    conflicted = [p["patch"] for p in report["patches"] if p["fate"] == "conflict"]
    collided = [o["file"] for o in report["overlay"] if o["fate"] == "collision"]
    what = []
    if conflicted:
        what.append(
            f"{len(conflicted)} of {len(report['patches'])} patches conflict with "
            f"{args.onto}: {', '.join(conflicted)}"
        )
    if collided:
        what.append(
            f"{args.onto} has files at {len(collided)} {OVERLAY_DIRNAME}/ paths: "
            f"{', '.join(collided)}"
        )
    print(
        f"rebase: {'; '.join(what)}; nothing rewritten (see "
        f"{args.report_dir / (args.onto + '.md')})",
        file=sys.stderr,
    )
    return 1


# -------------------------------------------------------------------------- lint

RUFF_CONFIG = REPO_ROOT / "ruff.toml"
# Keys of ruff.toml that are ours, not upstream's (see the file's header).
RUFF_OWN_KEYS = {("target-version",), ("src",), ("lint", "isort", "known-first-party")}


def _flatten(
    table: dict, prefix: tuple[str, ...] = ()
) -> dict[tuple[str, ...], object]:
    out: dict[tuple[str, ...], object] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out.update(_flatten(value, (*prefix, key)))
        else:
            out[(*prefix, key)] = value
    return out


def ruff_config_drift(src: Path, config: Path) -> list[str]:
    """Differences between ruff.toml and [tool.ruff] of the pinned pyproject.toml."""
    upstream = tomllib.loads(run_git(src, "show", f"{BASE_TAG}:pyproject.toml"))
    theirs = _flatten(upstream.get("tool", {}).get("ruff", {}))
    ours = _flatten(tomllib.loads(config.read_text()))
    drift = [
        f"{'.'.join(k)}: upstream {theirs[k]!r}, {config.name} {ours.get(k)!r}"
        for k in sorted(theirs)
        if ours.get(k) != theirs[k]
    ]
    drift += [
        f"{'.'.join(k)}: not upstream's"
        for k in sorted(set(ours) - set(theirs))
        if k not in RUFF_OWN_KEYS
    ]
    return drift


def ruff(
    *argv: str, cwd: Path, stdin: str | None = None
) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            ["ruff", *argv], cwd=cwd, input=stdin, capture_output=True, text=True
        )
    except FileNotFoundError as e:
        raise DDTreeError("ruff not found; pip install -r requirements-dev.txt") from e


def ruff_diagnostics(src: Path, rel: str, text: str) -> list[tuple[str, str, str]]:
    """(code, message, source line) of every diagnostic of `text` as build/src/rel,
    with build/src's own ruff settings (vLLM's pyproject.toml)."""
    r = ruff(
        "check",
        "--no-cache",
        "--output-format",
        "json",
        "--stdin-filename",
        rel,
        "-",
        cwd=src,
        stdin=text,
    )
    if r.returncode not in (0, 1):
        raise DDTreeError(f"ruff check {rel} failed:\n{r.stderr.strip()}")
    lines = text.splitlines()
    out = []
    for d in json.loads(r.stdout or "[]"):
        row = d["location"]["row"]
        line = lines[row - 1].strip() if 0 < row <= len(lines) else ""
        out.append((d["code"] or "syntax", d["message"], line))
    return out


def ruff_formatted(src: Path, rel: str, text: str) -> bool:
    r = ruff(
        "format",
        "--no-cache",
        "--check",
        "--stdin-filename",
        rel,
        "-",
        cwd=src,
        stdin=text,
    )
    return r.returncode == 0


def lint_patched_files(src: Path) -> tuple[list[str], int]:
    """Ruff on every upstream file the patches touch, as patched: only diagnostics
    that the pristine file does not have already are ours (lines we added); and the
    file stays formatted when the pristine one is. Returns (problems, files)."""
    files = run_git(
        src, "diff", "--name-only", "--diff-filter=M", BASE_TAG, "HEAD", "--", "*.py"
    ).split()
    problems: list[str] = []
    for rel in files:
        pristine = run_git(src, "show", f"{BASE_TAG}:{rel}")
        patched = run_git(src, "show", f"HEAD:{rel}")
        known = list(ruff_diagnostics(src, rel, pristine))
        for diag in ruff_diagnostics(src, rel, patched):
            if diag in known:
                known.remove(diag)
            else:
                code, message, line = diag
                problems.append(f"{rel}: {code} {message}: {line}")
        if ruff_formatted(src, rel, pristine) and not ruff_formatted(src, rel, patched):
            diff = ruff(
                "format",
                "--no-cache",
                "--diff",
                "--stdin-filename",
                rel,
                "-",
                cwd=src,
                stdin=patched,
            ).stdout
            problems.append(
                f"{rel}: not formatted as ruff formats it:\n{diff.rstrip()}"
            )
    return problems, len(files)


def cmd_lint(args: argparse.Namespace) -> int:
    src: Path = args.src.resolve()
    if not (src / ".git").exists():
        raise DDTreeError(f"{src} is not a patched tree; run `apply` first")
    version = ruff("--version", cwd=REPO_ROOT).stdout.strip()
    problems = [f"{args.config.name}: {d}" for d in ruff_config_drift(src, args.config)]
    paths = [str(p) for p in args.paths]
    check = ruff(
        "check", "--no-cache", "--config", str(args.config), *paths, cwd=REPO_ROOT
    )
    if check.returncode != 0:
        problems.append("ruff check:\n" + (check.stdout + check.stderr).rstrip())
    fmt = ruff(
        "format",
        "--no-cache",
        "--check",
        "--config",
        str(args.config),
        *paths,
        cwd=REPO_ROOT,
    )
    if fmt.returncode != 0:
        problems.append("ruff format --check:\n" + (fmt.stdout + fmt.stderr).rstrip())
    patched, num_files = lint_patched_files(src)
    problems += patched
    for p in problems:
        print(f"lint: {p}", file=sys.stderr)
    if problems:
        return 1
    log(
        f"lint: {version}: {' '.join(paths)} clean; the patches' added lines in "
        f"{num_files} upstream files clean (vLLM's settings)"
    )
    return 0


# ------------------------------------------------------------------------- wheel


def record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()


def copy_raw_member(
    zin: zipfile.ZipFile,
    zout: zipfile.ZipFile,
    info: zipfile.ZipInfo,
    new_name: str | None = None,
) -> None:
    """Copy one member's compressed bytes unchanged (no recompression)."""
    assert zin.fp is not None and zout.fp is not None
    zin.fp.seek(info.header_offset)
    header = zin.fp.read(30)
    if header[:4] != b"PK\x03\x04":
        raise DDTreeError(f"bad local header for {info.filename}")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    zin.fp.seek(info.header_offset + 30 + name_len + extra_len)
    data = zin.fp.read(info.compress_size)
    new = copy.copy(info)
    if new_name is not None:
        new.filename = new_name
        new.orig_filename = new_name
    new.flag_bits &= ~0x08  # sizes and CRC go into the local header
    new.extra = b""
    new.header_offset = zout.fp.tell()
    zout.fp.write(new.FileHeader(zip64=False))
    zout.fp.write(data)
    zout.filelist.append(new)
    zout.NameToInfo[new.filename] = new
    zout.start_dir = zout.fp.tell()
    zout._didModify = True  # noqa: SLF001 - zipfile has no public raw-copy API


def version_py(original: str, version: str) -> str:
    parts = re.match(r"(\d+)\.(\d+)\.(\d+)\+(.*)", version)
    assert parts, version
    vt = f"({parts[1]}, {parts[2]}, {parts[3]}, {parts[4]!r})"
    text = re.sub(
        r"^__version__ = version = .*$",
        f"__version__ = version = {version!r}",
        original,
        flags=re.M,
    )
    text = re.sub(
        r"^__version_tuple__ = version_tuple = .*$",
        f"__version_tuple__ = version_tuple = {vt}",
        text,
        flags=re.M,
    )
    if version not in text:
        raise DDTreeError("could not rewrite vllm/_version.py")
    return text


def changed_files(src: Path) -> tuple[dict[str, bytes], list[str]]:
    """Files under vllm/ that the stack changed: (path -> new bytes, deleted paths)."""
    repo = git.Repo(src)
    head = repo.commit("HEAD")
    changed: dict[str, bytes] = {}
    deleted: list[str] = []
    for d in repo.commit(BASE_TAG).diff(head, paths=["vllm/"]):
        if d.deleted_file:
            deleted.append(d.a_path)
            continue
        if d.renamed_file:
            deleted.append(d.a_path)
        changed[d.b_path] = head.tree[d.b_path].data_stream.read()
    changed.pop("vllm/_version.py", None)
    return changed, deleted


def wheel_name(lock: Lock) -> str:
    upstream = lock.artifact("wheel").filename
    return upstream.replace(f"-{lock.upstream['version']}-", f"-{lock.version}-", 1)


def build_wheel(
    lock: Lock, src: Path, dist: Path, overlay_dir: Path | None = None
) -> Path:
    if not (src / ".git").exists():
        raise DDTreeError(f"{src} is not a patched tree; run `apply` first")
    expected = lock.tree("patched_tree")
    head_tree = stack_tree(src)
    if expected and head_tree != expected:
        log(f"warning: building from tree {head_tree}, upstream.lock says {expected}")
    if overlay_dir is not None:
        drift = overlay_state(src, overlay_dir)[1]
        if drift:
            raise DDTreeError(
                f"wheel: {src} does not hold {OVERLAY_DIRNAME}/ as it is "
                "(run `apply`): " + "; ".join(drift)
            )
    upstream_whl = fetch_artifact(lock, "wheel")
    version = lock.version
    old_ver = lock.upstream["version"]
    old_di, new_di = f"vllm-{old_ver}.dist-info", f"vllm-{version}.dist-info"
    changed, deleted = changed_files(src)
    log(f"{len(changed)} patched/added files, {len(deleted)} deleted under vllm/")
    dist.mkdir(parents=True, exist_ok=True)
    out = dist / wheel_name(lock)
    tmp = out.with_name(out.name + ".tmp")
    t0 = time.monotonic()
    records: dict[str, list[str]] = {}
    with zipfile.ZipFile(upstream_whl) as zin, zipfile.ZipFile(tmp, "w") as zout:
        old_record = zin.read(f"{old_di}/RECORD").decode()
        for row in csv.reader(io.StringIO(old_record)):
            if row:
                records[row[0]] = row
        members = zin.infolist()
        new_files: dict[str, bytes] = dict(changed)
        new_files["vllm/_version.py"] = version_py(
            zin.read("vllm/_version.py").decode(), version
        ).encode()
        metadata = zin.read(f"{old_di}/METADATA").decode()
        metadata, n = re.subn(
            r"^Version: .*$", f"Version: {version}", metadata, count=1, flags=re.M
        )
        if n != 1:
            raise DDTreeError("METADATA has no Version: line")
        new_files[f"{new_di}/METADATA"] = metadata.encode()
        record_rows: list[list[str]] = []
        last = time.monotonic()
        for i, info in enumerate(members, 1):
            name = info.filename
            if time.monotonic() - last > 2:
                last = time.monotonic()
                log(f"  wheel: {i}/{len(members)} members")
            if name == f"{old_di}/RECORD" or name in deleted:
                continue
            target = (
                new_di + name[len(old_di) :] if name.startswith(old_di + "/") else name
            )
            if target in new_files:
                continue  # written below
            copy_raw_member(zin, zout, info, target)
            row = records.get(name)
            if row is None:
                raise DDTreeError(f"{name} is not in the upstream RECORD")
            record_rows.append([target, *row[1:]])
        for name, data in sorted(new_files.items()):
            if name in zout.NameToInfo:
                continue
            zi = zipfile.ZipInfo(name, date_time=(2000, 1, 1, 0, 0, 0))
            zi.external_attr = 0o644 << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            zout.writestr(zi, data)
            record_rows.append([name, record_hash(data), str(len(data))])
        record_rows.append([f"{new_di}/RECORD", "", ""])
        record_buf = io.StringIO()
        csv.writer(record_buf, lineterminator="\n").writerows(record_rows)
        zi = zipfile.ZipInfo(f"{new_di}/RECORD", date_time=(2000, 1, 1, 0, 0, 0))
        zi.external_attr = 0o644 << 16
        zi.compress_type = zipfile.ZIP_DEFLATED
        zout.writestr(zi, record_buf.getvalue())
    tmp.rename(out)
    log(f"wrote {out} ({out.stat().st_size >> 20} MiB) in {time.monotonic() - t0:.1f}s")
    return out


def cmd_wheel(args: argparse.Namespace) -> int:
    lock = Lock.load(args.lock)
    build_wheel(lock, args.src.resolve(), args.dist, args.overlay)
    return 0


def series_hash(patches_dir: Path, overlay_dir: Path | None = None) -> str:
    """sha256 of what the build is made of: the series, its patches and the overlay."""
    h = hashlib.sha256()
    for name in read_series(patches_dir):
        h.update(name.encode() + b"\0")
        h.update((patches_dir / name).read_bytes())
    for rel, path in overlay_files(overlay_dir or default_overlay(patches_dir)).items():
        h.update(f"{OVERLAY_DIRNAME}/{rel}".encode() + b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()


def default_overlay(patches_dir: Path) -> Path:
    return patches_dir.resolve().parent / OVERLAY_DIRNAME


def cmd_version(args: argparse.Namespace) -> int:
    print(Lock.load(args.lock).version)
    return 0


def cmd_wheel_name(args: argparse.Namespace) -> int:
    print(wheel_name(Lock.load(args.lock)))
    return 0


def cmd_series_hash(args: argparse.Namespace) -> int:
    print(series_hash(args.patches, args.overlay))
    return 0


def cmd_lock_get(args: argparse.Namespace) -> int:
    node = Lock.load(args.lock).data
    for part in args.key.split("."):
        node = node[part]
    print(node)
    return 0


# -------------------------------------------------------------------------- main


def resolve_line(args: argparse.Namespace) -> None:
    """Fill the paths that --line picks (explicit --lock, --patches, --src, --config
    win): the default line is the repo root's; overlay/ is shared by all lines."""
    if args.line is None:
        root, src = REPO_ROOT, DEFAULT_SRC
        overlay = None
    else:
        root = LINES_DIR / args.line
        if not (root / "upstream.lock").is_file():
            known = sorted(p.parent.name for p in LINES_DIR.glob("*/upstream.lock"))
            raise DDTreeError(
                f"--line {args.line}: no {root / 'upstream.lock'} "
                f"(lines: {', '.join(known) or 'none'})"
            )
        src = DEFAULT_SRC.with_name(f"{DEFAULT_SRC.name}-{args.line}")
        overlay = REPO_ROOT / OVERLAY_DIRNAME
    if args.lock is None:
        args.lock = root / "upstream.lock"
    if args.patches is None:
        args.patches = root / "patches"
    if args.overlay is None:
        args.overlay = overlay or default_overlay(args.patches)
    if getattr(args, "src", False) is None:
        args.src = src
    if getattr(args, "config", False) is None:
        line_config = root / RUFF_CONFIG.name
        args.config = line_config if line_config.is_file() else RUFF_CONFIG


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--line",
        metavar="VERSION",
        default=None,
        help="the release line under lines/VERSION/ (default: the repo root's)",
    )
    parser.add_argument("--lock", type=Path, default=None)
    parser.add_argument("--patches", type=Path, default=None)
    parser.add_argument(
        "--overlay",
        type=Path,
        default=None,
        help=f"the files we own (default: {OVERLAY_DIRNAME}/ next to --patches)",
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("fetch", help="download and verify the pinned sdist and wheel")
    sub.add_parser("check", help="validate series and patches (no tree needed)")
    p = sub.add_parser("apply", help="build the patched tree")
    p.add_argument("--src", type=Path, default=None)
    p.add_argument("--verify", action="store_true", help="compare with patched_tree")
    p.add_argument("--force", action="store_true", help="discard uncommitted changes")
    p = sub.add_parser("export", help="rewrite patches/ from the patched tree")
    p.add_argument("--src", type=Path, default=None)
    p.add_argument("--dry-run", action="store_true", help="only report drift (exit 1)")
    p = sub.add_parser("wheel", help="build our wheel from the official one")
    p.add_argument("--src", type=Path, default=None)
    p.add_argument("--dist", type=Path, default=DEFAULT_DIST)
    p = sub.add_parser(
        "rebase", help="replay the stack onto another vLLM release; report"
    )
    p.add_argument(
        "--onto",
        required=True,
        metavar="VERSION",
        help="vLLM release, e.g. 0.27.0, or `latest` (the newest final release "
        "on PyPI)",
    )
    p.add_argument("--report-dir", type=Path, default=DEFAULT_REPORTS)
    p.add_argument(
        "--write",
        action="store_true",
        help="rewrite upstream.lock and patches/ when no patch conflicts",
    )
    p.add_argument(
        "--fetch-wheel",
        action="store_true",
        help="also download and verify the new wheel (its commit id goes into "
        "the report; implied by --write)",
    )
    p.add_argument(
        "--scratch",
        type=Path,
        default=None,
        help="keep the scratch git repo here for inspection (default: temporary)",
    )
    p = sub.add_parser(
        "lint",
        help="ruff (vLLM's settings) on our files and on the lines the patches add",
    )
    p.add_argument("--src", type=Path, default=None)
    p.add_argument("--config", type=Path, default=None)
    p.add_argument("paths", nargs="+", type=Path, help="files and directories we own")
    sub.add_parser("version", help="print our version")
    sub.add_parser("wheel-name", help="print our wheel's file name")
    sub.add_parser("series-hash", help="print the sha256 of the patch series")
    p = sub.add_parser("lock-get", help="print one value of upstream.lock")
    p.add_argument("key")
    args = parser.parse_args(argv)
    try:
        resolve_line(args)
    except DDTreeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    handlers = {
        "fetch": cmd_fetch,
        "check": cmd_check,
        "apply": cmd_apply,
        "export": cmd_export,
        "wheel": cmd_wheel,
        "rebase": cmd_rebase,
        "lint": cmd_lint,
        "version": cmd_version,
        "wheel-name": cmd_wheel_name,
        "series-hash": cmd_series_hash,
        "lock-get": cmd_lock_get,
    }
    try:
        return handlers[args.cmd](args)
    except DDTreeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
