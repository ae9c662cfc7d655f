"""Causal tracing: its results and their tables (see :mod:`actstore.interventions.tracing`; its
settings, :class:`~actstore.interventions.settings.TraceConfig`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from actstore.core.tables import rows_table
from actstore.interventions.facts import StoredFact
from actstore.interventions.settings import TraceConfig


def window_layers(layer: int, window: int, n_layers: int) -> range:
    """ROME's window of layers restored together around ``layer``."""
    return range(max(0, layer - window // 2), min(n_layers, layer - (-window // 2)))


# ------------------------------------------------------------------------------------ results


@dataclass
class TraceResult:
    """One fact's trace.  Grids are [L, T] (layer x position) per component."""

    fact: StoredFact
    p_clean: float
    p_corrupt: float  # mean over samples
    p_corrupt_samples: np.ndarray  # [samples]
    noise_std: float
    restored: dict[str, np.ndarray] = field(default_factory=dict)  # component -> [L, T] mean P(o) restored

    @property
    def total_effect(self) -> float:
        return self.p_clean - self.p_corrupt

    def indirect_effect(self, component: str) -> np.ndarray:
        return self.restored[component] - self.p_corrupt

    def to_json(self) -> dict[str, Any]:
        f = self.fact
        return {
            "example_id": f.example_id,
            "relation_id": f.relation_id,
            "subject": f.subject,
            "object": f.object,
            "tokens": list(f.tokens),
            "subject_span": list(f.subject_span),
            "p_clean": self.p_clean,
            "p_corrupt": self.p_corrupt,
            "total_effect": self.total_effect,
            "noise_std": self.noise_std,
            "indirect_effect": {c: np.round(self.indirect_effect(c), 6).tolist() for c in self.restored},
        }


TRACE_EFFECTS = pa.schema(
    [
        ("example_id", pa.int64()),
        ("component", pa.string()),
        ("layer", pa.int32()),
        ("position", pa.int32()),
        ("token", pa.string()),
        ("role", pa.string()),
        ("prob", pa.float64()),
        ("indirect_effect", pa.float64()),
    ]
)
TRACE_FACTS = pa.schema(
    [
        ("example_id", pa.int64()),
        ("relation_id", pa.string()),
        ("subject", pa.string()),
        ("object", pa.string()),
        ("subject_start", pa.int32()),
        ("subject_end", pa.int32()),
        ("n_tokens", pa.int32()),
        ("p_clean", pa.float64()),
        ("p_corrupt", pa.float64()),
        ("total_effect", pa.float64()),
        ("noise_std", pa.float64()),
        ("samples", pa.int32()),
        ("window", pa.int32()),
    ]
)


def effects_table(results: Sequence[TraceResult]) -> pa.Table:
    """One row per (fact, component, layer, position): restored probability and indirect effect."""
    rows = []
    for r in results:
        f = r.fact
        roles = [_role(p, f.subject_span) for p in range(f.n_tokens)]
        for c, grid in r.restored.items():
            rows += [
                (f.example_id, c, layer, p, f.tokens[p], roles[p], float(x), float(x - r.p_corrupt))
                for (layer, p), x in np.ndenumerate(grid)
            ]
    return rows_table(rows, TRACE_EFFECTS)


def facts_table(results: Sequence[TraceResult], cfg: TraceConfig) -> pa.Table:
    rows = [
        {
            "example_id": r.fact.example_id,
            "relation_id": r.fact.relation_id,
            "subject": r.fact.subject,
            "object": r.fact.object,
            "subject_start": r.fact.subject_span[0],
            "subject_end": r.fact.subject_span[1],
            "n_tokens": r.fact.n_tokens,
            "p_clean": r.p_clean,
            "p_corrupt": r.p_corrupt,
            "total_effect": r.total_effect,
            "noise_std": r.noise_std,
            "samples": cfg.samples,
            "window": cfg.window,
        }
        for r in results
    ]
    return pa.Table.from_pylist(rows, schema=TRACE_FACTS)


def _role(p: int, span: tuple[int, int]) -> str:
    """ROME's position classes: first/middle/last subject token, after the subject, the last token."""
    s0, s1 = span
    if s0 <= p < s1:
        return "subject_first" if p == s0 else ("subject_last" if p == s1 - 1 else "subject_middle")
    return "before_subject" if p < s0 else "after_subject"


# ------------------------------------------------------------------------------------ clean states


STATE_KEY: dict[str, Callable[[int], tuple[str, int]]] = {
    "resid": lambda layer: ("resid", layer + 1),
    "mlp": lambda layer: ("mlp", layer),
    "attn": lambda layer: ("attn", layer),
}
"""Hook point a restoration of (component, layer) sets: resid at layer l is the output of layer l."""


@dataclass
class CleanStates:
    """One fact's clean run: P(object) and every state restorations need."""

    p: float
    states: dict[tuple[str, int], torch.Tensor]  # hook key -> [T, d_model] clean activations
