"""The device machine's one call (benchmarks/gpu.sh, docs/gpu.md), proven here without a GPU.

``bash benchmarks/gpu.sh --cpu --skip-install`` runs every step of the real call (the same commands,
arguments and paths) on this CPU with tiny sizes and the running Python's packages; its JSON must
hold every section, with numbers, and no error.  The wheel set carried there (benchmarks/gpu_wheels.txt,
written by ``make gpu-wheels``) must cover every third-party import of the package that the device
image (benchmarks/gpu_image_packages.txt) lacks.
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import importlib.util
import json
import math
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
MODELS = ("smollm2-135m", "llama-3.2-1b", "llama-3.1-8b")
CORPUS_RUNS = ("corpus_all", "corpus_resid", "corpus_mlp", "corpus_z", "corpus_attn")


def gpu_wheels() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_wheels", REPO / "benchmarks" / "gpu_wheels.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_wheels", module)  # its dataclasses look their module up there
    spec.loader.exec_module(sys.modules["gpu_wheels"])
    return sys.modules["gpu_wheels"]


def number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def test_gpu_script_dry_run_writes_every_section(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    env.pop("OUT", None)
    done = subprocess.run(
        [
            "bash",
            str(REPO / "benchmarks" / "gpu.sh"),
            "--cpu",
            "--skip-install",
            "--out",
            str(tmp_path / "o"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = (tmp_path / "o" / "gpu-log.txt").read_text()
    assert done.returncode == 0, done.stderr[-3000:] + log[-3000:]
    r = json.loads((tmp_path / "o" / "gpu-result.json").read_text())
    assert r["errors"] == [], r["errors"]
    assert r["mode"] == "cpu"
    steps = ["env", "exactness-float32", "exactness-bfloat16", *(f"ingest-{m}" for m in MODELS), "loader"]
    assert sorted(r["steps"]) == sorted(["install", *steps])
    assert r["steps"]["install"] == {"rc": None, "skipped": "--skip-install"}
    for name in steps:
        st = r["steps"][name]
        assert st["rc"] == 0 and not st["timed_out"] and number(st["seconds"]), (name, st)
    assert r["env"]["torch"] and r["env"]["requirement_problems"] == []
    for dtype in ("float32", "bfloat16"):
        ex = r["exactness"][dtype]
        assert ex["passed"] >= 2 and ex["failures"] == ex["errors"] == 0, ex
    for m in MODELS:
        part = r["ingest"][m]
        assert part["errors"] == [] and part["skipped"] == [], part
        runs = part["runs"]
        assert sorted(runs) == sorted(["target", "corpus_plain_forward", *CORPUS_RUNS])
        for key in ("target", *CORPUS_RUNS):
            for field in (
                "ingest_tokens_per_s",
                "ingest_over_plain_forward",
                "ingest_over_backbone",
                "tokens",
            ):
                assert number(runs[key][field]) and runs[key][field] > 0, (m, key, field)
        assert number(runs["target"]["plain_forward_tokens_per_s"])
        assert runs["corpus_attn"]["kinds"] == ["attn"]
    steps_per_s = r["loader"]["result"]["steps"]
    for key in (
        "resident_steps_per_s",
        "loader_w1_steps_per_s",
        "loader_w4_steps_per_s",
        "loader_w1_over_resident",
    ):
        assert number(steps_per_s[key]) and steps_per_s[key] > 0, key


def imported_modules() -> set[str]:
    """Top-level names of every module the package imports: import statements (in functions too) and
    the lazily imported ones named in actstore.core.dependencies (``LazyModule("name")``)."""
    names: set[str] = set()
    for folder in ("actstore", "ingest", "query"):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
                elif (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id == "LazyModule"
                    and node.args
                    and isinstance(node.args[0], ast.Constant)
                ):
                    names.add(str(node.args[0].value).split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in ("actstore", "__future__")}


def test_wheel_list_covers_third_party_imports() -> None:
    gw = gpu_wheels()
    image = gw.read_image()
    carried = {
        gw.canon(line.split("==")[0]) for line in gw.WHEEL_LIST.read_text().splitlines() if "==" in line
    }
    assert carried and not carried & set(image), "a carried wheel the image already has"
    from packaging.requirements import Requirement

    project = gw.tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = {gw.canon(Requirement(r).name) for r in project["dependencies"]}
    extras = {gw.canon(Requirement(r).name) for e in project["optional-dependencies"].values() for r in e}
    optional = extras - core
    dists = metadata.packages_distributions()
    missing = []
    for module in sorted(imported_modules()):
        names = {gw.canon(d) for d in dists.get(module, [module])}
        if names & (set(image) | carried):
            continue
        if names & optional:  # an extra's package (dask, datasets, wordfreq): not installed by actstore
            continue
        missing.append(f"{module} ({', '.join(sorted(names))})")
    assert not missing, f"imported, not in the image and not carried: {missing}; run make gpu-wheels"
    for req in core:  # every install requirement is in the image or carried
        assert req in image or req in carried, req


def fake_wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    path = folder / f"{name}-{version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta)
    return path


def test_resolve_stops_at_the_image_and_joins_specifiers(tmp_path: Path) -> None:
    """The closure walk, with a fake index: requirements of carried packages are followed, those of
    the image's are not; a second requirement of one package narrows it and replaces its wheel; a
    marker for another platform or an extra not asked for is no requirement; an image version outside
    a requirement is reported."""
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    gw = gpu_wheels()
    index = {
        "zarr": [("3.1", ["numcodecs>=0.13", "numpy>=3", "donfig"])],
        "numcodecs": [("0.16", []), ("0.13", [])],
        "donfig": [
            (
                "0.8",
                ["pyyaml", "numcodecs<0.15", "pywin32; sys_platform == 'win32'", "pytest; extra == 'test'"],
            )
        ],
    }
    fetched: list[str] = []

    def download(spec: str, dest: Path) -> Path:
        fetched.append(spec)
        req = Requirement(spec)
        for version, requires in index[req.name]:
            if req.specifier.contains(Version(version)):
                dest.mkdir(exist_ok=True)
                return fake_wheel(dest, req.name, version, requires)
        raise AssertionError(spec)

    image = {"numpy": "2.5.2", "pyyaml": None}
    res = gw.resolve([Requirement("zarr>=3"), Requirement("numpy")], image, download, tmp_path / "w")
    assert {n: w.version for n, w in res.wheels.items()} == {
        "zarr": "3.1",
        "numcodecs": "0.13",
        "donfig": "0.8",
    }
    assert res.specs["numcodecs"] == SpecifierSet(">=0.13,<0.15")
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == sorted(
        w.path.name for w in res.wheels.values()
    )
    assert res.conflicts == ["zarr needs numpy>=3, the image has 2.5.2"]
    assert not any("pywin32" in f or "pytest" in f for f in fetched)


def test_tree_bytes_counts_tracked_and_untracked_files_not_ignored(tmp_path: Path) -> None:
    gw = gpu_wheels()
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("/.whl/\n")
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "big.whl").write_bytes(b"x" * 1000)
    (tmp_path / "a.txt").write_bytes(b"y" * 10)
    assert gw.tree_bytes(tmp_path) == 10 + len("/.whl/\n")
