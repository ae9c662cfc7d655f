"""Interventions on a model's forward pass, and the experiments built on them.

* :mod:`actstore.ingest.interventions.runner`               batched forward passes with edits (:class:`InterventionRunner`),
                                                   head ablation and stored head means;
* :mod:`actstore.ingest.interventions.facts`                a store's facts, ready to trace or patch;
* :mod:`actstore.ingest.interventions.tracing`              causal tracing (ROME), with its settings and results in
                                                   :mod:`~actstore.ingest.interventions.trace_results` and the
                                                   incremental restorations in
                                                   :mod:`~actstore.ingest.interventions.tracing_incremental`;
* :mod:`actstore.ingest.interventions.patching`             activation patching between facts of one relation;
* :mod:`actstore.ingest.interventions.ablation`             the MAPS causal check (ablate a relation's heads).

The runner's names are re-exported here, so ``from actstore.ingest.interventions import InterventionRunner``
keeps working; the experiments are imported from their modules.
"""

from __future__ import annotations

from actstore.core.errors import InterventionError
from actstore.ingest.interventions.runner import (
    COMPONENTS,
    OPS,
    Intervention,
    InterventionRunner,
    RunItem,
    RunResult,
    head_ablation,
    stored_head_means,
)

__all__ = [
    "COMPONENTS",
    "OPS",
    "Intervention",
    "InterventionError",
    "InterventionRunner",
    "RunItem",
    "RunResult",
    "head_ablation",
    "stored_head_means",
]
