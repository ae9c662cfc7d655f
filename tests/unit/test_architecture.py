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


# docs/architecture.md's counts and rules, held against the code so that the page cannot drift.
DOC = ROOT / "docs" / "architecture.md"
COUNTED = {  # the page's row label -> the key of tests/house_counts.py
    "modules": "modules",
    "rooms": "rooms",
    "lines": "lines",
    "internal import edges": "internal edges",
    "function-level imports": "function-level imports",
    "`is_local` branches outside the storage package": "backend branches",
}


def _doc_counts() -> dict[str, str]:
    """The "now" column of the page's table of counts (its last cell), by row label."""
    rows: dict[str, str] = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0] in {*COUNTED, "modules over 500 lines"}:
            rows[cells[0]] = cells[-1]
    return rows


def test_the_architecture_pages_counts_are_the_codes() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from house_counts import counts

    now = counts(ROOT)
    page = _doc_counts()
    assert set(page) == {*COUNTED, "modules over 500 lines"}, "the page lost a row of its table of counts"
    for label, key in COUNTED.items():
        assert page[label].replace(",", "") == str(now[key]), (
            f"docs/architecture.md says {label} = {page[label]}; the code has {now[key]}: update the page"
        )
    assert now["over 500 lines"] == [] and page["modules over 500 lines"] == "0", now["over 500 lines"]


def test_the_architecture_page_quotes_the_layer_contracts() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    text = DOC.read_text()
    for contract in config["contracts"]:
        if contract["type"] == "layers":
            quoted = "layers = [" + ", ".join(f'"{x}"' for x in contract["layers"]) + "]"
            assert quoted in text, f"docs/architecture.md must quote the contract {contract['id']}: {quoted}"
            assert f'containers = ["{contract["containers"][0]}"]' in text


def test_every_public_error_class_is_in_errors_py() -> None:
    defined = re.compile(r"^class ([A-Z]\w*)\((?:[^)]*(?:Error|Exception)[^)]*)\):", re.M)
    outside = [
        f"{p.relative_to(ROOT)}:{m.group(1)}"
        for folder in ("actstore", "ingest", "query")
        for p in (ROOT / folder).rglob("*.py")
        if p != ROOT / "actstore" / "core" / "errors.py"
        for m in defined.finditer(p.read_text())
    ]
    assert not outside, f"define public error classes in actstore/core/errors.py: {outside}"


def test_the_tests_folders_mirror_the_packages_rooms() -> None:
    """tests/<tier>/<room>/test_*.py, where room is a room of the package (a folder that holds modules,
    by its name) or benchmarks/; only the tests of the house itself and of the suite's tolerances stand
    at a tier's root."""
    rooms = {"benchmarks", "cli"}  # the command line's folder; benchmarks/ has tests of its scripts
    for folder in ("actstore", "ingest", "query"):
        for p in (ROOT / folder).rglob("*.py"):
            if p.name != "__init__.py" and p.parent.name not in ("actstore",):
                rooms.add(p.parent.name)
    misplaced = []
    for p in (ROOT / "tests").glob("*/**/test_*.py"):
        rel = p.relative_to(ROOT / "tests").parts
        if rel[0] not in ("unit", "integration", "cli"):
            misplaced.append(str(p.relative_to(ROOT)))
        elif len(rel) == 2 and rel[1] not in ("test_architecture.py", "test_tolerances.py"):
            misplaced.append(str(p.relative_to(ROOT)))
        elif len(rel) == 3 and rel[1] not in rooms:
            misplaced.append(str(p.relative_to(ROOT)))
    assert not misplaced, (
        f"put each test in tests/<unit|integration|cli>/<room>/ (rooms: {sorted(rooms)}): {misplaced}"
    )
