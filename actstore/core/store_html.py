"""A store's summary as an HTML table, for notebooks (:meth:`actstore.core.store.StoreReader._repr_html_`)."""

from __future__ import annotations

from html import escape
from typing import Any

from actstore.core.tables import ALL_SEGMENT_TABLES


def store_html(store: Any) -> str:
    """Model, geometry, corpus per relation and result tables of ``store`` (a
    :class:`~actstore.core.store.StoreReader`; not imported: the store imports this module)."""
    g = store.geometry
    model = store.manifest.model
    rows = [
        ("store", store.url),
        ("model", f"{model.get('name')} ({store.manifest.architecture.get('family', '?')})"),
        (
            "geometry",
            f"{g.n_layers} layers x {g.n_heads} heads ({g.n_kv_heads} kv), d_model {g.d_model}, "
            f"d_head {g.d_head}, d_mlp {g.d_mlp}, vocab {g.vocab_size}",
        ),
        (
            "rows",
            f"{store.n_rows} target rows committed in {len(store.commits)}/{store.manifest.n_segments} "
            f"segments ({'complete' if store.complete else 'incomplete'}), {store.manifest.storage_dtype}",
        ),
    ]
    if store.commits:
        rel = store.sql(
            "SELECT relation_id, any_value(relation_name) AS name, count(*) AS n FROM examples "
            "GROUP BY 1 ORDER BY n DESC, 1"
        ).to_pylist()
        shown = ", ".join(
            f"{r['relation_id']} {r['name']} ({r['n']})"
            if r["name"] and r["name"] != r["relation_id"]
            else f"{r['relation_id']} ({r['n']})"
            for r in rel[:12]
        )
        rows.append(("relations", f"{len(rel)}: {shown}" + (", ..." if len(rel) > 12 else "")))
    results = {
        k: len(v) for k, v in store.table_files().items() if k not in ALL_SEGMENT_TABLES and k != "heads"
    }
    if results:
        rows.append(
            (
                "result tables",
                ", ".join(f"{k} ({n} file{'s' * (n != 1)})" for k, n in sorted(results.items())),
            )
        )
    body = "".join(
        f"<tr><th style='text-align:left'>{escape(k)}</th><td style='text-align:left'>{escape(str(v))}</td></tr>"
        for k, v in rows
    )
    return f"<table><caption style='text-align:left'><b>actstore.Store</b></caption>{body}</table>"
