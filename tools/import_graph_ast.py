"""A second, independent count of the import graph (standard library only: ``ast``), to cross-check
``tools/import_graph.py`` (grimp).  Counts every import statement of the modules of ``actstore``,
``ingest`` and ``query``, including ``from pkg import name`` as an edge to ``pkg`` (so a module that
imports a sibling through its package shows as a cycle through the package's ``__init__``), and
prints modules, edges, strongly connected components, package-level edges and modules over 500 lines.

    python tools/import_graph_ast.py [ROOT]      # ROOT: a checkout (default: this one)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from import_graph import strongly_connected  # noqa: E402 - the same SCC routine as the grimp count

PACKAGES = ("actstore", "ingest", "query")


def modules(root: Path) -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for p in (root / pkg).rglob("*.py"):
            parts = list(p.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = p
    return found


def edges(mods: dict[str, Path]) -> set[tuple[str, str]]:
    out = set()
    for m, p in mods.items():
        is_pkg = p.name == "__init__.py"
        for node in ast.walk(ast.parse(p.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = m.split(".") if is_pkg else m.split(".")[:-1]
                    parent = parent[: len(parent) - (node.level - 1)]
                    base = ".".join(parent + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for n in names:
                while n and n not in mods:
                    n = n.rpartition(".")[0]
                if n and n != m:
                    out.add((m, n))
    return out


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]
    mods = modules(root)
    es = edges(mods)
    sccs = strongly_connected({m: {b for a, b in es if a == m} for m in mods})
    print(f"modules {len(mods)} edges {len(es)} cyclic-groups {len(sccs)} modules-in-cycles {sum(map(len, sccs))}")
    for c in sccs:
        print("  cycle:", c)
    top = sorted({(a.split(".")[0], b.split(".")[0]) for a, b in es if a.split(".")[0] != b.split(".")[0]})
    print("package edges:", top)
    sizes = sorted(((sum(1 for _ in p.open()), m) for m, p in mods.items()), reverse=True)
    print("over 500 lines:", [(m, n) for n, m in sizes if n > 500])


if __name__ == "__main__":
    main()
