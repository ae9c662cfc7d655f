"""Section ``section-tables``: every result table no other section showed (name, rows, runs, a preview)."""

from __future__ import annotations

from actstore.core.tables import ALL_SEGMENT_TABLES
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


def other_tables_section(ctx: ReportContext) -> Section | None:
    skip = set(ALL_SEGMENT_TABLES) | {"heads", "runs"} | ctx.used
    rest = [n for n in sorted(ctx.files) if n not in skip and ctx.files[n]]
    if not rest:
        return None
    blocks: list[Block] = []
    for name in rest:
        try:
            t = ctx.store.table(name, files=ctx.files[name])
        except READ_ERRORS as e:  # one unreadable table: its own note, the others still previewed
            log.warning("report: table %s cannot be read (%s)", name, e)
            blocks += [Heading(f"{name}: {len(ctx.files[name])} runs"), Omitted(f"could not be read: {e}")]
            continue
        blocks += [
            Heading(f"{name}: {t.num_rows} rows, {len(ctx.files[name])} runs"),
            table_block(t.slice(0, ctx.opts.preview_rows).to_pylist(), t.column_names),
        ]
    return Section("tables", "Other result tables", blocks)
