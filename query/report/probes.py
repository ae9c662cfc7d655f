"""Sections ``section-probes`` (probe accuracy per run and per relation) and ``section-headscore``
(mean HeadScore per relation, layer x head)."""

from __future__ import annotations

from typing import Any

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
    heatmap_block,
    missing,
    of_run,
    pick,
    run_label,
    table_block,
    where_equal,
)

PROBE_RUN_COLUMNS = (
    "run_id",
    "kind",
    "setting",
    "episodes",
    "relations",
    "rows",
    "mean_selected_features",
    "relspec",
    "contrast",
    "accuracy ± 95% CI",
    "seconds",
)


def _accuracy_figure(rows: list[dict[str, Any]], dpi: int) -> Block:
    fig, axes = plotting.new_figure(figsize=(min(10.0, 2.5 + 0.9 * len(rows)), 3.2))
    ax = axes[0, 0]
    acc = [100 * float(r["accuracy"]) for r in rows]
    err = [
        [100 * (float(r["accuracy"]) - float(r.get("ci95_low") or r["accuracy"])) for r in rows],
        [100 * (float(r.get("ci95_high") or r["accuracy"]) - float(r["accuracy"])) for r in rows],
    ]
    labels = [f"{r.get('kind', '?')}\n{r['setting']}" for r in rows]
    ax.bar(range(len(rows)), acc, yerr=err, capsize=3, color="#4c72b0")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 100)
    ax.set_title("probe accuracy per run (95% interval)", fontsize=9)
    return figure_block(fig, "probe accuracy per run", dpi)


def probes_section(ctx: ReportContext) -> Section | None:
    runs = ctx.table("probe_runs")
    if runs is None:
        return None
    blocks: list[Block] = []
    rows = sorted(
        runs.to_pylist(), key=lambda r: (ctx.run_started.get(str(r.get("run_id")), 0.0), str(r.get("run_id")))
    )
    for r in rows:
        if "accuracy" in r and r.get("ci95_low") is not None and r.get("ci95_high") is not None:
            r["accuracy ± 95% CI"] = (
                f"{100 * float(r['accuracy']):.2f}% "
                f"({100 * float(r['ci95_low']):.2f}–{100 * float(r['ci95_high']):.2f})"
            )
        r["setting"] = f"{r.get('n_way', '?')}-way {r.get('k_shot', '?')}-shot"
    cols = [c for c in PROBE_RUN_COLUMNS if rows and (c in rows[0] or c in ("setting", "accuracy ± 95% CI"))]
    blocks.append(table_block(rows, cols, headers={"mean_selected_features": "features / episode"}))
    if rows and "accuracy" in rows[0]:
        blocks.append(_accuracy_figure(rows, ctx.opts.dpi))
    metrics = ctx.table("relation_metrics")
    if metrics is not None:
        for run in ctx.latest_runs(metrics):
            sub = of_run(metrics, run)
            mcols = [
                c
                for c in (
                    "relation_id",
                    "relation_name",
                    "n_queries",
                    "n_predicted",
                    "precision",
                    "recall",
                    "f1",
                )
                if c in sub.column_names
            ]
            recs = pick(sub, mcols)
            drawn = [r for r in recs if r.get("n_queries") or r.get("n_predicted")]
            blocks += [Heading(f"Per relation, {run_label(run)}"), table_block(drawn, mcols)]
            if len(drawn) < len(recs):
                blocks.append(
                    Note(
                        f"{len(recs) - len(drawn)} relations were never drawn as queries in this run's "
                        "episodes (too few episodes): not shown"
                    )
                )
    ctx.used.update({"probe_episodes", "probe_predictions"})
    return Section("probes", "Probes: episodic relation classification", blocks)


def run_kinds(ctx: ReportContext) -> dict[str, str]:
    """``run_id -> "kind, N-way K-shot"`` of every probe run (empty when the table lacks those columns)."""
    if not {"run_id", "kind", "n_way", "k_shot"} <= set(ctx.columns("probe_runs")):
        return {}
    return {
        str(r["run_id"]): f"{r['kind']}, {r['n_way']}-way {r['k_shot']}-shot"
        for r in ctx.sql('SELECT run_id, kind, n_way, k_shot FROM "probe_runs"').to_pylist()
    }


def headscore_section(ctx: ReportContext) -> Section | None:
    t = ctx.table("head_scores")
    if t is None:
        return None
    miss = missing(t, "layer", "head", "score")
    if miss:
        return Section("headscore", "HeadScore", [Note(f"head_scores lacks columns {miss}")])
    kinds = run_kinds(ctx)
    dpi = ctx.opts.dpi
    blocks: list[Block] = [
        Note(
            "Mean HeadScore of the predictions of each gold relation: sum over the features of head (l, h) of dW_m x'_m, "
            "with dW = W_pred - sum of the renormalised competitors' weights. Red: the head pushes towards the predicted "
            "relation. Column -1 = a whole layer (per-layer feature kinds)."
        )
    ]
    for run in ctx.latest_runs(t):
        sub = of_run(t, run)
        blocks.append(Heading(run_label(run) + (f" ({kinds[run]})" if run in kinds else "")))
        grid, layers, heads = grid_mean(sub, "score")
        imgs: list[Block] = [
            heatmap_block(grid, rows=layers, cols=heads, title="HeadScore, all relations", dpi=dpi)
        ]
        if "relation_id" in sub.column_names:
            rels = sorted({str(r) for r in sub.column("relation_id").to_pylist()})
            for rel in rels[: ctx.opts.max_relations]:
                g, ls, hs = grid_mean(where_equal(sub, "relation_id", rel), "score")
                imgs.append(heatmap_block(g, rows=ls, cols=hs, title=f"HeadScore {rel}", dpi=dpi))
            if len(rels) > ctx.opts.max_relations:
                imgs.append(Note(f"{len(rels) - ctx.opts.max_relations} more relations not shown"))
        blocks.append(Grid(imgs))
    return Section("headscore", "HeadScore per relation (layer × head)", blocks)
