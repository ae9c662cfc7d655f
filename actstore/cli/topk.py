"""``actstore topk``: max-activating contexts of one layer's MLP neurons, head output norms or given
directions."""

from __future__ import annotations

import json
from typing import Any

import click

from actstore.cli._config import config_from, options_from
from actstore.cli._options import Run, job, open_store_arg, run_options, where_option
from actstore.jobs.settings import TopkConfig


@job(example="actstore topk /tmp/s --kind mlp --layer 3 --k 20 --show 5")
@options_from(TopkConfig)
@where_option
@click.option("--show", type=click.IntRange(min=0), default=5, show_default=True, help="Units printed.")
@run_options
def topk(store: str, where: str | None, show: int, run: Run, **given: Any) -> None:
    """Top-k contexts of every unit of a layer in one streaming pass, stored as the topk_contexts table."""
    from actstore.jobs.topk import run_topk

    cfg = config_from(TopkConfig, given, where=where, save=run.save_results, progress=run.progress)
    kind, layer = cfg.kind, cfg.layer
    s = open_store_arg(store)
    out = run_topk(s, cfg)
    res = out.result
    units = list(range(min(show, res.values.shape[0])))
    contexts = _contexts(s, res.rows[units].reshape(-1).tolist()) if units else {}
    if run.as_json:
        click.echo(
            json.dumps(
                {
                    "run_id": out.run_id,
                    "kind": kind,
                    "layer": layer,
                    "units": int(res.values.shape[0]),
                    "k": int(res.values.shape[1]),
                    "shown": [
                        {
                            "unit": u,
                            "top": [
                                {"row": int(r), "value": float(v), **contexts[int(r)]}
                                for r, v in zip(res.rows[u], res.values[u])
                            ],
                        }
                        for u in units
                    ],
                }
            )
        )
        return
    click.echo(f"{kind} layer {layer}: top {res.values.shape[1]} of {res.values.shape[0]} units")
    for u in units:
        click.echo(f"unit {u}:")
        for r, v in list(zip(res.rows[u], res.values[u]))[:3]:
            c = contexts[int(r)]
            if "before" in c:  # a corpus row: the token in its window's text
                shown = f"{c['before'][-50:]}[{c['token']}]{c['after'][:25]}"
                click.echo(f"  {v:10.4f}  row {int(r):>7}  {shown!r}")
            else:
                click.echo(f"  {v:10.4f}  row {int(r):>7}  [{c['token']}]  {c['text'][:70]}")
    if out.run_id:
        click.echo(f"run {out.run_id} (table: topk_contexts)")


def _contexts(store: Any, rows: list[int]) -> dict[int, dict[str, Any]]:
    """The prompt text and the target token of each row; a corpus store's row: its token and the text
    of its window around it (``text`` with the token in brackets, ``before`` and ``after`` apart)."""
    if store.manifest.ingest.get("positions") == "all":
        from actstore.query.analyses.topk import position_contexts

        return {
            r: {
                "text": f"{c.before}[{c.token}]{c.after}",
                "token": c.token,
                "before": c.before,
                "after": c.after,
            }
            for r, c in position_contexts(store, rows).items()
        }
    got = store.sql(
        "SELECT t.row, e.text, k.token FROM targets t JOIN examples e USING (example_id) "
        "LEFT JOIN tokens k ON k.example_id = t.example_id AND k.position = t.position "
        "WHERE t.row IN (SELECT unnest($r::BIGINT[]))",
        {"r": sorted(set(rows))},
    ).to_pylist()
    return {int(g["row"]): {"text": str(g["text"]), "token": str(g["token"])} for g in got}


COMMANDS = [topk]
