"""The counts of docs/architecture.md's before/after table, for a checkout's three folders
(``tests/unit/test_architecture.py`` holds the page's "now" column against them).

    python tests/house_counts.py            # this checkout
    python tests/house_counts.py /tmp/old   # another one, e.g. `git worktree add /tmp/old f91e203`

modules and lines: the .py files of actstore/, ingest/ and query/; internal edges: distinct
(importer, imported) pairs of those modules, every import statement counted (``ingest.x`` and
``query.x`` of an old checkout read as ``actstore.ingest.x``); function-level imports: import
statements inside a function body; rooms: the folders that hold a module besides their package marker;
backend branches: ``is_local`` read outside the storage modules; and the modules over 500 lines.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

FOLDERS = ("actstore", "ingest", "query")


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[0] in ("ingest", "query"):
        parts = ["actstore", *parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def normalise(name: str) -> str:
    return "actstore." + name if name.split(".")[0] in ("ingest", "query") else name


def imported(node: ast.Import | ast.ImportFrom, package: str, modules: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [normalise(a.name) for a in node.names]
    if node.level:
        base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
        target = base + ("." + node.module if node.module else "")
    else:
        target = normalise(node.module or "")
    return [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names]


def counts(root: Path) -> dict[str, object]:
    files = [p for folder in FOLDERS for p in (root / folder).rglob("*.py")]
    names = {module_name(root, p): p for p in files}
    modules = set(names)
    edges: set[tuple[str, str]] = set()
    in_functions = 0
    lines = 0
    large = []
    for name, path in names.items():
        text = path.read_text()
        n = len(text.splitlines())
        lines += n
        if n > 500:
            large.append(f"{path.relative_to(root)} {n}")
        tree = ast.parse(text)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in imported(node, package, modules):
                    while target and target not in modules:
                        target = target.rpartition(".")[0]
                    if target and target != name:
                        edges.add((name, target))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                in_functions += sum(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(node))
    rooms = {p.parent for p in files if p.name != "__init__.py"}
    branches = sum(
        p.read_text().count("is_local")
        for p in files
        if p.parent.name != "storage" and p.name != "fs.py"  # the storage modules themselves
    )
    return {
        "modules": len(modules),
        "rooms": len(rooms),
        "lines": lines,
        "internal edges": len(edges),
        "function-level imports": in_functions,
        "backend branches": branches,
        "over 500 lines": large,
    }


if __name__ == "__main__":
    for key, value in counts(Path(sys.argv[1] if len(sys.argv) > 1 else ".")).items():
        print(f"{key}: {value}")
