"""Sections ``section-maps`` (static MAPS score heatmaps per relation), ``section-maps-dynamic`` (static
vs dynamic scores) and ``section-maps-ablation`` (accuracy with a relation's heads removed)."""

from __future__ import annotations

from typing import Any

import numpy as np

from actstore.query.analyses import plotting
from actstore.query.report.context import (
    Block,
    Grid,
    Heading,
    Note,
    ReportContext,
    Section,
    figure_block,
    grid_mean,
    missing,
    pick,
    run_label,
    table_block,
    where_equal,
)

DEFAULT_THRESHOLD = 0.15


def maps_figure(
    name: str,
    k: object,
    panels: list[tuple[str, np.ndarray, str]],
    layers: list[Any],
    heads: list[Any],
    threshold: float,
    dpi: int,
) -> Block:
    """Relation and suppression scores ([layers, heads] each) side by side, 0..1, heads >= threshold outlined."""
    w = min(5.5, 1.4 + 0.3 * len(heads))
    fig, axes = plotting.new_figure(
        len(panels), figsize=(w * len(panels), min(6.5, 1.5 + 0.15 * len(layers)))
    )
    for ax, (label, g, cmap) in zip(axes[0], panels):
        plotting.draw_heatmap(
            ax,
            g,
            rows=layers,
            cols=heads,
            title=f"{label} (k={k})",
            cmap=cmap,
            vmin=0.0,
            vmax=1.0,
            outline_at_least=threshold,
        )
    return figure_block(fig, f"MAPS {name}: relation and suppression scores", dpi, f"MAPS {name}")


def maps_section(ctx: ReportContext) -> Section | None:
    t = ctx.table("maps_scores")
    rel = ctx.table("maps_relations")
    if t is None and rel is None:
        return None
    blocks: list[Block] = [
        Note(
            "Static MAPS: phi_R(h) = share of a relation's (source, target) pairs whose target is in the top-k of the "
            "source's row of M = E W_VO U (weights only). Red outlines: heads implementing R (phi >= threshold)."
        )
    ]
    if t is not None:
        miss = missing(t, "relation", "layer", "head", "score")
        if miss:
            blocks.append(Note(f"maps_scores lacks columns {miss}"))
        else:
            run, sub = ctx.latest_run(t)
            thr = DEFAULT_THRESHOLD
            if rel is not None and "threshold" in rel.column_names:
                thr = float(rel.column("threshold")[0].as_py())
            blocks.append(Heading(run_label(run)))
            imgs = []
            for name in sorted({str(x) for x in sub.column("relation").to_pylist()})[
                : ctx.opts.max_relations
            ]:
                one = where_equal(sub, "relation", name)
                g, ls, hs = grid_mean(one, "score")
                k = one.column("k")[0].as_py() if "k" in one.column_names else "?"
                panels = [("score", g, "viridis")]
                if "suppression" in one.column_names:
                    panels.append(("suppression", grid_mean(one, "suppression")[0], "magma"))
                imgs.append(maps_figure(name, k, panels, ls, hs, thr, ctx.opts.dpi))
            blocks.append(Grid(imgs))
    if rel is not None:
        _, sub = ctx.latest_run(rel)
        blocks.append(
            table_block(
                pick(
                    sub,
                    [
                        "relation",
                        "n_pairs",
                        "n_used",
                        "n_multi_token",
                        "n_unknown",
                        "n_implementing",
                        "n_suppressing",
                        "max_score",
                        "best_layer",
                        "best_head",
                    ],
                )
            )
        )
    sal = ctx.table("maps_salient")
    if sal is not None and not missing(sal, "layer", "head", "sigma"):
        _, sub = ctx.latest_run(sal)
        recs = sorted(sub.to_pylist(), key=lambda r: -float(r["sigma"] or 0))[:12]
        blocks += [
            Heading("Most salient operations (largest sigma_t = |e_t W_VO| / |e_t|)"),
            table_block(
                recs,
                [c for c in ("layer", "head", "token", "sigma", "mapped_tokens") if c in sub.column_names],
            ),
        ]
    return Section("maps", "MAPS: head functions from the weights", blocks)


def _dynamic_figure(name: str, one: Any, value_cols: list[str], dpi: int) -> Block:
    grids = [grid_mean(one, c) for c in value_cols]
    fig, axes = plotting.new_figure(len(value_cols) + 1, figsize=(3.4 * (len(value_cols) + 1), 3.0))
    row = axes[0]
    for i, (ax, c, (g, ls, hs)) in enumerate(zip(row, value_cols, grids)):
        plotting.draw_heatmap(
            ax,
            g,
            rows=ls,
            cols=hs,
            title=c.replace("_", " "),
            cmap="viridis",
            vmin=0,
            vmax=1,
            colorbar=i == len(value_cols) - 1,
            fontsize=7,
        )
    ax = row[-1]
    if "static_score" in value_cols:
        st = grids[0][0].ravel()
        for c, (g, _, _) in zip(value_cols[1:], grids[1:]):
            ax.scatter(st, g.ravel(), s=6, alpha=0.6, label=c.replace("_", " "))
        ax.set_xlabel("static score", fontsize=7)
        ax.set_ylabel("dynamic score", fontsize=7)
        ax.legend(fontsize=6)
    ax.set_title("per head", fontsize=8)
    return figure_block(fig, f"MAPS static vs dynamic, {name}", dpi, f"MAPS static vs dynamic: {name}")


def maps_dynamic_section(ctx: ReportContext) -> Section | None:
    t = ctx.table("maps_dynamic")
    corr = ctx.table("maps_correlation")
    if t is None and corr is None:
        return None
    blocks: list[Block] = []
    if corr is not None:
        _, sub = ctx.latest_run(corr)
        blocks.append(
            table_block(
                pick(
                    sub,
                    [
                        "relation",
                        "n_prompts",
                        "n_templates",
                        "k",
                        "corr_wo_context",
                        "corr_w_context",
                        "n_implementing_static",
                        "n_implementing_wo_context",
                        "n_implementing_w_context",
                    ],
                ),
                headers={
                    "corr_wo_context": "r static vs dynamic (no context)",
                    "corr_w_context": "r static vs dynamic (context)",
                },
            )
        )
    if t is not None:
        value_cols = [c for c in ("static_score", "dyn_wo_context", "dyn_w_context") if c in t.column_names]
        if "relation" not in t.column_names or not value_cols or missing(t, "layer", "head"):
            blocks.append(Note("maps_dynamic lacks the relation/layer/head/score columns"))
        else:
            _, sub = ctx.latest_run(t)
            for name in sorted({str(x) for x in sub.column("relation").to_pylist()})[
                : ctx.opts.max_relations
            ]:
                blocks.append(
                    _dynamic_figure(name, where_equal(sub, "relation", name), value_cols, ctx.opts.dpi)
                )
    return Section("maps_dynamic", "MAPS: static vs dynamic scores", blocks)


def maps_ablation_section(ctx: ReportContext) -> Section | None:
    t = ctx.table("maps_ablation")
    if t is None:
        return None
    blocks: list[Block] = []
    if not missing(t, "condition", "accuracy"):
        groups: dict[tuple[str, str], dict[str, list[float]]] = {}
        for r in t.to_pylist():
            key = (str(r.get("relation", "")), str(r.get("evaluated", r.get("relation", ""))))
            groups.setdefault(key, {}).setdefault(str(r["condition"]), []).append(float(r["accuracy"]))
        conds = sorted({c for g in groups.values() for c in g})
        fig, axes = plotting.new_figure(figsize=(min(10.0, 2.5 + 1.2 * len(groups)), 3.2))
        ax = axes[0, 0]
        width = 0.8 / max(1, len(conds))
        for i, c in enumerate(conds):
            ax.bar(
                [j + i * width for j in range(len(groups))],
                [float(np.mean(g.get(c, [np.nan]))) for g in groups.values()],
                width,
                label=c,
            )
        ax.set_xticks(
            [j + 0.4 - width / 2 for j in range(len(groups))],
            [f"{a}\non {b}" if a != b else a for a, b in groups],
            fontsize=7,
        )
        ax.set_ylabel("accuracy")
        ax.legend(fontsize=7)
        ax.set_title("accuracy with heads removed", fontsize=9)
        blocks.append(figure_block(fig, "MAPS head ablation", ctx.opts.dpi))
    blocks.append(
        table_block(
            pick(
                t,
                [
                    "relation",
                    "evaluated",
                    "condition",
                    "draw",
                    "n_heads",
                    "heads",
                    "accuracy",
                    "n_prompts",
                    "mode",
                ],
            )[:40]
        )
    )
    return Section("maps_ablation", "MAPS: head ablation", blocks)
