"""``actstore report STORE --out report.html`` (registered lazily by actstore.cli)."""

from __future__ import annotations

import json

import click

from actstore.cli import friendly


@click.command()
@click.argument("store")
@click.option("--out", "out_path", default="report.html", show_default=True, help="HTML file to write.")
@click.option("--title", default=None, help="Page title (default: 'actstore report: MODEL').")
@click.option("--max-runs", type=int, default=3, show_default=True, help="Most recent runs shown per analysis.")
@click.option("--max-relations", type=int, default=24, show_default=True, help="Heatmaps per run, at most.")
@click.option("--token-examples", type=int, default=6, show_default=True,
              help="TokenScore examples shown: this many errors and about two thirds as many correct predictions.")
@click.option("--quiet", is_flag=True, help="No progress lines.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object (path, sections, bytes).")
@friendly
def report(store: str, out_path: str, title: str | None, max_runs: int, max_relations: int, token_examples: int,
           quiet: bool, as_json: bool) -> None:
    """Write one self-contained HTML file: the store's summary and every analysis result it holds."""
    import os

    import actstore
    from query.report import ReportOptions, collect_sections, render_html

    if max_runs < 1 or max_relations < 1 or token_examples < 0:
        raise ValueError("--max-runs and --max-relations must be at least 1, --token-examples at least 0")
    s = actstore.open(store)
    opts = ReportOptions(max_runs=max_runs, max_relations=max_relations, token_errors=token_examples,
                         token_correct=(2 * token_examples + 2) // 3)
    sections = collect_sections(s, opts, log=None if quiet or as_json else lambda m: click.echo(m, err=True))
    text = render_html(s, sections, title=title)
    parent = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(parent, exist_ok=True)
    tmp = f"{out_path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, out_path)
    n_img = text.count("<img ")
    if as_json:
        click.echo(json.dumps({"report": out_path, "sections": [sec.id for sec in sections], "images": n_img,
                               "bytes": len(text.encode("utf-8"))}))
        return
    click.echo(f"wrote {out_path}: {len(sections)} sections ({', '.join(sec.id for sec in sections)}), "
               f"{n_img} images, {len(text.encode('utf-8')) / 1e6:.1f} MB")
