"""Stores on S3: ingest into a real S3-compatible server (moto, 127.0.0.1), query, verify, compare
with the same ingest into a local directory."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from s3server import S3Server, aws_env, moto_server, use_server_env

import actstore
from actstore.cli import main
from actstore.core.layout import SEGMENT_ARRAYS
from actstore.core.verify import verify_store
from actstore.query.select.features import KINDS

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

QUERIES = [
    "SELECT * FROM examples ORDER BY example_id",
    "SELECT * FROM tokens ORDER BY example_id, position",
    "SELECT * FROM targets ORDER BY row",
    "SELECT * FROM heads ORDER BY layer, head",
    "SELECT relation_id, count(*) AS n, avg(object_logprob) AS lp FROM examples JOIN targets USING (example_id) "
    "GROUP BY 1 ORDER BY 1",
]


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with moto_server() as server, pytest.MonkeyPatch.context() as mp:
        use_server_env(mp, server)
        yield server


def run_cli(args: list[str]) -> str:
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def stores(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """The same ingest written to S3 and to a local directory, both through the CLI."""
    url = f"s3://{s3.bucket}/stores/tiny"
    local = tmp_path_factory.mktemp("s3ref") / "tiny"
    run_cli([*INGEST, "--out", url])
    run_cli([*INGEST, "--out", str(local)])
    return url, local


def test_s3_store_is_byte_identical_to_local(stores: tuple[str, Path]) -> None:
    url, local = stores
    s, ref = actstore.open(url), actstore.open(local)
    assert s.complete and s.n_rows == ref.n_rows > 0
    assert s.commits == ref.commits  # rows, ragged sizes and table SHA-256 per segment
    for seg in ref.commits:
        for name in SEGMENT_ARRAYS:
            x, y = s.array(seg, name)[...], ref.array(seg, name)[...]
            assert x.dtype == y.dtype and np.array_equal(x.view(np.uint8), y.view(np.uint8)), (seg, name)


def test_sql_and_features_match_local(stores: tuple[str, Path]) -> None:
    url, local = stores
    s, ref = actstore.open(url), actstore.open(local)
    for q in QUERIES:
        assert s.sql(q).equals(ref.sql(q)), q
    where = "relation_id IN (SELECT relation_id FROM examples ORDER BY relation_id LIMIT 1)"
    sa, sb = s.select(where), ref.select(where)
    assert sa.rows.equals(sb.rows) and len(sa) > 0
    for kind in KINDS:
        a = sa.features(kind, layers=[1] if kind != "resid" else [0, 2])
        b = sb.features(kind, layers=[1] if kind != "resid" else [0, 2])
        assert a.shape == b.shape and np.array_equal(a, b), kind
    assert np.array_equal(s.weight("W_O"), ref.weight("W_O"))


def test_queries_on_s3_list_nothing(stores: tuple[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Opening a complete store and querying its segment tables and arrays sends no LIST and no HEAD:
    the snapshot names every file (on S3 a LIST per query is the cost that grows with the store)."""
    url, local = stores
    s, ref = actstore.open(url), actstore.open(local)
    calls: list[str] = []
    fss = [s.location.fs, s.location._async_fs()]
    for fs in fss:
        for name in ("ls", "find", "walk", "glob", "exists", "info", "isdir", "isfile", "_ls", "_find"):
            for attr in (name, f"_{name}") if not name.startswith("_") else (name,):
                real = getattr(fs, attr, None)
                if real is not None:
                    monkeypatch.setattr(
                        fs, attr, lambda *a, _r=real, _n=attr, **k: calls.append(_n) or _r(*a, **k)
                    )
    assert s.sql(QUERIES[0]).equals(ref.sql(QUERIES[0]))
    eid = ref.n_rows // 2
    a = s.select(f"example_id = {eid}").features("resid", layers=[1])
    assert np.array_equal(a, ref.select(f"example_id = {eid}").features("resid", layers=[1]))
    rel = ref.sql("SELECT min(relation_id) AS r FROM examples").column("r")[0].as_py()
    b = s.select("relation_id = ?", params=[rel]).limit(3).features("attn_head", layers=[0])
    assert np.array_equal(
        b, ref.select("relation_id = ?", params=[rel]).limit(3).features("attn_head", layers=[0])
    )
    assert s.sql("SELECT count(*) AS n FROM heads").equals(ref.sql("SELECT count(*) AS n FROM heads"))
    assert calls == []


def test_result_tables_on_s3_are_listed_once_per_open_store(
    s3: S3Server, stores: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A result table's statements list the result tables once; a result written through the store is
    seen at once, one written by another reader (another process) after ``refresh()``."""
    import fsspec
    import pyarrow as pa

    from actstore.core.writer import write_result_table

    url, _ = stores
    copy = f"s3://{s3.bucket}/stores/results"
    fs = fsspec.filesystem("s3", client_kwargs={"endpoint_url": s3.endpoint}, skip_instance_cache=True)
    fs.copy(url.removeprefix("s3://") + "/", copy.removeprefix("s3://") + "/", recursive=True)
    s = actstore.open(copy)
    lists: list[str] = []
    real = s.location.fs.ls
    monkeypatch.setattr(s.location.fs, "ls", lambda *a, **k: lists.append(a[0]) or real(*a, **k))
    q = "SELECT sum(x) AS s FROM my_result"
    write_result_table(s, "my_result", "run1", pa.table({"x": [1, 2]}))
    assert s.sql(q).column(0)[0].as_py() == 3
    n = len(lists)
    assert n >= 1 and s.sql(q).column(0)[0].as_py() == 3 and len(lists) == n
    write_result_table(actstore.open(copy), "my_result", "run2", pa.table({"x": [10]}))
    assert s.sql(q).column(0)[0].as_py() == 3 and len(lists) == n
    s.refresh()
    assert s.sql(q).column(0)[0].as_py() == 13


def test_verify_info_sql_features_commands_on_s3(stores: tuple[str, Path], tmp_path: Path) -> None:
    url, local = stores
    report = verify_store(actstore.open(url))
    assert report.ok and report.chunks_checked == verify_store(actstore.open(local)).chunks_checked
    assert run_cli(["verify", url]).startswith("ok:")
    assert '"complete": true' in run_cli(["info", url, "--json"])
    q = "SELECT example_id, top_token_id FROM targets ORDER BY row"
    assert run_cli(["sql", url, q, "--format", "csv"]) == run_cli(["sql", str(local), q, "--format", "csv"])
    a, b = tmp_path / "a.npy", tmp_path / "b.npy"
    run_cli(["features", url, "--kind", "attn_head", "--layers", "0", "--out", str(a)])
    run_cli(["features", str(local), "--kind", "attn_head", "--layers", "0", "--out", str(b)])
    assert np.array_equal(np.load(a), np.load(b))


def test_s3_reader_sees_only_committed_segments(s3: S3Server, stores: tuple[str, Path]) -> None:
    import fsspec

    url, _ = stores
    copy = f"s3://{s3.bucket}/stores/uncommitted"
    fs = fsspec.filesystem("s3", client_kwargs={"endpoint_url": s3.endpoint}, skip_instance_cache=True)
    fs.copy(url.removeprefix("s3://") + "/", copy.removeprefix("s3://") + "/", recursive=True)
    fs.rm(copy.removeprefix("s3://") + "/commits/000001.json")
    # (and its snapshot: a store whose ingest is still running has none covering the missing segment)
    fs.rm(copy.removeprefix("s3://") + "/snapshot", recursive=True)
    s = actstore.open(copy)
    assert 1 not in s.commits and not s.complete
    assert s.sql("SELECT count(*) AS n FROM targets").to_pylist()[0]["n"] == s.n_rows
    assert 1 not in s.sql("SELECT DISTINCT segment FROM examples").column("segment").to_pylist()


def test_cli_subprocess_reads_s3_from_environment(s3: S3Server, stores: tuple[str, Path]) -> None:
    """A separate process configured only by the standard AWS variables."""
    url, _ = stores
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "actstore.cli",
            "sql",
            url,
            "SELECT count(*) AS n FROM examples",
            "--format",
            "csv",
        ],
        env=aws_env(s3),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ['"n"', str(actstore.open(url).n_rows)]
    assert out.stderr == ""


@pytest.mark.parametrize(
    "override,needle",
    [
        ({"AWS_SECRET_ACCESS_KEY": "wrong-secret"}, "access denied"),
        ({"AWS_ACCESS_KEY_ID": "AKIANOSUCHKEY0000000"}, "access denied"),
        ({"AWS_ENDPOINT_URL": "closed-port"}, "cannot reach the object store"),
    ],
)
def test_bad_credentials_or_endpoint_is_one_line(
    s3: S3Server, stores: tuple[str, Path], override: dict[str, str], needle: str
) -> None:
    from s3server import free_port

    url, _ = stores
    if override.get("AWS_ENDPOINT_URL") == "closed-port":
        override = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}", "AWS_MAX_ATTEMPTS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "actstore.cli", "info", url],
        env=aws_env(s3, **override),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], out.stderr


def test_shard_indexes_are_read_once_per_open_store(
    stores: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layer-chunked (sharded) array on S3: the first read of a row GETs the shard's index and then its
    inner chunk; a later read from the same shard in the same open store GETs only the inner chunk (the
    index is kept, a committed shard never changes).  Values equal the local store's each time."""
    url, local = stores
    s, ref = actstore.open(url), actstore.open(local)
    seg = min(ref.commits)
    gets: list[tuple[str, object]] = []
    afs = s.location._async_fs()
    real = afs._cat_file

    async def counting(path: str, start: object = None, end: object = None, **kw: object) -> bytes:
        gets.append((path, start))
        return await real(path, start=start, end=end, **kw)

    monkeypatch.setattr(afs, "_cat_file", counting)
    arr = s.array(seg, "resid")
    assert arr.shards is not None and arr.shards[0] >= 2
    counts: list[tuple[int, int]] = []
    for row, layer in ((0, 1), (0, 1), (1, 0)):  # (rows 0 and 1 of the segment share a shard)
        gets.clear()
        got = s.read_segment_rows(seg, "resid", np.array([row]), [layer])
        want = ref.read_segment_rows(seg, "resid", np.array([row]), [layer])
        assert np.array_equal(got, want)
        counts.append((len(gets), sum(isinstance(b, int) and b < 0 for _, b in gets)))
    assert counts == [(2, 1), (1, 0), (1, 0)]  # (GETs, of which shard-index suffix reads)
