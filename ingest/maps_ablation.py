"""Old import path of :mod:`ingest.interventions.ablation` (the MAPS causal check); kept so that
``from ingest.maps_ablation import ...`` keeps working."""

from __future__ import annotations

from ingest.interventions.ablation import (
    ROW_SCHEMA,
    AblationConfig,
    AblationError,
    AblationResult,
    Prompts,
    choose_controls,
    pairs_from_store,
    relation_prompts,
    run_ablation,
)

__all__ = [
    "ROW_SCHEMA", "AblationConfig", "AblationError", "AblationResult", "Prompts", "choose_controls",
    "pairs_from_store", "relation_prompts", "run_ablation",
]
