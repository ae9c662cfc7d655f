"""Causal tracing (``actstore trace``): one settings object (:class:`TraceRequest`, in
:mod:`actstore.jobs.settings`) to its result tables and ``runs`` row.

out = run_trace(store, TraceRequest(model=None, limit=3))     # model None: the store's own
out.results, out.run_id, out.tables
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actstore.core.progress import progress_bar
from actstore.core.runs import new_run_id
from actstore.core.store import StoreReader
from actstore.interventions.runner import InterventionRunner
from actstore.interventions.tracing import (
    CausalTracer,
    TraceError,
    effects_table,
    facts_table,
    stored_facts,
    subject_embedding_std,
)
from actstore.jobs.model import load_request_model
from actstore.jobs.record import record_run
from actstore.jobs.settings import TraceRequest
from actstore.query.select.selection import Selection

__all__ = ["TraceOutcome", "TraceRequest", "run_trace"]


@dataclass
class TraceOutcome:
    run_id: str
    results: list[Any]
    noise_std: float
    config: dict[str, Any]
    seconds: float
    tables: list[str] = field(default_factory=list)
    figures: list[str] = field(default_factory=list)


def run_trace(store: StoreReader, req: TraceRequest) -> TraceOutcome:
    """Causal tracing of the store's facts: noise on the subject, clean states restored per layer
    and position.  Settings are checked before the model loads."""

    started = time.time()
    cfg = req.trace
    cfg.validate(store.geometry.n_layers)
    facts = stored_facts(
        store, Selection.from_sql(store, req.where), correct_only=not req.all_facts, limit=req.limit
    )
    if not facts:
        raise TraceError(
            f"{store.url}: no facts to trace"
            + (f" where {req.where}" if req.where else "")
            + (
                ""
                if req.all_facts
                else " that the model answers correctly (wrong answers are left out unless all facts are asked for)"
            )
        )
    model, loaded = load_request_model(store, req)
    runner = InterventionRunner(loaded.model)
    std = (
        req.noise_std
        if req.noise_std is not None
        else cfg.noise_scale * subject_embedding_std(loaded.model, store, runner.arch)
    )
    tracer = CausalTracer(runner, cfg, std)
    t0 = time.time()
    with progress_bar(total=len(facts), unit="fact", desc="trace", enabled=not req.quiet) as bar:
        results = tracer.trace(facts, progress=bar.update)
    out = TraceOutcome(new_run_id("trace"), results, std, dict(cfg.__dict__), time.time() - t0)
    if req.save:
        config = {**cfg.__dict__, **req.facts_config(model), "noise_std": std, "all_facts": req.all_facts}
        tables = {"trace_effects": effects_table(results), "trace_facts": facts_table(results, cfg)}
        out.tables += record_run(store, "trace", config, tables, started=started, run_id=out.run_id).tables
    if req.figures:
        from actstore.query.analyses.plotting import trace_average_heatmap, trace_heatmap

        folder = Path(req.figures)
        folder.mkdir(parents=True, exist_ok=True)
        out.figures.append(str(trace_average_heatmap(results, folder / "trace_average.png")))
        for r in results[: req.max_figures]:
            out.figures.append(str(trace_heatmap(r, folder / f"trace_{r.fact.example_id}.png")))
    return out
