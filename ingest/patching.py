"""Old import path of :mod:`ingest.interventions.patching` (activation patching); kept so that
``from ingest.patching import ...`` keeps working."""

from __future__ import annotations

from ingest.interventions.patching import (
    COMPONENTS,
    PATCH_EFFECTS,
    PATCH_PAIRS,
    POSITIONS,
    ActivationPatcher,
    PatchConfig,
    PatchError,
    PatchPair,
    PatchResult,
    choose_counterfactuals,
    effects_table,
    pairs_table,
    patch_pairs,
    position_of,
)

__all__ = [
    "COMPONENTS", "PATCH_EFFECTS", "PATCH_PAIRS", "POSITIONS", "ActivationPatcher", "PatchConfig", "PatchError",
    "PatchPair", "PatchResult", "choose_counterfactuals", "effects_table", "pairs_table", "patch_pairs",
    "position_of",
]
