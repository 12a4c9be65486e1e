# SPDX-License-Identifier: Apache-2.0
"""A cached virtualenv with our wheel installed with its dependencies.

Keyed by the wheel's sha256 under ``$VLLM_DDTREE_CACHE-<vLLM version>`` (default
~/.cache/vllm-ddtree-<version>); the first build pulls torch and CUDA libraries
from PyPI (several GB, minutes).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def cache_dir(wheel: Path) -> Path:
    """Where the venvs of ``wheel``'s release line live: a folder per vLLM
    version (``<cache>-<version>``, beside the cache of sdists), so that
    testing every line keeps every line's venv (each several GB; one base venv
    per folder), and which line is the primary one does not move them."""
    d = Path(
        os.environ.get("VLLM_DDTREE_CACHE", Path.home() / ".cache" / "vllm-ddtree")
    )
    d = d.with_name(f"{d.name}-{_upstream_version(wheel)}")
    d.mkdir(parents=True, exist_ok=True)
    return d


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _log(msg: str) -> None:
    # stderr: stdout of `python tests/helpers/ddtree_venv.py WHEEL` is the
    # venv path.
    print(f"[ddtree] {msg}", file=sys.stderr, flush=True)


def _sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            # A file pip removes meanwhile.
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def _run_with_progress(cmd: list[str], venv: Path, every_s: float = 20.0) -> None:
    """Run ``cmd`` (pip, its output on stderr) and say every ``every_s``
    seconds how long it has run and how large ``venv`` has grown: pip prints
    nothing while it downloads a wheel of a GB or more (torch, the CUDA
    libraries) with its progress bar off."""
    done = threading.Event()
    t0 = time.monotonic()

    def report() -> None:
        while not done.wait(every_s):
            size = _tree_bytes(venv) / 2**30
            _log(f"... {time.monotonic() - t0:.0f}s, {venv.name} is {size:.1f} GB")

    reporter = threading.Thread(target=report, daemon=True)
    reporter.start()
    try:
        subprocess.run(cmd, check=True, stdout=sys.stderr)
    finally:
        done.set()
        reporter.join()


def _requires(wheel: Path) -> str:
    """The wheel's dependency list (Requires-Dist lines of its METADATA)."""
    import zipfile

    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(meta).decode().splitlines()
    return "\n".join(sorted(ln for ln in lines if ln.startswith("Requires-Dist:")))


REPO_ROOT = Path(__file__).resolve().parents[2]


def _upstream_version(wheel: Path) -> str:
    """The vLLM release ``wheel`` is built on (0.34.0 of vllm-0.34.0+ddtree.1-...)."""
    return wheel.name.split("-")[1].split("+")[0]


def _line_lock(wheel: Path) -> Path:
    """The upstream.lock of the release line that built ``wheel``: the
    checkout's own for the primary line, lines/<version>/ for the others."""
    line = REPO_ROOT / "lines" / _upstream_version(wheel) / "upstream.lock"
    return line if line.exists() else REPO_ROOT / "upstream.lock"


def skipped_requirements(wheel: Path) -> list[str]:
    """The line's ``[ddtree.test_venv] skip_requirements``: distributions the
    wheel requires that the package index cannot provide (a pin PyPI never
    had) and that no CPU test imports."""
    import tomllib

    lock = tomllib.loads(_line_lock(wheel).read_text())
    return list(
        lock.get("ddtree", {}).get("test_venv", {}).get("skip_requirements", [])
    )


def requirements_without(wheel: Path, skipped: list[str]) -> list[str]:
    """The wheel's unconditional requirements (no extras), less ``skipped``
    (compared by normalised distribution name)."""
    import re

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    drop = {norm(s) for s in skipped}
    kept = []
    for line in _requires(wheel).splitlines():
        req = line.removeprefix("Requires-Dist:").strip()
        if "extra ==" in req:
            continue
        name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req).group(0)
        if norm(name) not in drop:
            kept.append(req)
    return kept


# Test tools the tests in tests/in_vllm need inside the venv.
TEST_TOOLS = ["pytest>=8", "hypothesis>=6"]


def ensure_venv(wheel: Path, python: str | None = None) -> Path:
    """Return a venv whose vLLM is `wheel`, building what is missing.

    Two layers. The base venv is keyed by the wheel's dependencies (not by its
    bytes): it is created once with `pip install <wheel>` *with* its
    dependencies (torch and the CUDA libraries: several GB, minutes). Each
    build of our wheel then gets a small venv of its own, keyed by the
    wheel's sha256: the wheel installed with `--no-deps` (the Dockerfile's
    step) into its site-packages, which come before the base venv's (added by
    a .pth file). Checkouts that test different builds at the same time
    therefore never install over each other's vLLM.
    """
    python = python or os.environ.get("VLLM_DDTREE_VENV_PYTHON") or sys.executable
    skipped = skipped_requirements(wheel)
    key = hashlib.sha256(
        (
            _requires(wheel)
            + "\n"
            + "\n".join(TEST_TOOLS)
            + "\n"
            + python
            + "".join(f"\nskip {name}" for name in skipped)
        ).encode()
    ).hexdigest()[:16]
    base = cache_dir(wheel) / f"venv-{key}"
    if not (base / ".ddtree-complete").exists():
        for old in cache_dir(wheel).glob("venv-*"):  # one base venv at a time: ~8 GB
            shutil.rmtree(old, ignore_errors=True)
        t0 = time.monotonic()
        _log(f"creating venv {base} with {python}")
        subprocess.run([python, "-m", "venv", str(base)], check=True)
        _log(
            f"pip install {wheel.name} with dependencies: about 8 GB, minutes "
            "(once per set of dependencies)"
        )
        # The wheel itself goes into the layer below; with requirements the
        # index cannot provide, the base gets the others by name instead.
        wanted = requirements_without(wheel, skipped) if skipped else [str(wheel)]
        if skipped:
            _log(f"not installing {', '.join(skipped)} (see the line's upstream.lock)")
        _run_with_progress(
            [
                str(venv_python(base)),
                "-m",
                "pip",
                "install",
                "--progress-bar",
                "off",
                "--disable-pip-version-check",
                *wanted,
                *TEST_TOOLS,
            ],
            base,
        )
        (base / ".ddtree-complete").write_text(str(wheel) + "\n")
        _log(f"venv ready in {time.monotonic() - t0:.0f}s")
    wheel_sha = _sha256_file(wheel)[:16]
    layer = cache_dir(wheel) / f"wheel-{key}-{wheel_sha}"
    if not (layer / ".ddtree-complete").exists():
        t0 = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f"{layer.name}.", dir=layer.parent))
        _log(f"installing {wheel.name} into {layer} (--no-deps, over {base.name})")
        subprocess.run([python, "-m", "venv", "--without-pip", str(tmp)], check=True)
        site = _site_packages(tmp)
        subprocess.run(
            [
                str(venv_python(base)),
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                # Python compiles what the tests import on first use; all of
                # vLLM's 4,600 files up front took over half of the install.
                "--no-compile",
                "--disable-pip-version-check",
                "--target",
                str(site),
                str(wheel),
            ],
            check=True,
            stdout=sys.stderr,
        )
        # After the layer's own site-packages: the base venv's, with its .pth.
        (site / "zz-ddtree-base.pth").write_text(
            f"import site; site.addsitedir({str(_site_packages(base))!r})\n"
        )
        (tmp / ".ddtree-complete").write_text(str(wheel) + "\n")
        # Built aside and renamed: a concurrent build of the same wheel cannot
        # leave a half-installed layer (bin/python finds its venv from its
        # own location, so the rename is safe).
        try:
            tmp.rename(layer)
        except OSError:  # another process finished it first
            shutil.rmtree(tmp, ignore_errors=True)
        _prune_layers(keep=layer)
        _log(f"wheel layer ready in {time.monotonic() - t0:.0f}s")
    # Marks the layer as in use, for _prune_layers.
    os.utime(layer)
    return layer


def _site_packages(venv: Path) -> Path:
    found = sorted((venv / "lib").glob("python3*/site-packages"))
    if not found:
        raise RuntimeError(f"no site-packages under {venv}")
    return found[0]


def _prune_layers(keep: Path, count: int = 4, idle_hours: float = 6.0) -> None:
    """Remove the wheel layers (each about 1 GB) beyond the newest ``count``
    that no one has used for ``idle_hours``: a test run that took its layer
    minutes ago may still be running from it (checkouts build and test at the
    same time), so age alone, not rank, decides."""
    layers = sorted(
        (
            p
            for p in keep.parent.glob("wheel-*")
            if p.is_dir() and "." not in p.name and p != keep
        ),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    cutoff = time.time() - idle_hours * 3600
    for old in layers[count - 1 :]:
        if old.stat().st_mtime < cutoff:
            shutil.rmtree(old, ignore_errors=True)


if __name__ == "__main__":
    print(ensure_venv(Path(sys.argv[1]).resolve()))
