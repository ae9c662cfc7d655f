"""Section ``section-method-metrics``: the metrics of An Empirical Study of Mechanistic Interpretability
Approaches for Factual Recall (ACL 2025) for each interpretability method (``method_metrics``), the pair table with bootstrap intervals next to that study's figures
(``method_pair_metrics``) and the cross-size row of each model (``method_cross_size``), as
:mod:`actstore.query.methods.metrics` writes them.  The intervention runs behind them (``site_effects``) are
summarised by their sizes."""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from actstore.query.report.context import (
    Block,
    Heading,
    Note,
    ReportContext,
    Section,
    fmt,
    of_run,
    run_label,
    table_block,
)

TITLE = "Method comparison: precision, consistency, effectiveness (the ACL 2025 comparison of methods for factual recall)"
METRIC_COLUMNS = (
    "precision",
    "consistency",
    "verdict_consistency",
    "effectiveness",
    "located_effect",
    "beats_random",
)
NEEDED = {"method", "grouping", "group", "metric", "n", "value", "low", "high"}
PAIR_NEEDED = {"method_a", "method_b", "metric", "n", "value", "low", "high"}


def _ci(r: dict[str, Any]) -> str:
    """``value [low, high]`` (a dash where undefined)."""
    return f"{fmt(r.get('value'))} [{fmt(r.get('low'))}, {fmt(r.get('high'))}]"


def _config(ctx: ReportContext, run: str) -> dict[str, Any]:
    """A metrics run's configuration (its runs row), or {}."""
    if not run or "config" not in ctx.columns("runs"):
        return {}
    rows = ctx.sql('SELECT config FROM "runs" WHERE run_id = ?', [run]).to_pylist()
    try:
        config = json.loads(rows[0]["config"]) if rows else {}
    except (TypeError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _mode(config: dict[str, Any]) -> str:
    """The intervention mode a metrics run used, or ''."""
    return str(config.get("mode", ""))


def _labels(config: dict[str, Any]) -> dict[str, str]:
    """Method name -> the name shown: the tuned lens with its fitting rule (``tuned_lens (adam)``), as the
    run recorded it; runs made before the rule was recorded could only fit the ridge."""
    tl = config.get("tuned_lens")
    rule = tl.get("method") if isinstance(tl, dict) else None
    return {"tuned_lens": f"tuned_lens ({rule if isinstance(rule, str) else 'ridge'})"}


def _relabel(rows: list[dict[str, Any]], key: str, labels: dict[str, str]) -> list[dict[str, Any]]:
    return [{**r, key: labels.get(r[key], r[key])} for r in rows]


def _per_method(sub: pa.Table, grouping: str) -> list[dict[str, Any]]:
    """One row per (method, group) of ``grouping``: each metric as ``value [low, high]`` and the fact count."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for r in sub.to_pylist():
        if r["grouping"] != grouping or r["metric"] not in METRIC_COLUMNS:
            continue
        row = rows.setdefault(
            (r["method"], r["group"]), {"method": r["method"], "group": r["group"], "facts": 0}
        )
        row["facts"] = max(row["facts"], int(r["n"] or 0))
        row[r["metric"]] = _ci(r) if r["n"] else None
    return [rows[k] for k in sorted(rows)]


def method_metrics_section(ctx: ReportContext) -> Section | None:
    t = ctx.table("method_metrics")
    if t is None:
        return None
    ctx.used.update({"site_effects"})
    blocks: list[Block] = [
        Note(
            "Per method, the mean over facts with a percentile bootstrap 95% interval: localisation precision (share of "
            "the method's positive effect at its located layer and component), consistency (key layer within the "
            "tolerance of its relation's median key layer; verdict equal to the relation's majority), intervention "
            "effectiveness (effect of intervening on the located site minus the mean over random layers of the same "
            "component; knock-out: drop in P(object), restore: gain under subject noise). Definitions: docs/analyses.md."
        )
    ]
    if not NEEDED <= set(t.column_names):
        blocks.append(
            Note(f"method_metrics lacks the columns {', '.join(sorted(NEEDED - set(t.column_names)))}")
        )
        return Section("method_metrics", TITLE, blocks)
    pairs = ctx.table("method_pair_metrics")
    for run in ctx.latest_runs(t):
        sub = of_run(t, run)
        config = _config(ctx, run)
        mode, labels = _mode(config), _labels(config)
        blocks.append(Heading(run_label(run) + (f" ({mode})" if mode else "")))
        cols = ["method", "facts", *[c for c in METRIC_COLUMNS if c in set(sub.column("metric").to_pylist())]]
        blocks.append(table_block(_relabel(_per_method(sub, "all"), "method", labels), cols))
        for grouping in ("freq_band", "uniqueness", "source_set"):
            rows = _per_method(sub, grouping)
            if rows:
                blocks.append(Note(f"by {grouping.replace('_', ' ')}"))
                blocks.append(table_block(_relabel(rows, "method", labels), ["method", "group", *cols[1:]]))
        n_strata = len({r["group"] for r in sub.to_pylist() if r["grouping"] == "stratum"})
        if n_strata:
            blocks.append(
                Note(
                    f"{n_strata} strata (relation x frequency band x uniqueness) in the method_metrics "
                    "table (grouping = 'stratum')."
                )
            )
        if pairs is not None and PAIR_NEEDED <= set(pairs.column_names):
            prow = of_run(pairs, run).to_pylist()
            table: dict[tuple[str, str], dict[str, Any]] = {}
            for r in prow:
                a, b = labels.get(r["method_a"], r["method_a"]), labels.get(r["method_b"], r["method_b"])
                row = table.setdefault((r["method_a"], r["method_b"]), {"methods": f"{a} vs {b}", "facts": 0})
                row["facts"] = max(row["facts"], int(r["n"] or 0))
                row[r["metric"]] = _ci(r) if r["n"] else None
                if r.get("paper") is not None:
                    row[f"seed {r['metric']}"] = fmt(r["paper"])
            keys = [
                "key_layer",
                "seed key_layer",
                "verdict",
                "seed verdict",
                "effect_correlation",
                "seed effect_correlation",
                "consensus",
                "seed consensus",
            ]
            present = [k for k in keys if any(k in row for row in table.values())]
            blocks.append(
                Note(
                    "agreement between methods (95% bootstrap intervals), with the figures of An Empirical Study "
                    "of Mechanistic Interpretability Approaches for Factual Recall (ACL 2025)"
                )
            )
            blocks.append(table_block(list(table.values()), ["methods", "facts", *present]))
    cross = ctx.table("method_cross_size")
    if cross is not None and {"model", "metric", "value"} <= set(cross.column_names):
        by_model: dict[str, dict[str, Any]] = {}
        for r in cross.to_pylist():
            by_model.setdefault(str(r["model"]), {"model": r["model"]})[r["metric"]] = _ci(r)
        blocks.append(Heading("across model sizes"))
        metrics = sorted({k for row in by_model.values() for k in row if k != "model"})
        blocks.append(table_block(list(by_model.values()), ["model", *metrics]))
    return Section("method_metrics", TITLE, blocks)
