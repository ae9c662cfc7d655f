"""Interventions on a model's forward pass, and the experiments built on them.

* :mod:`ingest.interventions.runner`               batched forward passes with edits (:class:`InterventionRunner`),
                                                   head ablation and stored head means;
* :mod:`ingest.interventions.facts`                a store's facts, ready to trace or patch;
* :mod:`ingest.interventions.tracing`              causal tracing (ROME), with its settings and results in
                                                   :mod:`~ingest.interventions.trace_results` and the
                                                   incremental restorations in
                                                   :mod:`~ingest.interventions.tracing_incremental`;
* :mod:`ingest.interventions.patching`             activation patching between facts of one relation;
* :mod:`ingest.interventions.ablation`             the MAPS causal check (ablate a relation's heads).

The runner's names are re-exported here, so ``from ingest.interventions import InterventionRunner``
keeps working; the experiments are imported from their modules.
"""

from __future__ import annotations

from ingest.interventions.runner import (
    COMPONENTS,
    OPS,
    Intervention,
    InterventionError,
    InterventionRunner,
    RunItem,
    RunResult,
    head_ablation,
    stored_head_means,
)

__all__ = [
    "COMPONENTS", "OPS", "Intervention", "InterventionError", "InterventionRunner", "RunItem", "RunResult",
    "head_ablation", "stored_head_means",
]
