# SPDX-License-Identifier: Apache-2.0
"""`wheel`: our wheel from the official one: its members copied as they are
(compiled extensions included), the files the stack changes and the version
replaced, RECORD rewritten."""

from __future__ import annotations

import argparse
import base64
import copy
import csv
import hashlib
import io
import re
import struct
import time
import zipfile
from pathlib import Path

import git

from patchstack.common import OVERLAY_DIRNAME, DDTreeError, log
from patchstack.fetch import fetch_artifact
from patchstack.lock import Lock
from patchstack.overlay import overlay_state
from patchstack.repo import BASE_TAG, stack_tree


def record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()


def copy_raw_member(
    zin: zipfile.ZipFile,
    zout: zipfile.ZipFile,
    info: zipfile.ZipInfo,
    new_name: str | None = None,
) -> None:
    """Copy one member's compressed bytes unchanged (no recompression)."""
    assert zin.fp is not None and zout.fp is not None
    zin.fp.seek(info.header_offset)
    header = zin.fp.read(30)
    if header[:4] != b"PK\x03\x04":
        raise DDTreeError(f"bad local header for {info.filename}")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    zin.fp.seek(info.header_offset + 30 + name_len + extra_len)
    data = zin.fp.read(info.compress_size)
    new = copy.copy(info)
    if new_name is not None:
        new.filename = new_name
        new.orig_filename = new_name
    new.flag_bits &= ~0x08  # sizes and CRC go into the local header
    new.extra = b""
    new.header_offset = zout.fp.tell()
    zout.fp.write(new.FileHeader(zip64=False))
    zout.fp.write(data)
    zout.filelist.append(new)
    zout.NameToInfo[new.filename] = new
    zout.start_dir = zout.fp.tell()
    zout._didModify = True  # noqa: SLF001 - zipfile has no public raw-copy API


def version_py(original: str, version: str) -> str:
    parts = re.match(r"(\d+)\.(\d+)\.(\d+)\+(.*)", version)
    assert parts, version
    vt = f"({parts[1]}, {parts[2]}, {parts[3]}, {parts[4]!r})"
    text = re.sub(
        r"^__version__ = version = .*$",
        f"__version__ = version = {version!r}",
        original,
        flags=re.M,
    )
    text = re.sub(
        r"^__version_tuple__ = version_tuple = .*$",
        f"__version_tuple__ = version_tuple = {vt}",
        text,
        flags=re.M,
    )
    if version not in text:
        raise DDTreeError("could not rewrite vllm/_version.py")
    return text


def changed_files(src: Path) -> tuple[dict[str, bytes], list[str]]:
    """Files under vllm/ that the stack changed: (path -> new bytes, deleted paths)."""
    repo = git.Repo(src)
    head = repo.commit("HEAD")
    changed: dict[str, bytes] = {}
    deleted: list[str] = []
    for d in repo.commit(BASE_TAG).diff(head, paths=["vllm/"]):
        if d.deleted_file:
            deleted.append(d.a_path)
            continue
        if d.renamed_file:
            deleted.append(d.a_path)
        changed[d.b_path] = head.tree[d.b_path].data_stream.read()
    changed.pop("vllm/_version.py", None)
    return changed, deleted


def wheel_name(lock: Lock) -> str:
    upstream = lock.artifact("wheel").filename
    return upstream.replace(f"-{lock.upstream['version']}-", f"-{lock.version}-", 1)


def build_wheel(
    lock: Lock, src: Path, dist: Path, overlay_dir: Path | None = None
) -> Path:
    if not (src / ".git").exists():
        raise DDTreeError(f"{src} is not a patched tree; run `apply` first")
    expected = lock.tree("patched_tree")
    head_tree = stack_tree(src)
    if expected and head_tree != expected:
        log(f"warning: building from tree {head_tree}, upstream.lock says {expected}")
    if overlay_dir is not None:
        drift = overlay_state(src, overlay_dir)[1]
        if drift:
            raise DDTreeError(
                f"wheel: {src} does not hold {OVERLAY_DIRNAME}/ as it is "
                "(run `apply`): " + "; ".join(drift)
            )
    upstream_whl = fetch_artifact(lock, "wheel")
    version = lock.version
    entry_points = lock.entry_points
    changed, deleted = changed_files(src)
    log(f"{len(changed)} patched/added files, {len(deleted)} deleted under vllm/")
    dist.mkdir(parents=True, exist_ok=True)
    out = dist / wheel_name(lock)
    tmp = out.with_name(out.name + ".tmp")
    t0 = time.monotonic()
    repack_wheel(
        upstream_whl,
        tmp,
        lock.upstream["version"],
        version,
        changed,
        deleted,
        entry_points,
    )
    tmp.rename(out)
    log(f"wrote {out} ({out.stat().st_size >> 20} MiB) in {time.monotonic() - t0:.1f}s")
    return out


def repack_wheel(
    upstream_whl: Path,
    out: Path,
    old_version: str,
    version: str,
    changed: dict[str, bytes],
    deleted: list[str],
    entry_points: dict[str, dict[str, str]] | None = None,
) -> None:
    """Write `out`: vLLM's wheel `upstream_whl` as `version` (its dist-info
    directory, METADATA and vllm/_version.py), with the `changed` files and the
    `entry_points` (see entry_points_txt) in, the `deleted` files out, and a new
    RECORD. Every other member's compressed bytes are copied as they are."""
    old_di, new_di = f"vllm-{old_version}.dist-info", f"vllm-{version}.dist-info"
    records: dict[str, list[str]] = {}
    with zipfile.ZipFile(upstream_whl) as zin, zipfile.ZipFile(out, "w") as zout:
        old_record = zin.read(f"{old_di}/RECORD").decode()
        for row in csv.reader(io.StringIO(old_record)):
            if row:
                records[row[0]] = row
        members = zin.infolist()
        new_files: dict[str, bytes] = dict(changed)
        new_files["vllm/_version.py"] = version_py(
            zin.read("vllm/_version.py").decode(), version
        ).encode()
        metadata = zin.read(f"{old_di}/METADATA").decode()
        metadata, n = re.subn(
            r"^Version: .*$", f"Version: {version}", metadata, count=1, flags=re.M
        )
        if n != 1:
            raise DDTreeError("METADATA has no Version: line")
        new_files[f"{new_di}/METADATA"] = metadata.encode()
        if entry_points:
            old_ep = f"{old_di}/entry_points.txt"
            text = zin.read(old_ep).decode() if old_ep in zin.namelist() else ""
            new_files[f"{new_di}/entry_points.txt"] = entry_points_txt(
                text, entry_points
            ).encode()
        record_rows: list[list[str]] = []
        last = time.monotonic()
        for i, info in enumerate(members, 1):
            name = info.filename
            if time.monotonic() - last > 2:
                last = time.monotonic()
                log(f"  wheel: {i}/{len(members)} members")
            if name == f"{old_di}/RECORD" or name in deleted:
                continue
            target = (
                new_di + name[len(old_di) :] if name.startswith(old_di + "/") else name
            )
            if target in new_files:
                continue  # written below
            copy_raw_member(zin, zout, info, target)
            row = records.get(name)
            if row is None:
                raise DDTreeError(f"{name} is not in the upstream RECORD")
            record_rows.append([target, *row[1:]])
        for name, data in sorted(new_files.items()):
            if name in zout.NameToInfo:
                continue
            zi = zipfile.ZipInfo(name, date_time=(2000, 1, 1, 0, 0, 0))
            zi.external_attr = 0o644 << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            zout.writestr(zi, data)
            record_rows.append([name, record_hash(data), str(len(data))])
        record_rows.append([f"{new_di}/RECORD", "", ""])
        record_buf = io.StringIO()
        csv.writer(record_buf, lineterminator="\n").writerows(record_rows)
        zi = zipfile.ZipInfo(f"{new_di}/RECORD", date_time=(2000, 1, 1, 0, 0, 0))
        zi.external_attr = 0o644 << 16
        zi.compress_type = zipfile.ZIP_DEFLATED
        zout.writestr(zi, record_buf.getvalue())


def entry_points_txt(original: str, entry_points: dict[str, dict[str, str]]) -> str:
    """A dist-info entry_points.txt (`original`, "" for none) with `entry_points`
    (group -> {name: object reference}) added: each after its group's entries, a
    group it lacks as a new section at the end; upstream's lines stay as they are.
    A name its group has already is refused unless it names the same object."""
    lines = original.splitlines()
    for group, entries in entry_points.items():
        header = f"[{group}]"
        start = next((i for i, s in enumerate(lines) if s.strip() == header), None)
        if start is None:
            if lines and lines[-1].strip():
                lines.append("")
            lines.append(header)
            start = len(lines) - 1
        end = start + 1
        declared: dict[str, str] = {}
        while end < len(lines) and not lines[end].lstrip().startswith("["):
            name, sep, value = lines[end].partition("=")
            if sep and not name.lstrip().startswith(("#", ";")):
                declared[name.strip()] = value.strip()
            end += 1
        while end > start + 1 and not lines[end - 1].strip():
            end -= 1  # after the group's last entry, before the blank lines
        added = []
        for name, value in entries.items():
            if name in declared:
                if declared[name] != value:
                    raise DDTreeError(
                        f"entry point {group}: {name} is {declared[name]!r} in "
                        f"vLLM's wheel; upstream.lock would make it {value!r}"
                    )
                continue
            added.append(f"{name} = {value}")
        lines[end:end] = added
    return "\n".join(lines) + "\n"


def cmd_wheel(args: argparse.Namespace) -> int:
    lock = Lock.load(args.lock)
    build_wheel(lock, args.src.resolve(), args.dist, args.overlay)
    return 0
