"""``StoreLocation.walk_files`` on a local folder against ``os.walk``: every file below, as relative
paths, sorted; links (to a file or a folder) and named pipes listed as entries, never followed; a
missing folder or a file in its place lists nothing."""

from __future__ import annotations

import os
from pathlib import Path

from actstore.core.storage import locate


def reference(base: Path) -> list[str]:
    out = []
    for root, dirs, files in os.walk(base):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            out.append(os.path.relpath(os.path.join(root, name), base).replace(os.sep, "/"))
    return sorted(out)


def test_walk_files_lists_what_os_walk_finds(tmp_path: Path) -> None:
    root = tmp_path / "store"
    seg = root / "segments" / "000001"
    for rel in ("zarr.json", "z/zarr.json", "z/c/0/0/0/0", "z/c/1/0/0/0", "resid/c/0/0/0", "a b/x.y"):
        (seg / rel).parent.mkdir(parents=True, exist_ok=True)
        (seg / rel).write_bytes(b"x")
    (seg / "empty" / "deeper").mkdir(parents=True)
    (seg / "link-to-file").symlink_to(seg / "zarr.json")
    (seg / "link-to-dir").symlink_to(seg / "z")
    os.mkfifo(seg / "pipe")
    loc = locate(root)
    got = loc.walk_files("segments/000001")
    assert got == reference(seg)
    assert "link-to-dir" in got and "pipe" in got and not any(p.startswith("link-to-dir/") for p in got)
    assert loc.walk_files("segments/000002") == []
    assert loc.walk_files("segments/000001/zarr.json") == []
