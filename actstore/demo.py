"""``actstore demo``: the main job on built-in defaults, end to end on a laptop.

Ingests the built-in demo corpus (ingest/data/demo.json) with SmolLM2-135M, then runs
each analysis that is available over the store and writes the HTML report.  Steps whose
module is not installed are skipped with a note, so the demo always finishes.
"""

from __future__ import annotations

import importlib
import json
import os
import time
from collections.abc import Callable
from typing import Any

import click

from actstore.cli import friendly


def _step(title: str) -> None:
    click.echo(click.style(f"==> {title}", bold=True), err=True)


def _optional(module: str, attr: str) -> Callable[..., Any] | None:
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ModuleNotFoundError, AttributeError):
        return None
    return fn  # type: ignore[no-any-return]


@click.command()
@click.option("--out", default="demo-out", show_default=True, help="Folder for the store and the report.")
@click.option("--model", "model_name", default="smollm2-135m", show_default=True)
@click.option("--limit-per-relation", type=int, default=None, help="Fewer prompts for a quicker demo.")
@click.option("--episodes", type=int, default=100, show_default=True, help="Probe episodes per seed.")
@friendly
def demo(out: str, model_name: str, limit_per_relation: int | None, episodes: int) -> None:
    """Ingest the demo corpus, run probes, HeadScore/TokenScore and MAPS, and write a report."""
    import actstore
    from ingest.run import IngestRequest, ingest_corpus

    started = time.time()
    store_path = os.path.join(out, "store")
    os.makedirs(out, exist_ok=True)
    resume = os.path.exists(os.path.join(store_path, "manifest.json"))
    _step(f"ingest the demo corpus with {model_name} -> {store_path}" + (" (resuming)" if resume else ""))
    ingest_corpus(IngestRequest(model=model_name, dataset="demo", out=store_path, resume=resume,
                                limit_per_relation=limit_per_relation),
                  log=lambda m: click.echo(f"    {m}", err=True))
    store = actstore.open(store_path)
    click.echo(f"    {store!r}", err=True)
    acc = store.sql("SELECT relation_id, count(*) AS n, avg(CASE WHEN object_rank = 0 THEN 1 ELSE 0 END) AS top1 "
                    "FROM examples JOIN targets USING (example_id) GROUP BY 1 ORDER BY 1").to_pylist()
    for r in acc:
        click.echo(f"    {r['relation_id']:<20} {r['n']:>4} prompts, model's top-1 = object for {r['top1']:.0%}", err=True)

    summary: dict[str, Any] = {"store": store_path}
    run_demo_analyses = _optional("query.demo_steps", "run_demo_analyses")
    if run_demo_analyses is not None:
        summary.update(run_demo_analyses(store, out=out, episodes=episodes, step=_step))
    else:
        click.echo("    (analyses not installed in this build: skipped)", err=True)
    summary["seconds"] = round(time.time() - started, 1)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
    report = summary.get("report")
    click.echo(f"done in {summary['seconds']}s. store: {store_path}" + (f"  report: {report}" if report else ""))
