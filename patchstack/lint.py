# SPDX-License-Identifier: Apache-2.0
"""`lint`: ruff with vLLM's settings (ruff.toml, which must equal the pinned
pyproject.toml's) on our files, and on the lines the patches add."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import tomllib

from patchstack.common import REPO_ROOT, DDTreeError, log
from patchstack.repo import BASE_TAG, run_git

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
