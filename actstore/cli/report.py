"""``actstore report``: one self-contained HTML file of a store and every result it holds."""

from __future__ import annotations

import json
from typing import Any

import click

from actstore.cli._options import (
    bounded_option,
    command,
    json_option,
    open_store_arg,
    progress_lines,
    quiet_option,
    store_argument,
    threads_option,
)


@command(example="actstore report /tmp/s --out report.html --max-runs 2")
@store_argument
@threads_option
@click.option("--out", "out_path", default="report.html", show_default=True, help="HTML file to write.")
@click.option("--title", default=None, help="Page title (default: 'actstore report: MODEL').")
@bounded_option("--max-runs", 3, "Most recent runs shown per analysis.")
@bounded_option("--max-relations", 24, "Heatmaps per run, at most.")
@bounded_option(
    "--token-examples",
    6,
    "TokenScore examples shown: this many errors and about two thirds as many correct predictions.",
    low=0,
)
@click.option(
    "--explorer",
    default=None,
    metavar="URL",
    help="A running `actstore serve`, e.g. http://127.0.0.1:8765: the report links to its views of this "
    "store when it serves it.",
)
@quiet_option
@json_option
def report(
    store: str,
    out_path: str,
    title: str | None,
    max_runs: int,
    max_relations: int,
    token_examples: int,
    explorer: str | None,
    quiet: bool,
    as_json: bool,
) -> None:
    """Write one self-contained HTML file: the store's summary and every analysis result it holds."""
    from actstore.query.report.builder import collect_sections, render_html, write_text_atomically
    from actstore.query.report.context import ReportOptions

    s = open_store_arg(store)
    opts = ReportOptions(
        max_runs=max_runs,
        max_relations=max_relations,
        token_errors=token_examples,
        token_correct=(2 * token_examples + 2) // 3,
    )
    log = progress_lines(quiet, as_json)
    # no log: the section lines would go to the library's log, which the command line shows too
    sections = collect_sections(s, opts, log=log or (lambda m: None))
    section = _explorer_section(s, explorer, quiet or as_json) if explorer else None
    if section is not None:
        sections.insert(1, section)
    text = render_html(s, sections, title=title)
    write_text_atomically(out_path, text)
    n_img = text.count("<img ")
    size = len(text.encode("utf-8"))
    if as_json:
        click.echo(
            json.dumps(
                {"report": out_path, "sections": [sec.id for sec in sections], "images": n_img, "bytes": size}
            )
        )
        return
    click.echo(
        f"wrote {out_path}: {len(sections)} sections ({', '.join(sec.id for sec in sections)}), "
        f"{n_img} images, {size / 1e6:.1f} MB"
    )


def _explorer_section(store: Any, base: str, quiet: bool) -> Any:
    """The report's section of links to the explorer at ``base`` (None, with a note on stderr, when it
    does not serve the store)."""
    from actstore.query.report.context import Links, Note, Section
    from actstore.serve.links import explorer_links, served_name

    name = served_name(base, store.url)
    if name is None:
        if not quiet:
            click.echo(
                f"note: no explorer at {base} serves {store.url}: the report has no links to it", err=True
            )
        return None
    note = Note(f"The views of this store in the explorer at {base} (while it runs):")
    return Section("explorer", "Explorer", [note, Links(explorer_links(store, base, name))])


COMMANDS = [report]
