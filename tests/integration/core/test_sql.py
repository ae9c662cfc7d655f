"""SQL selection: read-only, confined to the store, and equal to an independent pandas filter."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import actstore
from actstore.core.errors import QueryError, ReadOnlySQLError


@pytest.fixture(scope="module")
def store(tiny_store: Path) -> actstore.Store:
    return actstore.open(tiny_store)


@pytest.fixture(scope="module")
def examples(store: actstore.Store) -> pd.DataFrame:
    # Read the Parquet shards directly with pandas: an independent path from DuckDB.
    files = store.table_files()["examples"]
    return pd.concat([pd.read_parquet(store.location.path(f)) for f in files], ignore_index=True)


def test_tables_have_expected_rows(store: actstore.Store, examples: pd.DataFrame) -> None:
    assert len(examples) == store.manifest.n_examples == store.n_rows
    targets = store.sql("SELECT * FROM targets ORDER BY row").to_pandas()
    assert targets["row"].tolist() == list(range(len(examples)))
    tokens = store.sql("SELECT example_id, count(*) AS n FROM tokens GROUP BY 1 ORDER BY 1").to_pandas()
    assert tokens["n"].tolist() == examples.sort_values("example_id")["n_tokens"].tolist()
    heads = store.sql("SELECT count(*) AS n FROM heads").to_pylist()[0]["n"]
    assert heads == store.geometry.n_layers * store.geometry.n_heads


relations = st.sampled_from(
    ["country_capital", "country_language", "city_country", "element_symbol", "person_occupation", "nope"]
)


@settings(max_examples=40, deadline=None)
@given(
    rels=st.lists(relations, min_size=0, max_size=3, unique=True),
    min_tokens=st.integers(0, 20),
    subject_len=st.integers(0, 12),
)
def test_selection_matches_pandas_filter(
    store: actstore.Store, examples: pd.DataFrame, rels: list[str], min_tokens: int, subject_len: int
) -> None:
    rel_list = ", ".join(f"'{r}'" for r in rels) or "NULL"
    where = f"(relation_id IN ({rel_list}) OR n_tokens >= {min_tokens}) AND length(subject) >= {subject_len}"
    sel = store.select(where)
    mask = (examples["relation_id"].isin(rels) | (examples["n_tokens"] >= min_tokens)) & (
        examples["subject"].str.len() >= subject_len
    )
    expected = np.sort(examples.loc[mask, "example_id"].to_numpy())
    np.testing.assert_array_equal(sel.example_ids, expected)
    if len(expected):
        # Features of the selection equal the same rows picked out of the full array by numpy.
        full = store.select().features("z", layers=[0])
        np.testing.assert_array_equal(sel.features("z", layers=[0]), full[expected])


@pytest.mark.parametrize(
    "query",
    [
        "CREATE TABLE x AS SELECT 1",
        "INSERT INTO examples SELECT * FROM examples",
        "COPY examples TO '/tmp/actstore-leak.csv'",
        "ATTACH '/tmp/actstore-x.db' AS x",
        "INSTALL httpfs",
        "LOAD httpfs",
        "SET enable_external_access = true",
        "SELECT 1; SELECT 2",
        "DROP VIEW examples",
    ],
)
def test_sql_rejects_writes_and_config(store: actstore.Store, query: str) -> None:
    with pytest.raises(QueryError):
        store.sql(query)
    assert not Path("/tmp/actstore-leak.csv").exists()


@pytest.mark.parametrize(
    "query",
    [
        "SELECT * FROM read_csv('/etc/passwd')",
        "SELECT * FROM read_text('/etc/hostname')",
        "SELECT * FROM read_parquet('/work/shared/data/*.parquet')",
        "SELECT * FROM 'https://example.com/x.parquet'",
    ],
)
def test_sql_cannot_read_outside_the_store(store: actstore.Store, query: str) -> None:
    with pytest.raises(ReadOnlySQLError):
        store.sql(query)


def test_sql_error_is_one_line(store: actstore.Store) -> None:
    with pytest.raises(QueryError) as e:
        store.sql("SELECT no_such_column FROM examples")
    assert "\n" not in str(e.value)


def test_where_predicate_cannot_smuggle_statements(store: actstore.Store) -> None:
    with pytest.raises(QueryError):
        store.select("TRUE); DROP VIEW examples; SELECT (1")
    assert store.sql("SELECT count(*) AS n FROM examples").to_pylist()[0]["n"] == store.n_rows


def test_notebook_reprs_show_the_stores_contents(store: actstore.Store, examples: pd.DataFrame) -> None:
    """``_repr_html_`` of a store and of a selection report the same counts as pandas over the tables."""
    html = store._repr_html_()
    assert f"{store.n_rows} target rows" in html
    assert f"{store.geometry.n_layers} layers x {store.geometry.n_heads} heads" in html
    per_rel = examples.groupby("relation_id").size()
    assert f"relations</th><td style='text-align:left'>{len(per_rel)}:" in html
    rel = str(per_rel.index[0])
    sel = store.select(f"relation_id = '{rel}'")
    sel_html = sel._repr_html_()
    assert f"of {int(per_rel[rel])} target rows" in sel_html
    assert f"per relation: {rel} ({int(per_rel[rel])})" in sel_html
    first = examples[examples.relation_id == rel].sort_values("example_id").iloc[0]
    assert f"<td>{int(first.example_id)}</td>" in sel_html
