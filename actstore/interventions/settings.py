"""The interventions' settings, for the modules of this floor.

They are defined torch-free below it, because importing any module of :mod:`actstore.interventions`
runs its ``__init__``, which loads the runner and torch, and the command line builds the options of
``actstore trace | patch | ablate`` from them without loading a model: :class:`TraceConfig` and
:class:`PatchConfig` in :mod:`actstore.core.intervention_settings`, the MAPS causal check's
:class:`AblationConfig` (it defaults to the MAPS defaults) in :mod:`actstore.query.maps.settings`."""

from __future__ import annotations

from actstore.core.intervention_settings import (
    PATCH_COMPONENTS,
    POSITIONS,
    TRACE_COMPONENTS,
    PatchConfig,
    TraceConfig,
)
from actstore.query.maps.settings import ABLATION_MODES, AblationConfig

__all__ = [
    "ABLATION_MODES",
    "PATCH_COMPONENTS",
    "POSITIONS",
    "TRACE_COMPONENTS",
    "AblationConfig",
    "PatchConfig",
    "TraceConfig",
]
