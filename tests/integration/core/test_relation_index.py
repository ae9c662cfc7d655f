"""The relation index (actstore.core.relation_index): written by compaction beside each examples file,
listed in the snapshot, checked by verify; selections restricted to relations (with and without a
limit) resolve to the rows a numpy filter over the shards finds, with the index, without it (an old
snapshot), and while segments beyond the snapshot exist."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xxhash
from click.testing import CliRunner
from helpers import build_store
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import actstore
import actstore.core.relation_index as relation_index
import actstore.query.select.plan as selection_plan
from actstore.cli import main
from actstore.core.compact import compact
from actstore.core.manifest import seal
from actstore.core.relation_index import candidates, id_bounds, relation_counts, relation_values
from actstore.core.verify import verify_store


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """9 segments of 4 demo prompts, compacted again with index row groups of 3 rows (several a
    relation, so that row groups are skipped and cut relations)."""
    s = build_store(tmp_path_factory.mktemp("relindex") / "s", limit=6, batch_size=2, segment_size=4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(relation_index, "INDEX_GROUP_ROWS", 3)
        compact(str(s))
    return s


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def shard_tables(path: Path) -> dict[str, dict[str, np.ndarray]]:
    """examples and targets read with pyarrow from the per-segment shards (no DuckDB, no snapshot)."""
    out = {}
    for t in ("examples", "targets"):
        table = pa.concat_tables(
            [pq.read_table(f) for f in sorted((path / "tables" / t).glob("[0-9]*.parquet"))]
        )
        out[t] = {c: table.column(c).to_numpy(zero_copy_only=False) for c in table.column_names}
    return out


def expected_rows(path: Path, keep_example: np.ndarray, limit: int | None) -> list[tuple[int, int, int]]:
    tg = shard_tables(path)["targets"]
    ex = shard_tables(path)["examples"]
    wanted = set(ex["example_id"][keep_example].tolist())
    order = np.argsort(tg["row"], kind="stable")
    rows = [(int(tg["example_id"][i]), int(tg["segment"][i]), int(tg["seg_row"][i])) for i in order]
    return [r for r in rows if r[0] in wanted][:limit]


def got_rows(sel: Any) -> list[tuple[int, int, int]]:
    r = sel.rows
    return list(
        zip(
            r.column("example_id").to_pylist(),
            r.column("segment").to_pylist(),
            r.column("seg_row").to_pylist(),
        )
    )


def test_compaction_writes_an_index_equal_to_a_sort_of_the_examples(base: Path) -> None:
    s = actstore.open(base)
    snap = s.snapshot
    assert snap is not None and len(snap.relation_index) == len(snap.tables["examples"]) == 1
    ex = shard_tables(base)["examples"]
    f = snap.relation_index[0]
    got = pq.read_table(base / f.path)
    pairs = sorted(zip(ex["relation_id"].tolist(), ex["example_id"].tolist(), ex["relation_name"].tolist()))
    cols = [got.column(c).to_pylist() for c in ("relation_id", "example_id", "relation_name")]
    assert list(zip(*cols)) == pairs
    assert pq.ParquetFile(base / f.path).metadata.num_row_groups == -(-len(pairs) // 3)
    for rel in sorted(set(ex["relation_id"].tolist())) + ["no such relation"]:
        want = np.sort(ex["example_id"][ex["relation_id"] == rel])
        np.testing.assert_array_equal(candidates(s, [rel]), want)
    assert verify_store(s).ok


@pytest.mark.parametrize(
    ("where", "params", "want"),
    [
        ("relation_id = 'a'", None, {"a"}),
        ("'a' = relation_id", None, {"a"}),
        ("examples.RELATION_ID = 'a' AND subject_start > 1", None, {"a"}),
        ("relation_id IN ('a', 'b') AND (x > 1 AND relation_id = 'b')", None, {"b"}),
        ("relation_id = ?", ["a"], {"a"}),
        ("relation_id = $r", {"r": "a"}, {"a"}),
        ("relation_id IN (?, $2)", ["a", "b"], {"a", "b"}),
        ("relation_id = 'a' OR relation_id = 'b'", None, {"a", "b"}),
        ("relation_id = 'a' OR x > 1", None, None),
        ("(relation_id = 'a' AND x > 1) OR relation_id IN ('b', ?)", ["c"], {"a", "b", "c"}),
        ("relation_id IN ('a', 'b') AND (relation_id = 'a' OR relation_id = 'c')", None, {"a"}),
        ("x > 1 AND (relation_id = 'a' OR (relation_id = 'b' AND x < 5))", None, {"a", "b"}),
        ("NOT (relation_id = 'a' OR relation_id = 'b')", None, None),
        ("relation_id = 'a' OR relation_id <> 'b'", None, None),
        ("NOT relation_id = 'a'", None, None),
        ("relation_id <> 'a'", None, None),
        ("relation_id = 7", None, None),
        ("relation_id = ?", [7], None),
        ("relation_id IN ('a', subject)", None, None),
        ("relation_id = (SELECT min(relation_id) FROM examples)", None, None),
        ("other.relation_id = 'a'", None, None),
        ("example_id < 5", None, None),
    ],
)
def test_relation_values_reads_conjuncts_and_or_of_restrictions(
    where: str, params: Any, want: set[str] | None
) -> None:
    got = relation_values(f"(\n{where}\n)", params)
    assert (None if got is None else set(got)) == want


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rels=st.lists(st.integers(0, 7), min_size=1, max_size=3),
    form=st.sampled_from(["eq", "in", "param", "named", "or"]),
    extra=st.sampled_from(
        ["", " AND subject_start >= 1", " AND example_id % 3 <> 1", " AND example_id > 20"]
    ),
    limit=st.none() | st.integers(1, 12),
    window=st.sampled_from([2, 5, 1 << 15]),
)
def test_a_relation_selection_resolves_to_the_rows_a_numpy_filter_finds(
    base: Path, rels: list[int], form: str, extra: str, limit: int | None, window: int
) -> None:
    """Against a numpy filter over the shards: every form of relation condition, with other conjuncts,
    with and without a limit, and limit windows of a few example ids (several windows a query)."""
    s = actstore.open(base)
    ex = shard_tables(base)["examples"]
    names = sorted(set(ex["relation_id"].tolist())) + ["none such", "zz"]
    chosen = sorted({names[i % len(names)] for i in rels})
    params: Any = None
    if form == "eq" or len(chosen) == 1:
        chosen = chosen[:1]
        where, params = (
            ("relation_id = ?", [chosen[0]]) if form == "param" else (f"relation_id = '{chosen[0]}'", None)
        )
        if form == "named":
            where, params = "relation_id = $r", {"r": chosen[0]}
    elif form == "in":
        where = "relation_id IN (" + ", ".join(f"'{r}'" for r in chosen) + ")"
    elif form == "or":  # (an OR of one relation each, one branch bound as a parameter)
        where = "(" + " OR ".join(["relation_id = ?", *(f"relation_id = '{r}'" for r in chosen[1:])]) + ")"
        params = chosen[:1]
    else:
        where = "relation_id IN (" + ", ".join("?" for _ in chosen) + ")"
        params = chosen
    keep = np.isin(ex["relation_id"], chosen)
    if "subject_start" in extra:
        keep &= ex["subject_start"] >= 1
    if "% 3" in extra:
        keep &= ex["example_id"] % 3 != 1
    if "> 20" in extra:
        keep &= ex["example_id"] > 20
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(selection_plan, "ROW_GROUP_ROWS", window)
        sel = s.select(where + extra, params=params)
        got = got_rows(sel.limit(limit) if limit is not None else sel)
    assert got == expected_rows(base, keep, limit)


def test_without_an_index_and_beyond_the_snapshot_the_answers_are_the_same(
    base: Path, tmp_path: Path
) -> None:
    """An old snapshot (no relation index) reads by scanning and gives the same rows; ``compact`` adds
    the index.  Segments committed after the snapshot are not in the index: the query scans."""
    rels = ("country_capital", "element_symbol")
    want = {r: got_rows(actstore.open(base).select(f"relation_id = '{r}'").limit(5)) for r in rels}
    assert all(len(v) == 5 for v in want.values())
    old = copy(base, tmp_path / "old")
    f = old / "snapshot" / "000002.json"
    d = json.loads(f.read_text())
    d.pop("checksum")
    d.pop("relation_index")
    f.write_text(json.dumps(seal(d)))
    s = actstore.open(old)
    assert (
        s.snapshot is not None and not s.snapshot.relation_index and candidates(s, ["city_country"]) is None
    )
    assert {r: got_rows(s.select(f"relation_id = '{r}'").limit(5)) for r in want} == want
    assert verify_store(s).ok
    compact(str(old))
    assert actstore.open(old).snapshot.relation_index  # type: ignore[union-attr]
    # a snapshot of segments 0-7 while segment 8 is committed: no index answer, the same rows
    part = copy(base, tmp_path / "part")
    marker = part / "commits" / "000008.json"
    marker.rename(tmp_path / "m8")
    shutil.rmtree(part / "snapshot")
    for p in (part / "tables").glob("*/[ci]*.parquet"):
        p.unlink()
    compact(str(part))
    (tmp_path / "m8").rename(marker)
    s = actstore.open(part)
    assert len(s.snapshot.segments) == 8 and candidates(s, ["city_country"]) is None  # type: ignore[union-attr]
    ex = shard_tables(base)["examples"]
    for r in ("country_capital", "element_symbol"):
        assert got_rows(s.select(f"relation_id = '{r}'")) == expected_rows(base, ex["relation_id"] == r, None)


def test_verify_finds_an_index_that_differs_from_its_examples(base: Path, tmp_path: Path) -> None:
    """An index file rewritten without one example, its hash and the snapshot resealed to match: the
    hash checks pass, verify's comparison with the examples file does not."""
    import hashlib

    s = copy(base, tmp_path / "s")
    f = s / "snapshot" / "000002.json"
    d = json.loads(f.read_text())
    entry = d["relation_index"][0]
    table = pq.read_table(s / entry["path"])
    pq.write_table(table.slice(1), s / entry["path"])
    data = (s / entry["path"]).read_bytes()
    entry.update(
        sha256=hashlib.sha256(data).hexdigest(),
        xxh3=xxhash.xxh3_128(data).hexdigest(),
        bytes=len(data),
        rows=table.num_rows - 1,
    )
    d.pop("checksum")
    f.write_text(json.dumps(seal(d)))
    report = verify_store(actstore.open(s))
    assert any("the relation index differs from the examples" in p for p in report.problems), report.problems


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda d: d["relation_index"][0].update(path=d["tables"]["examples"][0]["path"]),
            "is not a relation index file",
        ),
        (
            lambda d: d["relation_index"][0].update(path="tables/tokens/i000002-000.parquet"),
            "is not a relation index file",
        ),
        (lambda d: d["relation_index"].append(dict(d["relation_index"][0])), "is listed twice"),
        (lambda d: d["relation_index"][0].update(last=3), "does not cover the examples files one for one"),
        (lambda d: d.update(relation_index={}), "field 'relation_index' must be a list"),
    ],
)
def test_a_hostile_index_entry_is_refused_with_one_line(
    base: Path, tmp_path: Path, edit: Any, message: str
) -> None:
    s = copy(base, tmp_path / "s")
    f = s / "snapshot" / "000002.json"
    d = json.loads(f.read_text())
    d.pop("checksum")
    edit(d)
    f.write_text(json.dumps(seal(d)))
    result = CliRunner().invoke(main, ["sql", str(s), "SELECT count(*) FROM examples"])
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_info_counts_relations_from_the_index_as_a_plain_count_does(base: Path) -> None:
    s = actstore.open(base)
    ex = shard_tables(base)["examples"]
    want = [
        {
            "relation_id": r,
            "relation_name": min(ex["relation_name"][ex["relation_id"] == r].tolist()),
            "n": int((ex["relation_id"] == r).sum()),
        }
        for r in sorted(set(ex["relation_id"].tolist()))
    ]
    assert relation_counts(s) == want
    result = CliRunner().invoke(main, ["info", str(base), "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["relations"] == want


@pytest.mark.parametrize(
    ("where", "params", "want"),
    [
        ("example_id >= 5", None, (5, None)),
        ("5 < example_id AND example_id <= 9", None, (6, 9)),
        ("examples.EXAMPLE_ID BETWEEN 3 AND 7 AND example_id > 4", None, (5, 7)),
        ("example_id = ? AND relation_id = 'a'", [4], (4, 4)),
        ("example_id < $n", {"n": 10}, (None, 9)),
        ("example_id > 2.5", None, (None, None)),
        ("example_id > 2 OR example_id < 1", None, (None, None)),
        ("NOT example_id > 2", None, (None, None)),
        ("example_id + 1 > 2", None, (None, None)),
        ("example_id >= ?", [True], (None, None)),
        ("example_id >= -3", None, (-3, None)),
    ],
)
def test_id_bounds_reads_only_top_level_conjuncts(where: str, params: Any, want: tuple[Any, Any]) -> None:
    assert id_bounds(f"(\n{where}\n)", params) == want


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lo=st.integers(-5, 45),
    width=st.integers(-3, 40),
    op=st.sampled_from([">=", ">", "="]),
    rel=st.integers(0, 7),
    limit=st.integers(1, 12),
    window=st.sampled_from([2, 5, 1 << 15]),
)
def test_a_limit_with_an_example_id_bound_finds_the_rows_a_numpy_filter_finds(
    base: Path, lo: int, width: int, op: str, rel: int, limit: int, window: int
) -> None:
    s = actstore.open(base)
    ex = shard_tables(base)["examples"]
    names = sorted(set(ex["relation_id"].tolist())) + ["none such"]
    name = names[rel % len(names)]
    ids = ex["example_id"]
    first = {">=": ids >= lo, ">": ids > lo, "=": ids == lo}[op]
    keep = first & (ids <= lo + width) & (ex["relation_id"] == name)
    where = f"example_id {op} {lo} AND relation_id = ? AND example_id <= {lo + width}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(selection_plan, "ROW_GROUP_ROWS", window)
        got = got_rows(s.select(where, params=[name]).limit(limit))
    assert got == expected_rows(base, keep, limit)
