"""``actstore info | sql | features | verify | compact``: read a store, check it, compact its tables."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import click

from actstore.cli._options import (
    command,
    heads_option,
    json_option,
    layers_option,
    open_store_arg,
    parse_int_list,
    printable,
    quiet_option,
    sql_limit_options,
    store_argument,
    threads_option,
    where_option,
)
from actstore.core.model_names import describe_model
from actstore.core.tables import ALL_SEGMENT_TABLES

EXIT_DAMAGED = 3  # verify found a problem (the store is damaged or incomplete)


CORPUS_FIELDS = ("documents", "windows", "cut_documents", "context_length", "special", "pack", "kept")


def _corpus_line(ingest: dict[str, Any]) -> str:
    """What a corpus store (``--positions all``) holds, in one line of ``info``."""
    kept = ingest.get("kept") or {}
    layers = "; ".join(f"{k} {','.join(map(str, v))}" for k, v in kept.items() if v) or "nothing"
    return (
        f"corpus    every kept token of {ingest.get('documents')} documents in {ingest.get('windows')} "
        f"windows of <= {ingest.get('context_length')} tokens{' (packed)' if ingest.get('pack') else ''}, "
        f"special tokens {ingest.get('special')}; kept {layers}"
    )


@command(example="actstore info /tmp/s --json")
@store_argument
@json_option
def info(store: str, as_json: bool) -> None:
    """Summarise a store: model, geometry, corpus, sizes."""
    from actstore.core.relation_index import relation_counts
    from actstore.core.sizes import human_size, store_size

    s = open_store_arg(store)
    size = store_size(s)
    ingest = s.manifest.ingest
    corpus = ingest.get("positions") == "all"  # a corpus store's rows are token positions, no relations
    rel: list[dict[str, Any]] = []
    if not corpus:
        rel = relation_counts(s) or []  # from the relation index (no scan), else by SQL over examples
        if not rel:
            rel = s.sql(
                "SELECT relation_id, any_value(relation_name) AS relation_name, count(*) AS n "
                "FROM examples GROUP BY 1 ORDER BY 1"
            ).to_pylist()
    # Every table file info lists is checked (hash, footer) as a statement reading it would, except the
    # segment tables' (their files grow with the store; the index files read above are hash-checked, and
    # verify checks them all).
    listed = s.table_files()
    s.check_table_shards([n for n in listed if n not in ALL_SEGMENT_TABLES], listed)
    tables = {name: len(files) for name, files in listed.items()}
    d = {
        "store": s.url,
        "format_version": s.manifest.format_version,
        "model": s.manifest.model,
        "model_description": describe_model(s.manifest.model),
        "geometry": s.geometry.to_dict(),
        "storage_dtype": s.manifest.storage_dtype,
        "examples": s.manifest.n_examples,
        "rows_committed": s.n_rows,
        "segments": {"committed": len(s.commits), "total": s.manifest.n_segments},
        "complete": s.complete,
        "relations": rel,
        **({"corpus": {k: ingest.get(k) for k in CORPUS_FIELDS}} if corpus else {}),
        "tables": tables,
        **size.to_dict(),  # the one size: the report and the explorer show the same
        "chunks": {
            "rows": s.manifest.chunk_rows,
            "flat": s.manifest.chunk_flat,
            "layers": s.manifest.chunk_layers,
        },
    }
    if as_json:
        click.echo(json.dumps(d, indent=2, default=str))
        return
    g = s.geometry
    out = [  # store-provided strings (model, relation names) are printed with control characters escaped
        f"store     {s.url}  (format v{s.manifest.format_version})",
        f"model     {describe_model(s.manifest.model)}  [{s.manifest.model.get('architecture')}]  "
        f"weights sha256 {str(s.manifest.model.get('weight_hash', ''))[:16]}",
        f"geometry  L={g.n_layers} H={g.n_heads} H_kv={g.n_kv_heads} d_head={g.d_head} "
        f"d_model={g.d_model} d_mlp={g.d_mlp} vocab={g.vocab_size}",
        f"rows      {s.n_rows}/{s.manifest.n_examples} in {len(s.commits)}/{s.manifest.n_segments} "
        f"segments, {s.manifest.storage_dtype}{'' if s.complete else '  (INCOMPLETE: resume the ingest)'}",
        f"size      {human_size(d['bytes'])} on disk",
        f"weights   {size.weights_line()}",
        f"chunks    {s.manifest.chunk_rows} rows / {s.manifest.chunk_flat} flat entries x "
        + (f"{s.manifest.chunk_layers} layer(s)" if s.manifest.chunk_layers else "all layers"),
        f"tables    {', '.join(f'{k} ({v} files)' for k, v in tables.items())}",
        *([_corpus_line(ingest)] if corpus else []),
        *(f"  {printable(r['relation_id']):<24} {r['n']:>6}  {r['relation_name']}" for r in rel),
    ]
    for line in out:
        click.echo(printable(line))


@command(example='actstore sql /tmp/s "SELECT relation_id, count(*) FROM examples GROUP BY 1" --json')
@store_argument
@click.argument("query")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "csv", "json"]),
    default="table",
    show_default=True,
    help="Output format (--json is the same as --format json).",
)
@json_option
@sql_limit_options
def sql(store: str, query: str, fmt: str, as_json: bool) -> None:
    """Run one read-only SELECT over the store's tables."""
    from actstore.core.sql_render import render

    click.echo(render(open_store_arg(store).sql(query), "json" if as_json else fmt))


FEATURE_KINDS = "z, attn_head, attn, attn_head_token, attn_entity, attn_prob, mlp, mlp_group, resid"


@command(
    example="actstore features /tmp/s --kind attn_head --layers 0-3 --where \"relation_id = 'P177'\" "
    "--out x.npy"
)
@store_argument
@threads_option
@click.option("--kind", required=True, help=f"Feature kind: {FEATURE_KINDS}.")
@where_option
@layers_option()
@heads_option()
@click.option(
    "--groups",
    type=click.IntRange(min=1),
    default=None,
    help="mlp_group: number of neuron groups (default: heads).",
)
@click.option("--out", "out_path", required=True, help="Output .npy file.")
@click.option("--ids-out", default=None, help="Parquet file of (example_id, row) in the array's order.")
def features(
    store: str,
    kind: str,
    where: str | None,
    layers: str | None,
    heads: str | None,
    groups: int | None,
    out_path: str,
    ids_out: str | None,
) -> None:
    """Write the features of the selected target rows to a .npy file (target-row order)."""
    import numpy as np
    import pyarrow.parquet as pq

    s = open_store_arg(store)
    sel = s.select(where)
    x = sel.features(kind, layers=parse_int_list(layers), heads=parse_int_list(heads, "heads"), groups=groups)
    tmp = out_path + ".tmp.npy"
    np.save(tmp, x)
    os.replace(tmp, out_path)
    if ids_out:
        pq.write_table(sel.rows.select(["example_id", "row"]), ids_out)
    click.echo(f"wrote {out_path}: {kind} {list(x.shape)} float32 for {len(sel)} rows")


@command(example="actstore verify /tmp/s --values")
@store_argument
@click.option("--values", is_flag=True, help="Also decode every chunk and report NaN or infinite values.")
@click.option(
    "--quick",
    is_flag=True,
    help="Only the markers, the snapshot and every table file's footer (no byte hashed).",
)
@quiet_option
@json_option
def verify(store: str, values: bool, quick: bool, quiet: bool, as_json: bool) -> None:
    """Check that every committed chunk and table is there with its recorded hash, offsets, the manifest.

    Exit status 3 when a problem is found (the store is damaged or incomplete), 1 when the store
    cannot be checked at all."""
    from actstore.core.progress import progress_wanted
    from actstore.core.verify import quick_verify_store, verify_store

    if quick and values:
        raise click.UsageError("--quick and --values exclude each other (--values decodes every chunk)")
    s = open_store_arg(store)
    report = (
        quick_verify_store(s) if quick else verify_store(s, values=values, progress=progress_wanted(quiet))
    )
    if as_json:
        click.echo(
            json.dumps(
                {
                    "store": report.store,
                    "ok": report.ok,
                    "status": report.status,
                    "segments": report.segments_checked,
                    "chunks": report.chunks_checked,
                    "uncommitted_segments": report.uncommitted,
                    "values_checked": report.values_checked,
                    "problems": report.problems,
                    "notes": report.notes,
                }
            )
        )
    else:
        for n in report.notes:
            click.echo(f"NOTE {printable(n)}", err=True)
        for p in report.problems:
            click.echo(f"PROBLEM {printable(p)}", err=True)
        click.echo(
            f"{report.status}: {report.segments_checked} segments, "
            f"{report.chunks_checked} chunks checked{' (values scanned)' if values else ''}, "
            f"{len(report.problems)} problems"
        )
    if not report.ok:
        sys.exit(EXIT_DAMAGED)


@command(example="actstore compact /tmp/s")
@store_argument
@click.option(
    "--incremental",
    is_flag=True,
    help="Only gather the segments committed since the last snapshot (default: rewrite all tables).",
)
@json_option
def compact(store: str, incremental: bool, as_json: bool) -> None:
    """Gather the per-segment table shards into a few large files listed in a new snapshot, so that
    opening the store and each query cost the same at any size (takes the writer lock; readers go on
    reading the previous snapshot until the new one is committed).  Upgrades a format 2 store."""
    from dataclasses import asdict

    from actstore.core.compact import compact as run_compact

    open_store_arg(store)  # a damaged or foreign store: one line before the lock is taken
    report = run_compact(store, full=not incremental)
    if as_json:
        click.echo(json.dumps(asdict(report)))
        return
    if report.snapshot is None:
        click.echo(f"{report.url}: no committed segment to compact")
        return
    click.echo(
        f"snapshot {report.snapshot}: {report.segments} segments, {report.files_written} files written "
        f"({report.bytes_written / 1e6:.1f} MB), {report.files_removed} old files removed"
        + ("; upgraded to the current format" if report.upgraded else "")
    )


@click.group(
    "weights",
    epilog="\b\nExample (make a store self-contained before copying it elsewhere):\n"
    "  actstore weights materialise /tmp/s",
)
def weights() -> None:
    """Where a store's weights live: in the store, or one shared copy per model in the user cache
    ($ACTSTORE_WEIGHTS_DIR; ingest --weights shared, the default). docs/storage.md says which
    analyses need them."""


@weights.command(
    "materialise",
    cls=type(info),
    epilog="\b\nExample:\n  actstore weights materialise /tmp/s",
)
@store_argument
def materialise(store: str) -> None:
    """Copy the shared weights a store uses into the store (checked against its recorded SHA-256), so
    that it stays self-contained when copied, moved or uploaded."""
    from actstore.core.weight_store import materialise as run_materialise

    s = open_store_arg(store)  # a damaged or foreign store: one line before the lock is taken
    click.echo(printable(run_materialise(s.location)))


COMMANDS = [info, sql, features, verify, compact, weights]
