# SPDX-License-Identifier: Apache-2.0
"""`apply_patches.py rebase` on a synthetic upstream (no network).

Two fake releases, 1.0.0 and 1.1.0, as sdists (tar.gz) and wheels in a tmp dir; the
package index and the download are injected. The stack has one patch per fate:

  a.py  clean             upstream only inserts lines above (applies at an offset)
  b.py  merged three-way  upstream changes a context line two lines below the change
  c.py  conflict          upstream changes the very line the patch changes, differently
  d.py  already upstream  upstream made the same change (and touched the context)

and an overlay (files of our own, copied, not applied by git): vllm/ours/ (ours in both
releases) and, in one test, vllm/added.py, a path where 1.1.0 adds a file (a collision).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from repo_paths import REPO_ROOT

from patchstack import fetch
from patchstack.check import check_all
from patchstack.cli import main
from patchstack.common import DEFAULT_PATCHES, LINES_DIR, DDTreeError
from patchstack.fetch import newest_release
from patchstack.lock import Lock
from patchstack.rebase import release_line
from patchstack.replay import replay_patch
from patchstack.repo import new_files
from patchstack.series import read_series

OLD, NEW = "1.0.0", "1.1.0"
WHEEL = "vllm-{v}-cp38-abi3-manylinux_2_28_x86_64.whl"
FATES = {
    "fake-a-clean.patch": "clean",
    "fake-b-merged.patch": "merged",
    "fake-c-conflict.patch": "conflict",
    "fake-d-already-upstream.patch": "already-upstream",
}
HEADERS = "Why: test\nOrigin: vendor\nForwarded: not-needed\nTest: tests/test_rebase.py"


def lines(tag: str) -> list[str]:
    return [f"{tag}_{i} = {i}\n" for i in range(1, 31)]


def old_tree() -> dict[str, str]:
    return {f"vllm/{n}.py": "".join(lines(n)) for n in "abcd"} | {
        "vllm/_version.py": f"__version__ = version = '{OLD}'\n",
        "setup.py": "# not vllm/\n",
        "README.md": "fake vllm\n",
    }


def new_tree() -> dict[str, str]:
    t = old_tree()
    a = ["# new header line\n"] * 3 + lines("a")
    b = lines("b")
    b[11] = "b_12 = 'upstream'\n"  # line 12: context of the patch's change on line 10
    c = lines("c")
    c[9] = "c_10 = 'upstream'\n"  # line 10: the very line the patch changes
    d = lines("d")
    d[9] = "d_10 = 'patched'\n"  # the patch's own change ...
    d[11] = (
        "d_12 = 'upstream'\n"  # ... plus a context change, so it does not apply as is
    )
    t |= {
        "vllm/a.py": "".join(a),
        "vllm/b.py": "".join(b),
        "vllm/c.py": "".join(c),
        "vllm/d.py": "".join(d),
        "vllm/_version.py": f"__version__ = version = '{NEW}'\n",
        "vllm/added.py": "# new in 1.1.0\n",
    }
    return t


def make_sdist(path: Path, version: str, files: dict[str, str]) -> None:
    with tarfile.open(path, "w:gz") as tf:
        for rel, text in sorted(files.items()):
            data = text.encode()
            info = tarfile.TarInfo(f"vllm-{version}/{rel}")
            info.size, info.mtime, info.mode = len(data), 946684800, 0o644
            tf.addfile(info, io.BytesIO(data))


def make_wheel(path: Path, version: str, commit: str) -> None:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(
            "vllm/_version.py",
            f"__version__ = version = '{version}'\n"
            f"__commit_id__ = commit_id = 'g{commit}'\n",
        )


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def git(repo: Path, *argv: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *argv], check=True, capture_output=True, text=True
    ).stdout


class FakeUpstream:
    """Fake PyPI: artifacts in `dir`, an index function and a download function."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "pypi"
        self.dir.mkdir()
        self.downloads: list[str] = []
        make_sdist(self.dir / f"vllm-{OLD}.tar.gz", OLD, old_tree())
        make_sdist(self.dir / f"vllm-{NEW}.tar.gz", NEW, new_tree())
        make_wheel(self.dir / WHEEL.format(v=OLD), OLD, "0ld0ld0")
        make_wheel(self.dir / WHEEL.format(v=NEW), NEW, "abc1234")
        self.tamper: str | None = None

    def url(self, name: str) -> str:
        return f"https://files.example.invalid/{name}"

    def index(self, project: str) -> dict[str, dict]:
        assert project == "vllm"
        out = {}
        for p in self.dir.iterdir():
            digest = sha256(p) if p.name != self.tamper else "0" * 64
            out[p.name] = {"url": self.url(p.name), "sha256": digest, "yanked": False}
        return out

    def download(self, url: str, dest: Path) -> None:
        self.downloads.append(url.rsplit("/", 1)[1])
        dest.write_bytes((self.dir / url.rsplit("/", 1)[1]).read_bytes())


@pytest.fixture()
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeUpstream:
    monkeypatch.setenv("VLLM_DDTREE_CACHE", str(tmp_path / "cache"))
    up = FakeUpstream(tmp_path)
    monkeypatch.setattr(fetch, "pypi_index", up.index)
    monkeypatch.setattr(fetch, "download", up.download)
    return up


LOCK = """\
# fake lock for tests/tooling/test_rebase.py
[upstream]
repository = "https://github.com/vllm-project/vllm"
tag = "v{v}"
commit = "0ld0ld0"
version = "{v}"
base_image = "vllm/vllm-openai:v{v}"
precompiled = true

[upstream.sdist]
filename = "vllm-{v}.tar.gz"
url = "{sdist_url}"
sha256 = "{sdist_sha}"

[upstream.wheel]
filename = "{wheel}"
url = "{wheel_url}"
sha256 = "{wheel_sha}"

[ddtree]
build = 3
version = "{v}+ddtree.3"
# git tree ids
upstream_tree = ""
patched_tree = ""
"""


@pytest.fixture()
def stack(fake: FakeUpstream, tmp_path: Path) -> tuple[Path, Path]:
    """A lock pinned to 1.0.0 and a 4-patch stack made with `apply` + `export`."""
    lock = tmp_path / "upstream.lock"
    wheel = WHEEL.format(v=OLD)
    lock.write_text(
        LOCK.format(
            v=OLD,
            sdist_url=fake.url(f"vllm-{OLD}.tar.gz"),
            sdist_sha=sha256(fake.dir / f"vllm-{OLD}.tar.gz"),
            wheel=wheel,
            wheel_url=fake.url(wheel),
            wheel_sha=sha256(fake.dir / wheel),
        )
    )
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "series").write_text("# fake series\n")
    for rel in OVERLAY:
        path = tmp_path / "overlay" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{SPDX}\n# {rel}\n")
    src = tmp_path / "src"
    assert (
        main(
            ["--lock", str(lock), "--patches", str(patches), "apply", "--src", str(src)]
        )
        == 0
    )
    for name, subject in [
        ("a", "fake a clean"),
        ("b", "fake b merged"),
        ("c", "fake c conflict"),
        ("d", "fake d already upstream"),
    ]:
        f = src / f"vllm/{name}.py"
        text = f.read_text()
        f.write_text(text.replace(f"{name}_10 = 10\n", f"{name}_10 = 'patched'\n"))
        git(
            src,
            "commit",
            "-q",
            "-a",
            "-m",
            f"{subject}\n\n{HEADERS}",
            "--date",
            "2026-01-01T00:00:00+0000",
        )
    assert (
        main(
            [
                "--lock",
                str(lock),
                "--patches",
                str(patches),
                "export",
                "--src",
                str(src),
            ]
        )
        == 0
    )
    assert read_series(patches) == list(FATES)
    return lock, patches


SPDX = "# SPDX-License-Identifier: Apache-2.0"
OVERLAY = ["vllm/ours/__init__.py", "vllm/ours/mod.py"]


def run_rebase(lock: Path, patches: Path, reports: Path, *extra: str) -> int:
    return main(
        [
            "--lock",
            str(lock),
            "--patches",
            str(patches),
            "rebase",
            "--onto",
            NEW,
            "--report-dir",
            str(reports),
            *extra,
        ]
    )


def snapshot(lock: Path, patches: Path) -> dict[str, bytes]:
    return {"lock": lock.read_bytes()} | {
        p.name: p.read_bytes() for p in patches.iterdir()
    }


def test_each_fate_keep_going_no_rewrite(
    stack: tuple[Path, Path],
    fake: FakeUpstream,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    lock, patches = stack
    before = snapshot(lock, patches)
    reports = tmp_path / "reports"
    assert run_rebase(lock, patches, reports, "--write") == 1
    err = capsys.readouterr().err
    assert "1 of 4 patches conflict with 1.1.0: fake-c-conflict.patch" in err
    assert snapshot(lock, patches) == before  # not clean: nothing rewritten
    report = json.loads((reports / f"{NEW}.json").read_text())
    # every patch has a fate, also the one after the conflict (keep going)
    assert {p["patch"]: p["fate"] for p in report["patches"]} == FATES
    assert report["summary"] == {
        "clean": 1,
        "merged": 1,
        "conflict": 1,
        "already-upstream": 1,
        "overlay": 2,
        "overlay_collisions": 0,
    }
    assert report["overlay"] == [
        {"file": rel, "lines": 2, "fate": "ours"} for rel in OVERLAY
    ]
    assert report["rewritable"] is False and report["written"] is False
    # the new sdist was verified against the index's sha256, the wheel was fetched
    # (--write)
    assert report["to"]["sdist"]["sha256"] == sha256(fake.dir / f"vllm-{NEW}.tar.gz")
    assert report["to"]["commit"] == "abc1234" and report["to"]["wheel"]["verified"]
    by = {p["patch"]: p for p in report["patches"]}
    c = by["fake-c-conflict.patch"]
    assert c["conflict"]["files"] == ["vllm/c.py"]
    (region,) = c["conflict"]["regions"]
    assert (
        "c_10 = 'upstream'" in region["text"] and "c_10 = 'patched'" in region["text"]
    )
    assert c["hunks_not_applying"] == [
        {"file": "vllm/c.py", "hunk": 1, "header": "@@ -7,7 +7,7 @@ c_6 = 6"}
    ]
    assert "+c_10 = 'upstream'" in c["upstream"]["diff"]
    assert c["upstream"]["stat"] == [{"file": "vllm/c.py", "added": 1, "removed": 1}]
    assert "note" not in c
    assert "note" not in by["fake-d-already-upstream.patch"]  # other files than c's
    assert by["fake-a-clean.patch"]["upstream"]["stat"][0]["added"] == 3
    md = (reports / f"{NEW}.md").read_text()
    assert "# Rebase check: vLLM 1.0.0 -> 1.1.0" in md
    for needle in (
        "| 1 | `fake-a-clean.patch` | clean",
        "| 2 | `fake-b-merged.patch` | merged",
        "| 3 | `fake-c-conflict.patch` | CONFLICT",
        "| 4 | `fake-d-already-upstream.patch` | already upstream",
        "Conflict at `vllm/c.py:",
        "Upstream diff of the conflicted files",
        "overlay/ (ours, not applied by git",
        "| `vllm/ours/mod.py` | 2 | ours |",
        sha256(fake.dir / f"vllm-{NEW}.tar.gz"),
    ):
        assert needle in md, needle


def test_dry_run_reports_and_does_not_fetch_wheel(
    stack: tuple[Path, Path], fake: FakeUpstream, tmp_path: Path
) -> None:
    lock, patches = stack
    # drop the conflicting patch: no conflict left, but a dry run still rewrites nothing
    (patches / "fake-c-conflict.patch").unlink()
    (patches / "series").write_text(
        (patches / "series").read_text().replace("fake-c-conflict.patch\n", "")
    )
    before = snapshot(lock, patches)
    fake.downloads.clear()
    assert run_rebase(lock, patches, tmp_path / "r") == 0
    assert snapshot(lock, patches) == before
    assert fake.downloads == [f"vllm-{NEW}.tar.gz"]
    report = json.loads((tmp_path / "r" / f"{NEW}.json").read_text())
    assert report["rewritable"] and not report["written"]
    assert report["to"]["commit"] is None and not report["to"]["wheel"]["verified"]
    assert "not known: wheel not fetched" in (tmp_path / "r" / f"{NEW}.md").read_text()


def test_write_when_clean(
    stack: tuple[Path, Path], fake: FakeUpstream, tmp_path: Path
) -> None:
    lock, patches = stack
    (patches / "fake-c-conflict.patch").unlink()
    (patches / "series").write_text(
        (patches / "series").read_text().replace("fake-c-conflict.patch\n", "")
    )
    old_b = (patches / "fake-b-merged.patch").read_text()
    old_a = (patches / "fake-a-clean.patch").read_text()
    assert run_rebase(lock, patches, tmp_path / "r", "--write") == 0
    report = json.loads((tmp_path / "r" / f"{NEW}.json").read_text())
    assert report["written"] is True
    # the lock now pins 1.1.0, with both sha256s and the wheel's commit
    new = Lock.load(lock)
    assert new.upstream["version"] == NEW and new.upstream["tag"] == f"v{NEW}"
    assert new.upstream["commit"] == "abc1234"
    assert new.upstream["base_image"] == f"vllm/vllm-openai:v{NEW}"
    assert new.artifact("sdist").sha256 == sha256(fake.dir / f"vllm-{NEW}.tar.gz")
    assert new.artifact("wheel").sha256 == sha256(fake.dir / WHEEL.format(v=NEW))
    assert new.artifact("wheel").filename == WHEEL.format(v=NEW)
    assert new.version == f"{NEW}+ddtree.1"
    assert new.tree("upstream_tree") == report["to"]["upstream_tree"] != ""
    assert new.tree("patched_tree") == report["to"]["patched_tree"] != ""
    assert lock.read_text().startswith("# fake lock")  # comments kept
    # already-upstream patch dropped; the merged one refreshed; headers intact
    assert read_series(patches) == [
        "fake-a-clean.patch",
        "fake-b-merged.patch",
    ]
    assert (patches / "series").read_text().startswith("# fake series\n")
    assert not (patches / "fake-d-already-upstream.patch").exists()
    new_b = (patches / "fake-b-merged.patch").read_text()
    assert new_b != old_b and "b_12 = 'upstream'" in new_b
    assert new_b.split("\ndiff --git")[0] == old_b.split("\ndiff --git")[0]
    assert (patches / "fake-a-clean.patch").read_text() != old_a  # new line numbers
    assert check_all(new, patches) == []
    # the ordinary tools agree: apply --verify and no export drift
    src = tmp_path / "src-new"
    base = ["--lock", str(lock), "--patches", str(patches)]
    assert main([*base, "apply", "--src", str(src), "--verify"]) == 0
    assert main([*base, "export", "--src", str(src), "--dry-run"]) == 0
    assert (src / "vllm/b.py").read_text().count("'patched'") == 1
    # the overlay came along, copied as it is
    assert new_files(src) == OVERLAY
    assert (src / "vllm/ours/mod.py").read_text() == f"{SPDX}\n# vllm/ours/mod.py\n"


def test_overlay_collision_blocks_the_rewrite(
    stack: tuple[Path, Path],
    fake: FakeUpstream,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An overlay file at a path where the new release adds a file of its own."""
    lock, patches = stack
    (patches / "fake-c-conflict.patch").unlink()
    (patches / "series").write_text(
        (patches / "series").read_text().replace("fake-c-conflict.patch\n", "")
    )
    (tmp_path / "overlay/vllm/added.py").write_text(f"{SPDX}\n")
    before = snapshot(lock, patches)
    assert run_rebase(lock, patches, tmp_path / "r", "--write") == 1
    assert (
        "1.1.0 has files at 1 overlay/ paths: vllm/added.py" in capsys.readouterr().err
    )
    assert snapshot(lock, patches) == before
    report = json.loads((tmp_path / "r" / f"{NEW}.json").read_text())
    assert {o["file"]: o["fate"] for o in report["overlay"]} == {
        "vllm/added.py": "collision",
        "vllm/ours/__init__.py": "ours",
        "vllm/ours/mod.py": "ours",
    }
    assert report["rewritable"] is False and report["result"] == "1 overlay/ collisions"
    assert (
        "| `vllm/added.py` | 1 | COLLISION |"
        in (tmp_path / "r" / f"{NEW}.md").read_text()
    )


def test_index_sha256_is_enforced(
    stack: tuple[Path, Path],
    fake: FakeUpstream,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    lock, patches = stack
    fake.tamper = f"vllm-{NEW}.tar.gz"
    assert run_rebase(lock, patches, tmp_path / "r") == 1
    assert "sha256 mismatch" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_unknown_release(
    stack: tuple[Path, Path],
    fake: FakeUpstream,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    lock, patches = stack
    assert (
        main(
            [
                "--lock",
                str(lock),
                "--patches",
                str(patches),
                "rebase",
                "--onto",
                "9.9.9",
                "--report-dir",
                str(tmp_path / "r"),
            ]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "vllm-9.9.9.tar.gz is not on" in err


def test_newest_release_is_the_highest_final_sdist(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    files = {
        "vllm-0.9.0.tar.gz": False,  # 0.9 < 0.33: versions compare as numbers
        "vllm-0.33.0.tar.gz": False,
        "vllm-0.33.1.tar.gz": True,  # yanked
        "vllm-0.34.0rc1.tar.gz": False,  # a pre-release
        "vllm-0.34.0.dev3.tar.gz": False,
        "vllm-0.35.0-cp38-abi3-manylinux_2_28_x86_64.whl": False,  # no sdist
    }
    index = {n: {"url": n, "sha256": "", "yanked": y} for n, y in files.items()}
    monkeypatch.setattr(fetch, "pypi_index", lambda project: index)
    assert newest_release("vllm") == "0.33.0"
    monkeypatch.setattr(fetch, "pypi_index", lambda project: {})
    with pytest.raises(DDTreeError, match="no final release"):
        newest_release("vllm")


def test_onto_latest_rebases_onto_the_newest_release(
    stack: tuple[Path, Path],
    fake: FakeUpstream,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lock, patches = stack
    argv = ["--lock", str(lock), "--patches", str(patches), "rebase"]
    argv += ["--onto", "latest", "--report-dir", str(tmp_path / "r")]
    # The fake index has OLD (pinned) and NEW: the report is NEW's (one patch
    # of the fake stack conflicts, hence 1).
    assert main(argv) == 1
    assert (
        json.loads((tmp_path / "r" / f"{NEW}.json").read_text())["to"]["version"] == NEW
    )
    # Pinned to the newest already: nothing to do, no report.
    full = fake.index
    monkeypatch.setattr(
        fetch,
        "pypi_index",
        lambda project: {k: v for k, v in full(project).items() if NEW not in k},
    )
    argv[-1] = str(tmp_path / "r2")
    assert main(argv) == 0
    assert not (tmp_path / "r2").exists()


def test_cli_help_lists_rebase() -> None:
    r = subprocess.run(
        [sys.executable, str(REPO_ROOT / "apply_patches.py"), "rebase", "-h"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and "--onto" in r.stdout and "--write" in r.stdout


def test_make_rebase_check_needs_version() -> None:
    r = subprocess.run(
        ["make", "-s", "rebase-check", f"PYTHON={sys.executable}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert "usage: make rebase-check VERSION=" in r.stderr
    r = subprocess.run(
        ["make", "-n", "rebase-check", "VERSION=0.27.0", f"PYTHON={sys.executable}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0
    assert "apply_patches.py rebase --onto 0.27.0 --report-dir docs/rebase" in r.stdout
    # Another line's reports go to a directory of their own.
    r = subprocess.run(
        ["make", "-n", "rebase-check", "VERSION=latest", "LINE=0.26.0"]
        + [f"PYTHON={sys.executable}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0
    assert (
        "--line 0.26.0 rebase --onto latest --report-dir docs/rebase/from-0.26.0"
        in r.stdout
    )


def test_conflict_when_upstream_deleted_the_file(tmp_path: Path) -> None:
    r = tmp_path / "r"
    r.mkdir()
    git(r, "init", "-q")
    git(r, "config", "user.name", "t")
    git(r, "config", "user.email", "t@t.invalid")
    (r / "vllm").mkdir()
    (r / "vllm/e.py").write_text("".join(f"e_{i} = {i}\n" for i in range(20)))
    git(r, "add", "-A")
    git(r, "commit", "-q", "-m", "base")
    git(r, "tag", "old-base")
    (r / "vllm/e.py").write_text(
        (r / "vllm/e.py").read_text().replace("e_5 = 5", "e_5 = 'x'")
    )
    git(r, "commit", "-q", "-a", "-m", f"fake e\n\n{HEADERS}")
    pre = git(r, "rev-parse", "HEAD").strip()
    patch = tmp_path / "fake-e.patch"
    patch.write_text(git(r, "format-patch", "--stdout", "-1", pre))
    git(r, "checkout", "-q", "-b", "new", "old-base")
    git(r, "rm", "-q", "vllm/e.py")
    git(r, "commit", "-q", "-m", "upstream deletes e.py")
    rec = replay_patch(r, patch, pre)
    assert rec["fate"] == "conflict" and rec["conflict"]["files"] == ["vllm/e.py"]
    assert "upstream deleted or renamed" in rec["conflict"]["regions"][0]["text"]
    assert git(r, "status", "--porcelain") == ""  # reset for the next patch


def test_release_line_names_the_hand_resolved_stack() -> None:
    """A release with a line in lines/: the report says where its stack lives
    and which patches of the series it dropped; no line, nothing to say."""
    series = read_series(DEFAULT_PATCHES)
    for version in (p.name for p in LINES_DIR.iterdir()):
        line_series = read_series(LINES_DIR / version / "patches")
        line = release_line(version, [*series, "gone-upstream.patch"])
        assert line is not None
        assert line["dir"] == f"lines/{version}"
        assert line["patches"] == len(line_series)
        assert "gone-upstream.patch" in line["already_upstream"]
        assert set(line["already_upstream"]) - {"gone-upstream.patch"} == (
            set(series) - set(line_series)
        )
    assert release_line("0.0.1", series) is None


def test_scheduled_rebase_check_tries_every_line(tmp_path: Path) -> None:
    # .ci/rebase-check with a stand-in `make` that records its arguments and
    # fails for the default line: every line is still tried, and the exit
    # status says that one failed.
    calls = tmp_path / "calls"
    fake_make = tmp_path / "bin" / "make"
    fake_make.parent.mkdir()
    fake_make.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {calls}\n'
        'case "$*" in *LINE=*) exit 0;; *) exit 1;; esac\n'
    )
    fake_make.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake_make.parent}:{os.environ['PATH']}"}
    r = subprocess.run(
        [str(REPO_ROOT / ".ci" / "rebase-check")],
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1
    lines = sorted(p.parent.name for p in (REPO_ROOT / "lines").glob("*/upstream.lock"))
    made = calls.read_text().splitlines()
    assert len(made) == 1 + len(lines) and lines
    assert all("rebase-check VERSION=latest" in m for m in made)
    assert [m.split("LINE=")[1].split()[0] for m in made[1:]] == lines
