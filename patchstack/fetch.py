# SPDX-License-Identifier: Apache-2.0
"""The pinned upstream artifacts: looked up on PyPI's JSON simple API, downloaded
into the cache ($VLLM_DDTREE_CACHE, default ~/.cache/vllm-ddtree) and checked
against their sha256 before any use."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import time
import urllib.request
from pathlib import Path

from patchstack.common import DDTreeError, log
from patchstack.lock import Lock


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
