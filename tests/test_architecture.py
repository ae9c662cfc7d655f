"""The layers of docs/architecture.md, beyond what import-linter's contracts check (``make lint``):

- no import cycle anywhere in the module graph of ``actstore``, ``ingest`` and ``query`` (import-linter's
  ``acyclic_siblings`` sees cycles between siblings of one package only);
- every module of ``actstore`` is in a layer of the ``layers`` contract (a new core module cannot slip
  past the contract by not being listed);
- ``import actstore`` loads neither torch nor the ``query`` / ``ingest`` layers (the facade imports
  them when a function needs them).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("grimp", reason="grimp comes with import-linter (pip install -e '.[dev]')")
tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")


def import_graph_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["import_graph"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_cycle_finder_finds_known_cycles() -> None:
    ig = import_graph_tool()
    adj = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": {"e"}, "f": {"a"}}
    comps = ig.strongly_connected(adj)
    assert comps == [["a", "b", "c"], ["e", "e2"]]
    assert ig.shortest_cycle(adj, "a", {"a", "b", "c"}) == ["a", "b", "c", "a"]
    s = ig.summarise(adj)
    assert (s.modules, s.edges, len(s.cycles)) == (7, 7, 2)


def test_no_import_cycles_between_modules() -> None:
    ig = import_graph_tool()
    s = ig.summarise(ig.edges_of(ig.build()))
    assert s.modules > 50 and s.edges > s.modules
    assert not s.cycles, "import cycles (run python tools/import_graph.py):\n" + "\n".join(
        " -> ".join(c) for c in s.cycles)


def test_every_actstore_module_is_in_a_layer() -> None:
    ig = import_graph_tool()
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in config["contracts"] if c["type"] == "layers")["layers"]
    listed = {m.strip().strip("()") for layer in layers for m in layer.replace("|", ":").split(":")}
    modules = [m for m in sorted(ig.build().modules) if m.startswith("actstore.")]
    unlisted = [m for m in modules if not any(m == x or m.startswith(x + ".") for x in listed)]
    assert not unlisted, f"add these to a layer of [tool.importlinter] in pyproject.toml: {unlisted}"


def test_import_actstore_loads_no_torch_and_no_analysis_layer() -> None:
    code = ("import sys, actstore; s = actstore.open; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'query', 'ingest', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
