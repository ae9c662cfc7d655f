"""The bad-input catalogue: each input gives exactly one ``error:`` line on stderr, a non-zero exit,
and leaves every store it touches byte for byte as it was.

Commands run in-process through click's CliRunner (the same ``main`` the ``actstore`` script
runs; stderr is captured on its own).  Ingest cases pass ``--quiet``: without it the data set
summary line precedes the error.  The S3 cases talk to a real moto server on 127.0.0.1 with
authentication enforced (tests/s3server.py).

Hostile stores are copies of the shared store, each damaged once (``Ctx.damaged``) the way a
careless user or an attacker would: a deleted chunk or marker, a marker repeating another's
segment, made-up manifest fields (re-sealed, so that only the field checks can tell), a named
pipe where a file should be.  The second catalogue (``VERIFY_CASES``) lists what ``verify``
must report for each loss, one PROBLEM line each.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xxhash
import zarr
from click.testing import CliRunner
from helpers import uncompact
from s3server import S3Server, free_port, moto_server, use_server_env

from actstore.cli import main
from actstore.core.chunks import is_chunk_key
from actstore.core.manifest import FORMAT_VERSION, seal
from actstore.core.tables import digest as object_digest
from actstore.core.tables import to_parquet_bytes

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
    "--weights",
    "copy",  # the store's own weights/ are damaged below
    "--quiet",
]


@dataclass
class Ctx:
    root: Path
    store: Path  # a store written by the CLI (tiny-llama), shared by the cases
    newer: Path  # a store whose manifest says a format version newer than this actstore writes
    other_weights: Path  # a model folder: tiny-llama's architecture with other weights
    s3: S3Server | None = None
    fresh_count: list[int] = field(default_factory=lambda: [0])
    damaged_stores: dict[str, Path] = field(default_factory=dict)
    fifos: list[Path] = field(default_factory=list)

    def damaged(self, name: str, damage: Callable[[Path], None]) -> Path:
        """A copy of the shared store with ``damage`` applied once (the copy is shared by the cases naming it)."""
        if name not in self.damaged_stores:
            out = self.root / f"damaged-{name}"
            shutil.copytree(self.store, out)
            damage(out)
            self.damaged_stores[name] = out
        return self.damaged_stores[name]

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


# ------------------------------------------------------------------ ways to damage a store (a copy)
def reseal(path: Path, edit: Callable[[dict[str, Any]], None], indent: int | None = None) -> None:
    """Edit a sealed JSON file (manifest or marker) and seal it again: only field checks can tell."""
    d = json.loads(path.read_text())
    d.pop("checksum", None)
    edit(d)
    path.write_text(json.dumps(seal(d), indent=indent, sort_keys=True))


def set_manifest(key: str, value: Any) -> Callable[[Path], None]:
    def damage(store: Path) -> None:
        def edit(d: dict[str, Any]) -> None:
            *parents, last = key.split(".")
            target = d
            for k in parents:
                target = target[k]
            target[last] = value

        reseal(store / "manifest.json", edit, indent=2)

    return damage


def set_marker(seg: int, edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    return lambda store: reseal(store / "commits" / f"{seg:06d}.json", edit)


def write_file(rel: str, data: bytes) -> Callable[[Path], None]:
    return lambda store: (store / rel).write_bytes(data)


def delete(rel: str) -> Callable[[Path], None]:
    return lambda store: (store / rel).unlink()


def make_fifo(ctx: Ctx, rel: str) -> Callable[[Path], None]:
    def damage(store: Path) -> None:
        (store / rel).unlink()
        os.mkfifo(store / rel)
        ctx.fifos.append(store / rel)

    return damage


def nested(depth: int) -> bytes:
    return ('{"a": ' * depth + "1" + "}" * depth).encode()


def runs_file(store: Path) -> Path:
    return next((store / "tables" / "runs").glob("*.parquet"))


def garbage_table(which: str) -> Callable[[Path], None]:
    """Replace a table file by bytes that are no Parquet, with a matching hash companion (so that only
    the Parquet check can tell)."""

    def damage(store: Path) -> None:
        f = store / "tables" / "heads" / "heads.parquet" if which == "heads" else runs_file(store)
        f.write_bytes(b"PAR1 this is not a parquet file PAR1")
        (f.parent / (f.name + ".sha256")).write_text(hashlib.sha256(f.read_bytes()).hexdigest())

    return damage


def alter_table(which: str) -> Callable[[Path], None]:
    """Replace a table file by another valid Parquet file, leaving its hash companion as it was."""

    def damage(store: Path) -> None:
        f = store / "tables" / "heads" / "heads.parquet" if which == "heads" else runs_file(store)
        f.write_bytes(to_parquet_bytes(pq.read_table(f).slice(1)))

    return damage


def rehash_object(store: Path, seg: int, key: str) -> None:
    """Record the current hash (the marker's ``object_hash``) of ``segments/NNNNNN/<key>`` in the
    segment's marker (a consistent forgery)."""
    marker = store / "commits" / f"{seg:06d}.json"
    algorithm = json.loads(marker.read_text()).get("object_hash", "sha256")
    digest = object_digest((store / "segments" / f"{seg:06d}" / key).read_bytes(), algorithm)
    reseal(marker, lambda d: d["objects"].__setitem__(key, digest))


def huge_shape(rel: str, seg: int | None = None) -> Callable[[Path], None]:
    """A zarr.json claiming 10^12 rows in one-row chunks (re-hashed into the marker for a segment array);
    a sharded array's inner chunks get one row too, so that zarr opens it and the store's checks answer."""

    def damage(store: Path) -> None:
        p = store / rel
        meta = json.loads(p.read_text())
        meta["shape"][0] = 10**12
        meta["chunk_grid"]["configuration"]["chunk_shape"][0] = 1
        for codec in meta["codecs"]:
            if codec["name"] == "sharding_indexed":
                codec["configuration"]["chunk_shape"][0] = 1
        p.write_text(json.dumps(meta))
        if seg is not None:
            rehash_object(store, seg, rel.split("/", 2)[2])

    return damage


def rewrite_table(seg: int, name: str, column: str, value: int) -> Callable[[Path], None]:
    """Set ``column`` of a segment shard to ``value`` and record the new SHA-256 in its marker."""

    def damage(store: Path) -> None:
        p = store / "tables" / name / f"{seg:06d}.parquet"
        t = pq.read_table(p)
        i = t.schema.get_field_index(column)
        t = t.set_column(i, column, pa.array([value] * t.num_rows, t.schema.field(i).type))
        data = to_parquet_bytes(t)
        p.write_bytes(data)
        reseal(
            store / "commits" / f"{seg:06d}.json",
            lambda d: d["table_sha256"].__setitem__(name, hashlib.sha256(data).hexdigest()),
        )

    return damage


def nan_and_inf(store: Path) -> None:
    """Three NaN and two infinite values in segment 1's z chunk, re-hashed into the marker."""
    group = store / "segments" / "000001"
    arr = zarr.open_array(zarr.storage.LocalStore(group / "z"), mode="r+")
    x = np.asarray(arr[...]).copy()
    x[0, 0, 0, :3] = np.nan
    x[1, 0, 0, :2] = np.inf
    arr[...] = x
    rehash_object(store, 1, "z/c.0.0.0.0")


def repeat_segment(store: Path) -> None:
    """Marker 000001.json whose segment field says 0 (a copy of marker 0 under the next name)."""
    shutil.copy(store / "commits" / "000000.json", store / "commits" / "000001.json")


def with_model_name(name: str) -> Callable[[Path], None]:
    return set_manifest("model.name", name)


def maps_args(c: Ctx, store: Path, *extra: str) -> list[str]:
    pairs = c.root / "pairs.json"
    pairs.write_text('[["France", "Paris"], ["Germany", "Berlin"]]')
    return ["maps", str(store), "--pairs", str(pairs), "--no-save", *extra]


def fifo_dataset(c: Ctx) -> list[str]:
    p = c.root / "pipe.jsonl"
    if not p.exists():
        os.mkfifo(p)
        c.fifos.append(p)
    return [*INGEST[:4], f"jsonl:{p}", *INGEST[7:], "--out", str(c.fresh())]


ESCAPES = "\x1b[2J\x1b]0;owned\x07"  # clear the screen, set the window title

CASES = [
    # ---- ingest: data sets
    Case(
        "malformed-jsonl",
        lambda c: ingest_jsonl(c, "bad.jsonl", '{"text": "Paris is the capital of"}\n{"text": "x"\n'),
        "malformed JSON",
    ),
    Case("jsonl-wrong-type", lambda c: ingest_jsonl(c, "types.jsonl", '{"text": 42}\n'), "must be a string"),
    Case(
        "jsonl-not-an-object", lambda c: ingest_jsonl(c, "list.jsonl", '["Paris", "France"]\n'), "JSON object"
    ),
    Case(
        "span-out-of-range",
        lambda c: ingest_jsonl(
            c, "span.jsonl", '{"text": "Paris is the capital of", "subject_span": [0, 99]}\n'
        ),
        "out of range",
    ),
    Case(
        "target-out-of-range",
        lambda c: ingest_jsonl(c, "target.jsonl", '{"text": "Paris is the capital of", "target": 500}\n'),
        "out of range",
    ),
    Case("empty-jsonl", lambda c: ingest_jsonl(c, "empty.jsonl", ""), "jsonl"),
    Case(
        "prompt-past-context",
        lambda c: ingest_jsonl(c, "long.jsonl", json.dumps({"text": LONG}) + "\n"),
        "context",
    ),
    Case(
        "missing-dataset-file",
        lambda c: [*INGEST[:4], f"jsonl:{c.root / 'nope.jsonl'}", *INGEST[7:], "--out", str(c.fresh())],
        "not found",
    ),
    Case(
        "unknown-dataset-kind",
        lambda c: [*INGEST[:4], "wikipedia:/tmp/x", *INGEST[7:], "--out", str(c.fresh())],
        "wikipedia",
    ),
    Case("unknown-relation", lambda c: [*INGEST, "--relations", "P99999", "--out", str(c.fresh())], "P99999"),
    Case(
        "zero-limit",
        lambda c: [*INGEST[:5], "--limit-per-relation", "0", *INGEST[7:], "--out", str(c.fresh())],
        "limit",
    ),
    Case("zero-batch-size", lambda c: [*INGEST, "--batch-size", "0", "--out", str(c.fresh())], "batch-size"),
    Case("bad-dtype", lambda c: [*INGEST, "--dtype", "float8", "--out", str(c.fresh())], "--dtype"),
    # ---- ingest: hostile JSONL (issue 14 item 7)
    Case(
        "jsonl-deeply-nested",
        lambda c: ingest_jsonl(
            c,
            "deep.jsonl",
            '{"text": "Paris is the capital of", "meta": ' + "[" * 100000 + "]" * 100000 + "}\n",
        ),
        "nests deeper",
    ),
    Case(
        "jsonl-lone-surrogate",
        lambda c: ingest_jsonl(c, "surrogate.jsonl", '{"text": "Paris is the capital of \\ud800"}\n'),
        "lone surrogate",
    ),
    Case(
        "jsonl-dev-zero",
        lambda c: [*INGEST[:4], "jsonl:/dev/zero", *INGEST[7:], "--out", str(c.fresh())],
        "not a regular file",
    ),
    Case("jsonl-named-pipe", fifo_dataset, "not a regular file"),
    Case(
        "jsonl-escapes-in-error",
        lambda c: [
            *ingest_jsonl(
                c,
                "escapes.jsonl",
                json.dumps({"text": "Paris is the capital of", "relation_id": ESCAPES}) + "\n",
            ),
            "--relations",
            "P1",
        ],
        "\\x1b]0;owned\\x07",
    ),
    # ---- ingest: models and stores
    Case(
        "unknown-model-name",
        lambda c: [*INGEST[:1], "--model", "no-such-model", *INGEST[3:], "--out", str(c.fresh())],
        "unknown model",
        env={"HF_HUB_OFFLINE": "1"},
    ),
    Case(
        "unknown-model-folder",
        lambda c: [*INGEST[:1], "--model", str(c.root / "no-model"), *INGEST[3:], "--out", str(c.fresh())],
        "unknown model",
    ),
    Case("store-exists", lambda c: [*INGEST, "--out", str(c.store)], "already holds a store"),
    Case(
        "out-is-a-nonempty-dir", lambda c: [*INGEST, "--out", str(c.root / "data")], "not an empty directory"
    ),
    Case("resume-missing-store", lambda c: [*INGEST, "--resume", "--out", str(c.fresh())], "no store"),
    Case(
        "resume-other-settings",
        lambda c: [*INGEST, "--resume", "--dtype", "float32", "--out", str(c.store)],
        "storage_dtype",
    ),
    Case(
        "resume-other-weights",
        lambda c: [
            *INGEST[:1],
            "--model",
            str(c.other_weights),
            *INGEST[3:],
            "--resume",
            "--out",
            str(c.store),
        ],
        "different",
    ),
    Case("resume-newer-format", lambda c: [*INGEST, "--resume", "--out", str(c.newer)], "newer"),
    Case(
        "bad-rank-env",
        lambda c: [*INGEST, "--out", str(c.fresh())],
        "RANK",
        env={"RANK": "3", "WORLD_SIZE": "2"},
    ),
    # ---- reading stores
    Case("missing-store", lambda c: ["info", str(c.root / "nowhere")], "no actstore store"),
    Case("not-a-store", lambda c: ["sql", str(c.root / "data"), "SELECT 1"], "no actstore store"),
    Case("newer-format-info", lambda c: ["info", str(c.newer)], "newer"),
    Case("newer-format-sql", lambda c: ["sql", str(c.newer), "SELECT 1"], "newer"),
    # ---- hostile manifests: every field checked by type and range (issue 14 items 7 and 9)
    Case(
        "manifest-format-version-bool",
        lambda c: ["info", str(c.damaged("fv-bool", set_manifest("format_version", True)))],
        "'format_version' must be an integer, got bool",
    ),
    Case(
        "manifest-format-version-string",
        lambda c: ["info", str(c.damaged("fv-str", set_manifest("format_version", "1")))],
        "'format_version' must be an integer, got str '1'",
    ),
    Case(
        "manifest-storage-dtype-object",
        lambda c: [
            "sql",
            str(c.damaged("dtype-object", set_manifest("storage_dtype", "object"))),
            "SELECT 1",
        ],
        "'storage_dtype' is 'object'",
    ),
    Case(
        "manifest-negative-examples",
        lambda c: ["info", str(c.damaged("n-examples", set_manifest("n_examples", -5)))],
        "'n_examples' is -5",
    ),
    Case(
        "manifest-zero-kv-heads",
        lambda c: [
            "features",
            str(c.damaged("kv-heads", set_manifest("geometry.n_kv_heads", 0))),
            "--kind",
            "z",
            "--out",
            str(c.root / "f.npy"),
        ],
        "'n_kv_heads' is 0",
    ),
    Case(
        "manifest-zero-segment-size",
        lambda c: ["info", str(c.damaged("segment-size", set_manifest("segment_size", 0)))],
        "'segment_size' is 0",
    ),
    Case(
        "manifest-huge-layers",
        lambda c: ["verify", str(c.damaged("layers-int", set_manifest("geometry.n_layers", 10**12)))],
        "'n_layers' is 1000000000000",
    ),
    Case(
        "manifest-float-layers",
        lambda c: ["info", str(c.damaged("layers-float", set_manifest("geometry.n_layers", 1e12)))],
        "'n_layers' must be an integer, got float",
    ),
    Case(
        "manifest-deeply-nested",
        lambda c: ["info", str(c.damaged("manifest-deep", write_file("manifest.json", nested(100000))))],
        "nests deeper",
    ),
    Case(
        "manifest-too-large",
        lambda c: ["info", str(c.damaged("manifest-large", write_file("manifest.json", b" " * (17 << 20))))],
        "more than",
    ),
    Case(
        "manifest-named-pipe-info",
        lambda c: ["info", str(c.damaged("manifest-fifo", make_fifo(c, "manifest.json")))],
        "named pipe",
    ),
    Case(
        "manifest-named-pipe-sql",
        lambda c: ["sql", str(c.damaged("manifest-fifo", make_fifo(c, "manifest.json"))), "SELECT 1"],
        "named pipe",
    ),
    Case(
        "manifest-named-pipe-verify",
        lambda c: ["verify", str(c.damaged("manifest-fifo", make_fifo(c, "manifest.json")))],
        "named pipe",
    ),
    Case(
        "manifest-named-pipe-resume",
        lambda c: [
            *INGEST,
            "--resume",
            "--out",
            str(c.damaged("manifest-fifo", make_fifo(c, "manifest.json"))),
        ],
        "named pipe",
    ),
    # ---- hostile commit markers
    Case(
        "marker-named-pipe-info",
        lambda c: ["info", str(c.damaged("marker-fifo", make_fifo(c, "commits/000001.json")))],
        "named pipe",
    ),
    Case(
        "marker-named-pipe-features",
        lambda c: [
            "features",
            str(c.damaged("marker-fifo", make_fifo(c, "commits/000001.json"))),
            "--kind",
            "z",
            "--out",
            str(c.root / "f.npy"),
        ],
        "named pipe",
    ),
    Case(
        "marker-deeply-nested",
        lambda c: [
            "verify",
            str(c.damaged("marker-deep", write_file("commits/000001.json", nested(100000)))),
        ],
        "nests deeper",
    ),
    Case(
        "marker-too-large",
        lambda c: [
            "info",
            str(c.damaged("marker-large", write_file("commits/000001.json", b" " * (17 << 20)))),
        ],
        "more than",
    ),
    Case(
        "marker-negative-rows",
        lambda c: [
            "verify",
            str(c.damaged("marker-rows", set_marker(1, lambda d: d.__setitem__("n_rows", -1)))),
        ],
        "'n_rows' is -1",
    ),
    Case(
        "marker-huge-sources",
        lambda c: [
            "features",
            str(c.damaged("marker-sources", set_marker(1, lambda d: d.__setitem__("n_sources", 10**15)))),
            "--kind",
            "z",
            "--out",
            str(c.root / "f.npy"),
        ],
        "'n_sources' is 1000000000000000",
    ),
    Case(
        "marker-repeats-segment-info",
        lambda c: ["info", str(c.damaged("repeat", repeat_segment))],
        "segment field says 0",
    ),
    Case(
        "marker-repeats-segment-verify",
        lambda c: ["verify", str(c.damaged("repeat", repeat_segment))],
        "segment field says 0",
    ),
    Case(
        "marker-repeats-segment-resume",
        lambda c: [*INGEST, "--resume", "--out", str(c.damaged("repeat", repeat_segment))],
        "segment field says 0",
    ),
    # ---- hostile arrays and tables: readers refuse, never return zeros or crash
    Case(
        "deleted-chunk",
        lambda c: [
            "features",
            str(c.damaged("chunk", delete("segments/000001/z/c.0.0.0.0"))),
            "--kind",
            "z",
            "--out",
            str(c.root / "f.npy"),
        ],
        "chunk is missing",
    ),
    Case(
        "deleted-zero-weight-chunk",
        lambda c: [
            "features",
            str(c.damaged("b-O", delete("weights/b_O/c/0/0"))),
            "--kind",
            "attn",
            "--out",
            str(c.root / "f.npy"),
        ],
        "chunk is missing",
    ),
    Case(
        "chunk-named-pipe",
        lambda c: [
            "features",
            str(c.damaged("chunk-fifo", make_fifo(c, "segments/000001/z/c.0.0.0.0"))),
            "--kind",
            "z",
            "--out",
            str(c.root / "f.npy"),
        ],
        "named pipe",
    ),
    Case(
        "zarr-shape-1e12",
        lambda c: [
            "features",
            str(c.damaged("shape", huge_shape("segments/000001/z/zarr.json", 1))),
            "--kind",
            "z",
            "--out",
            str(c.root / "f.npy"),
        ],
        "shape (1000000000000, 2, 4, 16)",
    ),
    Case(
        "weights-zarr-shape-1e12",
        lambda c: [
            "features",
            str(c.damaged("w-shape", huge_shape("weights/W_O/zarr.json"))),
            "--kind",
            "attn_head",
            "--out",
            str(c.root / "f.npy"),
        ],
        "shape (1000000000000, 4, 16, 64)",
    ),
    Case(
        "negative-src-start",
        lambda c: [
            "features",
            str(c.damaged("src-start", rewrite_table(1, "targets", "src_start", -5))),
            "--kind",
            "attn_head_token",
            "--out",
            str(c.root / "f.npy"),
        ],
        "offsets outside",
    ),
    Case(
        "garbage-heads-parquet",
        lambda c: [
            "sql",
            str(c.damaged("heads-garbage", garbage_table("heads"))),
            "SELECT count(*) FROM heads",
        ],
        "unreadable Parquet",
    ),
    Case(
        "garbage-runs-parquet",
        lambda c: ["sql", str(c.damaged("runs-garbage", garbage_table("runs"))), "SELECT count(*) FROM runs"],
        "unreadable Parquet",
    ),
    Case(
        "garbage-runs-parquet-info",
        lambda c: ["info", str(c.damaged("runs-garbage", garbage_table("runs")))],
        "unreadable Parquet",
    ),
    Case(
        "altered-heads-table",
        lambda c: [
            "sql",
            str(c.damaged("heads-altered", alter_table("heads"))),
            "SELECT count(*) FROM heads",
        ],
        "SHA-256 does not match",
    ),
    Case(
        "altered-runs-table",
        lambda c: ["sql", str(c.damaged("runs-altered", alter_table("runs"))), "SELECT count(*) FROM runs"],
        "SHA-256 does not match",
    ),
    Case(
        "altered-runs-table-joined",
        lambda c: [
            "sql",
            str(c.damaged("runs-altered", alter_table("runs"))),
            "SELECT count(*) FROM examples, (SELECT 1 FROM runs)",
        ],
        "SHA-256 does not match",
    ),
    # ---- a store's model name is data (issue 14 item 8)
    Case(
        "maps-store-names-a-folder",
        lambda c: maps_args(c, c.damaged("name-etc", with_model_name("../../../../etc"))),
        "not one of actstore's aliases",
    ),
    Case(
        "maps-store-names-a-hub-repo",
        lambda c: maps_args(c, c.damaged("name-hub", with_model_name("attacker/evil-model"))),
        "not one of actstore's aliases",
        env={"HF_ENDPOINT": "http://127.0.0.1:9"},
    ),
    Case(
        "maps-first-mlp-store-name",
        lambda c: maps_args(
            c,
            c.damaged("name-etc", with_model_name("../../../../etc")),
            "--tokenizer",
            "tiny-llama",
            "--first-mlp",
        ),
        "--model: the store's model",
    ),
    Case(
        "maps-store-name-escapes",
        lambda c: maps_args(c, c.damaged("name-escapes", with_model_name("\x1b]0;owned\x07x"))),
        "\\x1b]0;owned\\x07x",
    ),
    # ---- SQL: read-only, confined to the store
    Case("sql-create", lambda c: ["sql", str(c.store), "CREATE TABLE t AS SELECT 1"], "read-only"),
    Case("sql-delete", lambda c: ["sql", str(c.store), "DELETE FROM examples"], "read-only"),
    Case(
        "sql-copy-out",
        lambda c: ["sql", str(c.store), f"COPY examples TO '{c.root / 'leak.csv'}'"],
        "read-only",
    ),
    Case("sql-attach", lambda c: ["sql", str(c.store), f"ATTACH '{c.root / 'x.duckdb'}' AS x"], "read-only"),
    Case("sql-install", lambda c: ["sql", str(c.store), "INSTALL httpfs"], "read-only"),
    Case("sql-load", lambda c: ["sql", str(c.store), "LOAD httpfs"], "read-only"),
    Case("sql-set", lambda c: ["sql", str(c.store), "SET enable_external_access = true"], "read-only"),
    Case("sql-read-file", lambda c: ["sql", str(c.store), "SELECT * FROM read_csv('/etc/passwd')"], "SQL"),
    Case("sql-read-file-bare", lambda c: ["sql", str(c.store), "SELECT * FROM '/etc/hostname'"], "SQL"),
    Case(
        "sql-read-parquet-outside",
        lambda c: [
            "sql",
            str(c.store),
            f"SELECT * FROM read_parquet('{c.newer}/tables/heads/heads.parquet')",
        ],
        "SQL",
    ),
    Case("sql-two-statements", lambda c: ["sql", str(c.store), "SELECT 1; SELECT 2"], "one statement"),
    Case("sql-syntax", lambda c: ["sql", str(c.store), "SELEC 1"], "SQL error"),
    Case("sql-unknown-table", lambda c: ["sql", str(c.store), "SELECT * FROM secrets"], "secrets"),
    # ---- features
    Case(
        "features-bad-layers",
        lambda c: ["features", str(c.store), "--kind", "z", "--layers", "7", "--out", str(c.root / "f.npy")],
        "layer 7",
    ),
    Case(
        "features-layers-not-ints",
        lambda c: [
            "features",
            str(c.store),
            "--kind",
            "z",
            "--layers",
            "one",
            "--out",
            str(c.root / "f.npy"),
        ],
        "--layers",
    ),
    Case(
        "features-bad-kind",
        lambda c: ["features", str(c.store), "--kind", "everything", "--out", str(c.root / "f.npy")],
        "feature kind",
    ),
    Case(
        "features-heads-on-resid",
        lambda c: [
            "features",
            str(c.store),
            "--kind",
            "resid",
            "--heads",
            "0",
            "--out",
            str(c.root / "f.npy"),
        ],
        "--heads",
    ),
    Case(
        "features-where-reads-file",
        lambda c: [
            "features",
            str(c.store),
            "--kind",
            "z",
            "--where",
            "example_id IN (SELECT 1 FROM read_csv('/etc/passwd'))",
            "--out",
            str(c.root / "f.npy"),
        ],
        "SQL",
    ),
    Case(
        "features-empty-selection",
        lambda c: [
            "features",
            str(c.store),
            "--kind",
            "z",
            "--where",
            "false",
            "--out",
            str(c.root / "f.npy"),
        ],
        "empty",
    ),
    # ---- probes
    Case(
        "probe-bad-layers",
        lambda c: [
            "probe",
            str(c.store),
            "--kind",
            "attn_head",
            "--layers",
            "9",
            "--episodes",
            "2",
            "--seeds",
            "1",
            "--quiet",
            "--no-save",
        ],
        "layer 9",
    ),
    Case(
        "probe-bad-kind",
        lambda c: [
            "probe",
            str(c.store),
            "--kind",
            "nothing",
            "--episodes",
            "2",
            "--seeds",
            "1",
            "--quiet",
            "--no-save",
        ],
        "nothing",
    ),
    # ---- S3
    Case(
        "s3-wrong-secret",
        lambda c: ["info", f"s3://{bucket(c)}/store"],
        "access denied",
        env={"AWS_SECRET_ACCESS_KEY": "not-the-secret"},
        s3=True,
    ),
    Case(
        "s3-unknown-key",
        lambda c: ["sql", f"s3://{bucket(c)}/store", "SELECT 1"],
        "access denied",
        env={"AWS_ACCESS_KEY_ID": "AKIANOSUCHKEY0000000"},
        s3=True,
    ),
    Case(
        "s3-unreachable-endpoint",
        lambda c: ["verify", f"s3://{bucket(c)}/store"],
        "cannot reach",
        env={"AWS_ENDPOINT_URL": "closed", "AWS_MAX_ATTEMPTS": "1"},
        s3=True,
    ),
    Case("s3-missing-bucket", lambda c: ["info", "s3://no-such-bucket/store"], "does not exist", s3=True),
    Case(
        "s3-ingest-wrong-secret",
        lambda c: [*INGEST, "--out", f"s3://{bucket(c)}/new"],
        "access denied",
        env={"AWS_SECRET_ACCESS_KEY": "not-the-secret"},
        s3=True,
    ),
    Case(
        "s3-ingest-missing-bucket",
        lambda c: [*INGEST, "--out", "s3://no-such-bucket/new"],
        "does not exist",
        s3=True,
    ),
]


def snapshot(root: Path) -> dict[str, str]:
    """SHA-256 of every regular file under ``root``; other entries (named pipes) by type, never opened."""
    out: dict[str, str] = {}
    for p in sorted(root.rglob("*")):
        mode = p.lstat().st_mode
        if stat.S_ISREG(mode):
            out[p.relative_to(root).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
        elif not stat.S_ISDIR(mode):
            out[p.relative_to(root).as_posix()] = f"special {stat.S_IFMT(mode):o}"
    return out


@contextmanager
def unblock_fifos(fifos: list[Path], after_s: float = 60.0) -> Iterator[list[Path]]:
    """If a command blocks opening one of ``fifos`` (the bug), open its other end after ``after_s`` so
    that the test fails instead of hanging; yields the list of pipes that had to be unblocked."""
    fired: list[Path] = []

    def unblock() -> None:
        for f in fifos:
            try:
                fd = os.open(f, os.O_WRONLY | os.O_NONBLOCK)  # succeeds only if a reader is blocked on it
            except OSError:
                continue
            fired.append(f)
            os.close(fd)

    timer = threading.Timer(after_s, unblock)
    timer.start()
    try:
        yield fired
    finally:
        timer.cancel()


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory) -> Ctx:
    from actstore.ingest.models.tiny import tiny_model

    root = tmp_path_factory.mktemp("hostile")
    store = root / "store"
    r = CliRunner().invoke(main, [*INGEST, "--out", str(store)])
    assert r.exit_code == 0, r.stderr
    # The cases damage markers and shards: the read path of a store without a snapshot (an ingest still
    # running).  A compacted store's own damage cases are in tests/integration/core/test_compaction.py.
    uncompact(store)
    newer = root / "newer"
    r = CliRunner().invoke(main, [*INGEST, "--out", str(newer)])
    assert r.exit_code == 0, r.stderr
    m = json.loads((newer / "manifest.json").read_text())
    m.pop("checksum")
    m["format_version"] = FORMAT_VERSION + 1
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
        use_server_env(mp, server)
        r = CliRunner().invoke(main, [*INGEST, "--out", f"s3://{server.bucket}/store"])
        assert r.exit_code == 0, r.stderr
        ctx.s3 = server
        yield ctx
        ctx.s3 = None


def s3_snapshot(server: S3Server) -> dict[str, str]:
    import boto3

    s3 = boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        region_name="us-east-1",
        aws_access_key_id=server.env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=server.env["AWS_SECRET_ACCESS_KEY"],
    )
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
    fresh_before = c.fresh_count[0]
    args = case.args(c)  # builds the damaged store the case reads, if any
    watched = [
        ("store", c.store),
        ("newer", c.newer),
        ("data", c.root / "data"),
        *((name, p) for name, p in c.damaged_stores.items() if str(p) in args),
    ]
    before = {name: snapshot(p) for name, p in watched}
    remote = s3_snapshot(c.s3) if c.s3 else None
    with unblock_fifos(c.fifos) as unblocked:
        result = CliRunner().invoke(main, args, env=env)
    assert not unblocked, f"the command blocked on {unblocked}"
    assert result.exit_code != 0, (args, result.stdout)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert case.needle.lower() in lines[0].lower(), lines[0]
    assert lines[0].isprintable(), lines[0]  # control characters from a store or data set come out escaped
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit)
    for name, p in watched:
        assert snapshot(p) == before[name], f"{name} changed"
    for i in range(fresh_before + 1, c.fresh_count[0] + 1):
        out = c.root / f"fresh-{i}"
        assert not out.exists() or not any(out.iterdir()), f"{out} holds a partial store"
    if c.s3:
        assert s3_snapshot(c.s3) == remote


# ------------------------------------------------------------------ verify: every loss is reported
@dataclass(frozen=True)
class VerifyCase:
    name: str
    damage: Callable[[Ctx], Callable[[Path], None]]
    problems: tuple[str, ...]  # one needle per expected PROBLEM line, in order
    status: str = "CORRUPT"
    values: bool = False


def strip_object_list(seg: int) -> Callable[[Path], None]:
    return set_marker(seg, lambda d: d.pop("objects"))


def rehash_heads(store: Path) -> None:
    """Another heads table (a row short) with a matching hash companion: only the geometry can tell."""
    f = store / "tables" / "heads" / "heads.parquet"
    alter_table("heads")(store)
    (f.parent / "heads.parquet.sha256").write_text(hashlib.sha256(f.read_bytes()).hexdigest())


def swap_chunk(store: Path) -> None:
    """Segment 1's attn chunk replaced by segment 0's: a valid chunk (its CRC passes), but not this one."""
    a, b = (store / "segments" / f"00000{i}" / "attn" / "c.0.0.0" for i in (0, 1))
    b.write_bytes(a.read_bytes())


VERIFY_CASES = [
    VerifyCase(
        "deleted-chunk",
        lambda c: delete("segments/000001/z/c.0.0.0.0"),
        ("segments/000001/z: chunk 0 (rows 0:4, every layer 0..1) is missing",),
    ),
    VerifyCase(
        "deleted-zero-weight-chunk",
        lambda c: delete("weights/b_O/c/0/0"),
        ("weights/b_O: chunk 0 (rows 0:1, layer 0) is missing",),  # one layer per chunk
    ),
    VerifyCase(
        "deleted-chunk-listing",
        lambda c: delete("segments/000000/zarr.json"),
        (
            "cannot open array",
            "cannot open array",
            "cannot open array",
            "cannot open array",
            "cannot open array",
            "segments/000000/zarr.json is missing",
        ),
    ),
    VerifyCase(
        "swapped-chunk",
        lambda c: swap_chunk,
        (
            "segments/000001/attn: chunk 0 (rows 0:79, every layer 0..1) is corrupt: XXH3-128 does not match the commit marker",
        ),
    ),
    VerifyCase(
        "nan-and-inf",
        lambda c: nan_and_inf,
        ("segments/000001/z: chunk 0 (rows 0:4, every layer 0..1) holds 3 NaN and 2 infinite values",),
        values=True,
    ),
    VerifyCase(
        "deleted-marker",
        lambda c: delete("commits/000001.json"),
        ("segment 1 (rows 8..11) is not committed although its data is there",),
        status="INCOMPLETE",
    ),
    VerifyCase(
        "deleted-marker-and-data",
        lambda c: (
            lambda s: [
                shutil.rmtree(p) if p.is_dir() else p.unlink()
                for p in (
                    s / "segments" / "000001",
                    s / "commits" / "000001.json",
                    *s.glob("tables/*/000001.parquet"),
                )
            ]
        ),
        ("segment 1 of 2 not committed and without data (4 rows)",),
        status="INCOMPLETE",
    ),
    VerifyCase(
        "stripped-object-list",
        lambda c: strip_object_list(1),
        ("segments 1: commit markers lack the object list",),
    ),
    VerifyCase(
        "altered-heads-table",
        lambda c: alter_table("heads"),
        ("tables/heads/heads.parquet: SHA-256 does not match heads.parquet.sha256",),
    ),
    VerifyCase(
        "rehashed-heads-table",
        lambda c: rehash_heads,
        ("tables/heads/heads.parquet: not the (layer, head, kv_head) table of the store's geometry",),
    ),
    VerifyCase("altered-runs-table", lambda c: alter_table("runs"), ("SHA-256 does not match",)),
    VerifyCase(
        "deleted-runs-hash",
        lambda c: lambda s: (runs_file(s).parent / (runs_file(s).name + ".sha256")).unlink(),
        ("1 table file(s) without a .sha256 companion",),
    ),
    VerifyCase("garbage-runs-parquet", lambda c: garbage_table("runs"), ("unreadable Parquet",)),
    VerifyCase(
        "negative-tok-start",
        lambda c: rewrite_table(1, "examples", "tok_start", -5),
        ("tables/examples/000001: token offsets run outside the v array",),
    ),
    VerifyCase(
        "negative-src-start",
        lambda c: rewrite_table(1, "targets", "src_start", -5),
        ("tables/targets/000001: source offsets run outside the attn array",),
    ),
    VerifyCase(
        "zarr-shape-1e12",
        lambda c: huge_shape("segments/000001/z/zarr.json", 1),
        ("segments/000001/z: shape (1000000000000, 2, 4, 16) but the store says (4, 2, 4, 16)",),
    ),
    VerifyCase(
        "weights-zarr-shape-1e12",
        lambda c: huge_shape("weights/W_O/zarr.json"),
        ("weights/W_O: shape (1000000000000, 4, 16, 64) but the store says (2, 4, 16, 64)",),
    ),
    VerifyCase(
        "chunk-named-pipe",
        lambda c: make_fifo(c, "segments/000001/z/c.0.0.0.0"),
        ("segments/000001/z: chunk 0 (rows 0:4, every layer 0..1) cannot be read",),
    ),
]


@pytest.mark.parametrize("case", VERIFY_CASES, ids=[c.name for c in VERIFY_CASES])
def test_verify_reports_loss(case: VerifyCase, ctx: Ctx) -> None:
    store = ctx.damaged(f"verify-{case.name}", case.damage(ctx))
    before = snapshot(store), snapshot(ctx.root / "data")
    with unblock_fifos(ctx.fifos) as unblocked:
        result = CliRunner().invoke(main, ["verify", str(store), *(["--values"] if case.values else [])])
    assert not unblocked, f"verify blocked on {unblocked}"
    assert result.exit_code == 3, (result.stdout, result.stderr)  # 3: verify found damage
    assert result.stdout.startswith(f"{case.status}: "), result.stdout
    problems = [line for line in result.stderr.splitlines() if line.startswith("PROBLEM ")]
    assert len(problems) == len(case.problems), result.stderr
    for line, needle in zip(problems, case.problems):
        assert needle in line, (needle, line)
    assert (snapshot(store), snapshot(ctx.root / "data")) == before


def test_nan_passes_without_values_and_the_intact_store_verifies(ctx: Ctx) -> None:
    """Values are scanned only on request (float16 activations may overflow on purpose); the shared store is ok."""
    store = ctx.damaged("verify-nan-and-inf", nan_and_inf)
    for path in (store, ctx.store):
        result = CliRunner().invoke(main, ["verify", str(path)])
        chunks = sum(  # every chunk file of the segments' and the weights' arrays (c/0/.., c.0...)
            1
            for f in path.rglob("*")
            if f.is_file()
            and f.relative_to(path).parts[0] in ("segments", "weights")
            and is_chunk_key(f.relative_to(path).as_posix())
        )
        assert result.exit_code == 0 and result.stdout.startswith(
            f"ok: 2 segments, {chunks} chunks checked"
        ), result.output
    result = CliRunner().invoke(main, ["verify", str(ctx.store), "--values", "--json"])
    report = json.loads(result.stdout)
    assert result.exit_code == 0 and report["ok"] and report["values_checked"] and report["notes"] == []


def test_every_chunk_is_written_and_listed(ctx: Ctx) -> None:
    """All-zero chunks (a bias-free model's b_O) exist on disk; each marker lists every object of its segment."""
    b_o = zarr.open_array(zarr.storage.LocalStore(ctx.store / "weights" / "b_O"), mode="r")
    assert not np.asarray(b_o[...]).any() and (ctx.store / "weights" / "b_O" / "c" / "0" / "0").is_file()
    for seg in (0, 1):
        marker = json.loads((ctx.store / "commits" / f"00000{seg}.json").read_text())
        folder = ctx.store / "segments" / f"00000{seg}"
        assert marker["object_hash"] == "xxh3"  # (format 4)
        on_disk = {
            p.relative_to(folder).as_posix(): xxhash.xxh3_128_hexdigest(p.read_bytes())
            for p in folder.rglob("*")
            if p.is_file()
        }
        assert marker["objects"] == on_disk
    for f in [ctx.store / "tables" / "heads" / "heads.parquet", runs_file(ctx.store)]:
        assert (f.parent / (f.name + ".sha256")).read_text() == hashlib.sha256(f.read_bytes()).hexdigest()


def make_old(store: Path) -> None:
    """The store as a writer before integrity 1 left it: no object lists, no table hashes, no
    ``integrity`` field, and all-zero chunks (b_O, b_V, b_down of a bias-free model) never written."""
    for seg in (0, 1):
        strip_object_list(seg)(store)
    for f in store.rglob("*.sha256"):
        f.unlink()
    reseal(store / "manifest.json", lambda d: d.pop("integrity"), indent=2)
    for name in ("b_O", "b_V", "b_down"):
        shutil.rmtree(store / "weights" / name / "c")


@pytest.mark.parametrize("command", ["verify", "info"])
def test_old_store_is_refused_with_one_line(ctx: Ctx, command: str) -> None:
    old = ctx.damaged("old", make_old)
    before = snapshot(old)
    result = CliRunner().invoke(main, [command, str(old)])
    assert result.exit_code != 0 and result.stdout == "", result.output
    lines = result.stderr.splitlines()
    assert (
        len(lines) == 1
        and f"written by an earlier actstore (format {FORMAT_VERSION}, integrity 0" in lines[0]
    ), lines
    assert lines[0].endswith("ingest it again (actstore ingest ... --overwrite)")
    assert snapshot(old) == before


def test_store_strings_are_printed_escaped(ctx: Ctx) -> None:
    """Relation names with terminal escape sequences (from a data set, so from the store) come out escaped."""
    data = ctx.root / "escape-rel.jsonl"
    data.write_text(json.dumps({"text": "Paris is the capital of", "relation_id": ESCAPES}) + "\n")
    out = ctx.root / "escape-store"
    r = CliRunner().invoke(main, [*INGEST[:4], f"jsonl:{data}", *INGEST[7:], "--out", str(out)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["info", str(out)])
    assert r.exit_code == 0 and "\x1b" not in r.stdout and "\x07" not in r.stdout
    assert "\\x1b[2J\\x1b]0;owned\\x07" in r.stdout
