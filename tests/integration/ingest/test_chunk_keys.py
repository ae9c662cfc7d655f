"""Segment arrays written since 2026-12-07 name their chunk files with zarr's default key encoding and
the separator "." (``resid/c.0.0.0`` beside ``resid/zarr.json``), where stores before used "/"
(``resid/c/0/0/0``: two folders a chunk file). Both read the same values through zarr and through the
local fast path, both verify, and a lost chunk of either is caught (docs/format.md, Chunks)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import import_vllm_files as _import

import actstore
from actstore.cli import main
from actstore.core.array_meta import parse_array_meta
from actstore.core.chunks import is_chunk_key, local_chunks
from actstore.core.errors import CorruptStoreError
from actstore.core.writer import StoreWriter


def _verify(path: Path) -> tuple[int, str]:
    r = CliRunner().invoke(main, ["verify", str(path), "--values"])
    return r.exit_code, r.output


def _as_slashes(key: str) -> str:
    """``resid/c.3.0.0`` -> ``resid/c/3/0/0`` (an array's folder, then its chunk key)."""
    folder, _, last = key.rpartition("/")
    return f"{folder}/{last.replace('.', '/')}" if last.startswith("c.") else key


def test_new_segments_use_dot_keys_and_read_as_the_old_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    new, given = _import(tmp_path, "new")
    monkeypatch.setattr(StoreWriter, "chunk_separator", "/")  # the writer before 2026-12-07
    old, _ = _import(tmp_path, "old")
    for seg in range(new.manifest.n_segments):
        folder = tmp_path / "new" / "segments" / f"{seg:06d}"
        # no folder below an array's folder: every chunk file lies beside its zarr.json
        assert [p for p in folder.rglob("*") if p.is_dir() and p.parent != folder] == []
        assert (folder / "resid" / "c.0.0.0").is_file()
        assert (tmp_path / "old" / "segments" / f"{seg:06d}" / "resid" / "c" / "0" / "0" / "0").is_file()
        meta = json.loads((folder / "resid" / "zarr.json").read_text())
        assert meta["chunk_key_encoding"] == {"name": "default", "configuration": {"separator": "."}}
        marker_new = json.loads((tmp_path / "new" / "commits" / f"{seg:06d}.json").read_text())["objects"]
        marker_old = json.loads((tmp_path / "old" / "commits" / f"{seg:06d}.json").read_text())["objects"]
        # the same chunk files under the other names, the same bytes (the digests), only zarr.json differs
        chunks_new = {_as_slashes(k): v for k, v in marker_new.items() if not k.endswith("zarr.json")}
        chunks_old = {k: v for k, v in marker_old.items() if not k.endswith("zarr.json")}
        assert chunks_new == chunks_old and any(k.startswith("resid/c/") for k in chunks_old)
        for store, sep in ((new, "."), (old, "/")):
            arr = store.array(seg, "resid")
            lc = local_chunks(arr)  # the fast path reads both layouts
            assert lc is not None and lc.separator == sep and lc.key(0) == sep.join("c000")
            np.testing.assert_array_equal(np.asarray(arr[...]), np.asarray(old.array(seg, "resid")[...]))
    a = new.select().features("resid", layers=[0, 2])
    np.testing.assert_array_equal(a, old.select().features("resid", layers=[0, 2]))
    np.testing.assert_array_equal(a[:, 1], given[:, 0].astype(np.float16).astype(np.float32))
    assert _verify(tmp_path / "new")[0] == 0 and _verify(tmp_path / "old")[0] == 0


def test_a_damaged_dot_key_chunk_is_caught_by_reads_and_verify(tmp_path: Path) -> None:
    _import(tmp_path, "s")
    shard = tmp_path / "s" / "segments" / "000002" / "resid" / "c.0.0.0"
    data = bytearray(shard.read_bytes())
    data[20] ^= 0xFF  # in the first inner chunk's compressed body (past Blosc's 16-byte header)
    shard.write_bytes(bytes(data))
    code, out = _verify(tmp_path / "s")
    assert code != 0 and "segments/000002/resid: chunk 0" in out and "XXH3-128 does not match" in out, out
    with pytest.raises(CorruptStoreError, match="CRC32C"):
        actstore.open(tmp_path / "s").select().features("resid", layers=[0, 2])
    shard.unlink()
    code, out = _verify(tmp_path / "s")
    assert code != 0 and "segments/000002/resid: chunk 0" in out and "missing" in out, out


def test_chunk_keys_of_either_separator() -> None:
    for key in ("c/0/1", "z/c/0/0/0/0", "c.0.1", "z/c.0.0.0.0", "resid/c.12.0.0"):
        assert is_chunk_key(key), key
    for key in ("zarr.json", "z/zarr.json", "c", "z/c.", "z/c.x.0", "z/cc.0.0", "a/b"):
        assert not is_chunk_key(key), key


def _meta(encoding: object) -> bytes:
    d: dict[str, object] = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": [4, 2],
        "data_type": "float16",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [2, 2]}},
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
    }
    if encoding is not None:
        d["chunk_key_encoding"] = encoding
    return json.dumps(d).encode()


def test_array_metadata_separator_is_parsed_and_others_refused() -> None:
    dot = {"name": "default", "configuration": {"separator": "."}}
    assert parse_array_meta(_meta(dot), "x").separator == "."
    assert parse_array_meta(_meta({"name": "default"}), "x").separator == "/"  # the spec's default
    assert parse_array_meta(_meta(None), "x").separator == "/"
    for bad in (
        {"name": "v2", "configuration": {"separator": "."}},
        {"name": "default", "configuration": {"separator": "-"}},
    ):
        with pytest.raises(CorruptStoreError, match="chunk key") as e:
            parse_array_meta(_meta(bad), "where")
        assert "\n" not in str(e.value)


def test_one_store_with_segments_of_both_layouts_reads_and_verifies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store begun by an older actstore and resumed by this one holds segments of both layouts: here
    segment 1 of a new store is replaced by the same segment written with "/" (its folder and marker)."""
    import shutil

    new, _ = _import(tmp_path, "new")
    want = new.select().features("resid", layers=[0, 2])
    monkeypatch.setattr(StoreWriter, "chunk_separator", "/")
    _import(tmp_path, "old")
    shutil.rmtree(tmp_path / "new" / "segments" / "000001")
    shutil.copytree(tmp_path / "old" / "segments" / "000001", tmp_path / "new" / "segments" / "000001")
    shutil.copy(tmp_path / "old" / "commits" / "000001.json", tmp_path / "new" / "commits" / "000001.json")
    mixed = actstore.open(tmp_path / "new")
    assert [local_chunks(mixed.array(s, "resid")).separator for s in range(3)] == [".", "/", "."]  # type: ignore[union-attr]
    np.testing.assert_array_equal(mixed.select().features("resid", layers=[0, 2]), want)
    assert _verify(tmp_path / "new")[0] == 0
    (tmp_path / "new" / "segments" / "000001" / "resid" / "c" / "0" / "0" / "0").unlink()
    code, out = _verify(tmp_path / "new")
    assert code != 0 and "segments/000001/resid: chunk 0" in out and "missing" in out, out
