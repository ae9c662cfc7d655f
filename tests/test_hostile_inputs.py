"""The bad-input catalogue: each input gives exactly one ``error:`` line on stderr, a non-zero exit,
and leaves every store it touches byte for byte as it was.

Commands run in-process through click's CliRunner (the same ``main`` the ``actstore`` script
runs; stderr is captured on its own).  Ingest cases pass ``--quiet``: without it the data set
summary line precedes the error.  The S3 cases talk to a real moto server on 127.0.0.1 with
authentication enforced (tests/s3server.py).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from click.testing import CliRunner
from s3server import S3Server, free_port, moto_server

from actstore.cli import main
from actstore.manifest import seal

INGEST = ["ingest", "--model", "tiny-llama", "--dataset", "demo", "--limit-per-relation", "2", "--batch-size", "4",
          "--segment-size", "8", "--dtype", "float16", "--quiet"]


@dataclass
class Ctx:
    root: Path
    store: Path  # a store written by the CLI (tiny-llama), shared by the cases
    newer: Path  # a store whose manifest says format version 2
    other_weights: Path  # a model folder: tiny-llama's architecture with other weights
    s3: S3Server | None = None
    fresh_count: list[int] = field(default_factory=lambda: [0])

    def fresh(self) -> Path:
        """An output path that does not exist yet (a failed ingest must not leave a store there)."""
        self.fresh_count[0] += 1
        return self.root / f"fresh-{self.fresh_count[0]}"

    def jsonl(self, name: str, text: str) -> str:
        p = self.root / name
        p.write_text(text)
        return f"jsonl:{p}"


@dataclass(frozen=True)
class Case:
    name: str
    args: Callable[[Ctx], list[str]]
    needle: str  # a word the error line must contain
    env: dict[str, str] = field(default_factory=dict)
    s3: bool = False


def ingest_jsonl(ctx: Ctx, name: str, text: str) -> list[str]:
    return [*INGEST[:4], ctx.jsonl(name, text), *INGEST[7:], "--out", str(ctx.fresh())]


def bucket(ctx: Ctx) -> str:
    assert ctx.s3 is not None
    return ctx.s3.bucket


LONG = " ".join(["word"] * 400)

CASES = [
    # ---- ingest: data sets
    Case("malformed-jsonl", lambda c: ingest_jsonl(c, "bad.jsonl", '{"text": "Paris is the capital of"}\n{"text": "x"\n'),
         "malformed JSON"),
    Case("jsonl-wrong-type", lambda c: ingest_jsonl(c, "types.jsonl", '{"text": 42}\n'), "must be a string"),
    Case("jsonl-not-an-object", lambda c: ingest_jsonl(c, "list.jsonl", '["Paris", "France"]\n'), "JSON object"),
    Case("span-out-of-range", lambda c: ingest_jsonl(
        c, "span.jsonl", '{"text": "Paris is the capital of", "subject_span": [0, 99]}\n'), "out of range"),
    Case("target-out-of-range", lambda c: ingest_jsonl(
        c, "target.jsonl", '{"text": "Paris is the capital of", "target": 500}\n'), "out of range"),
    Case("empty-jsonl", lambda c: ingest_jsonl(c, "empty.jsonl", ""), "jsonl"),
    Case("prompt-past-context", lambda c: ingest_jsonl(c, "long.jsonl", json.dumps({"text": LONG}) + "\n"),
         "context"),
    Case("missing-dataset-file", lambda c: [*INGEST[:4], f"jsonl:{c.root / 'nope.jsonl'}", *INGEST[7:], "--out",
                                            str(c.fresh())], "not found"),
    Case("unknown-dataset-kind", lambda c: [*INGEST[:4], "wikipedia:/tmp/x", *INGEST[7:], "--out", str(c.fresh())],
         "wikipedia"),
    Case("unknown-relation", lambda c: [*INGEST, "--relations", "P99999", "--out", str(c.fresh())], "P99999"),
    Case("zero-limit", lambda c: [*INGEST[:5], "--limit-per-relation", "0", *INGEST[7:], "--out", str(c.fresh())],
         "limit"),
    Case("zero-batch-size", lambda c: [*INGEST, "--batch-size", "0", "--out", str(c.fresh())], "batch-size"),
    Case("bad-dtype", lambda c: [*INGEST, "--dtype", "float8", "--out", str(c.fresh())], "--dtype"),
    # ---- ingest: models and stores
    Case("unknown-model-name", lambda c: [*INGEST[:1], "--model", "no-such-model", *INGEST[3:], "--out",
                                          str(c.fresh())], "unknown model", env={"HF_HUB_OFFLINE": "1"}),
    Case("unknown-model-folder", lambda c: [*INGEST[:1], "--model", str(c.root / "no-model"), *INGEST[3:], "--out",
                                            str(c.fresh())], "unknown model"),
    Case("store-exists", lambda c: [*INGEST, "--out", str(c.store)], "already holds a store"),
    Case("out-is-a-nonempty-dir", lambda c: [*INGEST, "--out", str(c.root / "data")], "not an empty directory"),
    Case("resume-missing-store", lambda c: [*INGEST, "--resume", "--out", str(c.fresh())], "no store"),
    Case("resume-other-settings", lambda c: [*INGEST, "--resume", "--dtype", "float32", "--out", str(c.store)],
         "storage_dtype"),
    Case("resume-other-weights", lambda c: [*INGEST[:1], "--model", str(c.other_weights), *INGEST[3:], "--resume",
                                            "--out", str(c.store)], "different"),
    Case("resume-newer-format", lambda c: [*INGEST, "--resume", "--out", str(c.newer)], "newer"),
    Case("bad-rank-env", lambda c: [*INGEST, "--out", str(c.fresh())], "RANK", env={"RANK": "3", "WORLD_SIZE": "2"}),
    # ---- reading stores
    Case("missing-store", lambda c: ["info", str(c.root / "nowhere")], "no actstore store"),
    Case("not-a-store", lambda c: ["sql", str(c.root / "data"), "SELECT 1"], "no actstore store"),
    Case("newer-format-info", lambda c: ["info", str(c.newer)], "newer"),
    Case("newer-format-sql", lambda c: ["sql", str(c.newer), "SELECT 1"], "newer"),
    # ---- SQL: read-only, confined to the store
    Case("sql-create", lambda c: ["sql", str(c.store), "CREATE TABLE t AS SELECT 1"], "read-only"),
    Case("sql-delete", lambda c: ["sql", str(c.store), "DELETE FROM examples"], "read-only"),
    Case("sql-copy-out", lambda c: ["sql", str(c.store), f"COPY examples TO '{c.root / 'leak.csv'}'"], "read-only"),
    Case("sql-attach", lambda c: ["sql", str(c.store), f"ATTACH '{c.root / 'x.duckdb'}' AS x"], "read-only"),
    Case("sql-install", lambda c: ["sql", str(c.store), "INSTALL httpfs"], "read-only"),
    Case("sql-load", lambda c: ["sql", str(c.store), "LOAD httpfs"], "read-only"),
    Case("sql-set", lambda c: ["sql", str(c.store), "SET enable_external_access = true"], "read-only"),
    Case("sql-read-file", lambda c: ["sql", str(c.store), "SELECT * FROM read_csv('/etc/passwd')"], "SQL"),
    Case("sql-read-file-bare", lambda c: ["sql", str(c.store), "SELECT * FROM '/etc/hostname'"], "SQL"),
    Case("sql-read-parquet-outside", lambda c: ["sql", str(c.store), f"SELECT * FROM read_parquet('{c.newer}/tables/"
                                                "heads/heads.parquet')"], "SQL"),
    Case("sql-two-statements", lambda c: ["sql", str(c.store), "SELECT 1; SELECT 2"], "one statement"),
    Case("sql-syntax", lambda c: ["sql", str(c.store), "SELEC 1"], "SQL error"),
    Case("sql-unknown-table", lambda c: ["sql", str(c.store), "SELECT * FROM secrets"], "secrets"),
    # ---- features
    Case("features-bad-layers", lambda c: ["features", str(c.store), "--kind", "z", "--layers", "7",
                                           "--out", str(c.root / "f.npy")], "layer 7"),
    Case("features-layers-not-ints", lambda c: ["features", str(c.store), "--kind", "z", "--layers", "one",
                                                "--out", str(c.root / "f.npy")], "--layers"),
    Case("features-bad-kind", lambda c: ["features", str(c.store), "--kind", "everything",
                                         "--out", str(c.root / "f.npy")], "feature kind"),
    Case("features-heads-on-resid", lambda c: ["features", str(c.store), "--kind", "resid", "--heads", "0",
                                               "--out", str(c.root / "f.npy")], "--heads"),
    Case("features-where-reads-file", lambda c: ["features", str(c.store), "--kind", "z", "--where",
                                                 "example_id IN (SELECT 1 FROM read_csv('/etc/passwd'))",
                                                 "--out", str(c.root / "f.npy")], "SQL"),
    Case("features-empty-selection", lambda c: ["features", str(c.store), "--kind", "z", "--where", "false",
                                                "--out", str(c.root / "f.npy")], "empty"),
    # ---- probes
    Case("probe-bad-layers", lambda c: ["probe", str(c.store), "--features", "attn_head", "--layers", "9",
                                        "--episodes", "2", "--seeds", "1", "--quiet", "--no-save"], "layer 9"),
    Case("probe-bad-kind", lambda c: ["probe", str(c.store), "--features", "nothing", "--episodes", "2",
                                      "--seeds", "1", "--quiet", "--no-save"], "nothing"),
    # ---- S3
    Case("s3-wrong-secret", lambda c: ["info", f"s3://{bucket(c)}/store"], "access denied",
         env={"AWS_SECRET_ACCESS_KEY": "not-the-secret"}, s3=True),
    Case("s3-unknown-key", lambda c: ["sql", f"s3://{bucket(c)}/store", "SELECT 1"],
         "access denied", env={"AWS_ACCESS_KEY_ID": "AKIANOSUCHKEY0000000"}, s3=True),
    Case("s3-unreachable-endpoint", lambda c: ["verify", f"s3://{bucket(c)}/store"],
         "cannot reach", env={"AWS_ENDPOINT_URL": "closed", "AWS_MAX_ATTEMPTS": "1"}, s3=True),
    Case("s3-missing-bucket", lambda c: ["info", "s3://no-such-bucket/store"], "does not exist", s3=True),
    Case("s3-ingest-wrong-secret", lambda c: [*INGEST, "--out", f"s3://{bucket(c)}/new"],
         "access denied", env={"AWS_SECRET_ACCESS_KEY": "not-the-secret"}, s3=True),
    Case("s3-ingest-missing-bucket", lambda c: [*INGEST, "--out", "s3://no-such-bucket/new"], "does not exist",
         s3=True),
]


def snapshot(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory) -> Ctx:
    from ingest.models import tiny_model

    root = tmp_path_factory.mktemp("hostile")
    store = root / "store"
    r = CliRunner().invoke(main, [*INGEST, "--out", str(store)])
    assert r.exit_code == 0, r.stderr
    newer = root / "newer"
    r = CliRunner().invoke(main, [*INGEST, "--out", str(newer)])
    assert r.exit_code == 0, r.stderr
    m = json.loads((newer / "manifest.json").read_text())
    m.pop("checksum")
    m["format_version"] = 2
    (newer / "manifest.json").write_text(json.dumps(seal(m), indent=2, sort_keys=True))
    other = tiny_model("llama", seed=1)
    folder = root / "other-weights"
    other.model.save_pretrained(folder)
    other.tokenizer.save_pretrained(folder)
    (root / "data").mkdir()
    (root / "data" / "notes.txt").write_text("not a store")
    return Ctx(root, store, newer, folder)


@pytest.fixture(scope="module")
def s3_ctx(ctx: Ctx) -> Iterator[Ctx]:
    with moto_server() as server, pytest.MonkeyPatch.context() as mp:
        for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
            mp.delenv(k, raising=False)
        for k, v in server.env.items():
            mp.setenv(k, v)
        r = CliRunner().invoke(main, [*INGEST, "--out", f"s3://{server.bucket}/store"])
        assert r.exit_code == 0, r.stderr
        ctx.s3 = server
        yield ctx
        ctx.s3 = None


def s3_snapshot(server: S3Server) -> dict[str, str]:
    import boto3

    s3 = boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1",
                      aws_access_key_id=server.env["AWS_ACCESS_KEY_ID"],
                      aws_secret_access_key=server.env["AWS_SECRET_ACCESS_KEY"])
    out: dict[str, str] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=server.bucket):
        for obj in page.get("Contents", []):
            out[obj["Key"]] = obj["ETag"]
    return out


def test_catalogue_is_large_enough() -> None:
    assert len(CASES) >= 20 and len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(case: Case, request: pytest.FixtureRequest) -> None:
    c: Ctx = request.getfixturevalue("s3_ctx" if case.s3 else "ctx")
    env = dict(case.env)
    if env.get("AWS_ENDPOINT_URL") == "closed":
        env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{free_port()}"
    before = {name: snapshot(p) for name, p in (("store", c.store), ("newer", c.newer), ("data", c.root / "data"))}
    remote = s3_snapshot(c.s3) if c.s3 else None
    fresh_before = c.fresh_count[0]
    args = case.args(c)
    result = CliRunner().invoke(main, args, env=env)
    assert result.exit_code != 0, (args, result.stdout)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert case.needle.lower() in lines[0].lower(), lines[0]
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit)
    for name, p in (("store", c.store), ("newer", c.newer), ("data", c.root / "data")):
        assert snapshot(p) == before[name], f"{name} changed"
    for i in range(fresh_before + 1, c.fresh_count[0] + 1):
        out = c.root / f"fresh-{i}"
        assert not out.exists() or not any(out.iterdir()), f"{out} holds a partial store"
    if c.s3:
        assert s3_snapshot(c.s3) == remote
