"""Predictors of per-relation probe accuracy (``actstore correlate``): one probe run's F1 per relation
against output range, knowledge-graph connectivity, TF-IDF similarity and HeadScore concentration,
recorded as a run of its own (``relation_predictors``, ``correlations``; ``probe_run`` names the run
it read).

    out = run_correlate(store, CorrelateConfig(probe_run="probe-..."))
    out.result.correlations, out.run_id, out.tables
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict

from actstore.core.store import StoreReader
from actstore.jobs.record import AnalysisOutcome, read_run_column
from actstore.jobs.settings import CorrelateConfig
from actstore.query.analyses.dask_tasks import dask_client
from actstore.query.analyses.predictors import PredictorResult, relation_predictors, scatter_plots

CorrelateOutcome = AnalysisOutcome[PredictorResult]


def run_correlate(store: StoreReader, cfg: CorrelateConfig) -> CorrelateOutcome:
    """Compute the predictors and their correlations with F1, draw the figures, record the run."""
    started = time.time()
    with dask_client(cfg.dask_address, cfg.workers) as client:
        res = relation_predictors(
            store,
            cfg.probe_run,
            kb=[os.path.abspath(f) for f in cfg.kb],
            direction=cfg.direction,
            client=client,
            concentration=cfg.concentration,
            dataset_file=cfg.dataset_file,
            output_range=cfg.output_range,
        )
    out = CorrelateOutcome(res, figures=scatter_plots(res, cfg.figures) if cfg.figures else [])
    if cfg.save:
        tables = {
            "relation_predictors": read_run_column(res.relations, "probe_run"),
            "correlations": read_run_column(res.correlations, "probe_run"),
        }
        config = {
            k: v for k, v in asdict(cfg).items() if k not in ("save", "figures", "dask_address", "workers")
        }
        out.record(store, "correlate", config, tables, started)
    return out
