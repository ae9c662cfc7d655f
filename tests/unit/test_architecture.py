"""The floors of docs/architecture.md, beyond what import-linter's contracts check (``make lint``):

- every module of the installed package is on a floor of the ``layers`` contract (a new folder or
  module cannot slip past the contract by not being listed);
- ``import actstore`` loads neither torch nor the ``actstore.query`` / ``actstore.ingest`` floors (the
  facade imports them when a function needs them);
- no module imports the repository's folders by their own names (``ingest``, ``query``): the
  installed package is ``actstore`` alone.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

# The facade (actstore/__init__.py) and the folder's own package marker sit above every floor.
FACADE = {"__init__"}


def test_every_module_is_on_a_floor() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in config["contracts"] if c["type"] == "layers")
    assert layers["containers"] == ["actstore"]
    listed = {m.strip() for layer in layers["layers"] for m in re.split(r"[:|]", layer)}
    children = {
        p.stem for p in (ROOT / "actstore").iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()
    }
    children |= {"ingest", "query"}  # installed as actstore.ingest and actstore.query (setup.py)
    assert children - FACADE == listed, "put each folder or module of actstore on a floor in pyproject.toml"


def test_import_actstore_loads_no_torch_and_no_analysis_floor() -> None:
    code = (
        "import sys, actstore; s = actstore.open; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')"
        " or m.startswith(('actstore.query', 'actstore.ingest', 'actstore.jobs'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "[]"


def test_the_installed_package_is_actstore_alone() -> None:
    code = "import actstore.ingest, actstore.query, importlib.util as u; print(u.find_spec('ingest'), u.find_spec('query'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.split() == ["None", "None"]
    imports = re.compile(r"^\s*(from|import)\s+(ingest|query)\b", re.M)
    offenders = [
        str(p.relative_to(ROOT))
        for folder in ("actstore", "ingest", "query", "tests", "benchmarks", "examples")
        for p in (ROOT / folder).rglob("*.py")
        if imports.search(p.read_text())
    ]
    assert not offenders, f"import actstore.ingest / actstore.query, not the folders: {offenders}"
