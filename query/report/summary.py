"""Section ``section-summary``: the model, geometry, corpus per relation, tables, sizes and runs (always shown)."""

from __future__ import annotations

import time
from typing import Any

from actstore.core.model_names import describe_model
from actstore.core.sizes import human_size, store_size
from actstore.core.store import StoreReader
from actstore.core.tables import table_kind
from actstore.query.report.context import (
    READ_ERRORS,
    Block,
    Heading,
    Omitted,
    ReportContext,
    Section,
    log,
    table_block,
)

CORPUS_WITH_TARGETS = (
    "SELECT e.relation_id, any_value(e.relation_name) AS relation_name, "
    "any_value(e.source) AS source, count(*) AS prompts, "
    "avg(CASE WHEN t.object_rank = 0 THEN 1.0 ELSE 0.0 END) AS model_top1, "
    "avg(e.n_tokens) AS mean_tokens "
    "FROM examples e LEFT JOIN targets t USING (example_id) GROUP BY 1 ORDER BY 1"
)


def _store_info(store: StoreReader) -> list[dict[str, Any]]:
    m, g, size = store.manifest, store.geometry, store_size(store)
    model = m.model
    return [
        {"": "store", "value": store.url},
        {"": "format", "value": f"actstore v{m.format_version}"},
        {"": "model", "value": f"{describe_model(model)} [{model.get('architecture', '?')}]"},
        {"": "weights sha256", "value": str(model.get("weight_hash", ""))[:16]},
        {
            "": "geometry",
            "value": f"L={g.n_layers} H={g.n_heads} H_kv={g.n_kv_heads} d_head={g.d_head} "
            f"d_model={g.d_model} d_mlp={g.d_mlp} vocab={g.vocab_size}",
        },
        {
            "": "rows",
            "value": f"{store.n_rows} of {m.n_examples} examples in {len(store.commits)}/{m.n_segments} "
            "segments" + ("" if store.complete else " (INCOMPLETE)"),
        },
        {"": "storage dtype", "value": m.storage_dtype},
        {"": "size on disk", "value": human_size(size.total)},
        {  # a store's own weights are part of its size; a shared copy is not, and says where it is
            "": "of which weights",
            "value": human_size(size.weights) if size.where == "store" else size.weights_line(),
        },
    ]


def _table_rows(ctx: ReportContext, name: str) -> int | None:
    """Rows of table ``name`` (None when its files cannot be read: the table list still shows it)."""
    if not ctx.files[name]:
        return 0
    try:
        return int(ctx.sql(f'SELECT count(*) AS n FROM "{name}"').column("n")[0].as_py())
    except READ_ERRORS as e:
        log.warning("report: table %s cannot be counted (%s)", name, e)
        return None


def _runs(ctx: ReportContext) -> list[dict[str, Any]]:
    rows = []
    for r in ctx.sql('SELECT * FROM "runs"').to_pylist():
        started, finished = r.get("started"), r.get("finished")
        timed = isinstance(started, int | float)
        rows.append(
            {
                "run_id": r.get("run_id"),
                "kind": r.get("kind"),
                "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(started)))
                if timed
                else started,
                "seconds": float(finished) - float(started)
                if timed and isinstance(finished, int | float)
                else None,
            }
        )
    rows.sort(key=lambda r: str(r["started"]))
    return rows


def summary_section(ctx: ReportContext) -> Section:
    blocks: list[Block] = [Heading("Store"), table_block(_store_info(ctx.store), ["", "value"], cls="kv")]
    rel = ctx.sql(CORPUS_WITH_TARGETS).to_pylist()
    cols = ["relation_id", "relation_name", "source", "prompts", "mean_tokens", "model_top1"]
    blocks += [
        Heading(f"Corpus: {len(rel)} relations, {sum(int(r['prompts']) for r in rel)} prompts"),
        table_block(rel, cols, headers={"model_top1": "model top-1 = object"}),
    ]
    tables = [
        {
            "table": name,
            "files": len(files),
            "rows": _table_rows(ctx, name),
            "kind": table_kind(name),
        }
        for name, files in sorted(ctx.files.items())
    ]
    blocks += [Heading("Tables"), table_block(tables, ["table", "kind", "files", "rows"])]
    if ctx.has("runs"):
        try:
            runs = _runs(ctx)
        except READ_ERRORS as e:
            log.warning("report: the runs table cannot be read (%s)", e)
            blocks += [Heading("Runs"), Omitted(f"the runs table could not be read: {e}")]
        else:
            blocks += [
                Heading(f"Runs ({len(runs)})"),
                table_block(runs[-30:], ["run_id", "kind", "started", "seconds"]),
            ]
    return Section("summary", "Store summary", blocks)
