"""The arrays a corpus store keeps no layer of (an import's ``z`` and ``mlp``; its empty ``attn`` and
``v``) have no chunk files since 2026-12-07 (docs/format.md, Chunks): they read as zeros through every
reader, ``verify`` passes, and still catches a lost chunk of a kept array; a store that wrote their zero
chunks (the writer before) reads and verifies as before. The local writer's segment files, built in
memory and written directly, are the bytes zarr's own local store writes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import import_vllm_files

import actstore
from actstore.cli import main
from actstore.core.arrays import create_array
from actstore.core.errors import CorruptStoreError
from actstore.core.segments import unwritten_arrays
from actstore.core.storage import locate
from actstore.core.writer import StoreWriter

LAYER_IDS = [2, 0]


def _import(tmp_path: Path, name: str) -> tuple[actstore.Store, np.ndarray]:
    """Three vLLM-layout files (tiny-llama, residual indices 2 and 0) imported in segments of 8 rows."""
    store, given = import_vllm_files(tmp_path, name, tuple(LAYER_IDS))
    return store, given


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _verify(path: Path) -> tuple[int, str]:
    r = CliRunner().invoke(main, ["verify", str(path), "--values"])
    return r.exit_code, r.output


def test_import_writes_no_chunk_of_what_it_kept_none_of(tmp_path: Path) -> None:
    store, given = _import(tmp_path, "s")
    reader = store  # (a Store is the core StoreReader)
    assert unwritten_arrays(reader.manifest) == {"z", "mlp"}
    g = reader.geometry
    for seg in range(store.manifest.n_segments):
        folder = tmp_path / "s" / "segments" / f"{seg:06d}"
        marker = json.loads((tmp_path / "s" / "commits" / f"{seg:06d}.json").read_text())
        for name in ("z", "mlp", "attn", "v"):
            assert sorted(os.listdir(folder / name)) == ["zarr.json"], name  # the metadata only
            assert [k for k in marker["objects"] if k.startswith(name + "/")] == [f"{name}/zarr.json"]
        assert any(k.startswith("resid/c.") for k in marker["objects"])
        n = marker["n_rows"]
        for name, shape in (
            ("z", (n, g.n_layers, g.n_heads, g.d_head)),
            ("mlp", (n, g.n_layers, g.d_mlp)),
            ("attn", (0, g.n_layers, g.n_heads)),
            ("v", (0, g.n_layers, g.n_kv_heads, g.d_head)),
        ):
            whole = np.asarray(reader.array(seg, name)[...])  # through zarr: its fill value
            assert whole.shape == shape and whole.dtype == np.float16 and not whole.any(), name
        rows = reader.read_segment_rows(seg, "z", np.arange(1, n), [0, g.n_layers - 1])
        assert rows.shape == (n - 1, 2, g.n_heads, g.d_head) and not rows.any()
        rows = reader.read_segment_rows(seg, "mlp", np.arange(n), None)
        assert rows.shape == (n, g.n_layers, g.d_mlp) and not rows.any()
    got = store.select().features("resid", layers=[0, 2])
    want = torch.from_numpy(given).half().float().numpy()
    np.testing.assert_array_equal(got[:, 0], want[:, 1])
    np.testing.assert_array_equal(got[:, 1], want[:, 0])
    assert _verify(tmp_path / "s")[0] == 0


def test_verify_still_catches_a_lost_chunk_of_a_kept_array(tmp_path: Path) -> None:
    _import(tmp_path, "s")
    shard = tmp_path / "s" / "segments" / "000001" / "resid" / "c.0.0.0"
    assert shard.is_file()
    shard.unlink()
    code, out = _verify(tmp_path / "s")
    assert code != 0 and "segments/000001/resid: chunk 0" in out and "missing" in out, out
    with pytest.raises(CorruptStoreError, match="missing"):
        actstore.open(tmp_path / "s").select().features("resid", layers=[0])


def test_a_store_that_wrote_the_zero_chunks_reads_and_verifies_as_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(StoreWriter, "chunk_separator", "/")  # the writer before 2026-12-07 (both stores)
    new, _ = _import(tmp_path, "new")
    monkeypatch.setattr(StoreWriter, "skip_unkept", False)  # the writer before 2026-12-07
    old, _ = _import(tmp_path, "old")
    z = tmp_path / "old" / "segments" / "000000" / "z"
    assert (z / "c" / "0" / "0" / "0" / "0").is_file()
    marker = json.loads((tmp_path / "old" / "commits" / "000000.json").read_text())
    assert "z/c/0/0/0/0" in marker["objects"] and "mlp/c/0/0/0" in marker["objects"]
    for name in ("z", "mlp"):
        assert not np.asarray(old.array(0, name)[...]).any()
    np.testing.assert_array_equal(
        old.select().features("resid", layers=[0, 2]), new.select().features("resid", layers=[0, 2])
    )
    # every file they share is the same bytes (the manifests and markers differ only in the listing)
    a, b = _files(tmp_path / "old" / "segments"), _files(tmp_path / "new" / "segments")
    assert set(b) < set(a) and all(a[k] == b[k] for k in b)
    assert _verify(tmp_path / "old")[0] == 0
    (z / "c" / "0" / "0" / "0" / "0").unlink()  # a chunk its marker lists: still a lost chunk
    code, out = _verify(tmp_path / "old")
    assert code != 0 and "segments/000000/z: chunk 0" in out, out


@pytest.mark.parametrize(("separator", "algorithm"), [("/", "sha256"), (".", "sha256"), (".", "xxh3")])
def test_segment_files_are_the_bytes_zarr_writes(tmp_path: Path, separator: str, algorithm: str) -> None:
    """A segment group written by the local writer (built in memory, each file written and hashed
    directly) holds exactly the files zarr's local store writes for the same arrays, and the digests
    are the SHA-256 (format 3) or XXH3-128 (format 4) of those files; with either separator of the
    chunk keys."""
    import hashlib

    import xxhash

    hashed = {"sha256": lambda b: hashlib.sha256(b).hexdigest(), "xxh3": xxhash.xxh3_128_hexdigest}[algorithm]

    loc = locate(str(tmp_path / "st"))
    rng = np.random.default_rng(0)
    arrays = {
        "resid": rng.standard_normal((40, 5, 16)).astype(np.float16),
        "attn": np.zeros((0, 4, 2), np.float16),
        "z": np.zeros((40, 4, 2, 8), np.float16),
    }

    def fill(group: object, unwritten: bool) -> None:
        for name, data in arrays.items():
            create_array(
                group, name, data, 16, logical_dtype="float16", chunk1=1,  # type: ignore[arg-type]
                zero_blocks={1, 3} if name == "resid" else (), chunks_written=not (unwritten and name == "z"),
                separator=separator,
            )  # fmt: skip

    digests: dict[str, str] = {}
    with loc.zarr_group_writer("direct", digests=digests, algorithm=algorithm) as group:
        fill(group, unwritten=False)
    with loc.zarr_group_writer("zarr") as group:  # (no digests: zarr's local store, in place)
        fill(group, unwritten=False)
    direct, ref = _files(tmp_path / "st" / "direct"), _files(tmp_path / "st" / "zarr")
    assert direct == ref and len(ref) > 8
    assert digests == {k: hashed(v) for k, v in ref.items()}
    with loc.zarr_group_writer("direct", digests=(again := {})) as group:  # replaces the folder
        fill(group, unwritten=True)
    left = _files(tmp_path / "st" / "direct")
    assert set(left) == set(again) == {k for k in ref if not k.startswith(f"z/c{separator}")}
    assert any(
        k.startswith(f"resid/c{separator}1{separator}0{separator}0") for k in ref
    )  # the keys asked for
    assert all(left[k] == ref[k] for k in left)
