# SPDX-License-Identifier: Apache-2.0
"""Our wheel: RECORD/METADATA integrity, and a round trip through a fresh venv."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import ddtree_venv
import pytest
from repo_paths import REPO_ROOT

import apply_patches


def test_version_py_rewrite() -> None:
    original = (
        "__version__ = version = '0.26.0'\n"
        "__version_tuple__ = version_tuple = (0, 26, 0)\n"
        "__commit_id__ = commit_id = 'gffd46bfab'\n"
    )
    text = apply_patches.version_py(original, "0.26.0+ddtree.7")
    assert "__version__ = version = '0.26.0+ddtree.7'" in text
    assert "(0, 26, 0, 'ddtree.7')" in text
    assert "'gffd46bfab'" in text


def test_wheel_record_and_metadata(
    our_wheel: Path, lock: apply_patches.Lock, src_tree: Path
) -> None:
    version = lock.version
    di = f"vllm-{version}.dist-info"
    with zipfile.ZipFile(our_wheel) as z:
        names = z.namelist()
        assert len(names) == len(set(names))
        assert not [n for n in names if n.startswith("vllm-0.26.0.dist-info/")]
        rows = {
            r[0]: r
            for r in csv.reader(io.StringIO(z.read(f"{di}/RECORD").decode()))
            if r
        }
        assert set(rows) == set(names)
        assert rows[f"{di}/RECORD"][1:] == ["", ""]
        for name in names:
            if name == f"{di}/RECORD":
                continue
            data = z.read(name)  # also checks each member's CRC
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(
                b"="
            )
            assert rows[name][1] == "sha256=" + digest.decode(), name
            assert int(rows[name][2]) == len(data), name
        metadata = z.read(f"{di}/METADATA").decode()
        assert re.search(rf"^Version: {re.escape(version)}$", metadata, re.M)
        version_py = z.read("vllm/_version.py").decode()
        assert f"__version__ = version = '{version}'" in version_py
        assert f"'g{lock.upstream['commit']}'" in version_py
        changed, deleted = apply_patches.changed_files(src_tree)
        assert changed, "the stack changes at least one file"
        for path, data in changed.items():
            assert z.read(path) == data, path
        for path in deleted:
            assert path not in names
        # nothing compiled: the extensions are the official ones, byte for byte
        upstream = apply_patches.fetch_artifact(lock, "wheel")
        with zipfile.ZipFile(upstream) as zu:
            for name in ("vllm/_C.abi3.so", "vllm/_C_stable_libtorch.abi3.so"):
                if name in zu.namelist():
                    assert z.getinfo(name).CRC == zu.getinfo(name).CRC


def test_wheel_is_deterministic(
    our_wheel: Path, lock: apply_patches.Lock, src_tree: Path, tmp_path: Path
) -> None:
    again = apply_patches.build_wheel(lock, src_tree, tmp_path)
    assert again.read_bytes() == our_wheel.read_bytes()


def dockerfile_pip_args() -> list[str]:
    """The pip arguments of the Dockerfile's install step (without the wheel path)."""
    text = (REPO_ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    m = re.search(
        r"^RUN python3 -m pip install (.*?) /tmp/ddtree/vllm-\*\.whl", text, re.M
    )
    assert m, (
        "Dockerfile has no `RUN python3 -m pip install ... /tmp/ddtree/vllm-*.whl`"
    )
    return shlex.split(m.group(1))


def test_dockerfile_contract(lock: apply_patches.Lock) -> None:
    text = (REPO_ROOT / "Dockerfile").read_text()
    assert re.search(rf"^FROM {re.escape(lock.upstream['base_image'])}$", text, re.M)
    assert 'ENTRYPOINT ["vllm", "serve"]' in text
    for label in ("upstream-commit", "series-sha256", "image.version"):
        assert label in text
    assert {"--no-deps", "--force-reinstall"} <= set(dockerfile_pip_args())


def test_dockerfile_install_step_in_clean_venv(
    our_wheel: Path, lock: apply_patches.Lock, tmp_path: Path
) -> None:
    """The Dockerfile's pip step, run in a fresh virtualenv (no engine needed)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    subprocess.run(
        [
            py,
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            *dockerfile_pip_args(),
            str(our_wheel),
        ],
        check=True,
    )
    out = subprocess.run(
        [py, "-m", "pip", "show", "vllm"], check=True, capture_output=True, text=True
    ).stdout
    assert f"Version: {lock.version}" in out
    version_py = venv.glob("lib/python*/site-packages/vllm/_version.py")
    assert f"'{lock.version}'" in next(version_py).read_text()


@pytest.mark.slow
def test_wheel_round_trip(
    wheel_venv: Path, our_wheel: Path, lock: apply_patches.Lock, src_tree: Path
) -> None:
    """Our wheel with its dependencies in a fresh venv: import, version, bytes."""
    py = str(ddtree_venv.venv_python(wheel_venv))
    probe = (
        "import os, vllm; "
        "print(vllm.__version__); print(os.path.dirname(vllm.__file__))"
    )
    out = subprocess.run(
        [py, "-c", probe], check=True, capture_output=True, text=True
    ).stdout.split("\n")
    assert out[0] == lock.version
    site_vllm = Path(out[1])
    changed, deleted = apply_patches.changed_files(src_tree)
    for path, data in changed.items():
        assert (site_vllm.parent / path).read_bytes() == data, path
    for path in deleted:
        assert not (site_vllm.parent / path).exists()
    # the Dockerfile's step on top of the full install
    subprocess.run(
        [
            py,
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            *dockerfile_pip_args(),
            str(our_wheel),
        ],
        check=True,
    )
    out = subprocess.run(
        [py, "-c", probe], check=True, capture_output=True, text=True
    ).stdout.split("\n")
    assert out[0] == lock.version
    check = subprocess.run([py, "-m", "pip", "check"], capture_output=True, text=True)
    print(check.stdout)
