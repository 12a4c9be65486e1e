# SPDX-License-Identifier: Apache-2.0
"""The documentation agrees with what it documents.

- Results tables: a Markdown table whose first two columns are ``pair`` and
  ``requests``; the paragraph right above it links the JSON file its rows come
  from (``bench/results/policy.json``). Every number in it must be that file's
  value for the row's pair and concurrency, to the digits printed, and the
  table must have every row of the pairs it shows.
- Relative links in README.md, docs/*.md and CHANGELOG.md reach a file (and a
  heading, for a Markdown anchor).
- docs/architecture.md's hook table is ``patches/series`` (the primary line's),
  docs/architecture-0.26.0.md's is ``lines/0.26.0/patches/series``, each patch
  with the upstream files it touches and its added and removed lines.
- Every refusal docs/configuration.md shows is a message the overlay builds.
"""

import ast
import json
import re
from pathlib import Path

import pytest
from repo_paths import REPO_ROOT

REPO = REPO_ROOT
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
CHANGELOG = REPO / "CHANGELOG.md"

# Column header -> key of a policy.json row.
COLUMNS = {
    "pair": "pair",
    "requests": "concurrency",
    "no speculation (tok/s)": "nospec_tok_s",
    "DFlash chain (tok/s)": "chain_tok_s",
    "chain tau": "chain_tau",
    "DDTree (tok/s)": "ddtree_tok_s",
    "DDTree budget": "budget_chosen",
    "DDTree tau": "tau",
    "DDTree / best other": "ddtree_over_best",
    "DDTree / chain": "ddtree_over_chain",
}
# A cell that stands for "no value": DDTree's tau where it chose no speculation.
NO_VALUE = "–"

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _cells(line: str) -> list[str]:
    return [c.replace("**", "").strip() for c in line.strip().strip("|").split("|")]


def results_tables(path: Path) -> list[tuple[Path, list[str], list[list[str]]]]:
    """(linked JSON file, header, rows) of every results table in ``path``."""
    lines = path.read_text().splitlines()
    tables = []
    i = 0
    while i < len(lines):
        if not lines[i].startswith("|") or _cells(lines[i])[:2] != ["pair", "requests"]:
            i += 1
            continue
        header = _cells(lines[i])
        # The paragraph above the table (up to the previous blank line).
        j = i - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        paragraph = []
        while j >= 0 and lines[j].strip():
            paragraph.append(lines[j])
            j -= 1
        sources = [
            t
            for t in LINK.findall(" ".join(paragraph))
            if t.split("#")[0].endswith(".json")
        ]
        assert len(sources) == 1, (
            f"{path.name}: the paragraph above the table at line {i + 1} must link "
            f"exactly one results JSON file, found {sources}"
        )
        source = (path.parent / sources[0].split("#")[0]).resolve()
        i += 2  # header and the |---| row
        rows = []
        while i < len(lines) and lines[i].startswith("|"):
            rows.append(_cells(lines[i]))
            i += 1
        tables.append((source, header, rows))
    return tables


def _matches(printed: str, value: object) -> bool:
    """Whether a printed number is ``value`` to the digits printed."""
    printed = printed.replace(",", "")
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return abs(float(printed) - float(value)) <= 0.5 * 10**-decimals + 1e-9


def check_table(source: Path, header: list[str], rows: list[list[str]]) -> list[str]:
    """What in a results table differs from its source file (empty if nothing)."""
    unknown = [h for h in header if h not in COLUMNS]
    assert not unknown, f"columns not mapped to {source.name}'s keys: {unknown}"
    data = {(r["pair"], r["concurrency"]): r for r in json.loads(source.read_text())}
    errors = []
    seen = set()
    for row in rows:
        assert len(row) == len(header), f"row {row} has {len(row)} cells"
        key = (row[0], int(row[1]))
        if key not in data:
            errors.append(f"{key}: no such row in {source.name}")
            continue
        seen.add(key)
        for name, cell in zip(header[2:], row[2:]):
            value = data[key][COLUMNS[name]]
            if cell == NO_VALUE:
                if not (COLUMNS[name] == "tau" and data[key]["budget_chosen"] == 0):
                    errors.append(f"{key} {name}: '{NO_VALUE}', the file has {value}")
            elif not _matches(cell, value):
                errors.append(f"{key} {name}: printed {cell}, the file has {value}")
    # A table may cover some pairs only, but every concurrency of those.
    pairs = {pair for pair, _ in seen}
    missing = sorted(k for k in set(data) - seen if k[0] in pairs)
    if missing:
        errors.append(f"rows of {source.name} not in the table: {missing}")
    return errors


def test_readme_has_one_results_table_of_both_pairs():
    tables = results_tables(README)
    assert len(tables) == 1, f"README.md has {len(tables)} results tables"
    source, _, rows = tables[0]
    assert source == REPO / "bench" / "results" / "policy.json"
    assert {row[0] for row in rows} == {"dense-8b", "hybrid-27b"}


@pytest.mark.parametrize(
    "path", [README, *DOCS], ids=lambda p: str(p.relative_to(REPO))
)
def test_results_tables_match_their_source(path):
    for source, header, rows in results_tables(path):
        assert check_table(source, header, rows) == []


def test_a_wrong_number_is_caught():
    """The check fails on a figure off in its last printed digit, on a wrong
    budget and on a row the file does not have."""
    source, header, rows = results_tables(README)[0]
    ratio = header.index("DDTree / best other")
    budget = header.index("DDTree budget")
    wrong = [list(r) for r in rows]
    printed = wrong[0][ratio]
    last = int(printed[-1])
    wrong[0][ratio] = printed[:-1] + str((last + 1) % 10)
    wrong[1][budget] = str(int(wrong[1][budget]) * 2 + 1)
    assert len(check_table(source, header, wrong)) == 2
    # A concurrency the file does not have, and the row it replaced missing.
    moved = [[rows[0][0], "3", *rows[0][2:]], *rows[1:]]
    assert len(check_table(source, header, moved)) == 2


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lstrip("#").strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    lines = path.read_text().splitlines()
    return {_slug(line) for line in lines if re.match(r"#{1,6} ", line)}


@pytest.mark.parametrize(
    "path", [README, *DOCS, CHANGELOG], ids=lambda p: str(p.relative_to(REPO))
)
def test_relative_links_resolve(path):
    broken = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        resolves = linked.exists() and not (
            anchor and linked.suffix == ".md" and anchor not in _anchors(linked)
        )
        if not resolves:
            broken.append(target)
    assert broken == [], f"{path.name}: links to nothing: {broken}"


def patch_stack(patches: Path) -> dict[str, tuple[list[str], int, int]]:
    """Each patch of ``patches/series``: the upstream files it touches (under
    ``vllm/``), its added and removed lines."""
    stack = {}
    for name in (patches / "series").read_text().splitlines():
        name = name.strip()
        if not name or name.startswith("#"):
            continue
        text = (patches / name).read_text()
        touched = re.findall(r"^\+\+\+ b/(\S+)", text, re.M)
        files = [f.removeprefix("vllm/") for f in touched]
        diff = text.split("\ndiff --git", 1)[1].splitlines()
        added = sum(1 for x in diff if x.startswith("+") and not x.startswith("+++"))
        removed = sum(1 for x in diff if x.startswith("-") and not x.startswith("---"))
        stack[name.removesuffix(".patch")] = (files, added, removed)
    return stack


@pytest.mark.parametrize(
    "doc, patches",
    [
        ("architecture.md", REPO / "patches"),
        ("architecture-0.26.0.md", REPO / "lines" / "0.26.0" / "patches"),
    ],
    ids=["primary", "0.26.0"],
)
def test_the_hook_table_is_the_patch_stack(doc, patches):
    """A line's architecture page lists every patch of its series, in order,
    with the files it touches and its line counts, and the stack's totals."""
    lines = (REPO / "docs" / doc).read_text().splitlines()
    header = ["patch", "upstream files"]
    start = next(i for i, line in enumerate(lines) if _cells(line)[:2] == header)
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(_cells(line))
    stack = patch_stack(patches)
    *patches, total = rows
    assert [r[0].strip("`") for r in patches] == list(stack)
    for row in patches:
        files, added, removed = stack[row[0].strip("`")]
        assert [f.strip().strip("`") for f in row[1].split(",")] == files, row[0]
        assert (int(row[2]), int(row[3])) == (added, removed), row[0]
    assert total[0] == f"total ({len(stack)} patches)"
    assert int(total[2]) == sum(s[1] for s in stack.values())
    assert int(total[3]) == sum(s[2] for s in stack.values())


def _message_pattern(node: ast.expr) -> str:
    """A regex for the strings an expression can build: its literal parts
    as they are, anything for the values formatted or joined in."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return re.escape(node.value)
    if isinstance(node, ast.JoinedStr):
        return "".join(_message_pattern(v) for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _message_pattern(node.left) + _message_pattern(node.right)
    return ".+?"


def code_messages() -> list[re.Pattern]:
    """Patterns of every DDTree message string in the overlay's modules."""
    patterns = set()
    for path in (REPO / "overlay").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Constant, ast.JoinedStr, ast.BinOp)):
                pattern = _message_pattern(node)
                if "DDTree" in pattern:
                    patterns.add(pattern)
    return [re.compile(p, re.S) for p in patterns]


def test_documented_refusals_are_messages_of_the_code():
    """Every refusal docs/configuration.md shows in a code block (a startup
    line after ``vllm serve: error:``, or a per-request message) is one the
    overlay can raise."""
    patterns = code_messages()
    text = (REPO / "docs" / "configuration.md").read_text()
    shown = [
        line[4:].removeprefix("vllm serve: error: ")
        for line in text.splitlines()
        if line.startswith(("    vllm serve: error: ", "    DDTree"))
    ]
    assert len(shown) > 40
    unknown = [m for m in shown if not any(p.fullmatch(m) for p in patterns)]
    assert unknown == []
