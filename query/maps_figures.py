"""Figures for MAPS results: layer x head heatmaps (matplotlib, Agg backend, PNG files)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "relation"


def head_heatmap(scores: np.ndarray, path: str | Path, title: str, *, label: str = "score",
                 vmax: float | None = None, threshold: float | None = None) -> Path:
    """A [layers, heads] heatmap; cells at or above ``threshold`` are outlined.  Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L, H = scores.shape
    fig, ax = plt.subplots(figsize=(max(3.0, 0.35 * H + 2.0), max(3.0, 0.22 * L + 1.5)))
    im = ax.imshow(scores, aspect="auto", origin="lower", cmap="viridis", vmin=0.0,
                   vmax=vmax if vmax is not None else max(float(np.nanmax(scores)), 1e-6))
    if threshold is not None:
        ys, xs = np.nonzero(scores >= threshold)
        for y, x in zip(ys, xs):
            ax.add_patch(plt.Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.0))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(H))
    ax.set_yticks(range(0, L, max(1, L // 15)))
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label=label)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
