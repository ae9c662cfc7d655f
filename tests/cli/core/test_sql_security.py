"""SQL that tries to write, to read outside the store, to run without end or to break out of ``--where``
(issue 14, items 1, 2 and the SQL parts of 9).

Every attack runs through the command line (click's CliRunner, the same ``main`` the ``actstore``
script runs) from a working directory that holds the store ``S`` and the user's own files,
``notes.txt`` and ``.tmp/secret.txt`` (``.tmp`` was DuckDB's default temporary directory, once on
the allowed list).  Each must exit non-zero with exactly one ``error:`` line on stderr, never show
the secret, and leave every file under the working directory (store included) byte for byte as it
was, with no file added or removed.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import actstore
from actstore.cli import main
from actstore.core.errors import QueryError, ReadOnlySQLError

INGEST = [
    "ingest",
    "--model",
    "tiny-llama",
    "--dataset",
    "demo",
    "--limit-per-relation",
    "2",
    "--batch-size",
    "4",
    "--segment-size",
    "8",
    "--dtype",
    "float16",
    "--quiet",
]
SECRET = "the-user-secret-3141"
# 10^11 products: minutes of work for two threads, and next to no memory.
SLOW = "SELECT sum(a.range * b.range) AS s FROM range(1000000) a, range(100000) b"
HUGE_IN = "example_id IN (SELECT unnest(range(1000000000)))"


@dataclass(frozen=True)
class Work:
    root: Path  # the working directory: S/, notes.txt, notes.csv, .tmp/secret.txt
    store: Path


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Work:
    root = tmp_path_factory.mktemp("sqlsec")
    store = root / "S"
    r = CliRunner().invoke(main, [*INGEST, "--out", str(store)])
    assert r.exit_code == 0, r.stderr
    (root / "notes.txt").write_text("the user's own notes\n")
    (root / "notes.csv").write_text(f"a,b\n1,{SECRET}\n")
    (root / ".tmp").mkdir()
    (root / ".tmp" / "secret.txt").write_text(SECRET + "\n")
    return Work(root, store)


@pytest.fixture()
def cwd(work: Work, monkeypatch: pytest.MonkeyPatch) -> Work:
    monkeypatch.chdir(work.root)
    return work


def snapshot(root: Path) -> dict[str, str]:
    """SHA-256 of every file under ``root`` (hidden ones included), by relative path."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def copy_to(target: str) -> str:
    return f"COPY (SELECT 1 AS a) TO '{target}' (FORMAT parquet, PARTITION_BY (a), OVERWRITE true)"


@dataclass(frozen=True)
class Attack:
    name: str
    args: Callable[[Work], list[str]]
    needle: str  # a phrase the error line must contain (case-insensitive)
    code: int = 1


def sql(query: str, *extra: str) -> Callable[[Work], list[str]]:
    return lambda w: ["sql", "S", query, *extra]


def features_where(where: str, *extra: str) -> Callable[[Work], list[str]]:
    return lambda w: ["features", "S", "--kind", "z", "--where", where, "--out", "f.npy", *extra]


ATTACKS = [
    # ---- item 1: statements that write, directly or inside EXPLAIN ANALYZE
    Attack(
        "explain-analyze-copy-over-manifest",
        sql("EXPLAIN ANALYZE COPY (SELECT 'x' AS a) TO 'S/manifest.json' (FORMAT csv)"),
        "EXPLAIN",
    ),
    Attack(
        "explain-analyze-partition-overwrite-tables", sql("EXPLAIN ANALYZE " + copy_to("S/tables")), "EXPLAIN"
    ),
    Attack(
        "explain-analyze-partition-overwrite-segments",
        sql("EXPLAIN ANALYZE " + copy_to("S/segments")),
        "EXPLAIN",
    ),
    Attack(
        "explain-analyze-partition-overwrite-commits",
        sql("EXPLAIN ANALYZE " + copy_to("S/commits")),
        "EXPLAIN",
    ),
    Attack(
        "explain-copy", sql("EXPLAIN COPY (SELECT 'x' AS a) TO 'S/manifest.json' (FORMAT csv)"), "EXPLAIN"
    ),
    Attack("explain-analyze-select", sql("EXPLAIN ANALYZE SELECT * FROM examples"), "EXPLAIN"),
    Attack("copy-partition-overwrite-tables", sql(copy_to("S/tables")), "read-only"),
    Attack(
        "copy-over-manifest", sql("COPY (SELECT 'x' AS a) TO 'S/manifest.json' (FORMAT csv)"), "read-only"
    ),
    Attack(
        "copy-in-query-function",
        sql("SELECT * FROM query('COPY (SELECT 1 AS a) TO ''S/manifest.json''')"),
        "SQL error",
    ),
    Attack("export-database", sql("EXPORT DATABASE 'S/tables'"), "read-only"),
    Attack("pragma", sql("PRAGMA enable_profiling"), "read-only"),
    Attack("call", sql("CALL pragma_version()"), "read-only"),
    Attack("set-temp-directory", sql("SET temp_directory = '.tmp'"), "read-only"),
    Attack("reset-memory-limit", sql("RESET memory_limit"), "read-only"),
    Attack("prepare", sql("PREPARE p AS COPY (SELECT 1) TO 'S/manifest.json'"), "read-only"),
    Attack("pivot-multi-statement", sql("PIVOT examples ON split USING count(*)"), "read-only"),
    Attack("copy-after-select", sql("SELECT 1; " + copy_to("S/tables")), "one statement"),
    # ---- item 2: files outside the store (and inside it: DuckDB reads no file itself)
    Attack("read-secret-in-tmp", sql("SELECT * FROM read_text('.tmp/secret.txt')"), "may only read"),
    Attack(
        "read-secret-absolute",
        lambda w: ["sql", "S", f"SELECT * FROM read_text('{w.root}/.tmp/secret.txt')"],
        "may only read",
    ),
    Attack("read-secret-as-csv", sql("SELECT * FROM read_csv('.tmp/secret.txt')"), "may only read"),
    Attack("read-secret-bare-path", sql("SELECT * FROM '.tmp/secret.txt'"), "SQL"),
    Attack(
        "read-user-csv-bare-path",
        lambda w: ["sql", "S", f"SELECT * FROM '{w.root}/notes.csv'"],
        "may only read",
    ),
    Attack("read-blob-secret", sql("SELECT * FROM read_blob('.tmp/*')"), "may only read"),
    Attack("glob-working-directory", sql("SELECT * FROM glob('*')"), "may only read"),
    Attack("read-store-manifest-as-text", sql("SELECT * FROM read_text('S/manifest.json')"), "may only read"),
    Attack(
        "read-store-shard-directly",
        sql("SELECT * FROM read_parquet('S/tables/examples/*.parquet')"),
        "may only read",
    ),
    Attack(
        "explain-analyze-copy-into-tmp",
        lambda w: ["sql", "S", f"EXPLAIN ANALYZE COPY (SELECT 1 AS a) TO '{w.root}/.tmp/x.csv'"],
        "EXPLAIN",
    ),
    Attack(
        "where-reads-secret",
        features_where("example_id IN (SELECT 1 FROM read_text('.tmp/secret.txt'))"),
        "may only read",
    ),
    Attack("where-globs", features_where("example_id IN (SELECT 1 FROM glob('.tmp/*'))"), "may only read"),
    Attack(
        "where-reads-secret-scalar",
        features_where("text = (SELECT content FROM read_text('.tmp/secret.txt'))"),
        "may only read",
    ),
    # ---- item 2: memory and time
    Attack(
        "where-unnest-1e9",
        features_where(HUGE_IN, "--sql-memory", "100MB"),
        "more memory than the limit of 100MB",
    ),
    # the exact command, under the default limit (4GB: DuckDB's buffers, the process may grow by 2x + 256 MiB)
    Attack("where-unnest-1e9-default-limit", features_where(HUGE_IN), "more memory than the limit of 4GB"),
    Attack(
        "sql-unnest-1e9",
        sql(f"SELECT count(*) FROM examples WHERE {HUGE_IN}", "--sql-memory", "100MB"),
        "more memory than the limit of 100MB",
    ),
    Attack("sql-time-limit", sql(SLOW, "--sql-timeout", "0.5"), "longer than the time limit of 0.5 s"),
    Attack(
        "where-time-limit",
        features_where(f"example_id IN (SELECT s FROM ({SLOW}))", "--sql-timeout", "0.5"),
        "longer than the time limit of 0.5 s",
    ),
    Attack("sql-memory-not-a-size", sql("SELECT 1", "--sql-memory", "lots"), "not a size", code=2),
    Attack("sql-timeout-negative", sql("SELECT 1", "--sql-timeout", "-1"), "--sql-timeout", code=2),
    # ---- item 9: --where is one expression, not text pasted into a query
    Attack("where-union-breakout", features_where("1=1) UNION SELECT (1"), "one SQL expression", code=2),
    Attack("where-or-breakout", features_where("FALSE) OR (TRUE"), "one SQL expression", code=2),
    Attack("where-second-statement", features_where("1=1; DROP VIEW examples"), "one SQL expression", code=2),
    Attack(
        "where-copy-statement",
        features_where("1=1); COPY (SELECT 1 AS a) TO '.tmp/x.csv'; SELECT (1"),
        "one SQL expression",
        code=2,
    ),
    Attack("where-order-by", features_where("TRUE ORDER BY 1"), "one SQL expression", code=2),
    Attack("where-set-operation", features_where("TRUE UNION SELECT 1"), "one SQL expression", code=2),
    Attack("where-unterminated-comment", features_where("TRUE /* )"), "one SQL expression", code=2),
    Attack("sql-error-with-csv", sql("SELECT no_such_column FROM examples", "--format", "csv"), "SQL error"),
    Attack(
        "sql-error-with-table", sql("SELECT no_such_column FROM examples", "--format", "table"), "SQL error"
    ),
]


def test_catalogue_names_are_unique() -> None:
    assert len({a.name for a in ATTACKS}) == len(ATTACKS)


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.name for a in ATTACKS])
def test_attack_is_refused_and_changes_nothing(attack: Attack, cwd: Work) -> None:
    before = snapshot(cwd.root)
    args = attack.args(cwd)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == attack.code, (args, result.stdout, result.stderr)
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), (
        result.exception
    )
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert attack.needle.lower() in lines[0].lower(), lines[0]
    assert SECRET not in result.stdout + result.stderr
    assert snapshot(cwd.root) == before, "a file changed, appeared or disappeared"


def test_store_still_reads_after_the_attacks(cwd: Work) -> None:
    """After the whole catalogue (same module, same store) the store verifies and answers."""
    r = CliRunner().invoke(main, ["verify", "S"])
    assert r.exit_code == 0, r.stdout + r.stderr
    r = CliRunner().invoke(main, ["sql", "S", "SELECT count(*) AS n FROM examples", "--format", "json"])
    assert json.loads(r.stdout) == [{"n": actstore.open(cwd.store).manifest.n_examples}]


# ---------------------------------------------------------------------------------- the connection itself


def test_connection_has_no_file_access_even_for_a_statement_that_skips_the_check(work: Work) -> None:
    """The second layer: a statement run on the connection directly (no statement check) still cannot
    write into the store or read the user's file."""
    import duckdb

    before = snapshot(work.root)
    con = actstore.open(work.store).connect()
    for stmt in (
        f"COPY (SELECT 'x' AS a) TO '{work.store}/manifest.json' (FORMAT csv)",
        f"EXPLAIN ANALYZE {copy_to(str(work.store / 'tables'))}",
        f"SELECT * FROM read_text('{work.root}/.tmp/secret.txt')",
        f"ATTACH '{work.root}/.tmp/db.duckdb' AS x",
        "SET enable_external_access = true",
        "SET temp_directory = '.tmp'",
    ):
        with pytest.raises(duckdb.Error):
            con.execute(stmt)
    assert snapshot(work.root) == before


def test_connection_settings(work: Work) -> None:
    """No temporary directory, no replacement scans, locked configuration; no allowed directory or
    path on a connection handed out, and on the database of a store's own statements only the
    read-only file system of its checked table files (see the next test)."""
    store = actstore.open(work.store)
    query = (
        "SELECT name, value FROM duckdb_settings() WHERE name IN ('allowed_directories', "
        "'allowed_paths', 'temp_directory', 'enable_external_access', 'lock_configuration', "
        "'python_enable_replacements', 'autoload_known_extensions', 'autoinstall_known_extensions')"
    )
    want = {
        "allowed_directories": "[]",
        "allowed_paths": "[]",
        "temp_directory": "",
        "enable_external_access": "false",
        "lock_configuration": "true",
        "python_enable_replacements": "false",
        "autoload_known_extensions": "false",
        "autoinstall_known_extensions": "false",
    }
    con = store.connect(memory_limit="256MB")
    try:
        assert dict(con.execute(query).fetchall()) == want
    finally:
        con.close()
    got = {r["name"]: r["value"] for r in store.sql(query, memory_limit="256MB").to_pylist()}
    assert got == {**want, "allowed_directories": "['actstore-table://']"}
    limit = store.sql("SELECT current_setting('memory_limit') AS m", memory_limit="256MB").to_pylist()[0]["m"]
    assert limit == "244.1 MiB"  # 256 * 10^6 bytes, as DuckDB prints it


def test_the_statements_file_system_serves_checked_table_files_alone_and_only_for_reading(work: Work) -> None:
    """The database a local store's statements run on reads the store's table files through a read-only
    file system of the files it checked: statements run on it directly (no statement check) can neither
    write a table file nor read any other file through it (the user's, the store's manifest, a path with
    ``..``), and list nothing."""
    import duckdb

    from actstore.core.sql_files import PREFIX
    from actstore.core.sql_limits import DEFAULT_MEMORY_LIMIT

    before = snapshot(work.root)
    store = actstore.open(work.store)
    assert store.sql("SELECT count(*) AS n FROM examples").to_pylist() == [{"n": store.manifest.n_examples}]
    db = store.sql_session().database(DEFAULT_MEMORY_LIMIT).db
    table_file = store.location.path(store.statement_files({"examples"})[0]["examples"][0])
    assert db.execute(f"SELECT count(*) FROM read_parquet('{PREFIX}{table_file}')").fetchone() == (
        pq.ParquetFile(table_file).metadata.num_rows,
    )
    for stmt in (
        f"COPY (SELECT 'x' AS a) TO '{PREFIX}{table_file}' (FORMAT csv, USE_TMP_FILE false)",
        f"COPY (SELECT 'x' AS a) TO '{PREFIX}{table_file}' (FORMAT parquet)",
        f"COPY (SELECT 'x' AS a) TO '{work.store}/manifest.json' (FORMAT csv)",
        f"SELECT * FROM read_blob('{PREFIX}{table_file}/../../../manifest.json')",
        f"SELECT * FROM read_text('{work.root}/notes.txt')",
        f"ATTACH '{PREFIX}{work.root}/.tmp/db.duckdb' AS x",
    ):
        with pytest.raises(duckdb.Error):
            db.execute(stmt).fetchall()
    for stmt in (  # a file not on the list does not exist there: no rows
        f"SELECT * FROM glob('{PREFIX}{work.store}/*')",
        f"SELECT * FROM read_text('{PREFIX}{work.root}/.tmp/secret.txt')",
        f"SELECT * FROM read_text('{PREFIX}{work.store}/manifest.json')",
        f"SELECT * FROM read_blob(['{PREFIX}{work.root}/notes.txt', '{PREFIX}{table_file}.sha256'])",
    ):
        assert db.execute(stmt).fetchall() == [], stmt
    assert snapshot(work.root) == before


# ---------------------------------------------------------------------------------- limits in the library


def test_library_limits_per_call_and_per_block(work: Work) -> None:
    import resource

    rlimit = resource.getrlimit(resource.RLIMIT_DATA)
    store = actstore.open(work.store)
    with pytest.raises(QueryError, match="time limit of 0.2 s"):
        store.sql(SLOW, timeout=0.2)
    with pytest.raises(QueryError, match="memory than the limit of 64MB"):
        store.sql(f"SELECT count(*) FROM examples WHERE {HUGE_IN}", memory_limit="64MB")
    with actstore.core.sql_limits.limits(timeout=0.2):
        with pytest.raises(QueryError, match="time limit of 0.2 s"):
            len(store.select(f"example_id IN (SELECT s FROM ({SLOW}))"))  # a selection runs when read
    with actstore.core.sql_limits.limits(memory_limit="64MB"):
        with pytest.raises(QueryError, match="limit of 64MB"):
            len(store.select(HUGE_IN))
    with pytest.raises(QueryError, match="not a size"):
        store.sql("SELECT 1", memory_limit="a lot")
    with pytest.raises(QueryError, match="positive number of seconds"):
        store.sql("SELECT 1", timeout=-1)
    assert store.sql("SELECT 7 AS x", timeout=0).to_pylist() == [{"x": 7}]  # 0: no time limit
    # the block's limits end with the block; a stopped query leaves nothing behind
    n = store.sql("SELECT count(*) AS n FROM examples").to_pylist()[0]["n"]
    assert n == store.manifest.n_examples
    assert resource.getrlimit(resource.RLIMIT_DATA) == rlimit  # the process's own limit is back


def test_concurrent_statements_share_the_growth_cap(work: Work) -> None:
    """Statements in several threads each get their answer, and the process limit is restored after."""
    import resource
    from concurrent.futures import ThreadPoolExecutor

    rlimit = resource.getrlimit(resource.RLIMIT_DATA)
    store = actstore.open(work.store)
    ex = store.table("examples", ["example_id", "n_tokens"]).to_pandas()

    def one(i: int) -> int:
        q = f"SELECT coalesce(sum(n_tokens), 0) AS s FROM examples WHERE example_id % 4 = {i % 4}"
        return int(store.sql(q, memory_limit="200MB").to_pylist()[0]["s"])

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(one, range(16)))
    assert got == [int(ex.loc[ex.example_id % 4 == i % 4, "n_tokens"].sum()) for i in range(16)]
    assert resource.getrlimit(resource.RLIMIT_DATA) == rlimit


# ---------------------------------------------------------------------------------- item 9: results and --where


@pytest.fixture(scope="module")
def tokens(work: Work) -> pd.DataFrame:
    """The tokens table read with pandas straight from the Parquet shards (not through DuckDB, nor
    the compacted file the snapshot lists)."""
    files = sorted((work.store / "tables" / "tokens").glob("[0-9]*.parquet"))
    return pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)


LIST_QUERY = "SELECT example_id, list(token ORDER BY position) AS toks FROM tokens GROUP BY 1 ORDER BY 1"


def expected_lists(tokens: pd.DataFrame) -> dict[int, list[str]]:
    return {int(e): g.sort_values("position")["token"].tolist() for e, g in tokens.groupby("example_id")}


def test_csv_prints_list_columns_as_json(cwd: Work, tokens: pd.DataFrame) -> None:
    r = CliRunner().invoke(main, ["sql", "S", LIST_QUERY, "--format", "csv"])
    assert r.exit_code == 0, r.stderr
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    assert {int(x["example_id"]): json.loads(x["toks"]) for x in rows} == expected_lists(tokens)


def test_table_prints_list_struct_map_and_union_columns(cwd: Work, tokens: pd.DataFrame) -> None:
    q = (
        "SELECT example_id, [example_id, example_id * 10] AS l, {'id': example_id} AS s, "
        "map([example_id], ['x']) AS m, union_value(k := example_id) AS u FROM examples ORDER BY 1"
    )
    r = CliRunner().invoke(main, ["sql", "S", q, "--format", "table"])
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    ids = sorted(int(e) for e in tokens["example_id"].unique())
    assert lines[0].split() == ["example_id", "l", "s", "m", "u"] and len(lines) == 1 + len(ids)
    for line, e in zip(lines[1:], ids):
        assert line.split() == [
            str(e),
            f"[{e},",
            f"{e * 10}]",
            '{"id":',
            f"{e}}}",
            f"[[{e},",
            '"x"]]',
            str(e),
        ]
    r = CliRunner().invoke(main, ["sql", "S", q, "--format", "csv"])
    assert r.exit_code == 0, r.stderr
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    assert [(json.loads(x["l"]), json.loads(x["s"]), json.loads(x["m"]), int(x["u"])) for x in rows] == [
        ([e, e * 10], {"id": e}, [[e, "x"]], e) for e in ids
    ]


def test_table_escapes_control_characters(cwd: Work) -> None:
    r = CliRunner().invoke(main, ["sql", "S", "SELECT chr(27) || '[31mred' AS t", "--format", "table"])
    assert r.exit_code == 0, r.stderr
    assert "\x1b" not in r.stdout and "\\x1b[31mred" in r.stdout


def test_printing_failure_is_one_sql_error_line(cwd: Work, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever fails while a result is printed, the user gets one ``SQL error:`` line."""
    import pyarrow as pa

    import actstore.core.sql_render as sqlmod

    def broken(table: pa.Table) -> pa.Table:
        raise pa.ArrowNotImplementedError("Unsupported Type:list<l: int32>\nsecond line")

    monkeypatch.setattr(sqlmod, "_as_text", broken)
    for fmt in ("csv", "table"):
        r = CliRunner().invoke(main, ["sql", "S", "SELECT [1, 2] AS l", "--format", fmt])
        assert r.exit_code == 1
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            f"error: SQL error: cannot print the result as {fmt}"
        ), lines


def test_where_with_trailing_comment(cwd: Work, tmp_path: Path) -> None:
    store = actstore.open(cwd.store)
    ex = store.table("examples", ["example_id", "relation_id"]).to_pandas()
    rel = str(ex["relation_id"].iloc[0])
    want = np.sort(ex.loc[ex["relation_id"] == rel, "example_id"].to_numpy())
    plain = f"relation_id = '{rel}'"
    np.testing.assert_array_equal(store.select(plain + " -- pick one relation").example_ids, want)
    np.testing.assert_array_equal(store.select("/* lead */ " + plain + " /* trail */").example_ids, want)
    outs = []
    for where in (plain, plain + " -- pick one relation", plain + "\n-- a comment line\n"):
        out = tmp_path / f"f{len(outs)}.npy"
        r = CliRunner().invoke(
            main,
            [
                "features",
                "S",
                "--kind",
                "z",
                "--where",
                where,
                "--out",
                str(out),
                "--ids-out",
                str(out) + ".parquet",
            ],
        )
        assert r.exit_code == 0, r.stderr
        ids = pd.read_parquet(str(out) + ".parquet")["example_id"].to_numpy()
        np.testing.assert_array_equal(ids, want)
        outs.append(np.load(out))
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


def test_where_comment_in_a_command_that_pastes_it(cwd: Work) -> None:
    """``lens`` places --where inside its own query text: a trailing comment must not swallow the rest."""
    base = ["lens", "S", "--no-tuned", "--no-save", "--json"]
    store = actstore.open(cwd.store)
    rel = str(store.table("examples", ["relation_id"]).column(0)[0])
    res = []
    for where in (f"relation_id = '{rel}'", f"relation_id = '{rel}' -- only this one"):
        r = CliRunner().invoke(main, [*base, "--where", where])
        assert r.exit_code == 0, r.stderr
        d = json.loads(r.stdout)
        d.pop("run_id"), d.pop("seconds", None)  # differ from run to run
        res.append(d)
    assert res[0] == res[1] and res[0]["n_eval"] == int(
        (store.table("examples", ["relation_id"]).column(0).to_numpy(zero_copy_only=False) == rel).sum()
    )


@pytest.mark.parametrize(
    "where",
    [
        "1=1) UNION SELECT (1",
        "TRUE); DROP VIEW examples; SELECT (1",
        "TRUE ORDER BY 1",
        "TRUE LIMIT 1",
        "relation_id, split",
    ],
)
def test_select_refuses_more_than_one_expression(work: Work, where: str) -> None:
    with pytest.raises(QueryError, match="one SQL expression"):
        actstore.open(work.store).select(where)


def test_selection_query_is_one_select(work: Work) -> None:
    from actstore.query.select.selection import Selection

    store = actstore.open(work.store)
    n = Selection.from_sql(
        store, query="SELECT example_id FROM examples WHERE example_id < 3 -- first three;"
    )
    assert n.example_ids.tolist() == [0, 1, 2]
    with pytest.raises(ReadOnlySQLError):
        Selection.from_sql(store, query="EXPLAIN ANALYZE SELECT example_id FROM examples")
    with pytest.raises(QueryError, match="one statement"):
        Selection.from_sql(store, query="SELECT 1 AS example_id; SELECT 2 AS example_id")
    with pytest.raises(QueryError):
        Selection.from_sql(store, query="SELECT 1 AS example_id) UNION (SELECT 2 AS example_id")
