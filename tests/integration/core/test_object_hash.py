"""The hash a commit marker lists its segment's objects with (docs/format.md, Versioning): a store of
format 4 lists each object's XXH3-128 (``object_hash: "xxh3"``); a store of format 3 lists SHA-256 and
reads, verifies and resumes as it did, its resumed segments hashed with SHA-256 too.  Each digest is
compared with one computed here from the file's bytes; damage is named with the marker's hash."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import xxhash
from click.testing import CliRunner
from helpers import build_store, uncompact

import actstore
from actstore.cli import main
from actstore.core.manifest import FORMAT_VERSION, seal
from actstore.core.verify import verify_store

SETTINGS: dict[str, Any] = {"limit": 2, "batch_size": 2, "segment_size": 4}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_store(tmp_path_factory.mktemp("object-hash") / "s", **SETTINGS)


def files_of(store: Path, segment: str) -> dict[str, bytes]:
    root = store / "segments" / segment
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def markers(store: Path) -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((store / "commits").glob("*.json"))}


def rewrite(path: Path, edit: Any) -> None:
    d = json.loads(path.read_text())
    d.pop("checksum")
    edit(d)
    path.write_text(json.dumps(seal(d), sort_keys=True))


def as_format_3(src: Path, dst: Path) -> Path:
    """``src`` as a store of format 3 writes it: every marker's objects hashed with SHA-256 and no
    ``object_hash``; the manifest's version 3."""
    shutil.copytree(src, dst)
    for seg in markers(dst):

        def sha(d: dict[str, Any], seg: str = seg) -> None:
            d.pop("object_hash")
            d["objects"] = {k: hashlib.sha256(v).hexdigest() for k, v in files_of(dst, seg).items()}

        rewrite(dst / "commits" / f"{seg}.json", sha)
    rewrite(dst / "manifest.json", lambda d: d.update(format_version=3))
    return dst


def damage_a_chunk(store: Path) -> str:
    chunk = sorted((store / "segments" / "000001" / "resid").glob("c*"))[0]
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    return "segments/000001/resid: chunk 0"


def answers(store: Path) -> tuple[Any, ...]:
    s = actstore.open(store)
    return (
        s.sql("SELECT * FROM examples ORDER BY example_id").to_pylist(),
        s.select().features("resid", layers=[0, 1]).tobytes(),
    )


def test_a_new_store_lists_the_xxh3_of_every_object(base: Path) -> None:
    assert json.loads((base / "manifest.json").read_text())["format_version"] == FORMAT_VERSION == 4
    found = markers(base)
    assert len(found) == 3
    for seg, d in found.items():
        files = files_of(base, seg)
        assert d["object_hash"] == "xxh3"
        assert d["objects"] == {k: xxhash.xxh3_128_hexdigest(v) for k, v in files.items()}
    assert verify_store(actstore.open(base)).ok


def test_damage_is_named_with_the_markers_hash(base: Path, tmp_path: Path) -> None:
    for name, store, hash_name in (
        ("v4", shutil.copytree(base, tmp_path / "v4"), "XXH3-128"),
        ("v3", as_format_3(base, tmp_path / "v3"), "SHA-256"),
    ):
        where = damage_a_chunk(Path(store))
        result = CliRunner().invoke(main, ["verify", str(store)])
        assert result.exit_code != 0, (name, result.output)
        assert (
            f"{where}" in result.output and f"{hash_name} does not match the commit marker" in result.output
        ), (
            name,
            result.output,
        )


def test_a_format_3_store_reads_verifies_and_resumes_with_sha256(base: Path, tmp_path: Path) -> None:
    s = as_format_3(base, tmp_path / "v3")
    assert actstore.open(s).manifest.format_version == 3
    assert answers(s) == answers(base) and verify_store(actstore.open(s)).ok
    # an ingest killed before its last segment: that segment's files and marker gone
    uncompact(s)
    shutil.rmtree(s / "segments" / "000002")
    (s / "commits" / "000002.json").unlink()
    for t in (s / "tables").glob("*/000002.parquet"):
        t.unlink()
    build_store(s, resume=True, **SETTINGS)
    resumed = markers(s)["000002"]
    assert "object_hash" not in resumed  # the store's format (3) says SHA-256
    assert resumed["objects"] == {k: hashlib.sha256(v).hexdigest() for k, v in files_of(s, "000002").items()}
    # the resumed ingest's final compaction raised the version: format 4 reads markers of either hash
    assert actstore.open(s).manifest.format_version == 4
    assert answers(s) == answers(base) and verify_store(actstore.open(s)).ok


def test_a_marker_of_an_unknown_hash_is_refused_with_one_line(base: Path, tmp_path: Path) -> None:
    s = Path(shutil.copytree(base, tmp_path / "md5"))
    marker = s / "commits" / "000001.json"
    rewrite(marker, lambda d: d.update(object_hash="md5"))
    before = marker.read_bytes()
    result = CliRunner().invoke(main, ["verify", str(s)])
    lines = result.output.strip().splitlines()
    assert result.exit_code != 0 and any(
        "field 'object_hash' must be one of sha256, xxh3, got 'md5'" in line for line in lines
    ), result.output
    assert marker.read_bytes() == before
    # and a marker whose digests are of the other hash's length, read by a store of its shards
    rewrite(marker, lambda d: d.update(object_hash="sha256"))
    uncompact(s)
    result = CliRunner().invoke(main, ["sql", str(s), "SELECT count(*) FROM examples"])
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1, result.output
    assert "field 'objects' has a bad entry" in result.stderr, result.output
