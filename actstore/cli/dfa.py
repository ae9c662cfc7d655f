"""``actstore dfa``: any direction decomposed into (position, layer, head, source) terms on a corpus
store ingested with --sources."""

from __future__ import annotations

import json
from typing import Any

import click

from actstore.cli._config import config_from, options_from
from actstore.cli._options import Run, job, open_store_arg, run_options, where_option
from actstore.jobs.settings import DfaConfig


@job(example="actstore dfa /tmp/s --direction token:42 --k 20")
@options_from(DfaConfig)
@where_option
@run_options
def dfa(store: str, where: str | None, run: Run, **given: Any) -> None:
    """Top-k source terms of a direction's direct attribution and per-head totals, stored as the
    dfa_terms and dfa_totals tables."""
    from actstore.jobs.dfa import run_dfa

    cfg = config_from(DfaConfig, given, where=where, save=run.save_results)
    s = open_store_arg(store)
    out = run_dfa(s, cfg)
    terms = out.result.terms.to_pylist()
    if run.as_json:
        click.echo(json.dumps({"run_id": out.run_id, "rows": out.rows, "terms": terms}))
        return
    click.echo(f"{cfg.direction}: top {len(terms)} terms over {out.rows} positions")
    for t in terms[:10]:
        click.echo(
            f"  {t['score']:+10.4f}  row {t['row']:>7}  layer {t['layer']:>2} head {t['head']:>2}  source row {t['source_row']}"
        )
    if out.run_id:
        click.echo(f"run {out.run_id} (tables: dfa_terms, dfa_totals)")


COMMANDS = [dfa]
