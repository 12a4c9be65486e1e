# SPDX-License-Identifier: Apache-2.0
"""`check`: the series, each patch's headers and paths, and the overlay's rules."""

from __future__ import annotations

import argparse
import io
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import unidiff

from patchstack.common import OVERLAY_DIRNAME, DDTreeError, log
from patchstack.lock import Lock
from patchstack.overlay import overlay_files
from patchstack.repo import BASE_TAG, ensure_base_repo, run_git
from patchstack.series import patch_message, read_series

SPDX_LINE = "# SPDX-License-Identifier: Apache-2.0"
REQUIRED_HEADERS = ("Why", "Origin", "Forwarded", "Test")
FORWARDED_VALUES = ("no", "not-needed", "not yet, candidate")
COMPILED_PATHS = ("csrc/", "CMakeLists.txt", "setup.py", "cmake/")


def header_fields(body: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in body.splitlines():
        m = re.match(r"^(Why|Origin|Forwarded|Test):\s*(.*?)\s*$", line)
        if m and m.group(1) not in fields:
            fields[m.group(1)] = m.group(2)
    return fields


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
    _ = lock.entry_points  # and [ddtree.entry_points]
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
