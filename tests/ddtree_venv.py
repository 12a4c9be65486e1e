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
    d = Path(
        os.environ.get("VLLM_DDTREE_CACHE", Path.home() / ".cache" / "vllm-ddtree")
    )
    d.mkdir(parents=True, exist_ok=True)
    return d


# Also run as a script (`python3 tests/ddtree_venv.py WHEEL`): find the tool.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from apply_patches import sha256_file  # noqa: E402


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _log(msg: str) -> None:
    # stderr: stdout of `python tests/ddtree_venv.py WHEEL` is the venv path.
    print(f"[ddtree] {msg}", file=sys.stderr, flush=True)


def _requires(wheel: Path) -> str:
    """The wheel's dependency list (Requires-Dist lines of its METADATA)."""
    import zipfile

    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(meta).decode().splitlines()
    return "\n".join(sorted(ln for ln in lines if ln.startswith("Requires-Dist:")))


# Test tools the tests in tests/in_vllm need inside the venv.
TEST_TOOLS = ["pytest>=8", "hypothesis>=6"]


def ensure_venv(wheel: Path, python: str | None = None) -> Path:
    """Return a venv with `wheel` installed, building it if needed.

    The venv is keyed by the wheel's dependencies (not by its bytes): it is
    created once with `pip install <wheel>` *with* its dependencies (torch
    and the CUDA libraries: several GB, minutes), and a later build of our
    wheel is installed over it with `--no-deps --force-reinstall`, the same
    step the Dockerfile runs. A fresh machine therefore always gets the full
    install.
    """
    python = python or os.environ.get("VLLM_DDTREE_VENV_PYTHON") or sys.executable
    key = hashlib.sha256(
        (_requires(wheel) + "\n" + "\n".join(TEST_TOOLS) + "\n" + python).encode()
    ).hexdigest()[:16]
    venv = cache_dir() / f"venv-{key}"
    marker = venv / ".ddtree-complete"
    installed = venv / ".ddtree-wheel-sha256"
    wheel_sha = sha256_file(wheel)
    if not marker.exists():
        for old in cache_dir().glob("venv-*"):  # one venv at a time: each is ~8 GB
            shutil.rmtree(old, ignore_errors=True)
        t0 = time.monotonic()
        _log(f"creating venv {venv} with {python}")
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        _log(f"pip install {wheel.name} with dependencies (several GB) ...")
        subprocess.run(
            [
                str(venv_python(venv)),
                "-m",
                "pip",
                "install",
                "--progress-bar",
                "off",
                "--disable-pip-version-check",
                str(wheel),
                *TEST_TOOLS,
            ],
            check=True,
            stdout=sys.stderr,
        )
        installed.write_text(wheel_sha + "\n")
        marker.write_text(str(wheel) + "\n")
        _log(f"venv ready in {time.monotonic() - t0:.0f}s")
    elif installed.read_text().strip() != wheel_sha:
        _log(f"installing {wheel.name} over {venv} (--no-deps --force-reinstall)")
        subprocess.run(
            [
                str(venv_python(venv)),
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--force-reinstall",
                "--disable-pip-version-check",
                str(wheel),
            ],
            check=True,
            stdout=sys.stderr,
        )
        installed.write_text(wheel_sha + "\n")
    return venv


if __name__ == "__main__":
    print(ensure_venv(Path(sys.argv[1]).resolve()))
