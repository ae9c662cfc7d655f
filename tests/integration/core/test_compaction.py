"""Compaction and snapshots (actstore.core.compact, actstore.core.snapshot): a compacted store answers
exactly as the same store read from its shards; a compaction killed after any write leaves a store that
answers as before and compacts again; readers keep reading across a compaction; verify sees damage in
the compacted files; hostile snapshots are refused with one line."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from helpers import build_store, uncompact
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import actstore
from actstore.cli import main
from actstore.core.compact import compact, compacted_fully
from actstore.core.errors import CorruptStoreError
from actstore.core.manifest import FORMAT_VERSION, seal
from actstore.core.snapshot import CURRENT
from actstore.core.storage import locate
from actstore.core.storage.base import StoreLocation
from actstore.core.verify import verify_store

TABLES = ("examples", "tokens", "targets")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store of 9 segments (36 demo prompts, 4 a segment), as the ingest leaves it: compacted."""
    return build_store(tmp_path_factory.mktemp("compaction") / "s", limit=6, batch_size=2, segment_size=4)


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def answers(path: Path) -> dict[str, Any]:
    """What a reader sees: every segment table in store order, a selection's rows and features."""
    s = actstore.open(path)
    out: dict[str, Any] = {t: s.sql(f"SELECT * FROM {t}").to_pylist() for t in TABLES}
    sel = s.select("relation_id = (SELECT min(relation_id) FROM examples)")
    out["ids"] = sel.example_ids.tolist()
    out["resid"] = sel.features("resid", layers=[0, 1]).tobytes()
    out["point"] = s.sql("SELECT example_id, text FROM examples WHERE example_id = 5").to_pylist()
    return out


def test_ingest_compacts_and_the_snapshot_answers_as_the_shards(base: Path, tmp_path: Path) -> None:
    snap = actstore.open(base).snapshot
    assert snap is not None and sorted(snap.segments) == list(range(9))
    assert all(len(files) == 1 for files in snap.tables.values())
    plain = uncompact(copy(base, tmp_path / "plain"))
    assert answers(base) == answers(plain)
    # against the shards read directly with pyarrow, in segment order
    for t in TABLES:
        shards = [pq.read_table(plain / "tables" / t / f"{seg:06d}.parquet").to_pylist() for seg in range(9)]
        assert answers(base)[t] == [row for shard in shards for row in shard]
    assert verify_store(actstore.open(base)).ok


def test_incremental_compaction_during_ingest(tmp_path: Path) -> None:
    s = build_store(tmp_path / "inc", limit=6, batch_size=2, segment_size=4, compact_every=2)
    snap = actstore.open(s).snapshot
    assert snap is not None and snap.number == 5  # after segments 2, 4, 6 and 8, then the full one at the end
    plain = uncompact(copy(s, tmp_path / "plain"))
    assert answers(s) == answers(plain)
    # an incremental compaction adds one file per table for the new segments, keeping the old ones
    part = copy(plain, tmp_path / "part")
    (part / "commits" / "000008.json").rename(tmp_path / "marker8")
    compact(str(part))
    (tmp_path / "marker8").rename(part / "commits" / "000008.json")
    report = compact(str(part), full=False)
    snap = actstore.open(part).snapshot
    assert report.files_written == 4 and snap is not None  # three tables and the relation index
    assert [(f.first, f.last) for f in snap.tables["examples"]] == [(0, 7), (8, 8)]
    assert [(f.first, f.last) for f in snap.relation_index] == [(0, 7), (8, 8)]
    # (the tables are compacted on threads: each file listed under its own table, counted once)
    new = [f for files in (*snap.tables.values(), snap.relation_index) for f in files if f.first == 8]
    assert (
        report.bytes_written == sum((part / f.path).stat().st_size for f in new) == sum(f.bytes for f in new)
    )
    assert all(f"/{t}/" in f.path for t, files in snap.tables.items() for f in files)
    assert answers(part) == answers(plain)
    assert verify_store(actstore.open(part)).ok


def count_writes(monkeypatch: pytest.MonkeyPatch, fail_at: int | None) -> list[str]:
    """Record every atomic write; raise at write number ``fail_at`` (a kill between two writes)."""
    seen: list[str] = []
    real = StoreLocation.write_bytes_atomic

    def write(self: StoreLocation, rel: str, data: bytes) -> None:
        if fail_at is not None and len(seen) == fail_at:
            raise KeyboardInterrupt(f"killed before writing {rel}")
        seen.append(rel)
        real(self, rel, data)

    real_stream = StoreLocation.write_stream_atomic

    def stream(self: StoreLocation, rel: str, produce: Any) -> Any:
        if fail_at is not None and len(seen) == fail_at:
            raise KeyboardInterrupt(f"killed before writing {rel}")
        seen.append(rel)
        return real_stream(self, rel, produce)

    monkeypatch.setattr(StoreLocation, "write_bytes_atomic", write)
    monkeypatch.setattr(StoreLocation, "write_stream_atomic", stream)
    return seen


@pytest.mark.parametrize("full", [True, False])
def test_compaction_killed_at_every_step(base: Path, tmp_path: Path, full: bool) -> None:
    plain = uncompact(copy(base, tmp_path / "plain"))
    want = answers(plain)
    with pytest.MonkeyPatch.context() as mp:
        steps = count_writes(mp, None)
        compact(str(copy(plain, tmp_path / "probe")), full=full)
    assert steps[-2:] == ["snapshot/000001.json", CURRENT] and len(steps) == 6
    assert "tables/examples/i000001-000.parquet" in steps  # the relation index, before the snapshot
    for k in range(len(steps)):
        s = copy(plain, tmp_path / f"killed{k}")
        first_snapshot(s, tmp_path, all_segments=full)  # the one a killed compaction falls back on
        with pytest.MonkeyPatch.context() as mp:
            count_writes(mp, k)
            with pytest.raises(KeyboardInterrupt):
                compact(str(s), full=full)
        assert actstore.open(s).snapshot.number == 1  # type: ignore[union-attr]
        assert answers(s) == want
        assert verify_store(actstore.open(s)).ok
        compact(str(s), full=full)
        assert actstore.open(s).snapshot.number == 2  # type: ignore[union-attr]
        assert answers(s) == want and verify_store(actstore.open(s)).ok
        leftovers = sorted(p.name for p in (s / "tables" / "examples").glob("[ci]*"))
        second = "000002-000.parquet" if full else "000002-001.parquet"  # (incremental: file 1 of snapshot 2)
        assert leftovers == ["c000001-000.parquet", "c" + second, "i000001-000.parquet", "i" + second]


def first_snapshot(s: Path, tmp_path: Path, *, all_segments: bool) -> None:
    """Snapshot 1 of every segment, or of all but the last (an incremental compaction then has one to add)."""
    if all_segments:
        compact(str(s))
        return
    marker = s / "commits" / "000008.json"
    marker.rename(tmp_path / "marker8")
    compact(str(s))
    (tmp_path / "marker8").rename(marker)


def test_a_reader_reads_across_a_compaction(base: Path, tmp_path: Path) -> None:
    s = uncompact(copy(base, tmp_path / "s"))
    want = answers(s)
    reader = actstore.open(s)
    first = reader.sql("SELECT count(*) AS n FROM tokens").to_pylist()
    compact(str(s))  # while the reader is open: it goes on with the shards it listed
    assert reader.sql("SELECT count(*) AS n FROM tokens").to_pylist() == first
    reader.refresh()
    assert reader.snapshot is not None and reader.snapshot.number == 1
    assert reader.sql("SELECT * FROM examples").to_pylist() == want["examples"]
    compact(str(s))  # the previous snapshot's files stay: a reader of snapshot 1 still reads
    assert reader.sql("SELECT * FROM tokens").to_pylist() == want["tokens"]
    compact(str(s))  # snapshot 1's files are gone now; refresh picks up snapshot 3
    reader.refresh()
    assert reader.sql("SELECT * FROM targets").to_pylist() == want["targets"]


def damaged(base: Path, tmp_path: Path, name: str, damage: Callable[[Path], None]) -> Path:
    s = copy(base, tmp_path / name)
    damage(s)
    return s


def flip_compacted(s: Path) -> None:
    f = next((s / "tables" / "tokens").glob("c*.parquet"))
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))


def test_verify_finds_damage_in_compacted_files(base: Path, tmp_path: Path) -> None:
    s = damaged(base, tmp_path, "flip", flip_compacted)
    report = verify_store(actstore.open(s))
    assert not report.ok and any("SHA-256 does not match the snapshot" in p for p in report.problems)
    with pytest.raises(CorruptStoreError, match="XXH3 does not match the snapshot"):
        actstore.open(s).sql("SELECT count(*) FROM tokens")
    s = damaged(
        base, tmp_path, "gone", lambda s: next((s / "tables" / "targets").glob("c*.parquet")).unlink()
    )
    report = verify_store(actstore.open(s))
    assert any("missing (snapshot 1 lists it)" in p for p in report.problems), report.problems
    s = damaged(base, tmp_path, "marker", lambda s: (s / "commits" / "000002.json").unlink())
    report = verify_store(actstore.open(s))
    assert any("their commit markers are missing" in p for p in report.problems), report.problems


def edit_snapshot(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def damage(s: Path) -> None:
        f = s / "snapshot" / "000001.json"
        d = json.loads(f.read_text())
        d.pop("checksum")
        edit(d)
        f.write_text(json.dumps(seal(d)))

    return damage


def _shard_named(d: dict[str, Any]) -> None:
    d["tables"]["examples"][0]["path"] = "tables/examples/000000.parquet"


def _foreign(d: dict[str, Any]) -> None:
    d["tables"]["examples"][0]["path"] = d["tables"]["tokens"][0]["path"]


def _duplicated(d: dict[str, Any]) -> None:
    d["tables"]["tokens"].append(dict(d["tables"]["tokens"][0]))


def _segment_twice(d: dict[str, Any]) -> None:
    d["segments"].append(d["segments"][0])


def _bad_xxh3(d: dict[str, Any]) -> None:
    d["tables"]["examples"][0]["xxh3"] = "not-hex"


def _outside(d: dict[str, Any]) -> None:
    d["tables"]["examples"][0]["path"] = "../../etc/c000001-000.parquet"


HOSTILE = {
    "missing-snapshot": (
        lambda s: (s / CURRENT).write_text("000007\n"),
        "missing (snapshot/CURRENT names it)",
    ),
    "current-garbage": (lambda s: (s / CURRENT).write_text("../x"), "not a snapshot number"),
    "checksum": (
        lambda s: (s / "snapshot" / "000001.json").write_text('{"version": 1}'),
        "fails its checksum",
    ),
    "names-a-shard": (edit_snapshot(_shard_named), "is not a compacted file of table 'examples'"),
    "foreign-table": (edit_snapshot(_foreign), "is not a compacted file of table 'examples'"),
    "outside": (edit_snapshot(_outside), "is not a compacted file of table 'examples'"),
    "file-twice": (edit_snapshot(_duplicated), "is listed twice"),
    "xxh3-not-hex": (edit_snapshot(_bad_xxh3), "is not an XXH3-128 hex digest"),
    "segment-twice": (edit_snapshot(_segment_twice), "segment 0 is listed twice"),
    "missing-file": (
        lambda s: next((s / "tables" / "examples").glob("c*.parquet")).unlink(),
        "c000001-000.parquet: missing",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_snapshot_is_refused_with_one_line(base: Path, tmp_path: Path, case: str) -> None:
    damage, message = HOSTILE[case]
    s = damaged(base, tmp_path, case, damage)
    before = {p: p.read_bytes() for p in s.rglob("*") if p.is_file()}
    result = CliRunner().invoke(main, ["sql", str(s), "SELECT count(*) FROM examples"])
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    assert {p: p.read_bytes() for p in s.rglob("*") if p.is_file()} == before


def test_a_format_2_store_reads_and_compact_upgrades_it(base: Path, tmp_path: Path) -> None:
    s = uncompact(copy(base, tmp_path / "v2"))
    m = json.loads((s / "manifest.json").read_text())
    m.pop("checksum")
    m["format_version"] = 2
    (s / "manifest.json").write_text(json.dumps(seal(m)))
    want = answers(s)
    assert actstore.open(s).manifest.format_version == 2
    result = CliRunner().invoke(main, ["compact", str(s)])
    assert result.exit_code == 0 and "upgraded to the current format" in result.stdout, result.output
    assert actstore.open(s).manifest.format_version == FORMAT_VERSION
    assert answers(s) == want and verify_store(actstore.open(s)).ok


def test_features_of_every_row_match_across_layouts(base: Path, tmp_path: Path) -> None:
    plain = uncompact(copy(base, tmp_path / "plain"))
    a = actstore.open(base).select().features("attn_head", layers=[1])
    b = actstore.open(plain).select().features("attn_head", layers=[1])
    np.testing.assert_array_equal(a, b)


def test_verify_quick_sees_missing_markers_and_broken_footers(base: Path, tmp_path: Path) -> None:
    ok = CliRunner().invoke(main, ["verify", "--quick", str(base)])
    assert ok.exit_code == 0 and ok.stdout.startswith("ok: 9 segments"), ok.output

    def truncate(s: Path) -> None:
        f = next((s / "tables" / "tokens").glob("c*.parquet"))
        f.write_bytes(f.read_bytes()[:-20])

    for name, damage, message in (
        ("truncated", truncate, "unreadable Parquet footer"),
        ("marker", lambda s: (s / "commits" / "000003.json").unlink(), "their commit markers are missing"),
        ("shard", lambda s: (s / "tables" / "targets" / "000001.parquet").unlink(), None),
    ):
        s = damaged(base, tmp_path, name, damage)
        r = CliRunner().invoke(main, ["verify", "--quick", str(s)])
        if message is None:  # a compacted store does not read its shards; the full verify finds them
            assert r.exit_code == 0, r.output
            full = CliRunner().invoke(main, ["verify", str(s)])
            assert full.exit_code == 3 and "000001.parquet: missing" in full.stderr, full.output
        else:
            assert r.exit_code == 3 and message in r.stderr, r.output


@pytest.mark.parametrize("n", [1, 3, 7, 100])
def test_a_limit_after_the_query_equals_the_first_rows(base: Path, n: int) -> None:
    s = actstore.open(base)
    where = "relation_id <> (SELECT min(relation_id) FROM examples)"
    pushed = s.select(where).limit(n)  # the LIMIT goes into the SQL
    whole = s.select(where)
    assert len(whole) > 0  # (whole's rows are read first below: its limit slices them in Python)
    sliced = whole.limit(n)
    assert pushed.rows.to_pylist() == whole.rows.slice(0, n).to_pylist() == sliced.rows.to_pylist()
    np.testing.assert_array_equal(pushed.features("resid", layers=[1]), sliced.features("resid", layers=[1]))


def test_verify_on_threads_reports_what_one_thread_does(base: Path, tmp_path: Path) -> None:
    def damage(s: Path) -> None:
        flip_compacted(s)
        for seg in (1, 4, 7):  # the last z chunk of three segments
            chunk = sorted(p for p in (s / "segments" / f"{seg:06d}" / "z").rglob("*") if p.is_file())[-1]
            chunk.write_bytes(chunk.read_bytes()[:-1] + b"\0")
        (s / "tables" / "examples" / "000005.parquet").unlink()

    s = actstore.open(damaged(base, tmp_path, "several", damage))
    one, many = verify_store(s, threads=1), verify_store(s, threads=4)
    assert len(one.problems) >= 4 and one.problems == many.problems
    assert (one.chunks_checked, one.segments_checked) == (many.chunks_checked, many.segments_checked)


def _shard_tables(path: Path) -> dict[str, Any]:
    """examples and targets read with pyarrow from the shards, as numpy columns (no DuckDB, no snapshot)."""
    out = {}
    for t in ("examples", "targets"):
        files = sorted((path / "tables" / t).glob("[0-9]*.parquet"))
        table = pa.concat_tables([pq.read_table(f) for f in files])
        out[t] = {c: table.column(c).to_numpy(zero_copy_only=False) for c in table.column_names}
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lo=st.integers(-2, 40),
    width=st.integers(0, 40),
    rels=st.sets(st.integers(0, 5), max_size=3),
    limit=st.none() | st.integers(1, 12),
)
def test_a_selection_resolves_to_the_rows_a_numpy_filter_finds(
    base: Path, lo: int, width: int, rels: set[int], limit: int | None
) -> None:
    s = actstore.open(base)
    shards = _shard_tables(base)
    ex, tg = shards["examples"], shards["targets"]
    names = sorted(set(ex["relation_id"].tolist()))
    chosen = [names[i % len(names)] for i in sorted(rels)]
    where = f"example_id BETWEEN {lo} AND {lo + width}"
    if chosen:
        where += " AND relation_id IN (" + ", ".join(f"'{r}'" for r in chosen) + ")"
    sel = s.select(where)
    sel = sel.limit(limit) if limit is not None else sel
    keep_ex = (ex["example_id"] >= lo) & (ex["example_id"] <= lo + width)
    if chosen:
        keep_ex &= np.isin(ex["relation_id"], chosen)
    wanted = set(ex["example_id"][keep_ex].tolist())
    order = np.argsort(tg["row"], kind="stable")
    rows = [(int(tg["example_id"][i]), int(tg["segment"][i]), int(tg["seg_row"][i])) for i in order]
    rows = [r for r in rows if r[0] in wanted][: limit if limit is not None else None]
    got = sel.rows
    assert (
        list(
            zip(
                got.column("example_id").to_pylist(),
                got.column("segment").to_pylist(),
                got.column("seg_row").to_pylist(),
            )
        )
        == rows
    )


def test_compacted_files_are_written_a_row_group_at_a_time(
    base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Row groups cut across the source files at ROW_GROUP_ROWS rows, the rows those of the shards in
    store order (a concatenation of the shards, read here with pyarrow alone)."""
    import actstore.core.compact as compact_module

    monkeypatch.setattr(compact_module, "ROW_GROUP_ROWS", 5)
    s = copy(base, tmp_path / "s")
    compact(str(s))
    snap = actstore.open(s).snapshot
    assert snap is not None
    for table in ("examples", "tokens", "targets"):
        shards = sorted((s / "tables" / table).glob("[0-9]*.parquet"))
        want = pa.concat_tables([pq.read_table(f) for f in shards])
        files = snap.tables[table]
        got = pa.concat_tables([pq.read_table(s / f.path) for f in files])
        assert got.equals(want.cast(got.schema)), table
        for f in files:
            sizes = [
                g.num_rows
                for g in (
                    pq.ParquetFile(s / f.path).metadata.row_group(i)
                    for i in range(pq.ParquetFile(s / f.path).metadata.num_row_groups)
                )
            ]
            assert sizes and all(n == 5 for n in sizes[:-1]) and 0 < sizes[-1] <= 5, (table, sizes)
            ids = pq.read_table(s / f.path).column("example_id").to_numpy()
            assert (f.min_id, f.max_id, f.rows) == (ids.min(), ids.max(), len(ids))


@pytest.mark.parametrize("n", [0, 1, 5, 10_000])
def test_a_limit_with_bound_parameters_and_one_matching_nothing(base: Path, n: int) -> None:
    """The limit's two steps (the first examples, then their rows) bind the same parameters; a
    condition matching nothing gives the empty rows of the plain plan."""
    s = actstore.open(base)
    rel = s.sql("SELECT max(relation_id) AS r FROM examples").column("r")[0].as_py()
    for params in ([rel], {"r": rel}):
        where = "relation_id = ?" if isinstance(params, list) else "relation_id = $r"
        whole = s.select(where, params=params)
        assert len(whole) > 0
        assert s.select(where, params=params).limit(n).rows.equals(whole.rows.slice(0, n))
    nothing = s.select("relation_id = 'no such relation'")
    assert nothing.limit(n).rows.equals(nothing.rows) and len(nothing) == 0


def test_snapshot_files_carry_their_xxh3_which_opening_checks(base: Path, tmp_path: Path) -> None:
    """Every compacted and index file's snapshot entry holds the XXH3-128 and the SHA-256 of its bytes
    (computed here by xxhash and hashlib on the files); a reader checks the XXH3, verify both."""
    import hashlib

    import xxhash

    snap = actstore.open(base).snapshot
    assert snap is not None
    files = snap.files()
    assert len(files) == len(TABLES) + 1  # one file per table, plus the relation index
    for rel, f in files.items():
        data = (base / rel).read_bytes()
        assert f.xxh3 == xxhash.xxh3_128(data).hexdigest() and f.sha256 == hashlib.sha256(data).hexdigest()

    # an entry whose XXH3 is wrong (its SHA-256 right): refused on open, reported by verify
    def wrong_xxh3(d: dict[str, Any]) -> None:
        entry = d["tables"]["targets"][0]
        entry["xxh3"] = ("0" if entry["xxh3"][0] != "0" else "1") + entry["xxh3"][1:]

    s = damaged(base, tmp_path, "wrong-xxh3", edit_snapshot(wrong_xxh3))
    with pytest.raises(CorruptStoreError, match="XXH3 does not match the snapshot"):
        actstore.open(s).sql("SELECT count(*) FROM targets")
    report = verify_store(actstore.open(s))
    assert any("its XXH3 does not match snapshot 1 (its SHA-256 does)" in p for p in report.problems), (
        report.problems
    )


def test_a_snapshot_without_xxh3_is_checked_by_sha256_and_compact_adds_it(base: Path, tmp_path: Path) -> None:
    """A snapshot written before the XXH3 (entries with the SHA-256 only) reads, its files checked by
    SHA-256 (a flipped byte is still refused); ``actstore compact`` writes entries with both."""

    def strip(d: dict[str, Any]) -> None:
        for entries in [*d["tables"].values(), d.get("relation_index", [])]:
            for e in entries:
                e.pop("xxh3")

    s = damaged(base, tmp_path, "old", edit_snapshot(strip))
    snap = actstore.open(s).snapshot
    assert snap is not None and all(not f.xxh3 for f in snap.files().values())
    assert answers(s) == answers(base)
    flipped = damaged(s, tmp_path, "old-flipped", flip_compacted)
    with pytest.raises(CorruptStoreError, match="SHA-256 does not match the snapshot"):
        actstore.open(flipped).sql("SELECT count(*) FROM tokens")
    assert CliRunner().invoke(main, ["compact", str(s)]).exit_code == 0
    snap = actstore.open(s).snapshot
    assert snap is not None and snap.number == 2 and all(f.xxh3 for f in snap.files().values())
    assert answers(s) == answers(base) and verify_store(actstore.open(s)).ok


def test_compacted_fully_only_when_a_full_compaction_would_write_the_same_files(
    base: Path, tmp_path: Path
) -> None:
    """What an ingest's resume asks before its final compaction: True only where the current snapshot
    holds every committed segment in a full compaction's files (then the same store results without
    it); a snapshot missing a segment, an incremental one of other files, or none at all: False."""
    s = uncompact(copy(base, tmp_path / "s"))
    loc = locate(str(s))
    assert not compacted_fully(loc)  # no snapshot
    first_snapshot(s, tmp_path, all_segments=False)  # every segment but the last
    assert not compacted_fully(loc)
    compact(str(s), full=False)  # the last one added in a file of its own: not a full compaction's files
    snap = actstore.open(s).snapshot
    assert snap is not None and len(snap.tables["examples"]) == 2
    assert not compacted_fully(loc)
    compact(str(s))
    snap = actstore.open(s).snapshot
    assert snap is not None and len(snap.tables["examples"]) == 1 and compacted_fully(loc)
    before = sorted(p.relative_to(s).as_posix() for p in s.rglob("*"))
    assert compacted_fully(loc)  # asking writes nothing
    assert sorted(p.relative_to(s).as_posix() for p in s.rglob("*")) == before
