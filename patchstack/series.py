# SPDX-License-Identifier: Apache-2.0
"""patches/: the series file, a patch's message, and the hash of what a build is
made of."""

from __future__ import annotations

import email.parser
import email.policy
import hashlib
import re
from pathlib import Path

from patchstack.common import OVERLAY_DIRNAME, DDTreeError, default_overlay
from patchstack.overlay import overlay_files


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
