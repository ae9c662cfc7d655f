"""Figures for MAPS results: layer x head heatmaps written as PNG files (:mod:`actstore.query.analyses.plotting`)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from actstore.query.analyses import plotting


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "relation"


def head_heatmap(
    scores: np.ndarray,
    path: str | Path,
    title: str,
    *,
    label: str = "score",
    vmax: float | None = None,
    threshold: float | None = None,
) -> Path:
    """A [layers, heads] heatmap from 0 to ``vmax`` (default the largest score); cells at or above
    ``threshold`` are outlined.  Returns the path."""
    L, H = scores.shape
    top = vmax if vmax is not None else max(float(np.nanmax(scores)), 1e-6)
    fig = plotting.heatmap(
        scores,
        title=title,
        vmin=0.0,
        vmax=top,
        colorbar_label=label,
        outline_at_least=threshold,
        figsize=(max(3.0, 0.35 * H + 2.0), max(3.0, 0.22 * L + 1.5)),
    )
    return plotting.save_png(fig, path, dpi=110)
