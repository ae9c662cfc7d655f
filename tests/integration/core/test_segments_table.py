"""``StoreReader.segments_table``: the rows of some segments of a segment table, read from its files
without SQL, against the per-segment shards read directly with pyarrow, for a compacted store, a store
of shards only, and a snapshot that leaves the last segment to its shard."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers import build_store, uncompact

import actstore
from actstore.core.compact import compact
from actstore.core.errors import QueryError


def shards(store: Path, table: str, first: int, last: int) -> list[dict[str, object]]:
    return [
        row
        for seg in range(first, last + 1)
        for row in pq.read_table(store / "tables" / table / f"{seg:06d}.parquet").to_pylist()
    ]


def test_segments_table_equals_the_shards(tmp_path: Path) -> None:
    base = build_store(tmp_path / "s", limit=6, batch_size=2, segment_size=4)  # 9 segments, compacted
    plain = uncompact(Path(shutil.copytree(base, tmp_path / "plain")))
    mixed = Path(shutil.copytree(plain, tmp_path / "mixed"))
    (mixed / "commits" / "000008.json").rename(tmp_path / "marker8")
    compact(str(mixed))  # a snapshot of segments 0-7
    (tmp_path / "marker8").rename(mixed / "commits" / "000008.json")  # segment 8: its shard alone
    layouts = {"compacted": base, "shards": plain, "mixed": mixed}
    assert actstore.open(mixed).snapshot is not None and 8 not in actstore.open(mixed).snapshot.segments
    for name, path in layouts.items():
        store = actstore.open(path)
        for first, last in ((0, 8), (2, 5), (7, 8), (8, 8)):
            got = store.segments_table("targets", first, last).to_pylist()
            # a compacted file may hold other segments' rows too: the caller filters (here by segment)
            got = [r for r in got if first <= r["segment"] <= last]
            assert got == shards(plain, "targets", first, last), (name, first, last)
            rows = [r["row"] for r in store.segments_table("targets", first, last).to_pylist()]
            assert rows == sorted(rows)  # in store order
    with pytest.raises(QueryError, match="not a segment table"):
        actstore.open(base).segments_table("heads", 0, 1)
