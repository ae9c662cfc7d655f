"""The wheels the device machine needs to run actstore (``make gpu-wheels``; docs/gpu.md).

The device machine's image (benchmarks/gpu_image_packages.txt) has torch, transformers, pyarrow and
most of what actstore needs, and no network.  This computes what it lacks: actstore's install
requirements (pyproject.toml ``dependencies``) and, recursively, their requirements, for CPython 3.12
on manylinux x86_64, stopping at every package the image has (its own needs are the image's).  Each
missing package is downloaded alone (``pip download --no-deps --only-binary=:all:``) into ``--dest``,
its METADATA read for the next requirements; a package required twice gets both specifiers.  Wheels
in ``--dest`` outside the set are removed.  The set is written to ``--list`` (committed, so that a
test can check it covers the package's imports without a network).

The total must fit beside the working tree in one device call (64 MiB, tracked and untracked files
not ignored by git, ``shared/`` included): otherwise one line and exit status 1.

    python benchmarks/gpu_wheels.py --dest .whl --list benchmarks/gpu_wheels.txt
"""

from __future__ import annotations

import argparse
import email.parser
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[1]
IMAGE_LIST = REPO / "benchmarks" / "gpu_image_packages.txt"
WHEEL_LIST = REPO / "benchmarks" / "gpu_wheels.txt"
CARRY_LIMIT = 64 * 1024 * 1024  # the device tool's limit on what travels: working tree + carried paths

# The device machine's Python (KINDS.md: 3.12.3, CPython, Linux x86_64): markers are evaluated for it.
TARGET_ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
}
PIP_TARGET = [
    "--only-binary=:all:",
    "--python-version",
    "3.12",
    "--implementation",
    "cp",
    "--abi",
    "cp312",
    *(
        a
        for p in (
            "manylinux_2_28_x86_64",
            "manylinux_2_27_x86_64",
            "manylinux_2_17_x86_64",
            "manylinux2014_x86_64",
            "manylinux1_x86_64",
        )
        for a in ("--platform", p)
    ),
]


def canon(name: str) -> str:
    """PEP 503 normal form of a distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_image(path: Path = IMAGE_LIST) -> dict[str, str | None]:
    """The image's packages: canonical name -> version where one was seen, else None."""
    out: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canon(name)] = version or None
    return out


def project_requirements(pyproject: Path = REPO / "pyproject.toml") -> list[Requirement]:
    """actstore's install requirements (``[project] dependencies``)."""
    data = tomllib.loads(pyproject.read_text())
    return [Requirement(r) for r in data["project"]["dependencies"]]


def applies(req: Requirement, extras: Iterable[str] = ()) -> bool:
    """Whether ``req`` is needed on the device machine (its marker, for the requested extras)."""
    if req.marker is None:
        return True
    return any(req.marker.evaluate(TARGET_ENV | {"extra": e}) for e in ("", *extras))


@dataclass
class Wheel:
    name: str  # canonical
    version: str
    path: Path
    requires: list[Requirement]


def read_wheel(path: Path) -> Wheel:
    """Name, version and Requires-Dist of a wheel file (its METADATA)."""
    with zipfile.ZipFile(path) as z:
        meta_name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(z.read(meta_name).decode())
    return Wheel(
        canon(meta["Name"]),
        meta["Version"],
        path,
        [Requirement(r) for r in meta.get_all("Requires-Dist") or []],
    )


def pip_download(spec: str, dest: Path) -> Path:
    """Download the one wheel of requirement ``spec`` for the device machine into ``dest``; its path."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PIP_TARGET, "-d", tmp, spec]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(
                f"gpu-wheels: pip download {spec!r} failed: {done.stderr.strip().splitlines()[-1:]}"
            )
        (got,) = Path(tmp).glob("*.whl")
        dest.mkdir(parents=True, exist_ok=True)
        target = dest / got.name
        if not target.exists():
            shutil.move(got, target)
        return target


@dataclass
class Resolution:
    wheels: dict[str, Wheel] = field(default_factory=dict)  # carried, by canonical name
    specs: dict[str, SpecifierSet] = field(default_factory=dict)
    from_image: dict[str, list[str]] = field(default_factory=dict)  # image package -> "requirer: spec"
    conflicts: list[str] = field(default_factory=list)  # an image version outside a requirement


def resolve(
    reqs: list[Requirement],
    image: dict[str, str | None],
    download: Callable[[str, Path], Path],
    dest: Path,
    top: str = "actstore",
) -> Resolution:
    """The closure of ``reqs`` minus the image's packages (see the module notes)."""
    res = Resolution()
    queue: list[tuple[str, Requirement]] = [(top, r) for r in reqs]
    while queue:
        requirer, req = queue.pop(0)
        name = canon(req.name)
        if name in image:
            res.from_image.setdefault(name, []).append(f"{requirer}: {req.specifier or 'any'}")
            seen = image[name]
            if (
                seen is not None
                and req.specifier
                and not req.specifier.contains(Version(seen), prereleases=True)
            ):
                res.conflicts.append(f"{requirer} needs {name}{req.specifier}, the image has {seen}")
            continue
        spec = res.specs.get(name, SpecifierSet()) & req.specifier
        res.specs[name] = spec
        have = res.wheels.get(name)
        if have is not None and spec.contains(Version(have.version), prereleases=True):
            continue
        wheel = read_wheel(download(f"{req.name}{spec}", dest))
        if have is not None and have.path != wheel.path:
            have.path.unlink(missing_ok=True)
        res.wheels[name] = wheel
        queue += [(name, r) for r in wheel.requires if applies(r, req.extras)]
    return res


def tree_bytes(repo: Path = REPO) -> int:
    """Bytes of what a device call sends besides carried paths: tracked files and untracked files git
    does not ignore (links as links), and ``shared/`` where the checkout has one."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        capture_output=True,
        check=True,
    ).stdout
    paths = {p for p in out.decode().split("\0") if p}
    shared = repo / "shared"
    if shared.is_dir():
        paths |= {str(p.relative_to(repo)) for p in shared.rglob("*") if not p.is_dir()}
    total = 0
    for p in paths:
        try:
            total += os.lstat(repo / p).st_size
        except FileNotFoundError:  # a tracked file deleted in the work tree does not travel
            pass
    return total


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dest", type=Path, default=REPO / ".whl")
    ap.add_argument("--list", type=Path, default=WHEEL_LIST, help="where the wheel set is written")
    ap.add_argument("--image", type=Path, default=IMAGE_LIST)
    args = ap.parse_args(argv)
    image = read_image(args.image)
    res = resolve(project_requirements(), image, pip_download, args.dest)
    keep = {w.path.name for w in res.wheels.values()}
    for stale in args.dest.glob("*.whl"):
        if stale.name not in keep:
            stale.unlink()
    wheels = sorted(res.wheels.values(), key=lambda w: w.name)
    total = sum(w.path.stat().st_size for w in wheels)
    tree = tree_bytes()
    room = CARRY_LIMIT - tree
    lines = [
        "# Wheels carried to the device machine (.whl/, make gpu-wheels): actstore's install requirements",
        "# and their requirements, minus benchmarks/gpu_image_packages.txt; CPython 3.12, manylinux x86_64.",
        f"# {len(wheels)} wheels, {mib(total)}; working tree {mib(tree)} when computed; limit 64 MiB in all.",
        *(f"{w.name}=={w.version}  {w.path.name}  {w.path.stat().st_size}" for w in wheels),
    ]
    args.list.write_text("\n".join(lines) + "\n")
    for c in res.conflicts:
        print(f"gpu-wheels: warning: {c}", file=sys.stderr)
    print(
        f"gpu-wheels: {len(wheels)} wheels in {args.dest}: {mib(total)}; working tree {mib(tree)}; room {mib(room)}"
    )
    for w in wheels:
        print(f"  {w.name}=={w.version}  {mib(w.path.stat().st_size)}")
    if total > room:
        print(
            f"gpu-wheels: the wheels ({mib(total)}) exceed the room beside the working tree ({mib(room)} of 64 MiB)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
