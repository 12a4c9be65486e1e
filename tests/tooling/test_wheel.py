# SPDX-License-Identifier: Apache-2.0
"""Our wheel: RECORD/METADATA integrity, and a round trip through a fresh venv."""

from __future__ import annotations

import base64
import configparser
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

from patchstack import wheel
from patchstack.common import DDTreeError
from patchstack.fetch import fetch_artifact
from patchstack.lock import Lock


def test_version_py_rewrite() -> None:
    original = (
        "__version__ = version = '0.26.0'\n"
        "__version_tuple__ = version_tuple = (0, 26, 0)\n"
        "__commit_id__ = commit_id = 'gffd46bfab'\n"
    )
    text = wheel.version_py(original, "0.26.0+ddtree.7")
    assert "__version__ = version = '0.26.0+ddtree.7'" in text
    assert "(0, 26, 0, 'ddtree.7')" in text
    assert "'gffd46bfab'" in text


def fake_vllm_wheel(path: Path, version: str, entry_points: str | None) -> None:
    """A wheel as vLLM's is laid out, a few members only, with its RECORD."""
    di = f"vllm-{version}.dist-info"
    members = {
        "vllm/__init__.py": "",
        "vllm/_version.py": f"__version__ = version = '{version}'\n"
        "__version_tuple__ = version_tuple = (1, 0, 0)\n",
        f"{di}/METADATA": f"Metadata-Version: 2.4\nName: vllm\nVersion: {version}\n",
    }
    if entry_points is not None:
        members[f"{di}/entry_points.txt"] = entry_points
    record = "".join(
        f"{name},{wheel.record_hash(data.encode())},{len(data.encode())}\n"
        for name, data in members.items()
    )
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
        z.writestr(f"{di}/RECORD", record + f"{di}/RECORD,,\n")


UPSTREAM_ENTRY_POINTS = (
    "[console_scripts]\n"
    "vllm = vllm.entrypoints.cli.main:main\n"
    "\n"
    "[vllm.general_plugins]\n"
    "lora_filesystem_resolver = vllm.plugins.lora_resolvers.filesystem:register\n"
)


@pytest.mark.parametrize(
    "upstream", [UPSTREAM_ENTRY_POINTS, None], ids=["upstream-file", "no-file"]
)
def test_repack_adds_the_locks_entry_points(
    tmp_path: Path, upstream: str | None
) -> None:
    """[ddtree.entry_points] of upstream.lock goes into the repacked wheel's
    entry_points.txt (upstream's lines kept, a missing group or file made), and
    RECORD has the new file's hash and size."""
    lock_path = tmp_path / "upstream.lock"
    lock_path.write_text(
        '[ddtree.entry_points."vllm.general_plugins"]\n'
        'ddtree = "vllm.v1.spec_decode.ddtree.plugin:register"\n'
        '[ddtree.entry_points."vllm.platform_plugins"]\n'
        'ddtree_platform = "vllm.v1.spec_decode.ddtree.plugin:platform"\n'
    )
    upstream_whl, ours = tmp_path / "up.whl", tmp_path / "ours.whl"
    fake_vllm_wheel(upstream_whl, "1.0.0", upstream)
    di = "vllm-1.0.0+ddtree.2.dist-info"
    # No table: the wheel's entry points as they are.
    none = Lock(lock_path, {"ddtree": {}}).entry_points
    wheel.repack_wheel(upstream_whl, ours, "1.0.0", "1.0.0+ddtree.2", {}, [], none)
    with zipfile.ZipFile(ours) as z:
        if upstream is None:
            assert f"{di}/entry_points.txt" not in z.namelist()
        else:
            assert z.read(f"{di}/entry_points.txt").decode() == upstream
    entry_points = Lock.load(lock_path).entry_points
    wheel.repack_wheel(
        upstream_whl, ours, "1.0.0", "1.0.0+ddtree.2", {}, [], entry_points
    )
    with zipfile.ZipFile(ours) as z:
        text = z.read(f"{di}/entry_points.txt").decode()
        rows = {
            r[0]: r
            for r in csv.reader(io.StringIO(z.read(f"{di}/RECORD").decode()))
            if r
        }
        assert set(rows) == set(z.namelist())
    plugin = "ddtree = vllm.v1.spec_decode.ddtree.plugin:register\n"
    platform = (
        "[vllm.platform_plugins]\n"
        "ddtree_platform = vllm.v1.spec_decode.ddtree.plugin:platform\n"
    )
    if upstream is None:
        assert text == "[vllm.general_plugins]\n" + plugin + "\n" + platform
    else:
        assert text == UPSTREAM_ENTRY_POINTS + plugin + "\n" + platform
    data = text.encode()
    assert rows[f"{di}/entry_points.txt"][1:] == [
        wheel.record_hash(data),
        str(len(data)),
    ]
    # Read back as installers read it.
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str
    parser.read_string(text)
    assert parser["vllm.general_plugins"]["ddtree"] == (
        "vllm.v1.spec_decode.ddtree.plugin:register"
    )


def test_entry_points_join_their_group() -> None:
    """An entry point goes after its group's last entry (before the blank line);
    a name the group has already must name the same object."""
    scripts = {"console_scripts": {"vllm-ddtree": "vllm.ddtree_cli:main"}}
    assert wheel.entry_points_txt(UPSTREAM_ENTRY_POINTS, scripts) == (
        UPSTREAM_ENTRY_POINTS.replace(
            "cli.main:main\n", "cli.main:main\nvllm-ddtree = vllm.ddtree_cli:main\n"
        )
    )
    same = {"vllm.general_plugins": {"lora_filesystem_resolver": "x.y:z"}}
    with pytest.raises(DDTreeError, match="lora_filesystem_resolver is 'vllm.plugin"):
        wheel.entry_points_txt(UPSTREAM_ENTRY_POINTS, same)
    again = {"console_scripts": {"vllm": "vllm.entrypoints.cli.main:main"}}
    assert wheel.entry_points_txt(UPSTREAM_ENTRY_POINTS, again) == (
        UPSTREAM_ENTRY_POINTS
    )


@pytest.mark.parametrize(
    "table",
    [
        'entry_points = "x"',
        '[ddtree.entry_points]\n"vllm.general_plugins" = "x:y"',
        '[ddtree.entry_points."vllm.general_plugins"]\nddtree = "not an object"',
        '[ddtree.entry_points."vllm.general_plugins"]\nddtree = 1',
    ],
)
def test_lock_refuses_malformed_entry_points(tmp_path: Path, table: str) -> None:
    lock_path = tmp_path / "upstream.lock"
    lock_path.write_text(f"[ddtree]\n{table}\n")
    with pytest.raises(DDTreeError, match="ddtree.entry_points"):
        _ = Lock.load(lock_path).entry_points


def test_wheel_record_and_metadata(our_wheel: Path, lock: Lock, src_tree: Path) -> None:
    version = lock.version
    di = f"vllm-{version}.dist-info"
    with zipfile.ZipFile(our_wheel) as z:
        names = z.namelist()
        assert len(names) == len(set(names))
        upstream_di = f"vllm-{lock.upstream['version']}.dist-info/"
        assert not [n for n in names if n.startswith(upstream_di)]
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
        changed, deleted = wheel.changed_files(src_tree)
        assert changed, "the stack changes at least one file"
        for path, data in changed.items():
            assert z.read(path) == data, path
        for path in deleted:
            assert path not in names
        # nothing compiled: the extensions are the official ones, byte for byte
        upstream = fetch_artifact(lock, "wheel")
        with zipfile.ZipFile(upstream) as zu:
            for name in ("vllm/_C.abi3.so", "vllm/_C_stable_libtorch.abi3.so"):
                if name in zu.namelist():
                    assert z.getinfo(name).CRC == zu.getinfo(name).CRC


def test_wheel_is_deterministic(
    our_wheel: Path, lock: Lock, src_tree: Path, tmp_path: Path
) -> None:
    again = wheel.build_wheel(lock, src_tree, tmp_path)
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


def test_dockerfile_contract(lock: Lock) -> None:
    text = (REPO_ROOT / "Dockerfile").read_text()
    assert re.search(rf"^FROM {re.escape(lock.upstream['base_image'])}$", text, re.M)
    assert 'ENTRYPOINT ["vllm", "serve"]' in text
    for label in ("upstream-commit", "series-sha256", "image.version"):
        assert label in text
    assert {"--no-deps", "--force-reinstall"} <= set(dockerfile_pip_args())


def test_dockerfile_install_step_in_clean_venv(
    our_wheel: Path, lock: Lock, tmp_path: Path
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
            "--no-compile",  # not what this checks, and over half the time
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
    wheel_venv: Path, our_wheel: Path, lock: Lock, src_tree: Path
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
    changed, deleted = wheel.changed_files(src_tree)
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
            "--no-compile",  # not what this checks, and over half the time
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
