#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""vllm-ddtree patch-stack tool.

Subcommands:
  fetch            download the pinned sdist and wheel into the cache, verify sha256
  check            validate patches/series and every patch (no tree needed)
  apply            pristine sdist tree + series -> git repo (default build/src)
  export           rewrite patches/ from the commits above the `upstream` tag
  wheel            official wheel + patched vllm/ files -> dist/<our wheel>
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
import tomllib
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

import git
import unidiff

REPO_ROOT = Path(__file__).resolve().parent
DEFAULT_LOCK = REPO_ROOT / "upstream.lock"
DEFAULT_PATCHES = REPO_ROOT / "patches"
DEFAULT_SRC = REPO_ROOT / "build" / "src"
DEFAULT_DIST = REPO_ROOT / "dist"
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
    def load(cls, path: Path) -> "Lock":
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
            raise DDTreeError(f"{self.path}: no `{key} = \"...\"` line to update")
        text = pattern.sub(f'{key} = "{value}"', text, count=1)
        self.path.write_text(text)
        self.data["ddtree"][key] = value


# ------------------------------------------------------------------------- fetch


def cache_dir() -> Path:
    d = Path(os.environ.get("VLLM_DDTREE_CACHE", Path.home() / ".cache" / "vllm-ddtree"))
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
            f"sha256 mismatch for {path.name} ({path}): expected {expected}, got {actual}; "
            "refusing to use it"
        )


PYPI_SIMPLE = "https://pypi.org/simple/{project}/"


def pypi_index(project: str) -> dict[str, dict]:
    """filename -> {url, sha256, yanked} from PyPI's JSON simple API."""
    url = PYPI_SIMPLE.format(project=project)
    req = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
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


def resolve_url(filename: str) -> str:
    """Find a file's URL through PyPI's JSON simple API."""
    project = filename.split("-", 1)[0]
    entry = pypi_index(project).get(filename)
    if entry is None:
        raise DDTreeError(f"{filename} not found on {PYPI_SIMPLE.format(project=project)}")
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


def check_patch(path: Path, precompiled: bool) -> list[str]:
    """Return the problems found in one patch file."""
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
    if fwd and not (fwd in ("no", "not-needed") or fwd.startswith("https://")):
        problems.append(f"{path.name}: Forwarded must be 'no', 'not-needed' or a URL")
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
        if pf.is_binary_file:
            problems.append(f"{path.name}: binary diff for {pf.path}")
    return problems


def check_all(lock: Lock, patches_dir: Path) -> list[str]:
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
    for name in dict.fromkeys(series):
        if (patches_dir / name).is_file():
            problems.extend(check_patch(patches_dir / name, lock.precompiled))
    return problems


def cmd_check(args: argparse.Namespace) -> int:
    lock = Lock.load(args.lock)
    lock.version  # validates the version fields
    problems = check_all(lock, args.patches)
    for p in problems:
        print(f"check: {p}", file=sys.stderr)
    if problems:
        return 1
    log(f"check: {len(read_series(args.patches))} patches ok")
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
            f"vLLM {lock.upstream['version']} ({lock.upstream['commit']}): pristine sdist "
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
        m2 = re.search(r"error: (.+?): (does not exist in index|already exists in index)", stderr)
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
    problems = check_all(lock, args.patches)
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
                f"{src} has uncommitted changes; commit them (and `export`) or pass --force"
            )
        head = run_git(src, "rev-parse", "HEAD").strip()
        upstream = run_git(src, "rev-parse", f"refs/tags/{BASE_TAG}^{{commit}}").strip()
        if head != upstream and tree_of(src, "HEAD") != lock.tree("patched_tree"):
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
            ["git", "-C", str(src), "am", "-q", "--keep", "--committer-date-is-author-date",
             str(patch_path)],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise DDTreeError(explain_am_failure(src, patch_path, proc.stderr + proc.stdout))
    head_tree = tree_of(src, "HEAD")
    log(f"applied {len(series)} patches in {time.monotonic() - t0:.1f}s; tree {head_tree}")
    if args.verify:
        expected = lock.tree("patched_tree")
        if head_tree != expected:
            raise DDTreeError(
                f"apply --verify: patched tree {head_tree} != patched_tree {expected!r} "
                f"in {lock.path} (run `export` after changing patches)"
            )
        log("verify: patched tree matches upstream.lock")
    return 0


# ------------------------------------------------------------------------ export


def slugify(subject: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", subject.lower()).strip("-")
    return (slug[:64].rstrip("-") or "patch") + ".patch"


def render_patches(src: Path) -> list[tuple[str, bytes]]:
    """Format the commits above `upstream` as (file name, bytes), in order."""
    revs = run_git(src, "rev-list", "--reverse", f"{BASE_TAG}..HEAD").split()
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
        name = slugify(subject)
        if name in names:
            raise DDTreeError(f"two commits give the same patch name {name}")
        names.add(name)
        text = subprocess.run(
            ["git", "-C", str(src), "format-patch", "--stdout", *FORMAT_PATCH_ARGS,
             f"{rev}~1..{rev}"],
            capture_output=True,
            check=True,
        ).stdout
        out.append((name, text))
    return out


def export_drift(lock: Lock, patches_dir: Path, rendered: list[tuple[str, bytes]],
                 upstream_tree: str, head_tree: str) -> tuple[list[str], list[str]]:
    """(drift descriptions, stale patch files) between `rendered` and patches_dir/lock."""
    drift: list[str] = []
    for name, data in rendered:
        p = patches_dir / name
        if not p.exists() or p.read_bytes() != data:
            drift.append(name)
    new_names = {n for n, _ in rendered}
    stale = sorted(p.name for p in patches_dir.glob("*.patch") if p.name not in new_names)
    drift.extend(f"{n} (would be removed)" for n in stale)
    series_path = patches_dir / "series"
    old_series = series_path.read_text() if series_path.exists() else ""
    if [line for line in old_series.splitlines() if line.strip() and not line.startswith("#")] != [
        n for n, _ in rendered
    ]:
        drift.append("series")
    if lock.tree("patched_tree") != head_tree:
        drift.append(f"upstream.lock patched_tree ({lock.tree('patched_tree')!r} -> {head_tree})")
    if lock.tree("upstream_tree") != upstream_tree:
        drift.append(f"upstream.lock upstream_tree -> {upstream_tree}")
    return drift, stale


def write_patches(patches_dir: Path, rendered: list[tuple[str, bytes]],
                  stale: list[str]) -> None:
    """Write the rendered patches and the series (keeping its comment lines)."""
    series_path = patches_dir / "series"
    old_series = series_path.read_text() if series_path.exists() else ""
    patches_dir.mkdir(parents=True, exist_ok=True)
    for name, data in rendered:
        (patches_dir / name).write_bytes(data)
    for name in stale:
        (patches_dir / name).unlink()
    comments = "".join(line + "\n" for line in old_series.splitlines() if line.startswith("#"))
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
    head_tree = tree_of(src, "HEAD")
    upstream_tree = tree_of(src, BASE_TAG)
    drift, stale = export_drift(lock, args.patches, rendered, upstream_tree, head_tree)
    if args.dry_run:
        if drift:
            print("export --dry-run: drift between build tree and patches/:", file=sys.stderr)
            for d in drift:
                print(f"  {d}", file=sys.stderr)
            return 1
        log(f"export --dry-run: no drift ({len(rendered)} patches)")
        return 0
    write_patches(args.patches, rendered, stale)
    lock.set_tree("upstream_tree", upstream_tree)
    lock.set_tree("patched_tree", head_tree)
    log(f"exported {len(rendered)} patches; patched_tree {head_tree}")
    for d in drift:
        log(f"  updated: {d}")
    return 0


# ------------------------------------------------------------------------- wheel


def record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()


def copy_raw_member(zin: zipfile.ZipFile, zout: zipfile.ZipFile, info: zipfile.ZipInfo,
                    new_name: str | None = None) -> None:
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


def build_wheel(lock: Lock, src: Path, dist: Path) -> Path:
    if not (src / ".git").exists():
        raise DDTreeError(f"{src} is not a patched tree; run `apply` first")
    expected = lock.tree("patched_tree")
    head_tree = tree_of(src, "HEAD")
    if expected and head_tree != expected:
        log(f"warning: building from tree {head_tree}, upstream.lock says {expected}")
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
        metadata, n = re.subn(r"^Version: .*$", f"Version: {version}", metadata, count=1,
                              flags=re.M)
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
            target = new_di + name[len(old_di):] if name.startswith(old_di + "/") else name
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
    build_wheel(lock, args.src.resolve(), args.dist)
    return 0


def series_hash(patches_dir: Path) -> str:
    h = hashlib.sha256()
    for name in read_series(patches_dir):
        h.update(name.encode() + b"\0")
        h.update((patches_dir / name).read_bytes())
    return h.hexdigest()


def cmd_version(args: argparse.Namespace) -> int:
    print(Lock.load(args.lock).version)
    return 0


def cmd_wheel_name(args: argparse.Namespace) -> int:
    print(wheel_name(Lock.load(args.lock)))
    return 0


def cmd_series_hash(args: argparse.Namespace) -> int:
    print(series_hash(args.patches))
    return 0


def cmd_lock_get(args: argparse.Namespace) -> int:
    node = Lock.load(args.lock).data
    for part in args.key.split("."):
        node = node[part]
    print(node)
    return 0


# -------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lock", type=Path, default=DEFAULT_LOCK)
    parser.add_argument("--patches", type=Path, default=DEFAULT_PATCHES)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("fetch", help="download and verify the pinned sdist and wheel")
    sub.add_parser("check", help="validate series and patches (no tree needed)")
    p = sub.add_parser("apply", help="build the patched tree")
    p.add_argument("--src", type=Path, default=DEFAULT_SRC)
    p.add_argument("--verify", action="store_true", help="compare with patched_tree")
    p.add_argument("--force", action="store_true", help="discard uncommitted changes")
    p = sub.add_parser("export", help="rewrite patches/ from the patched tree")
    p.add_argument("--src", type=Path, default=DEFAULT_SRC)
    p.add_argument("--dry-run", action="store_true", help="only report drift (exit 1)")
    p = sub.add_parser("wheel", help="build our wheel from the official one")
    p.add_argument("--src", type=Path, default=DEFAULT_SRC)
    p.add_argument("--dist", type=Path, default=DEFAULT_DIST)
    sub.add_parser("version", help="print our version")
    sub.add_parser("wheel-name", help="print our wheel's file name")
    sub.add_parser("series-hash", help="print the sha256 of the patch series")
    p = sub.add_parser("lock-get", help="print one value of upstream.lock")
    p.add_argument("key")
    args = parser.parse_args(argv)
    handlers = {
        "fetch": cmd_fetch,
        "check": cmd_check,
        "apply": cmd_apply,
        "export": cmd_export,
        "wheel": cmd_wheel,
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
