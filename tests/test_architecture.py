"""docs/architecture.md's floors table is the import graph as it is: every module under d2export/ has a row and is
named in it, no import runs up a floor (lazy imports inside functions too), no import circle (on one floor either),
and d2export imports neither third_party/, training/ (the fixtures' workshop) nor the dispatcher (d2export/cli.py).
Reads source only: imports nothing of d2export."""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "architecture.md"
DISPATCHER = "d2export.cli"
DISPATCHER_FILE = "d2export/cli.py"


def outside_names(repo: Path = REPO) -> dict[str, str]:
    """Top-level names d2export must never import → the folder they live in: third_party/ itself and each package in
    it, and training/ (the scripts that train the fixtures, run from the repository, never installed)."""
    names = {p.name: "third_party/" for p in (repo / "third_party").iterdir() if p.is_dir()}
    return {**names, "third_party": "third_party/", "training": "training/"}


# ------------------------------------------------------------------------------------------------------ the table
def read_rows(markdown: str) -> dict[str, str]:
    """The floors table's rows: `d2export/...` → the text of its row (where a package's files are named)."""
    rows = {}
    for line in markdown.splitlines():
        for name in re.findall(r"`(d2export/[^`]*)`", line.split("|")[2] if line.count("|") > 3 else ""):
            rows.setdefault(name, line)
    return rows


def read_floors(markdown: str) -> dict[str, int]:
    """The floors table: `d2export/...` (a file, or a package ending in /) → its floor. The table is the one whose
    header has a `floor` and a `modules` column; rows whose floor is not a number (`—`) stand apart."""
    floors: dict[str, int] = {}
    columns = None
    for line in markdown.splitlines():
        if not line.lstrip().startswith("|"):
            columns = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if columns is None:
            names = [c.lower() for c in cells]
            if "floor" in names and "modules" in names:
                columns = names.index("floor"), names.index("modules")
            continue
        floor, mods = cells[columns[0]], cells[columns[1]]
        if not floor.isdigit():
            continue  # the separator row, or a row standing apart
        for name in re.findall(r"`(d2export/[^`]*)`", mods):
            assert name not in floors, f"{name} has two rows"
            floors[name] = int(floor)
    return floors


def row_of(path: str, floors: dict[str, int]) -> str | None:
    """The row covering a repository path: its own, else that of the innermost package row above it."""
    if path in floors:
        return path
    packages = [row for row in floors if row.endswith("/") and path.startswith(row)]
    return max(packages, key=len, default=None)


# -------------------------------------------------------------------------------------------------------- imports
@dataclass(frozen=True)
class Import:
    file: str  # the importing file, relative to the repository
    line: int
    target: str  # the dotted name imported: a d2export module as resolved, else the statement's top-level name


def module_paths(repo: Path) -> dict[str, str]:
    """Dotted name → repository path, for every module and package under d2export/ (a package without an
    __init__.py as its folder, ending in /)."""
    paths = {}
    root = repo / "d2export"
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(repo)
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        paths[".".join(parts)] = rel.as_posix()
        for i in range(1, len(rel.parts) - 1):  # the folders above it
            paths.setdefault(".".join(rel.parts[:i + 1]), "/".join(rel.parts[:i + 1]) + "/")
    paths.setdefault("d2export", "d2export/")
    return paths


def _module(name: str, paths: dict[str, str]) -> str:
    """The innermost module under d2export a dotted name lies in (`d2export.ops.SAMPLERS` → `d2export.ops`)."""
    while name not in paths and "." in name:
        name = name.rpartition(".")[0]
    return name


def imports_of(repo: Path, rel: str, paths: dict[str, str]) -> list[Import]:
    """Every import statement of one file, wherever it sits (module level, functions, conditions), with relative
    forms resolved and `from pkg import name` going to pkg.name where that is a module."""
    parts = rel[:-len(".py")].split("/")
    package = parts[:-1]  # a module's package; an __init__.py's is its own folder
    found = []
    for node in ast.walk(ast.parse((repo / rel).read_text(), rel)):
        if isinstance(node, ast.Import):
            found += [Import(rel, node.lineno, _module(a.name, paths) if a.name.split(".")[0] == "d2export"
                             else a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "d2export":
                found.append(Import(rel, node.lineno, source.split(".")[0]))
                continue
            for alias in node.names:
                name = f"{source}.{alias.name}"
                found.append(Import(rel, node.lineno, name if name in paths else _module(source, paths)))
    return list(dict.fromkeys(found))  # `from m import a, b` of one module: once


# -------------------------------------------------------------------------------------------------------- checking
@dataclass
class Problems:
    uncovered: list[str]  # modules without a row, and rows naming nothing
    upward: list[str]  # imports running up a floor
    forbidden: list[str]  # imports of third_party/, training/ or the dispatcher
    unnamed: list[str]  # files a package row covers without naming them
    circles: list[list[str]]  # files that import themselves back through others


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import graph's strongly connected components of more than one file (Tarjan's), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def check(repo: Path, markdown: str, forbidden: dict[str, str]) -> Problems:
    floors = read_floors(markdown)
    paths = module_paths(repo)
    files = sorted(p for p in paths.values() if p.endswith(".py"))
    problems = Problems([], [], [], [], [])
    rows = read_rows(markdown)
    problems.uncovered += [f"{f}: no row in the floors table" for f in files if row_of(f, floors) is None]
    problems.uncovered += [f"{row}: a row for nothing under d2export/" for row in floors
                           if not any(f == row or (row.endswith("/") and f.startswith(row)) for f in files)]
    for rel in files:
        here = row_of(rel, floors)
        name = rel[len(here):] if here and here.endswith("/") else None
        if name and name != "__init__.py" and f"`{name}`" not in rows.get(here, "") \
                and f"`{name.split('/')[0]}/`" not in rows.get(here, ""):
            problems.unnamed.append(f"{rel}: not named in the row of {here}")
    edges: dict[str, set[str]] = {}
    for rel in files:
        here = row_of(rel, floors)
        for imp in imports_of(repo, rel, paths):
            target = paths.get(imp.target, "")
            if target.endswith(".py") and target != rel:
                edges.setdefault(rel, set()).add(target)
            if imp.target == DISPATCHER and rel != DISPATCHER_FILE:
                problems.forbidden.append(f"{rel}:{imp.line} imports the dispatcher {DISPATCHER} (the helpers are "
                                          "in d2export.argparsing)")
            elif imp.target in forbidden:
                problems.forbidden.append(f"{rel}:{imp.line} imports {imp.target} ({forbidden[imp.target]})")
            if not imp.target.startswith("d2export"):
                continue
            there = row_of(paths[imp.target], floors)
            if here is None or there is None:
                continue  # said above, as uncovered
            if floors[there] > floors[here]:
                problems.upward.append(f"{rel}:{imp.line} (floor {floors[here]}, row {here}) imports {imp.target} "
                                       f"(floor {floors[there]}, row {there})")
    problems.circles = circles(edges)
    return problems


def _real() -> Problems:
    return check(REPO, DOC.read_text(), outside_names())


def test_every_module_under_d2export_has_a_row():
    assert _real().uncovered == []


def test_every_file_is_named_in_its_row():
    assert _real().unnamed == []


def test_no_import_runs_up_a_floor():
    assert _real().upward == []


def test_no_import_circle():
    assert _real().circles == []


def test_d2export_imports_neither_third_party_training_nor_the_dispatcher():
    assert _real().forbidden == []


# ----------------------------------------------------------------------------------------- the checker can fail
def _fake_repo(tmp_path: Path) -> Path:
    files = {
        "d2export/__init__.py": "",
        "d2export/low.py": "def f():\n    from d2export.pkg import high  # lazy, still counted\n",
        "d2export/pkg/__init__.py": "",
        "d2export/pkg/high.py": "from . import other\nfrom ..low import f\n",
        "d2export/pkg/other.py": "import d2export.cli\nimport testr.modeling\nfrom training.common import reading\n",
        "d2export/pkg/ring_a.py": "from d2export.pkg import ring_b\n",
        "d2export/pkg/ring_b.py": "def f():\n    from d2export.pkg.ring_a import g  # lazy, still a circle\n",
        "d2export/cli.py": "from d2export import low\n",
        "d2export/stray.py": "",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


TABLE = """| floor | modules | what |
|---|---|---|
| 0 | `d2export/low.py` | low |
| 1 | `d2export/pkg/` | the package: `high.py`, `ring_a.py`, `ring_b.py` |
| 2 | `d2export/__init__.py` | face |
| 2 | `d2export/cli.py` | dispatcher |
| 3 | `d2export/gone.py` | a module that does not exist |
| — | `tools/` | apart |
"""


def test_the_checker_reports_a_moved_row_a_missing_row_and_forbidden_imports(tmp_path):
    repo = _fake_repo(tmp_path)
    found = check(repo, TABLE, {"testr": "third_party/", "third_party": "third_party/", "training": "training/"})
    assert found.uncovered == ["d2export/stray.py: no row in the floors table",
                               "d2export/gone.py: a row for nothing under d2export/"]
    assert found.upward == ["d2export/low.py:2 (floor 0, row d2export/low.py) imports d2export.pkg.high "
                            "(floor 1, row d2export/pkg/)",
                            "d2export/pkg/other.py:1 (floor 1, row d2export/pkg/) imports d2export.cli "
                            "(floor 2, row d2export/cli.py)"]
    assert found.unnamed == ["d2export/pkg/other.py: not named in the row of d2export/pkg/"]
    # cli → low → pkg.high → pkg.other → cli: across floors (also upward imports); ring_a ↔ ring_b on one floor
    assert found.circles == [["d2export/cli.py", "d2export/low.py", "d2export/pkg/high.py", "d2export/pkg/other.py"],
                             ["d2export/pkg/ring_a.py", "d2export/pkg/ring_b.py"]]
    assert found.forbidden == ["d2export/pkg/other.py:1 imports the dispatcher d2export.cli (the helpers are in "
                               "d2export.argparsing)", "d2export/pkg/other.py:2 imports testr (third_party/)",
                               "d2export/pkg/other.py:3 imports training (training/)"]

    # one row moved up a floor: the package's own relative imports stay on its floor; its import of low is fine
    moved = TABLE.replace("| 0 | `d2export/low.py`", "| 1 | `d2export/low.py`").replace(
        "| 1 | `d2export/pkg/`", "| 0 | `d2export/pkg/`")
    upward = check(repo, moved, {}).upward
    assert "d2export/pkg/high.py:2 (floor 0, row d2export/pkg/) imports d2export.low (floor 1, row " \
           "d2export/low.py)" in upward and not any(u.startswith("d2export/low.py") for u in upward)

    # a file with its own row sits on that floor, not its package's
    upward = check(repo, TABLE + "| 3 | `d2export/pkg/other.py` | x |\n", {}).upward
    assert "d2export/pkg/high.py:1 (floor 1, row d2export/pkg/) imports d2export.pkg.other (floor 3, row " \
           "d2export/pkg/other.py)" in upward
