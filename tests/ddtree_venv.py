# SPDX-License-Identifier: Apache-2.0
"""A cached virtualenv with our wheel installed with its dependencies.

Keyed by the wheel's sha256 under $VLLM_DDTREE_CACHE (default ~/.cache/vllm-ddtree);
the first build pulls torch and CUDA libraries from PyPI (several GB, minutes).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


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


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_venv(wheel: Path, python: str | None = None) -> Path:
    """Return a venv with `wheel` installed (with dependencies), building it if needed."""
    key = sha256_file(wheel)[:16]
    venv = cache_dir() / f"venv-{key}"
    marker = venv / ".ddtree-complete"
    if marker.exists():
        return venv
    for old in cache_dir().glob("venv-*"):  # one venv at a time: each is ~8 GB
        shutil.rmtree(old, ignore_errors=True)
    python = python or os.environ.get("VLLM_DDTREE_VENV_PYTHON") or sys.executable
    t0 = time.monotonic()
    print(f"[ddtree] creating venv {venv} with {python}", flush=True)
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    print(f"[ddtree] pip install {wheel.name} with dependencies (several GB) ...", flush=True)
    subprocess.run(
        [str(venv_python(venv)), "-m", "pip", "install", "--progress-bar", "off",
         "--disable-pip-version-check", str(wheel)],
        check=True,
    )
    marker.write_text(str(wheel) + "\n")
    print(f"[ddtree] venv ready in {time.monotonic() - t0:.0f}s", flush=True)
    return venv


if __name__ == "__main__":
    print(ensure_venv(Path(sys.argv[1]).resolve()))
