"""Any direction decomposed over a corpus store with sources (``actstore dfa``): the top ``k``
(position, layer, head, source) terms of ``u``'s direct attribution and the per-head and per-MLP
totals over the rows ``where`` selects (:mod:`actstore.query.analyses.dfa`), recorded as the
``dfa_terms`` and ``dfa_totals`` result tables of a ``dfa`` run.

    out = run_dfa(store, DfaConfig(direction="token:42", k=20))
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from actstore.core.store import StoreReader
from actstore.jobs.model import direction_for
from actstore.jobs.record import record_run
from actstore.jobs.settings import DfaConfig
from actstore.query.analyses.dfa import DfaResult, dfa_top
from actstore.query.select.corpus_sources import require_sources
from actstore.query.select.selection import Selection


@dataclass
class DfaOutcome:
    run_id: str | None
    result: DfaResult
    rows: int
    tables: list[str] = field(default_factory=list)


def run_dfa(store: StoreReader, cfg: DfaConfig) -> DfaOutcome:
    """Check everything (sources, direction, layers) before reading a row; then stream and record."""
    started = time.time()
    assert cfg.direction is not None
    layers = (store.manifest.ingest.get("kept") or {}).get("z") if cfg.layers is None else list(cfg.layers)
    require_sources(store, layers or [])
    u = direction_for(store, cfg.direction)
    sel = Selection.from_sql(store, cfg.where)
    rows = sel.rows.column("row").to_numpy().astype(np.int64)
    res = dfa_top(store, rows, u, cfg.k, cfg.layers, cfg.batch_rows)
    out = DfaOutcome(None, res, int(rows.size))
    if cfg.save:
        config = {
            "direction": cfg.direction,
            "k": cfg.k,
            "layers": cfg.layers,
            "where": cfg.where,
            "rows": out.rows,
        }
        recorded = record_run(
            store, "dfa", config, {"dfa_terms": res.terms, "dfa_totals": res.totals}, started=started
        )
        out.run_id, out.tables = recorded.run_id, recorded.tables
    return out
