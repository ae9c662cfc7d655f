"""``Store.sql(query, params)``: values are bound by DuckDB, never pasted into the statement.

A value holding quotes, semicolons, comments or keywords is compared as data; the read-only checks
of :mod:`actstore.core.sql` still apply to the statement that carries the placeholders.  Expected counts
come from the Parquet tables read with pyarrow and filtered in Python, not from SQL.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

import actstore
from actstore.core.errors import EmptySelectionWarning, QueryError, ReadOnlySQLError
from actstore.query.select.selection import Selection

HOSTILE = [
    "x' OR '1'='1",
    "country_capital'; DROP VIEW examples; SELECT '",
    'a"b" -- comment',
    "'); COPY examples TO '/tmp/actstore-params-leak.csv'; --",
    "$1 ? $name",
    "",
]


@pytest.fixture(scope="module")
def store(tiny_store: Path) -> actstore.Store:
    return actstore.open(tiny_store)


def relation_counts(store: actstore.Store) -> Counter[str]:
    return Counter(store.table("examples", ["relation_id"]).column(0).to_pylist())


@pytest.mark.parametrize("value", HOSTILE)
def test_a_value_with_quotes_and_semicolons_comes_back_unchanged(store: actstore.Store, value: str) -> None:
    assert store.sql("SELECT ? AS v, length(?) AS n", [value, value]).to_pylist() == [
        {"v": value, "n": len(value)}
    ]
    assert store.sql("SELECT $v AS v", {"v": value}).to_pylist() == [{"v": value}]


@pytest.mark.parametrize("value", HOSTILE)
def test_a_hostile_value_matches_nothing_and_leaves_the_views(store: actstore.Store, value: str) -> None:
    before = relation_counts(store)
    n = store.sql("SELECT count(*) AS n FROM examples WHERE relation_id = ?", [value]).column("n")[0].as_py()
    assert n == before.get(value, 0) == 0
    # the views the value tried to drop are still there, with every row
    total = store.sql("SELECT count(*) AS n FROM examples").column("n")[0].as_py()
    assert total == sum(before.values()) > 0
    assert not Path("/tmp/actstore-params-leak.csv").exists()


def test_each_relation_counted_through_a_parameter_equals_pyarrow(store: actstore.Store) -> None:
    expected = relation_counts(store)
    assert len(expected) >= 2
    for rel, n in expected.items():
        got = store.sql("SELECT count(*) AS n FROM examples WHERE relation_id = $rel", {"rel": rel})
        assert got.column("n")[0].as_py() == n, rel
    as_pandas = store.sql(
        "SELECT relation_id FROM examples WHERE relation_id = ?", [next(iter(expected))], format="pandas"
    )
    assert len(as_pandas) == expected[next(iter(expected))]


def test_a_list_parameter_binds_as_one_value(store: actstore.Store) -> None:
    ids = store.table("examples", ["example_id"]).column(0).to_pylist()
    pick = sorted(ids)[::2]
    got = (
        store.sql(
            "SELECT example_id FROM examples WHERE list_contains(?::BIGINT[], example_id) ORDER BY 1", [pick]
        )
        .column(0)
        .to_pylist()
    )
    assert got == pick


@pytest.mark.parametrize(
    ("query", "params", "error"),
    [
        ("COPY examples TO ?", ["/tmp/actstore-params-copy.csv"], ReadOnlySQLError),
        ("SELECT ? AS a; SELECT 2", [1], QueryError),
        ("SELECT * FROM read_text(?)", ["/etc/hostname"], ReadOnlySQLError),
        ("SELECT * FROM read_parquet(?)", ["/etc/hostname"], ReadOnlySQLError),
    ],
)
def test_the_sandbox_applies_to_a_statement_with_parameters(
    store: actstore.Store, query: str, params: list[str], error: type[Exception]
) -> None:
    with pytest.raises(error):
        store.sql(query, params)
    assert not Path("/tmp/actstore-params-copy.csv").exists()


def test_sql_text_given_as_a_value_to_query_runs_only_as_one_select(store: actstore.Store) -> None:
    """``query(?)`` is the one way a value becomes SQL, and only by the caller's choice: DuckDB still
    takes one SELECT there."""
    with pytest.raises(QueryError):
        store.sql("SELECT * FROM query(?)", ["COPY examples TO '/tmp/actstore-params-leak.csv'"])
    assert not Path("/tmp/actstore-params-leak.csv").exists()


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ("P17", "must be a list or a dict"),
        (b"P17", "must be a list or a dict"),
        (42, "must be a list or a dict"),
        ({1: "x"}, "names must be strings"),
        ([], "SQL error"),  # a placeholder without a value
        (["a", "b"], "SQL error"),  # more values than placeholders
    ],
)
def test_bad_parameters_are_one_query_error(store: actstore.Store, params: object, message: str) -> None:
    with pytest.raises(QueryError, match=message):
        store.sql("SELECT ? AS v", params)  # type: ignore[call-overload]


def test_selection_binds_parameters_of_where_and_query(store: actstore.Store) -> None:
    ex = store.table("examples", ["example_id", "relation_id"]).to_pylist()
    rel = ex[0]["relation_id"]
    want = sorted(r["example_id"] for r in ex if r["relation_id"] == rel)
    by_where = store.select("relation_id = $rel", params={"rel": rel})
    by_query = Selection.from_sql(
        store, query="SELECT example_id FROM examples WHERE relation_id = ?", params=[rel]
    )
    assert sorted(by_where.example_ids.tolist()) == sorted(by_query.example_ids.tolist()) == want
    assert len(store.select("relation_id = ?", params=[HOSTILE[1]])) == 0


def test_from_ids_keeps_store_order_and_drops_unknown_ids(store: actstore.Store) -> None:
    ids = sorted(store.table("examples", ["example_id"]).column(0).to_pylist())
    asked = [ids[3], ids[0], ids[3], 10**9]
    sel = Selection.from_ids(store, asked)
    with pytest.warns(EmptySelectionWarning, match="no rows for example ids 1000000000"):  # named when read
        assert sel.example_ids.tolist() == [ids[0], ids[3]]
    assert len(Selection.from_ids(store, [])) == 0
