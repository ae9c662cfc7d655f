"""Figures, written once: layer x head heatmaps, figure creation, and PNG output.

Every figure of the project (the HTML report, MAPS heatmaps, predictor scatter plots, the shortcut
figure, and the command line's trace and probe heatmaps) is made here or with the helpers here.

Figures are :class:`matplotlib.figure.Figure` objects drawn by the Agg renderer.  They are made
without ``pyplot``, so nothing here selects a global backend (``matplotlib.use``), nothing is kept
in pyplot's figure registry (no ``plt.close`` to forget), and importing this module changes no
state of a notebook that uses matplotlib interactively.

    fig = heatmap(scores, rows=layers, cols=heads, title="HeadScore", diverging=True)
    save_png(fig, "out/headscore.png")            # or png_bytes(fig) / data_uri(png_bytes(fig))

Grids are ``[rows, cols]`` arrays (``[n_layers, n_heads]`` for a layer x head grid); with
``origin="lower"`` (the default) row 0 is drawn at the bottom, as layers are stacked.
"""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.image import AxesImage
from matplotlib.patches import Rectangle

from actstore.core.errors import QueryError

if TYPE_CHECKING:
    from typing_extensions import Unpack

Origin = Literal["lower", "upper"]

#: Colour map of a diverging heatmap (negative blue, zero white, positive red).
DIVERGING_CMAP = "RdBu_r"
#: Colour map of a one-sided heatmap.
SEQUENTIAL_CMAP = "viridis"


def new_figure(
    ncols: int = 1, nrows: int = 1, *, figsize: tuple[float, float] = (6.4, 4.8)
) -> tuple[Figure, Any]:
    """A figure and its axes as a ``[nrows, ncols]`` object array (always 2-D, like ``squeeze=False``)."""
    fig = Figure(figsize=figsize)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def png_bytes(fig: Figure, dpi: float = 80) -> bytes:
    """The figure as PNG bytes at ``dpi``."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def save_png(fig: Figure, path: str | os.PathLike[str], dpi: float = 100) -> Path:
    """Write the figure as a PNG file (parent folders made as needed) and return its path."""
    out = Path(path)
    if out.parent != Path(""):
        out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=dpi)
    return out


def data_uri(png: bytes) -> str:
    """A ``data:image/png;base64,...`` URI holding ``png`` (for self-contained HTML)."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def label_ticks(
    ax: Axes, axis: Literal["x", "y"], labels: Sequence[object], *, fontsize: float = 7, max_ticks: int = 16
) -> None:
    """A tick at every cell of an image axis (every n-th when there are more than ~``max_ticks``),
    labelled with ``labels[i]``."""
    step = max(1, len(labels) // max_ticks)
    pos = list(range(0, len(labels), step))
    names = [str(labels[i]) for i in pos]
    if axis == "x":
        ax.set_xticks(pos, names, fontsize=fontsize)
    else:
        ax.set_yticks(pos, names, fontsize=fontsize)


def symmetric_limits(grid: np.ndarray) -> tuple[float, float]:
    """``(-m, m)`` with ``m`` the largest finite ``|value|`` of ``grid`` (1 when there is none or it is 0)."""
    g = np.asarray(grid, dtype=np.float64)
    finite = np.abs(g[np.isfinite(g)])
    m = float(finite.max()) if finite.size else 0.0
    m = m or 1.0
    return -m, m


def outline_cells(ax: Axes, mask: np.ndarray, *, color: str = "red", linewidth: float = 0.8) -> None:
    """Outline the cells where ``mask`` ([rows, cols], boolean) is true on an image drawn by :func:`draw_heatmap`
    (cell centres at integer data coordinates, whatever the image's origin)."""
    ys, xs = np.nonzero(np.asarray(mask))
    for y, x in zip(ys.tolist(), xs.tolist()):
        ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, edgecolor=color, linewidth=linewidth))


def draw_heatmap(
    ax: Axes,
    grid: np.ndarray,
    *,
    rows: Sequence[object] | None = None,
    cols: Sequence[object] | None = None,
    title: str | None = None,
    xlabel: str | None = "head",
    ylabel: str | None = "layer",
    cmap: str | None = None,
    diverging: bool = False,
    vmin: float | None = None,
    vmax: float | None = None,
    origin: Origin = "lower",
    colorbar: bool = True,
    colorbar_label: str | None = None,
    outline_at_least: float | None = None,
    fontsize: float = 8,
    tick_fontsize: float = 7,
    max_ticks: int = 16,
) -> AxesImage:
    """Draw ``grid`` ([rows, cols]) on ``ax``: cell ``(i, j)`` is row ``i`` (``rows[i]``, counted from the
    bottom with ``origin="lower"``, from the top with ``"upper"``) and column ``j`` (``cols[j]``).

    ``diverging``: limits symmetric around 0 (unless ``vmin``/``vmax`` are given) and the diverging colour
    map (unless ``cmap`` is given).  ``rows``/``cols``: tick labels (default the indices).
    ``outline_at_least``: cells whose value is at least this are outlined in red.  NaN cells stay blank."""
    g = _grid(grid)
    if diverging:
        lo, hi = symmetric_limits(g)
        vmin = lo if vmin is None else vmin
        vmax = hi if vmax is None else vmax
    colours = cmap or (DIVERGING_CMAP if diverging else SEQUENTIAL_CMAP)
    fig = ax.get_figure()
    assert fig is not None
    im = ax.imshow(
        g, aspect="auto", origin=origin, cmap=colours, vmin=vmin, vmax=vmax, interpolation="nearest"
    )
    if outline_at_least is not None:
        with np.errstate(invalid="ignore"):
            outline_cells(ax, g >= outline_at_least)
    along: tuple[tuple[Literal["x", "y"], int, Sequence[object] | None], ...] = (
        ("x", g.shape[1], cols),
        ("y", g.shape[0], rows),
    )
    for axis, n, labels in along:
        ticks = list(range(n)) if labels is None else list(labels)
        label_ticks(ax, axis, ticks, fontsize=tick_fontsize, max_ticks=max_ticks)
    if xlabel:
        ax.set_xlabel(xlabel, fontsize=fontsize)
    if ylabel:
        ax.set_ylabel(ylabel, fontsize=fontsize)
    if title:
        ax.set_title(title, fontsize=fontsize)
    if colorbar:
        bar = fig.colorbar(im, ax=ax, fraction=0.05)
        if colorbar_label:
            bar.set_label(colorbar_label, fontsize=fontsize)
    return im


def heatmap_size(n_rows: int, n_cols: int) -> tuple[float, float]:
    """A figure size (inches) that keeps cells readable without growing without bound."""
    return min(9.0, 1.8 + 0.32 * n_cols), min(7.0, 1.4 + 0.16 * n_rows)


class HeatmapOptions(TypedDict, total=False):
    """The keyword options of :func:`draw_heatmap` (and :func:`heatmap`), for type checkers; their
    defaults are written once, in :func:`draw_heatmap`."""

    rows: Sequence[object] | None
    cols: Sequence[object] | None
    title: str | None
    xlabel: str | None
    ylabel: str | None
    cmap: str | None
    diverging: bool
    vmin: float | None
    vmax: float | None
    origin: Origin
    colorbar: bool
    colorbar_label: str | None
    outline_at_least: float | None
    fontsize: float
    tick_fontsize: float
    max_ticks: int


def heatmap(
    grid: np.ndarray, *, figsize: tuple[float, float] | None = None, **options: Unpack[HeatmapOptions]
) -> Figure:
    """One heatmap figure of ``grid`` ([rows, cols], e.g. [n_layers, n_heads]), sized by
    :func:`heatmap_size` unless ``figsize`` is given; options as :func:`draw_heatmap`."""
    g = _grid(grid)
    fig, axes = new_figure(figsize=figsize or heatmap_size(g.shape[0], g.shape[1]))
    draw_heatmap(axes[0, 0], g, **options)
    fig.tight_layout()
    return fig


def _grid(grid: np.ndarray) -> np.ndarray:
    """``grid`` as a float64 array, refused unless 2-D."""
    g = np.asarray(grid, dtype=np.float64)
    if g.ndim != 2:
        raise QueryError(f"a heatmap needs a 2-D grid (got shape {g.shape})")
    return g


# ------------------------------------------------------------------ the analysis commands' figures
# ROME-style causal-tracing heatmaps (position x layer, one panel per component), the
# per-position-class average of those, lens curves per layer, the methods' mean per-layer profiles,
# and the HeadScore layer x head heatmap.  Each function writes one PNG and returns its path.

_TRACE_CMAPS = {"resid": "Purples", "mlp": "Greens", "attn": "Reds"}
_TRACE_TITLES = {
    "resid": "single restored layer (residual)",
    "mlp": "restored MLP (window)",
    "attn": "restored attention (window)",
}
#: ROME's position classes (Meng et al. 2022, Fig. 1e-g), in the order the average heatmap draws them.
ROLE_ORDER = ("subject_first", "subject_middle", "subject_last", "first_after", "further_after", "last")


def trace_heatmap(result: Any, path: str | os.PathLike[str]) -> Path:
    """One traced fact (an ``actstore.interventions.tracing.TraceResult``): P(object) with the clean state
    restored, tokens (rows, top to bottom) x layers (columns), one panel per component."""
    f = result.fact
    comps = list(result.restored)
    fig, axes = new_figure(len(comps), figsize=(4.2 * len(comps), 0.32 * f.n_tokens + 1.6))
    labels = [t + ("*" if f.subject_span[0] <= i < f.subject_span[1] else "") for i, t in enumerate(f.tokens)]
    for ax, c in zip(axes[0], comps):
        grid = np.asarray(result.restored[c]).T  # [T, L]
        draw_heatmap(
            ax,
            grid,
            rows=labels,
            xlabel="layer",
            ylabel=None,
            title=_TRACE_TITLES.get(c, c),
            cmap=_TRACE_CMAPS.get(c, SEQUENTIAL_CMAP),
            vmin=min(result.p_corrupt, float(np.nanmin(grid))),
            origin="upper",
            colorbar_label=f"p({f.object!r})",
            fontsize=9,
            max_ticks=max(16, f.n_tokens),
        )
    fig.suptitle(
        f"{f.subject} -> {f.object}: p_clean {result.p_clean:.3f}, p_corrupt {result.p_corrupt:.3f}",
        fontsize=9,
    )
    fig.tight_layout()
    return save_png(fig, path, dpi=110)


def position_class(p: int, span: tuple[int, int], n: int) -> str | None:
    """ROME's averaging class of position ``p`` of ``n`` tokens with the subject at ``span``; None before
    the subject."""
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


def trace_average_heatmap(results: Sequence[Any], path: str | os.PathLike[str]) -> Path:
    """Mean indirect effect per ROME position class (rows) and layer (columns), one panel per component."""
    comps = list(results[0].restored)
    fig, axes = new_figure(len(comps), figsize=(4.2 * len(comps), 3.2))
    for ax, c in zip(axes[0], comps):
        draw_heatmap(
            ax,
            average_by_class(results, c),
            rows=[r.replace("_", " ") for r in ROLE_ORDER],
            xlabel="layer",
            ylabel=None,
            title=f"average indirect effect: {c}",
            cmap=_TRACE_CMAPS.get(c, SEQUENTIAL_CMAP),
            origin="upper",
            fontsize=9,
        )
    fig.suptitle(f"causal tracing, {len(results)} facts", fontsize=9)
    fig.tight_layout()
    return save_png(fig, path, dpi=110)


def lens_curves(summary: Sequence[dict[str, Any]], path: str | os.PathLike[str], title: str) -> Path:
    """Mean p(object) and median object rank per residual index, logit lens and tuned lens."""
    x = [r["index"] for r in summary]
    fig, axes = new_figure(2, figsize=(10, 3.6))
    a1, a2 = axes[0]
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
    return save_png(fig, path, dpi=110)


def profile_curves(readings: Sequence[Any], path: str | os.PathLike[str], title: str) -> Path:
    """Each method's mean per-layer profile (``actstore.query.methods.readings.MethodReading.profile``: [facts, L]),
    scaled to a maximum of 1."""
    fig, axes = new_figure(figsize=(7, 3.6))
    ax = axes[0, 0]
    for r in readings:
        m = np.nanmean(r.profile, axis=0)
        top = np.nanmax(np.abs(m)) if np.isfinite(m).any() else 0
        ax.plot(m / top if top else m, label=f"{r.method} (n={len(r.example_ids)})")
    ax.set_xlabel("layer")
    ax.set_ylabel("mean profile / max")
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return save_png(fig, path, dpi=110)


def headscore_heatmap(
    grid: np.ndarray, layers: Sequence[int], heads: Sequence[int], path: str | os.PathLike[str], title: str
) -> Path:
    """Mean HeadScore, layers (rows, from the bottom) x heads (columns), diverging colours around 0.
    ``grid``: [L, H]."""
    fig = heatmap(
        grid,
        rows=list(layers),
        cols=list(heads),
        title=title,
        diverging=True,
        figsize=(1.5 + 0.35 * len(heads), 1.5 + 0.2 * len(layers)),
    )
    return save_png(fig, path, dpi=100)
