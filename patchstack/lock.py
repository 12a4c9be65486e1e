# SPDX-License-Identifier: Apache-2.0
"""upstream.lock: the pinned upstream release (sdist, wheel, sha256s) and our build
(version, tree ids, the entry points our wheel adds)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import tomllib

from patchstack.common import DDTreeError

# Entry point names as the packaging specification recommends them, and values
# as object references (`package.module:object.attr`, without the deprecated extras).
ENTRY_POINT_NAME = re.compile(r"[\w.-]+")
OBJECT_REFERENCE = re.compile(r"\w+(\.\w+)*(:\w+(\.\w+)*)?")


@dataclass
class Artifact:
    filename: str
    url: str
    sha256: str


@dataclass
class Lock:
    path: Path
    data: dict

    @classmethod
    def load(cls, path: Path) -> Lock:
        try:
            with open(path, "rb") as f:
                return cls(path, tomllib.load(f))
        except FileNotFoundError as e:
            raise DDTreeError(f"lock file not found: {path}") from e
        except tomllib.TOMLDecodeError as e:
            raise DDTreeError(f"{path}: invalid TOML: {e}") from e

    @property
    def upstream(self) -> dict:
        return self.data["upstream"]

    @property
    def version(self) -> str:
        version = self.data["ddtree"]["version"]
        expected = f"{self.upstream['version']}+ddtree.{self.data['ddtree']['build']}"
        if version != expected:
            raise DDTreeError(
                f"{self.path}: ddtree.version {version!r} does not match "
                f"upstream.version + ddtree.build ({expected!r})"
            )
        return version

    def artifact(self, kind: str) -> Artifact:
        a = self.upstream[kind]
        return Artifact(a["filename"], a.get("url", ""), a["sha256"].lower())

    @property
    def precompiled(self) -> bool:
        return bool(self.upstream.get("precompiled", True))

    def tree(self, key: str) -> str:
        return str(self.data["ddtree"].get(key, ""))

    def set_tree(self, key: str, value: str) -> None:
        """Rewrite one `key = "..."` line of [ddtree] in place (keeps comments)."""
        text = self.path.read_text()
        pattern = re.compile(rf'^{key}[ \t]*=[ \t]*"[^"\n]*"[ \t]*$', re.M)
        if not pattern.search(text):
            raise DDTreeError(f'{self.path}: no `{key} = "..."` line to update')
        text = pattern.sub(f'{key} = "{value}"', text, count=1)
        self.path.write_text(text)
        self.data["ddtree"][key] = value

    @property
    def entry_points(self) -> dict[str, dict[str, str]]:
        """[ddtree.entry_points]: group -> {name: object reference}, the entry
        points our wheel declares besides upstream's (none without the table)::

            [ddtree.entry_points."vllm.general_plugins"]
            ddtree = "vllm.v1.spec_decode.ddtree.plugin:register"
        """
        table = self.data["ddtree"].get("entry_points", {})
        where = f"{self.path}: ddtree.entry_points"
        if not isinstance(table, dict):
            raise DDTreeError(f"{where} must be a table of groups")
        for group, entries in table.items():
            if not ENTRY_POINT_NAME.fullmatch(group) or not isinstance(entries, dict):
                raise DDTreeError(f"{where}.{group}: not a group of entry points")
            for name, value in entries.items():
                if not ENTRY_POINT_NAME.fullmatch(name) or not (
                    isinstance(value, str) and OBJECT_REFERENCE.fullmatch(value)
                ):
                    raise DDTreeError(
                        f"{where}.{group}.{name}: want name = "
                        f'"package.module:object", got {value!r}'
                    )
        return table


def set_lock_value(text: str, section: str, key: str, value: str | int) -> str:
    """Rewrite `key = ...` inside [section] of a TOML text, keeping everything else."""
    m = re.search(rf"^\[{re.escape(section)}\][ \t]*$", text, re.M)
    if not m:
        raise DDTreeError(f"lock has no [{section}] table")
    end = re.search(r"^\[", text[m.end() :], re.M)
    body_end = m.end() + end.start() if end else len(text)
    body = text[m.end() : body_end]
    rendered = json.dumps(value) if isinstance(value, str) else str(value)
    body, n = re.subn(
        rf"^{re.escape(key)}[ \t]*=.*$",
        f"{key} = {rendered}".replace("\\", "\\\\"),
        body,
        count=1,
        flags=re.M,
    )
    if n != 1:
        raise DDTreeError(f"lock has no `{key}` in [{section}]")
    return text[: m.end()] + body + text[body_end:]
