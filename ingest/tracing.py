"""Old import path of :mod:`ingest.interventions.tracing` (causal tracing); kept so that
``from ingest.tracing import ...`` keeps working."""

from __future__ import annotations

from ingest.interventions.tracing import (
    COMPONENTS,
    TRACE_EFFECTS,
    TRACE_FACTS,
    CausalTracer,
    GroupedEditRunner,
    StoredFact,
    TraceConfig,
    TraceError,
    TraceResult,
    effects_table,
    facts_table,
    stored_facts,
    subject_embedding_std,
    trace_facts,
    window_layers,
)

__all__ = [
    "COMPONENTS", "TRACE_EFFECTS", "TRACE_FACTS", "CausalTracer", "GroupedEditRunner", "StoredFact", "TraceConfig",
    "TraceError", "TraceResult", "effects_table", "facts_table", "stored_facts", "subject_embedding_std",
    "trace_facts", "window_layers",
]
