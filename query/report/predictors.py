"""Sections ``section-predictors`` (probe F1 against each predictor, with correlations) and
``section-shortcuts`` (lexical shortcut figures of probe errors)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pyarrow as pa

from actstore.query.analyses import plotting
from actstore.query.report.context import (
    Block,
    Grid,
    Heading,
    ReportContext,
    Section,
    figure_block,
    fmt,
    missing,
    of_run,
    pick,
    run_label,
    table_block,
)

PREDICTOR_COLUMNS = (
    "output_range",
    "output_range_ratio",
    "connectivity",
    "tfidf_similarity",
    "head_concentration",
)


def _scatter(recs: list[dict[str, Any]], predictor: str, stats: dict[str, Any], dpi: int) -> Block | None:
    """Probe F1 against one predictor, a labelled point per relation (None when the predictor has no value)."""
    xs = np.asarray([np.nan if r[predictor] is None else float(r[predictor]) for r in recs])
    ys = np.asarray([np.nan if r["f1"] is None else float(r["f1"]) for r in recs])
    if not np.isfinite(xs).any():
        return None
    fig, axes = plotting.new_figure(figsize=(4.2, 3.4))
    ax = axes[0, 0]
    ax.scatter(xs, ys, s=18, color="#dd8452")
    for r, x, y in zip(recs, xs, ys):
        if np.isfinite(x) and np.isfinite(y):
            ax.annotate(
                str(r.get("relation_id")), (x, y), fontsize=6, xytext=(2, 2), textcoords="offset points"
            )
    ax.set_xlabel(predictor, fontsize=8)
    ax.set_ylabel("probe F1", fontsize=8)
    ax.set_title(
        f"{predictor}: Spearman {fmt(stats.get('spearman_rho'), 2)} (p={fmt(stats.get('spearman_p'), 2)})",
        fontsize=8,
    )
    return figure_block(fig, f"F1 vs {predictor}", dpi)


def predictors_section(ctx: ReportContext) -> Section | None:
    rel = ctx.table("relation_predictors")
    corr = ctx.table("correlations")
    first = rel if rel is not None else corr
    if first is None:
        return None
    blocks: list[Block] = []
    for run in ctx.latest_runs(first)[:1]:
        c_sub = of_run(corr, run) if corr is not None else None
        r_sub = of_run(rel, run) if rel is not None else None
        blocks.append(Heading(run_label(run)))
        if c_sub is not None:
            blocks.append(
                table_block(
                    pick(
                        c_sub,
                        [
                            "predictor",
                            "n",
                            "spearman_rho",
                            "spearman_p",
                            "pearson_r",
                            "pearson_p",
                            "coverage",
                        ],
                    )
                )
            )
        if r_sub is None or "f1" not in r_sub.column_names:
            continue
        recs = r_sub.to_pylist()
        if c_sub is not None and "predictor" in c_sub.column_names:
            predictors = [str(x["predictor"]) for x in c_sub.to_pylist()]
        else:
            predictors = [c for c in r_sub.column_names if c in PREDICTOR_COLUMNS]
        stats = {str(x.get("predictor")): x for x in (c_sub.to_pylist() if c_sub is not None else [])}
        imgs = [
            _scatter(recs, p, stats.get(p, {}), ctx.opts.dpi) for p in predictors if p in r_sub.column_names
        ]
        blocks.append(Grid([b for b in imgs if b is not None]))
        blocks.append(
            table_block(
                pick(
                    r_sub,
                    [
                        "relation_id",
                        "relation_name",
                        "f1",
                        "n_instances",
                        "output_range",
                        "connectivity",
                        "connectivity_coverage",
                        "tfidf_similarity",
                        "head_concentration",
                    ],
                )
            )
        )
    return Section("predictors", "Predictors of per-relation probe accuracy", blocks)


def _finite(t: pa.Table, column: str) -> np.ndarray:
    return np.asarray([x for x in t.column(column).to_pylist() if x is not None and math.isfinite(x)])


def shortcuts_section(ctx: ReportContext) -> Section | None:
    summ = ctx.table("shortcut_summary")
    errs = ctx.table("shortcut_errors")
    if summ is None and errs is None:
        return None
    blocks: list[Block] = []
    if summ is not None:
        blocks.append(
            table_block(
                pick(
                    summ,
                    ["run_id", "n_errors", "n_cues", "spearman_rho", "mass", "mass_baseline", "strong_align"],
                ),
                headers={"strong_align": "StrongAlign-x", "spearman_rho": "Spearman rho"},
            )
        )
    if errs is not None and not missing(errs, "rho", "mass"):
        run, sub = ctx.latest_run(errs)
        fig, axes = plotting.new_figure(2, figsize=(8, 3))
        a1, a2 = axes[0]
        a1.hist(_finite(sub, "rho"), bins=20, range=(-1, 1), color="#4c72b0")
        a1.set_title("Spearman rho (TokenScore vs lexical cue) per error", fontsize=8)
        a2.hist(_finite(sub, "mass"), bins=20, range=(0, 1), color="#55a868")
        a2.set_title("TokenScore mass on lexical cues per error", fontsize=8)
        blocks.append(figure_block(fig, f"lexical shortcuts, {run_label(run)}", ctx.opts.dpi))
    return Section("shortcuts", "Lexical shortcuts in probe errors", blocks)
