"""A flipped byte anywhere in a chunk, a table shard, a commit marker, the manifest or the weights is
reported by ``actstore verify`` (which array, which chunk) and by queries as CorruptStoreError,
never returned as wrong numbers."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from helpers import uncompact

import actstore
from actstore.cli import main
from actstore.core.errors import CorruptStoreError
from actstore.core.verify import verify_store


@pytest.fixture
def store(tiny_store: Path, tmp_path: Path) -> Path:
    """A copy read from its markers and shards (the damage cases of a compacted store are in
    tests/integration/core/test_compaction.py)."""
    out = tmp_path / "store"
    shutil.copytree(tiny_store, out)
    return uncompact(out)


def flip(path: Path, pos: int) -> None:
    data = bytearray(path.read_bytes())
    data[pos] ^= 0xFF
    path.write_bytes(bytes(data))


def replace_digit(path: Path, key: str) -> None:
    """Change the first digit of ``key``'s value: the JSON stays valid, only the number changes."""
    text = path.read_text()
    m = re.search(rf'"{key}": *(\d)', text)
    assert m, key
    i = m.start(1)
    path.write_text(text[:i] + str((int(text[i]) + 1) % 10) + text[i + 1 :])


def cli(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(main, list(args))
    return r.exit_code, r.stdout, r.stderr


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def test_every_byte_of_a_chunk_is_protected(store: Path) -> None:
    s = actstore.open(store)
    chunk = store / "segments" / "000001" / "z" / "c.1.0.0.0"
    assert chunk.exists()
    good = chunk.read_bytes()
    arr = s.array(1, "z")
    lo = int(arr.chunks[0])
    for pos in range(len(good)):
        flip(chunk, pos)
        with pytest.raises(CorruptStoreError, match=r"segments/000001/z: chunk read failed for rows 4:8"):
            s.read_segment_rows(1, "z", np.arange(lo, 2 * lo))
        chunk.write_bytes(good)
    assert np.array_equal(s.read_segment_rows(1, "z", np.arange(lo, 2 * lo)), arr[lo : 2 * lo])


def test_flipped_chunk_byte_is_reported_by_verify_and_queries(store: Path) -> None:
    flip(store / "segments" / "000001" / "attn" / "c.0.0.0", 40)
    report = verify_store(actstore.open(store))
    assert not report.ok and len(report.problems) == 1
    assert report.problems[0].startswith("segments/000001/attn: chunk 0 (rows 0:")
    code, out, err = cli("verify", str(store))
    assert code == 3 and "PROBLEM segments/000001/attn: chunk 0" in err and out.startswith("CORRUPT")
    s = actstore.open(store)
    with pytest.raises(CorruptStoreError, match="segments/000001/attn"):
        s.select().features("attn_prob")
    assert s.select("example_id < 8").features("attn_prob").shape[0] == 8  # segment 0 is intact
    code, _, err = cli(
        "features", str(store), "--kind", "attn_head_token", "--out", str(store.parent / "x.npy")
    )
    assert code == 1 and "segments/000001/attn" in one_error_line(err)


def test_flipped_parquet_shard_is_reported(store: Path) -> None:
    shard = store / "tables" / "tokens" / "000001.parquet"
    flip(shard, len(shard.read_bytes()) // 2)
    report = verify_store(actstore.open(store))
    assert report.problems == [
        "tables/tokens/000001.parquet: SHA-256 does not match the commit marker (table corrupted)"
    ]
    with pytest.raises(CorruptStoreError, match="tables/tokens/000001.parquet: SHA-256"):
        actstore.open(store).sql("SELECT count(*) FROM tokens")
    code, _, err = cli("sql", str(store), "SELECT count(*) FROM examples e JOIN tokens t USING (example_id)")
    assert code == 1 and "tables/tokens/000001.parquet" in one_error_line(err)
    # A statement checks the files of the tables it reads: the intact examples table still answers,
    # with every row (its shards match their hashes); verify (above) is what finds damage anywhere.
    n = actstore.open(store).sql("SELECT count(*) AS n FROM examples").column("n")[0].as_py()
    shards = sorted((store / "tables" / "examples").glob("[0-9]*.parquet"))
    assert n == sum(pq.read_metadata(f).num_rows for f in shards)
    # A statement whose tables cannot be told from its parse tree (a table function) checks them all.
    with pytest.raises(CorruptStoreError, match="tables/tokens/000001.parquet: SHA-256"):
        actstore.open(store).sql("SELECT count(*) FROM query_table('examples')")


@pytest.mark.parametrize("how", ["byte", "digit"])
def test_flipped_commit_marker_is_reported(store: Path, how: str) -> None:
    marker = store / "commits" / "000001.json"
    if how == "byte":
        flip(marker, len(marker.read_bytes()) // 3)
    else:
        replace_digit(marker, "n_rows")  # still valid JSON: only the checksum can tell
    with pytest.raises(CorruptStoreError, match="commits/000001.json"):
        actstore.open(store)
    code, _, err = cli("verify", str(store))
    assert code == 1 and "commits/000001.json" in one_error_line(err)


@pytest.mark.parametrize("how", ["byte", "digit"])
def test_flipped_manifest_is_reported(store: Path, how: str) -> None:
    manifest = store / "manifest.json"
    if how == "byte":
        flip(manifest, len(manifest.read_bytes()) // 2)
    else:
        replace_digit(manifest, "d_model")
    with pytest.raises(CorruptStoreError, match="manifest"):
        actstore.open(store)
    code, _, err = cli("info", str(store))
    assert code == 1 and "manifest" in one_error_line(err)


def test_flipped_weights_chunk_is_reported(store: Path) -> None:
    chunk = store / "weights" / "W_O" / "c" / "0" / "0" / "0" / "0"
    flip(chunk, 17)
    report = verify_store(actstore.open(store))
    assert [p.split(" is corrupt")[0] for p in report.problems] == [
        "weights/W_O: chunk 0 (rows 0:1, layer 0)"
    ]  # one layer per chunk
    s = actstore.open(store)
    with pytest.raises(CorruptStoreError, match="weights/W_O"):
        s.select().features("attn_head")
    assert s.select().features("z").shape[0] == s.n_rows  # stored factors do not need W_O


def test_sealed_files_carry_checksums(store: Path) -> None:
    assert json.loads((store / "manifest.json").read_text())["checksum"].startswith("sha256:")
    assert json.loads((store / "commits" / "000000.json").read_text())["checksum"].startswith("sha256:")
