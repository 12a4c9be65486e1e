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
import sys
from pathlib import Path

from patchstack.apply import cmd_apply
from patchstack.check import cmd_check
from patchstack.common import (
    DEFAULT_DIST,
    DEFAULT_REPORTS,
    DEFAULT_SRC,
    LINES_DIR,
    OVERLAY_DIRNAME,
    REPO_ROOT,
    DDTreeError,
    default_overlay,
)
from patchstack.export import cmd_export
from patchstack.fetch import cmd_fetch
from patchstack.lint import RUFF_CONFIG, cmd_lint
from patchstack.lock import Lock
from patchstack.rebase import cmd_rebase
from patchstack.series import series_hash
from patchstack.wheel import cmd_wheel, wheel_name


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
