"""Figures the analysis commands draw (matplotlib, Agg), until one plotting module holds them all.

ROME-style causal-tracing heatmaps (position x layer, one panel per component), the
per-position-class average of those, lens curves per layer, the methods' mean per-layer
profiles, and the HeadScore layer x head heatmap.  Each function writes one PNG and returns its
path.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

_CMAPS = {"resid": "Purples", "mlp": "Greens", "attn": "Reds"}
_TITLES = {"resid": "single restored layer (residual)", "mlp": "restored MLP (window)",
           "attn": "restored attention (window)"}
ROLE_ORDER = ("subject_first", "subject_middle", "subject_last", "first_after", "further_after", "last")


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def trace_heatmap(result: Any, path: Path) -> Path:
    """One fact: P(object) with the clean state restored, tokens (rows) x layers (columns), per component."""
    plt = _plt()
    f = result.fact
    comps = list(result.restored)
    fig, axes = plt.subplots(1, len(comps), figsize=(4.2 * len(comps), 0.32 * f.n_tokens + 1.6), squeeze=False)
    labels = [t + ("*" if f.subject_span[0] <= i < f.subject_span[1] else "") for i, t in enumerate(f.tokens)]
    for ax, c in zip(axes[0], comps):
        grid = result.restored[c].T  # [T, L]
        im = ax.imshow(grid, cmap=_CMAPS.get(c, "viridis"), aspect="auto", vmin=min(result.p_corrupt, grid.min()))
        ax.set_yticks(range(f.n_tokens))
        ax.set_yticklabels(labels, fontsize=7)
        ax.set_xlabel("layer")
        ax.set_title(_TITLES.get(c, c), fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.046).set_label(f"p({f.object!r})", fontsize=7)
    fig.suptitle(f"{f.subject} -> {f.object}: p_clean {result.p_clean:.3f}, p_corrupt {result.p_corrupt:.3f}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def position_class(p: int, span: tuple[int, int], n: int) -> str | None:
    """ROME's averaging classes (Meng et al. 2022, Fig. 1e-g); None before the subject."""
    s0, s1 = span
    if p == n - 1:
        return "last"
    if s0 <= p < s1:
        return "subject_first" if p == s0 else ("subject_last" if p == s1 - 1 else "subject_middle")
    if p == s1:
        return "first_after"
    return "further_after" if p > s1 else None


def average_by_class(results: Sequence[Any], component: str) -> np.ndarray:
    """Mean indirect effect per ROME position class x layer: [len(ROLE_ORDER), L] (NaN: no such token)."""
    L = next(iter(results)).restored[component].shape[0]
    sums = np.zeros((len(ROLE_ORDER), L))
    counts = np.zeros(len(ROLE_ORDER))
    for r in results:
        f = r.fact
        ie = r.indirect_effect(component)
        per: dict[str, list[int]] = {}
        for p in range(f.n_tokens):
            c = position_class(p, f.subject_span, f.n_tokens)
            if c is not None:
                per.setdefault(c, []).append(p)
        for c, ps in per.items():
            k = ROLE_ORDER.index(c)
            sums[k] += ie[:, ps].mean(axis=1)
            counts[k] += 1
    with np.errstate(invalid="ignore"):
        return sums / counts[:, None]


def trace_average_heatmap(results: Sequence[Any], path: Path) -> Path:
    """Mean indirect effect per ROME position class (rows) and layer (columns), one panel per component."""
    plt = _plt()
    comps = list(results[0].restored)
    fig, axes = plt.subplots(1, len(comps), figsize=(4.2 * len(comps), 3.2), squeeze=False)
    for ax, c in zip(axes[0], comps):
        grid = average_by_class(results, c)
        im = ax.imshow(grid, cmap=_CMAPS.get(c, "viridis"), aspect="auto")
        ax.set_yticks(range(len(ROLE_ORDER)))
        ax.set_yticklabels([r.replace("_", " ") for r in ROLE_ORDER], fontsize=7)
        ax.set_xlabel("layer")
        ax.set_title(f"average indirect effect: {c}", fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(f"causal tracing, {len(results)} facts", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def lens_curves(summary: Sequence[dict[str, Any]], path: Path, title: str) -> Path:
    """Mean p(object) and median object rank per residual index, logit lens and tuned lens."""
    plt = _plt()
    x = [r["index"] for r in summary]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, style in (("logit", "-"), ("tuned", "--")):
        if f"{name}_prob" not in summary[0]:
            continue
        a1.plot(x, [r[f"{name}_prob"] for r in summary], style, label=f"{name} lens")
        a2.plot(x, [max(r[f"{name}_rank_median"], 0.5) for r in summary], style, label=f"{name} lens")
    a1.set_xlabel("residual index (0 = embeddings)")
    a1.set_ylabel("mean p(object)")
    a2.set_xlabel("residual index (0 = embeddings)")
    a2.set_ylabel("median object rank")
    a2.set_yscale("log")
    for a in (a1, a2):
        a.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def profile_curves(readings: Sequence[Any], path: Path, title: str) -> Path:
    """Each method's mean per-layer profile, scaled to a maximum of 1."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for r in readings:
        m = np.nanmean(r.profile, axis=0)
        top = np.nanmax(np.abs(m)) if np.isfinite(m).any() else 0
        ax.plot(m / top if top else m, label=f"{r.method} (n={len(r.example_ids)})")
    ax.set_xlabel("layer")
    ax.set_ylabel("mean profile / max")
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def headscore_heatmap(grid: np.ndarray, layers: Sequence[int], heads: Sequence[int], path: str | Path,
                      title: str) -> Path:
    """Mean HeadScore, layers (rows) x heads (columns), diverging colours around 0.  ``grid``: [L, H]."""
    plt = _plt()

    fig, ax = plt.subplots(figsize=(1.5 + 0.35 * len(heads), 1.5 + 0.2 * len(layers)))
    lim = float(abs(grid[~(grid != grid)]).max()) if grid.size else 1.0
    im = ax.imshow(grid, aspect="auto", cmap="RdBu_r", vmin=-lim, vmax=lim, origin="lower")
    ax.set_xticks(range(len(heads)), [str(h) for h in heads], fontsize=7)
    ax.set_yticks(range(len(layers)), [str(x) for x in layers], fontsize=7)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=8)
    fig.colorbar(im)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
