"""Max-activating contexts (``actstore topk``): the top ``k`` rows of every unit of one layer, from one
streaming pass (:func:`actstore.query.analyses.topk.top_activations`), recorded as the ``topk_contexts`` result
table of a ``topk`` run.

    out = run_topk(store, kind="mlp", layer=3, k=20)
    out.result.values, out.run_id, out.tables
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from actstore.core.store import StoreReader
from actstore.jobs.record import record_run
from actstore.query.analyses.topk import TopK, top_activations
from actstore.query.select.selection import Selection


@dataclass
class TopkOutcome:
    run_id: str | None  # None when not saved
    result: TopK
    tables: list[str] = field(default_factory=list)


def run_topk(
    store: StoreReader,
    *,
    kind: str,
    layer: int,
    k: int = 20,
    where: str | None = None,
    on: str = "resid",
    directions: np.ndarray | None = None,
    direction_file: str | None = None,
    batch_rows: int = 1024,
    save: bool = True,
) -> TopkOutcome:
    """Select the rows (``where``: one predicate over ``examples``), find the top ``k`` of every unit,
    record the run (unless ``save`` is False)."""

    started = time.time()
    sel = Selection.from_sql(store, where)
    res = top_activations(sel, kind, layer, k, on=on, directions=directions, batch_rows=batch_rows)
    out = TopkOutcome(None, res)
    if save:
        config = {"kind": kind, "layer": layer, "k": k, "where": where, "rows": len(sel)}
        if kind == "direction":
            config.update(on=on, direction_file=direction_file, units=int(res.values.shape[0]))
        recorded = record_run(store, "topk", config, {"topk_contexts": res.table}, started=started)
        out.run_id, out.tables = recorded.run_id, recorded.tables
    return out
