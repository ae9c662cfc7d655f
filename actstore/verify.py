"""``actstore verify``: read every byte of a store and check it against what was committed.

Checks: the manifest parses; every committed segment's arrays decode (the CRC32C codec
fails on any flipped byte) and have the shapes the commit marker records; every table
shard's SHA-256 matches its marker; the ragged offsets in the tables stay inside the flat
arrays; the weights decode.  Problems are collected, not raised, so one run reports all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zarr

from actstore.errors import ActstoreError
from actstore.store import SEGMENT_ARRAYS, Store, segment_name
from actstore.tables import SEGMENT_TABLES, sha256


@dataclass
class VerifyReport:
    store: str
    segments_checked: int = 0
    chunks_checked: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _expected_shape(store: Store, name: str, n_rows: int, n_src: int, n_tok: int) -> tuple[int, ...]:
    g = store.geometry
    return {
        "z": (n_rows, g.n_layers, g.n_heads, g.d_head),
        "attn": (n_src, g.n_layers, g.n_heads),
        "v": (n_tok, g.n_layers, g.n_kv_heads, g.d_head),
        "resid": (n_rows, g.n_layers + 1, g.d_model),
        "mlp": (n_rows, g.n_layers, g.d_mlp),
    }[name]


def _check_array(report: VerifyReport, where: str, arr: zarr.Array) -> None:
    chunk = int(arr.chunks[0]) if arr.ndim else 1
    n = int(arr.shape[0]) if arr.ndim else 1
    for i, lo in enumerate(range(0, max(n, 1), chunk)):
        try:
            np.asarray(arr[lo:lo + chunk] if arr.ndim else arr[...])
            report.chunks_checked += 1
        except Exception as e:
            report.problems.append(f"{where}: chunk {i} (rows {lo}:{min(lo + chunk, n)}) is corrupt: {type(e).__name__}: {e}")


def verify_store(store: Store) -> VerifyReport:
    report = VerifyReport(store.url)
    loc = store.location
    for seg, commit in store.commits.items():
        report.segments_checked += 1
        for name in SEGMENT_ARRAYS:
            where = f"segments/{segment_name(seg)}/{name}"
            try:
                arr = store.array(seg, name)
            except ActstoreError as e:
                report.problems.append(str(e))
                continue
            want = _expected_shape(store, name, commit.n_rows, commit.n_sources, commit.n_tokens)
            if tuple(arr.shape) != want:
                report.problems.append(f"{where}: shape {tuple(arr.shape)} but the commit says {want}")
            _check_array(report, where, arr)
        tables: dict[str, pa.Table] = {}
        for name in SEGMENT_TABLES:
            rel = f"tables/{name}/{segment_name(seg)}.parquet"
            try:
                data = loc.read_bytes(rel)
            except FileNotFoundError:
                report.problems.append(f"{rel}: missing (segment {seg} is committed)")
                continue
            if sha256(data) != commit.table_sha256.get(name):
                report.problems.append(f"{rel}: SHA-256 does not match the commit marker (table corrupted)")
                continue
            tables[name] = pq.read_table(pa.BufferReader(data))
        if "targets" in tables:
            t = tables["targets"]
            end = (t.column("src_start").to_numpy() + t.column("n_src").to_numpy())
            if t.num_rows != commit.n_rows:
                report.problems.append(f"tables/targets/{segment_name(seg)}: {t.num_rows} rows, commit says {commit.n_rows}")
            if end.size and (end.max() > commit.n_sources or t.column("src_start").to_numpy().min() < 0):
                report.problems.append(f"tables/targets/{segment_name(seg)}: source offsets run past the attn array")
            rows = t.column("row").to_numpy()
            if rows.size and not np.array_equal(rows, np.arange(commit.row_start, commit.row_start + rows.size)):
                report.problems.append(f"tables/targets/{segment_name(seg)}: rows are not {commit.row_start}..")
        if "examples" in tables:
            ex = tables["examples"]
            end = ex.column("tok_start").to_numpy() + ex.column("n_tokens").to_numpy()
            if end.size and end.max() > commit.n_tokens:
                report.problems.append(f"tables/examples/{segment_name(seg)}: token offsets run past the v array")
    try:
        group = store._weights_group
        for name in sorted(group.array_keys()):
            warr = group[name]
            assert isinstance(warr, zarr.Array)
            _check_array(report, f"weights/{name}", warr)
    except ActstoreError as e:
        report.problems.append(str(e))
    return report
