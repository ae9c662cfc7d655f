"""The one way a job records its run: its result tables, each row tagged with the run id, then
the run's row in the ``runs`` table (written last, so a run listed there has all its tables)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import pyarrow as pa

from actstore.core.runs import new_run_id, with_run_id, write_run
from actstore.core.store import StoreReader
from actstore.core.writer import write_result_table

R = TypeVar("R")


@dataclass(frozen=True)
class RecordedRun:
    """What :func:`record_run` wrote: the run's id and its tables' paths inside the store."""

    run_id: str
    tables: list[str] = field(default_factory=list)


def record_run(
    store: StoreReader,
    kind: str,
    config: Mapping[str, Any] | str,
    tables: Mapping[str, pa.Table],
    *,
    started: float,
    finished: float | None = None,
    run_id: str | None = None,
    row_groups: Mapping[str, int] | None = None,
) -> RecordedRun:
    """Write ``tables`` (result table name -> Arrow table) under ``run_id`` (a new ``kind`` id when
    None), then the run's ``runs`` row with ``config`` (``finished``: now when None); return the id
    and the tables' paths."""
    run_id = run_id or new_run_id(kind)
    groups = row_groups or {}
    paths = [
        write_result_table(store, name, run_id, with_run_id(t, run_id), groups.get(name))
        for name, t in tables.items()
    ]
    write_run(store, run_id, kind, started, config, finished=finished)
    return RecordedRun(run_id, paths)


def read_run_column(table: pa.Table, name: str) -> pa.Table:
    """``table`` with its ``run_id`` column renamed ``name``: for a job whose rows describe another
    run (``probe_run``), so that ``run_id`` can name the job's own run."""
    if "run_id" not in table.column_names:
        return table
    return table.rename_columns([name if c == "run_id" else c for c in table.column_names])


@dataclass
class AnalysisOutcome(Generic[R]):
    """An analysis job's ``result``, its figures' paths, and the run it recorded (``run_id`` None and no
    tables when not saved): ``correlate``, ``shortcuts``, ``topk``."""

    result: R
    run_id: str | None = None
    figures: list[str] = field(default_factory=list)
    tables: list[str] = field(default_factory=list)

    def record(
        self,
        store: StoreReader,
        kind: str,
        config: Mapping[str, Any],
        tables: Mapping[str, pa.Table],
        started: float,
    ) -> None:
        """Record the run (:func:`record_run`) and keep its id and tables' paths."""
        recorded = record_run(store, kind, config, tables, started=started)
        self.run_id, self.tables = recorded.run_id, recorded.tables
