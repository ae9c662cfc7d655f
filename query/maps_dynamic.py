"""Old import path of :mod:`query.maps.dynamic` (MAPS dynamic ranks and correlations); kept so that
``from query.maps_dynamic import ...`` keeps working."""

from __future__ import annotations

from query.maps.dynamic import (
    CORRELATION_SCHEMA,
    DynamicRanks,
    PromptSelection,
    correlation_summary,
    correlation_table,
    dynamic_ranks,
    head_table,
    rank_block,
    usable_prompts,
)

__all__ = [
    "CORRELATION_SCHEMA", "DynamicRanks", "PromptSelection", "correlation_summary", "correlation_table",
    "dynamic_ranks", "head_table", "rank_block", "usable_prompts",
]
