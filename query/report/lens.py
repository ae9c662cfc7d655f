"""Sections ``section-lens`` (logit and tuned lens curves per layer) and ``section-agreement`` (agreement
between interpretability methods)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from matplotlib.ticker import MaxNLocator

from actstore.query.analyses import plotting
from actstore.query.methods.agreement import PAIR_COLUMNS
from actstore.query.report.context import (
    Heading,
    Note,
    ReportContext,
    Section,
    figure_block,
    floats,
    pick,
    run_label,
    strings,
    table_block,
)

Panel = tuple[str, Callable[[np.ndarray], float], str]


def lens_panels(columns: list[str]) -> list[Panel]:
    """The curves drawn: (column, aggregate over a layer's facts, y label)."""
    panels: list[Panel] = []
    if "object_prob" in columns:
        panels.append(("object_prob", lambda v: float(np.mean(v)), "mean p(object)"))
    if "object_rank" in columns:
        panels.append(("object_rank", lambda v: float(np.mean(v == 0)), "top-1 share (object ranked first)"))
        panels.append(("object_rank", lambda v: max(float(np.median(v)), 0.5), "median object rank"))
    return panels


def lens_section(ctx: ReportContext) -> Section | None:
    t = ctx.table("lens")
    if t is None:
        return None
    xcol = "index" if "index" in t.column_names else "layer"
    panels = lens_panels(t.column_names)
    if xcol not in t.column_names or not panels:
        return Section(
            "lens", "Logit and tuned lens", [Note("lens lacks a layer and an object_prob/object_rank column")]
        )
    run, sub = ctx.latest_run(t)
    lens = strings(sub, "lens", "lens")
    x = np.asarray(sub.column(xcol).to_pylist())
    fig, axes = plotting.new_figure(len(panels), figsize=(4.2 * len(panels), 3.2))
    for ax, (col, agg, label) in zip(axes[0], panels):
        y = floats(sub, col)
        for name in sorted(set(lens.tolist())):
            xs = sorted(set(x[lens == name].tolist()))
            ax.plot(xs, [agg(y[(lens == name) & (x == xi)]) for xi in xs], marker=".", label=f"{name} lens")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("residual index (0 = embeddings)" if xcol == "index" else "layer", fontsize=8)
        ax.set_ylabel(label, fontsize=8)
        if label.startswith("median"):
            ax.set_yscale("log")
        ax.legend(fontsize=7)
    n = len(set(sub.column("example_id").to_pylist())) if "example_id" in sub.column_names else sub.num_rows
    return Section(
        "lens",
        "Logit and tuned lens",
        [
            Note(
                "Logit lens: the stored residual stream read through the final norm and unembedding. Tuned lens: "
                "an affine translator per layer trained on stored residuals, evaluated on held-out facts."
            ),
            Heading(run_label(run)),
            figure_block(fig, "logit and tuned lens per layer", ctx.opts.dpi, f"lens curves, {n} facts"),
        ],
    )


def agreement_section(ctx: ReportContext) -> Section | None:
    t = ctx.table("method_agreement")
    if t is None:
        return None
    run, sub = ctx.latest_run(t)
    ctx.used.add("method_readings")
    return Section(
        "agreement",
        "Agreement between interpretability methods",
        [
            Heading(run_label(run)),
            table_block(
                pick(
                    sub,
                    [
                        *PAIR_COLUMNS,
                        "key_layer_chance",
                        "key_layer_excess",
                        "key_layer_kappa",
                        "verdict_chance",
                        "verdict_kappa",
                    ],
                )
            ),
        ],
    )
