"""The method-comparison metrics of a study (``actstore study run``): recorded as a ``methods``
run (``method_metrics``, ``method_pair_metrics`` and, across model sizes, ``method_cross_size``)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from actstore.core.store import StoreReader
from actstore.jobs.record import record_run
from actstore.query.methods.tables import MetricsResult


def record_method_metrics(
    store: StoreReader,
    run_id: str,
    result: MetricsResult,
    cross: pa.Table | None,
    config: Mapping[str, Any],
    started: float,
) -> list[str]:
    """Write the metrics tables and the run's row; return the tables' paths."""
    tables = {"method_metrics": result.metrics, "method_pair_metrics": result.pairs}
    if cross is not None:
        tables["method_cross_size"] = cross
    return record_run(
        store, "methods", config, tables, started=started, finished=time.time(), run_id=run_id
    ).tables
