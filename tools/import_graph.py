"""The module import graph of actstore's three packages: modules, edges and cycles.

    python tools/import_graph.py                 # counts, then every cycle found
    python tools/import_graph.py --runtime-only  # leave out imports under ``if TYPE_CHECKING:``
    python tools/import_graph.py --root /tmp/old-checkout   # another checkout (e.g. a ``git archive``)

Every import statement counts, those inside functions included (a lazy import is still a
dependency).  A cycle is a strongly connected component of two or more modules; for each one
the shortest cycle through its first module is printed as ``a -> b -> ... -> a``.
``tests/test_architecture.py`` asserts that the graph has none.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grimp import ImportGraph

PACKAGES = ("actstore", "ingest", "query")


@dataclass(frozen=True)
class GraphSummary:
    modules: int
    edges: int  # distinct (importer, imported) module pairs inside the packages
    cycles: list[list[str]]  # one cycle (first module repeated at the end) per strongly connected component


def build(runtime_only: bool = False) -> ImportGraph:
    """grimp's graph of :data:`PACKAGES` (must be importable from ``sys.path``), no cache written."""
    import grimp

    return grimp.build_graph(*PACKAGES, exclude_type_checking_imports=runtime_only, cache_dir=None)


def edges_of(graph: ImportGraph) -> dict[str, set[str]]:
    """Each module's directly imported modules."""
    return {m: set(graph.find_modules_directly_imported_by(m)) for m in sorted(graph.modules)}


def strongly_connected(adj: dict[str, set[str]]) -> list[list[str]]:
    """Components of two or more modules that import each other, directly or through others
    (Tarjan's algorithm, iterative; components and their members sorted)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(adj):
        if root in index:
            continue
        work = [(root, iter(sorted(adj.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(adj.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


def shortest_cycle(adj: dict[str, set[str]], start: str, within: set[str]) -> list[str]:
    """The shortest path start -> ... -> start inside ``within`` (breadth first)."""
    prev: dict[str, str] = {}
    frontier = [start]
    seen = {start}
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for n in sorted(adj.get(node, ())):
                if n not in within:
                    continue
                if n == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [*reversed(path), start]
                if n not in seen:
                    seen.add(n)
                    prev[n] = node
                    nxt_frontier.append(n)
        frontier = nxt_frontier
    raise ValueError(f"{start} is on no cycle inside the component")


def summarise(adj: dict[str, set[str]]) -> GraphSummary:
    comps = strongly_connected(adj)
    cycles = [shortest_cycle(adj, comp[0], set(comp)) for comp in comps]
    return GraphSummary(modules=len(adj), edges=sum(len(v) for v in adj.values()), cycles=cycles)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runtime-only", action="store_true", help="leave out imports under `if TYPE_CHECKING:`")
    ap.add_argument("--root", help="folder holding the packages (default: the current checkout)")
    args = ap.parse_args(argv)
    if args.root:
        sys.path.insert(0, args.root)
    s = summarise(edges_of(build(args.runtime_only)))
    print(f"modules {s.modules}  edges {s.edges}  cycles (strongly connected components) {len(s.cycles)}")
    for c in s.cycles:
        print("  " + " -> ".join(c))
    return 1 if s.cycles else 0


if __name__ == "__main__":
    raise SystemExit(main())
