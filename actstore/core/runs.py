"""Run records: one id scheme, one schema of the ``runs`` table, one writer.

Every analysis or ingest that writes into a store names itself with a run id
(``KIND-YYYYMMDDTHHMMSS-xxxxxxxx``), tags the rows of its result tables with it, and adds one row
to the ``runs`` table (``tables/runs/RUN_ID.parquet``)::

    run_id = new_run_id("maps")
    write_table(store, "maps_scores", run_id, with_run_id(table, run_id))
    write_run(store, run_id, "maps", started, config={"k": 10})

``code_version`` is the version of the code that *made the run* (``actstore.__version__`` when it
ran), not the version that ingested the store (that one is the manifest's ``code_version``).

Part of the store core: imports nothing from ``ingest`` or ``query``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Protocol

import pyarrow as pa

from actstore.core.storage.base import StoreLocation
from actstore.core.tables import to_parquet_bytes

RUNS_TABLE = "runs"

RUNS_SCHEMA = pa.schema(
    [
        pa.field("run_id", pa.string()),
        pa.field(
            "kind", pa.string()
        ),  # ingest, probe, maps, maps-dynamic, lens, agree, trace, patch, ablate, ...
        pa.field("started", pa.float64()),  # seconds since the epoch
        pa.field("finished", pa.float64()),
        pa.field("segments_written", pa.int64()),  # ingest: segments this process committed; analyses: 0
        pa.field("rank", pa.int64()),
        pa.field("world_size", pa.int64()),
        pa.field("config", pa.string()),  # JSON of the run's settings, keys sorted
        pa.field("code_version", pa.string()),
    ]
)


class HasLocation(Protocol):
    """A store or a store writer: anything with the store's :class:`StoreLocation`."""

    location: StoreLocation


def code_version() -> str:
    """The installed actstore version (the code making a run)."""
    try:
        return version("actstore")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0+unknown"


def new_run_id(kind: str) -> str:
    """``KIND-YYYYMMDDTHHMMSS-xxxxxxxx``: local time of creation and 8 random hex digits.

    Ids sort by time within a kind; the random part keeps two runs of one second apart."""
    if not kind or not kind.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"run kind {kind!r} must be letters, digits, '-' or '_'")
    return f"{kind}-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"


def config_json(config: Mapping[str, Any] | str) -> str:
    """``config`` as the ``runs.config`` text: JSON with sorted keys (a string is kept as it is)."""
    return config if isinstance(config, str) else json.dumps(dict(config), sort_keys=True, default=str)


def run_record(
    run_id: str,
    kind: str,
    started: float,
    config: Mapping[str, Any] | str,
    *,
    finished: float | None = None,
    segments_written: int = 0,
    rank: int = 0,
    world_size: int = 1,
) -> pa.Table:
    """One row of the ``runs`` table (schema :data:`RUNS_SCHEMA`); ``finished`` defaults to now."""
    return pa.table(
        {
            "run_id": [run_id],
            "kind": [kind],
            "started": [float(started)],
            "finished": [float(time.time() if finished is None else finished)],
            "segments_written": [int(segments_written)],
            "rank": [int(rank)],
            "world_size": [int(world_size)],
            "config": [config_json(config)],
            "code_version": [code_version()],
        },
        schema=RUNS_SCHEMA,
    )


def write_run(
    target: HasLocation,
    run_id: str,
    kind: str,
    started: float,
    config: Mapping[str, Any] | str,
    **fields: Any,
) -> str:
    """Add the run's row (:func:`run_record`, whose keywords ``fields`` are) to the ``runs`` table of
    ``target`` (a Store or a StoreWriter), atomically; return the file's path inside the store."""
    rel = f"tables/{RUNS_TABLE}/{run_id}.parquet"
    table = run_record(run_id, kind, started, config, **fields)
    target.location.write_bytes_atomic(rel, to_parquet_bytes(table))
    return rel


def with_run_id(table: pa.Table, run_id: str) -> pa.Table:
    """``table`` with a leading ``run_id`` column, so runs can be told apart in SQL (kept when present)."""
    if "run_id" in table.column_names:
        return table
    return table.add_column(0, "run_id", pa.array([run_id] * table.num_rows, pa.string()))
