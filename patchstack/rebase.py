# SPDX-License-Identifier: Apache-2.0
"""`rebase`: replay the stack onto another vLLM release in a scratch repo and give
each patch its fate (clean, merged, conflict, already upstream); with --write,
rewrite upstream.lock and patches/ when nothing conflicts."""

from __future__ import annotations

import argparse
import copy
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import git

from patchstack import fetch
from patchstack.apply import apply_stack, explain_am_failure
from patchstack.check import check_all
from patchstack.common import (
    LINES_DIR,
    OVERLAY_DIRNAME,
    REPO_ROOT,
    DDTreeError,
    default_overlay,
    log,
)
from patchstack.export import export_drift, render_patches, write_patches
from patchstack.fetch import PYPI_SIMPLE, cache_dir, fetch_artifact, newest_release
from patchstack.lock import Lock, set_lock_value
from patchstack.overlay import overlay_files
from patchstack.replay import (
    FATE_TEXT,
    FATES,
    replay_patch,
    sdist_vllm_tree,
    upstream_changes,
    vllm_tree_commit,
)
from patchstack.repo import (
    BASE_TAG,
    configure_repo,
    ensure_base_repo,
    run_git,
    stack_tree,
    tree_of,
)
from patchstack.report import render_markdown
from patchstack.series import read_series, series_hash


def release_lock(lock: Lock, version: str, index: dict[str, dict]) -> Lock:
    """An in-memory lock for upstream `version` (artifacts, sha256s from the index)."""
    old = lock.upstream["version"]
    if version == old:
        raise DDTreeError(f"rebase: {version} is already the pinned release")
    data = copy.deepcopy(lock.data)
    up = data["upstream"]
    for kind in ("sdist", "wheel"):
        art = lock.artifact(kind)
        name = art.filename.replace(f"-{old}-", f"-{version}-", 1).replace(
            f"-{old}.tar.gz", f"-{version}.tar.gz", 1
        )
        project = art.filename.split("-", 1)[0]
        entry = index.get(name)
        if entry is None:
            raise DDTreeError(
                f"rebase: {name} is not on {PYPI_SIMPLE.format(project=project)}; "
                f"is {version} a released version?"
            )
        if not re.fullmatch(r"[0-9a-f]{64}", entry.get("sha256", "")):
            raise DDTreeError(f"rebase: the package index lists no sha256 for {name}")
        if entry.get("yanked"):
            log(f"warning: {name} is yanked on PyPI")
        up[kind] = {"filename": name, "url": entry["url"], "sha256": entry["sha256"]}
    up["version"] = version
    up["tag"] = lock.upstream["tag"].replace(old, version)
    up["base_image"] = lock.upstream["base_image"].replace(old, version)
    up["commit"] = ""
    data["ddtree"].update(
        build=1, version=f"{version}+ddtree.1", upstream_tree="", patched_tree=""
    )
    return Lock(lock.path, data)


def commit_id_from_version_py(text: str) -> str:
    m = re.search(
        r"^__commit_id__ = commit_id = ['\"]g?([0-9a-f]{7,40})['\"]", text, re.M
    )
    return m.group(1) if m else ""


def wheel_commit(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        return commit_id_from_version_py(z.read("vllm/_version.py").decode())


def release_line(version: str, series: list[str]) -> dict | None:
    """The release line of `version` in lines/, if there is one: where its stack
    was resolved by hand, and which of this series' patches it no longer has
    (their change is upstream's by then)."""
    root = LINES_DIR / version
    if not (root / "upstream.lock").is_file():
        return None
    line_series = read_series(root / "patches")
    return {
        "dir": root.relative_to(REPO_ROOT).as_posix(),
        "patches": len(line_series),
        "already_upstream": [name for name in series if name not in line_series],
    }


def rebase(
    lock: Lock,
    patches_dir: Path,
    version: str,
    report_dir: Path,
    *,
    write: bool = False,
    fetch_wheel: bool = False,
    scratch: Path | None = None,
    index_fn=None,
    overlay_dir: Path | None = None,
) -> dict:
    """Replay the stack onto `version`; write reports; rewrite when clean and `write`.

    The overlay's files are not applied by git: they are copied as they are. Each is
    reported as ours, or as a collision where the new release has a file at its path."""
    overlay_dir = overlay_dir or default_overlay(patches_dir)
    problems = check_all(lock, patches_dir, overlay_dir)
    if problems:
        raise DDTreeError("rebase: `check` failed:\n  " + "\n  ".join(problems))
    series = read_series(patches_dir)
    # fetch.pypi_index as it is when called (the tests stand in a fake index).
    index_fn = index_fn or fetch.pypi_index
    project = lock.artifact("sdist").filename.split("-", 1)[0]
    log(
        f"rebase: vLLM {lock.upstream['version']} -> {version}: looking up {project} "
        "on PyPI"
    )
    new = release_lock(lock, version, index_fn(project))
    new_sdist = fetch_artifact(new, "sdist")
    log(f"sdist {new_sdist.name}: sha256 {new.artifact('sdist').sha256} ok")
    wheel_cached = (cache_dir() / new.artifact("wheel").filename).exists()
    wheel_verified = False
    if write or fetch_wheel or wheel_cached:
        whl = fetch_artifact(new, "wheel")
        wheel_verified = True
        new.upstream["commit"] = wheel_commit(whl)
        log(f"wheel {whl.name}: sha256 ok, commit {new.upstream['commit']}")
    old_base = ensure_base_repo(lock)
    if lock.tree("upstream_tree") and tree_of(old_base, BASE_TAG) != lock.tree(
        "upstream_tree"
    ):
        raise DDTreeError(
            f"pristine tree of {lock.upstream['version']} differs from "
            f"upstream_tree in {lock.path}"
        )
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(dir=cache_dir(), prefix="rebase-") as tmp:
        work = scratch.resolve() if scratch else Path(tmp) / "scratch"
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
        run_git(work, "init", "-q")
        configure_repo(git.Repo(work))
        (work / ".git/objects/info/alternates").write_text(
            str((old_base / "objects").resolve()) + "\n"
        )
        old_vllm = run_git(old_base, "rev-parse", f"{BASE_TAG}:vllm").strip()
        old_c = vllm_tree_commit(
            work, old_vllm, None, f"vLLM {lock.upstream['version']}: vllm/ of the sdist"
        )
        run_git(work, "tag", "old-base", old_c)
        log(
            f"[scratch] {work}: applying the stack on {lock.upstream['version']} "
            "(pre-images) ..."
        )
        run_git(work, "checkout", "-q", "-B", "stack", "old-base")
        for name in series:
            proc = subprocess.run(
                [
                    "git",
                    "-C",
                    str(work),
                    "am",
                    "-q",
                    "--keep",
                    "--committer-date-is-author-date",
                    str((patches_dir / name).resolve()),
                ],
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                raise DDTreeError(
                    f"rebase: the stack does not apply on its own base "
                    f"{lock.upstream['version']}; fix that first (`make apply`):\n"
                    + explain_am_failure(
                        work, patches_dir / name, proc.stderr + proc.stdout
                    )
                )
        pre_images = run_git(work, "rev-list", "--reverse", "old-base..stack").split()
        assert len(pre_images) == len(series)
        log(f"[scratch] importing vllm/ of {new_sdist.name} ...")
        new_c = vllm_tree_commit(
            work,
            sdist_vllm_tree(work, new_sdist),
            old_c,
            f"vLLM {version}: vllm/ of the sdist",
        )
        run_git(work, "tag", "new-base", new_c)
        run_git(work, "checkout", "-q", "-B", "rebased", "new-base")
        records: list[dict] = []
        skipped: dict[str, set[str]] = {}  # conflicted (so skipped) patch -> its files
        for i, (name, pre) in enumerate(zip(series, pre_images), 1):
            rec = replay_patch(work, (patches_dir / name).resolve(), pre)
            overlap = [n for n, files in skipped.items() if files & set(rec["files"])]
            if overlap and rec["fate"] != "clean":
                rec["note"] = (
                    "earlier conflicted (so skipped) patches touch the same files ("
                    + ", ".join(overlap)
                    + "); this result may depend on them"
                )
            if rec["fate"] == "conflict":
                skipped[name] = set(rec["files"])
            rec["upstream"] = upstream_changes(
                work, rec["files"], with_diff=rec["fate"] == "conflict"
            )
            log(f"[{i}/{len(series)}] {name}: {FATE_TEXT[rec['fate']]}")
            records.append(rec)
        new_paths = set(
            run_git(work, "ls-tree", "-r", "--name-only", "new-base").splitlines()
        )
        overlay_records = [
            {
                "file": rel,
                "lines": len(path.read_bytes().splitlines()),
                "fate": "collision" if rel in new_paths else "ours",
            }
            for rel, path in overlay_files(overlay_dir).items()
        ]
        collisions = [o["file"] for o in overlay_records if o["fate"] == "collision"]
        for rel in collisions:
            log(
                f"[{OVERLAY_DIRNAME}] {rel}: COLLISION (vLLM {version} has a file "
                "there)"
            )
        log(
            f"[{OVERLAY_DIRNAME}] {len(overlay_records) - len(collisions)} files ours "
            "(copied, not applied by git)"
        )
        summary = {f: sum(r["fate"] == f for r in records) for f in FATES}
        summary["overlay"] = len(overlay_records)
        summary["overlay_collisions"] = len(collisions)
        rewritable = summary["conflict"] == 0 and not collisions
        problems_text = (
            [f"{summary['conflict']} conflicted"] if summary["conflict"] else []
        )
        if collisions:
            problems_text.append(f"{len(collisions)} {OVERLAY_DIRNAME}/ collisions")
        result = (
            "clean"
            if summary["clean"] == len(records) and not collisions
            else "no conflicts"
            if rewritable
            else ", ".join(problems_text)
        )
        report = {
            "tool": "apply_patches.py rebase",
            "from": {
                "version": lock.upstream["version"],
                "tag": lock.upstream["tag"],
                "commit": lock.upstream["commit"],
                "sdist": {
                    "filename": lock.artifact("sdist").filename,
                    "sha256": lock.artifact("sdist").sha256,
                },
                "wheel": {
                    "filename": lock.artifact("wheel").filename,
                    "sha256": lock.artifact("wheel").sha256,
                },
                "upstream_tree": lock.tree("upstream_tree"),
            },
            "to": {
                "version": version,
                "tag": new.upstream["tag"],
                "commit": new.upstream["commit"] or None,
                "sdist": {**new.upstream["sdist"], "verified": True},
                "wheel": {**new.upstream["wheel"], "verified": wheel_verified},
            },
            "series_sha256": series_hash(patches_dir, overlay_dir),
            "patches": records,
            "overlay": overlay_records,
            "summary": summary,
            "result": result,
            "rewritable": rewritable,
            "written": False,
            "line": release_line(version, series),
        }
        if write and rewritable:
            run_git(work, "tag", BASE_TAG, "new-base")
            rendered = render_patches(work)
            write_release(lock, new, patches_dir, rendered, work, overlay_dir)
            report["written"] = True
            report["to"]["upstream_tree"] = new.tree("upstream_tree")
            report["to"]["patched_tree"] = new.tree("patched_tree")
    log(
        f"replayed {len(series)} patches in {time.monotonic() - t0:.1f}s: "
        + ", ".join(f"{summary[f]} {f}" for f in FATES)
    )
    report_dir.mkdir(parents=True, exist_ok=True)
    md, js = report_dir / f"{version}.md", report_dir / f"{version}.json"
    md.write_text(render_markdown(report))
    js.write_text(json.dumps(report, indent=2) + "\n")
    log(f"reports: {md} {js}")
    return report


def write_release(
    old: Lock,
    new: Lock,
    patches_dir: Path,
    rendered: list[tuple[str, bytes]],
    scratch: Path,
    overlay_dir: Path,
) -> None:
    """Rewrite upstream.lock and patches/ for the new release; restore on failure."""
    saved_lock = old.path.read_text()
    saved = {p.name: p.read_bytes() for p in patches_dir.iterdir() if p.is_file()}
    try:
        base = ensure_base_repo(new)
        upstream_tree = tree_of(base, BASE_TAG)
        if (
            run_git(base, "rev-parse", f"{BASE_TAG}:vllm").strip()
            != run_git(scratch, "rev-parse", "new-base:vllm").strip()
        ):
            raise DDTreeError(
                "rebase: the scratch vllm/ tree differs from the full sdist's"
            )
        text = saved_lock
        up = new.upstream
        for key in ("tag", "commit", "version", "base_image"):
            text = set_lock_value(text, "upstream", key, up[key])
        for kind in ("sdist", "wheel"):
            for key in ("filename", "url", "sha256"):
                text = set_lock_value(text, f"upstream.{kind}", key, up[kind][key])
        text = set_lock_value(text, "ddtree", "build", 1)
        text = set_lock_value(text, "ddtree", "version", new.data["ddtree"]["version"])
        text = set_lock_value(text, "ddtree", "upstream_tree", upstream_tree)
        text = set_lock_value(text, "ddtree", "patched_tree", "")
        old.path.write_text(text)
        _, stale = export_drift(Lock.load(old.path), patches_dir, rendered, "", "")
        write_patches(patches_dir, rendered, stale)
        # Prove it the ordinary way: apply the rewritten stack on the full new sdist
        # tree.
        with tempfile.TemporaryDirectory(
            dir=cache_dir(), prefix="rebase-apply-"
        ) as tmp:
            src = Path(tmp) / "src"
            apply_stack(Lock.load(old.path), patches_dir, overlay_dir, src)
            if render_patches(src) != rendered:
                raise DDTreeError(
                    "rebase: re-exporting the applied stack gives other patches"
                )
            patched_tree = stack_tree(src)
        written = Lock.load(old.path)
        written.set_tree("patched_tree", patched_tree)
        new.data["ddtree"].update(
            upstream_tree=upstream_tree, patched_tree=patched_tree
        )
        log(
            f"rewrote {old.path.name} ({up['version']}, commit {up['commit']}) and "
            f"{len(rendered)} patches; patched_tree {patched_tree}"
        )
        for name in stale:
            log(f"  dropped {name} (already upstream)")
    except BaseException:
        old.path.write_text(saved_lock)
        for p in patches_dir.iterdir():
            if p.is_file() and p.name not in saved:
                p.unlink()
        for name, data in saved.items():
            (patches_dir / name).write_bytes(data)
        raise


def cmd_rebase(args: argparse.Namespace) -> int:
    lock = Lock.load(args.lock)
    _ = lock.version  # validates the version fields
    if args.onto == "latest":
        args.onto = newest_release("vllm")
        log(f"rebase: the newest vLLM release on PyPI is {args.onto}")
        if args.onto == lock.upstream["version"]:
            log(f"rebase: the stack is pinned to {args.onto} already; nothing to do")
            return 0
    report = rebase(
        lock,
        args.patches,
        args.onto,
        args.report_dir,
        write=args.write,
        fetch_wheel=args.fetch_wheel,
        scratch=args.scratch,
        overlay_dir=args.overlay,
    )
    if report["rewritable"]:
        if not args.write:
            log(
                "dry run: nothing rewritten (pass --write to rewrite upstream.lock and "
                "patches/)"
            )
        return 0
    conflicted = [p["patch"] for p in report["patches"] if p["fate"] == "conflict"]
    collided = [o["file"] for o in report["overlay"] if o["fate"] == "collision"]
    what = []
    if conflicted:
        what.append(
            f"{len(conflicted)} of {len(report['patches'])} patches conflict with "
            f"{args.onto}: {', '.join(conflicted)}"
        )
    if collided:
        what.append(
            f"{args.onto} has files at {len(collided)} {OVERLAY_DIRNAME}/ paths: "
            f"{', '.join(collided)}"
        )
    print(
        f"rebase: {'; '.join(what)}; nothing rewritten (see "
        f"{args.report_dir / (args.onto + '.md')})",
        file=sys.stderr,
    )
    return 1
