"""``actstore verify``'s check of a committed segment's table shards: each one's hash against its
commit marker, its Parquet footer, and the row and span columns against the segment's arrays."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from actstore.core.manifest import SegmentCommit
from actstore.core.segments import segment_name
from actstore.core.store import StoreReader
from actstore.core.tables import MAX_TABLE_BYTES
from actstore.core.verify_report import VerifyReport, read_hashed

_SPAN_COLUMNS = {
    "targets": ("row", "segment", "seg_row", "src_start", "n_src"),
    "examples": ("tok_start", "n_tokens"),
}


def check_segment_tables(store: StoreReader, report: VerifyReport, commit: SegmentCommit) -> None:
    seg = commit.segment
    tables: dict[str, pa.Table] = {}
    for name in store.manifest.segment_tables:
        rel = f"tables/{name}/{segment_name(seg)}.parquet"
        data = read_hashed(
            store,
            report,
            rel,
            MAX_TABLE_BYTES,
            commit.table_sha256.get(name),
            f"segment {seg} is committed",
            "the commit marker (table corrupted)",
        )
        if data is None:
            continue
        try:  # only the columns checked below are decoded (the shard's hash matched its marker)
            pf = pq.ParquetFile(pa.BufferReader(data))
            if name in _SPAN_COLUMNS:
                tables[name] = pf.read(columns=list(_SPAN_COLUMNS[name]), use_threads=False)  # (small)
        except Exception as e:
            report.problems.append(f"{rel}: unreadable Parquet ({type(e).__name__}: {e})")
    seg_rel = segment_name(seg)
    try:
        if "targets" in tables:
            t = tables["targets"]
            _check_spans(
                report,
                f"tables/targets/{seg_rel}",
                t,
                commit.n_rows,
                ("src_start", "n_src"),
                commit.n_sources,
                "source",
                "attn",
            )
            rows = t.column("row").to_numpy()
            if rows.size and not np.array_equal(
                rows, np.arange(commit.row_start, commit.row_start + rows.size)
            ):
                report.problems.append(f"tables/targets/{seg_rel}: rows are not {commit.row_start}..")
            seg_rows = t.column("seg_row").to_numpy()
            if (
                not np.array_equal(seg_rows, np.arange(seg_rows.size))
                or (t.column("segment").to_numpy() != seg).any()
            ):
                report.problems.append(
                    f"tables/targets/{seg_rel}: segment/seg_row columns do not match segment {seg}"
                )
        if "examples" in tables:
            _check_spans(
                report,
                f"tables/examples/{seg_rel}",
                tables["examples"],
                commit.n_rows,
                ("tok_start", "n_tokens"),
                commit.n_tokens,
                "token",
                "v",
            )
    except (KeyError, pa.ArrowException) as e:
        report.problems.append(f"tables/*/{seg_rel}: a column is missing or has the wrong type ({e})")


def _check_spans(
    report: VerifyReport,
    rel: str,
    table: pa.Table,
    n_rows: int,
    columns: tuple[str, str],
    bound: int,
    what: str,
    array: str,
) -> None:
    """``table`` has the commit's ``n_rows`` rows, and its spans (``columns``: start, length) lie in
    ``0..bound`` of the flat ``array``."""
    start, length = (table.column(c).to_numpy() for c in columns)
    if table.num_rows != n_rows:
        report.problems.append(f"{rel}: {table.num_rows} rows, commit says {n_rows}")
    if start.size and (start.min() < 0 or length.min() < 0 or (start + length).max() > bound):
        report.problems.append(f"{rel}: {what} offsets run outside the {array} array (0..{bound})")
