"""The demo, end to end on a laptop: ingest the built-in demo corpus (ingest/data/demo.json) with
SmolLM2-135M, run each analysis over the store, and write the HTML report (``actstore demo``).

    summary = run_demo("demo-out")      # demo-out/store, demo-out/report.html, demo-out/summary.json

Part of the top layer (beside the command line): it imports both ``ingest`` and ``query``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

Log = Callable[[str], None]


def _nothing(text: str) -> None:
    """The default log: nothing."""


def run_demo(
    out: str,
    *,
    model: str = "smollm2-135m",
    limit_per_relation: int | None = None,
    episodes: int = 100,
    step: Log = _nothing,
    log: Log = _nothing,
) -> dict[str, Any]:
    """Ingest the demo corpus into ``out/store`` (resuming a store already there), run the analyses
    (:func:`actstore.jobs.demo_steps.run_demo_analyses`) and write ``out/summary.json``; return the summary.
    ``step(title)`` is called as each step starts, ``log`` with the detail lines."""
    from actstore.core.store import open_reader
    from actstore.jobs.demo_steps import run_demo_analyses
    from actstore.jobs.ingest import IngestRequest, run_ingest

    started = time.time()
    store_path = os.path.join(out, "store")
    os.makedirs(out, exist_ok=True)
    resume = os.path.exists(os.path.join(store_path, "manifest.json"))
    step(f"ingest the demo corpus with {model} -> {store_path}" + (" (resuming)" if resume else ""))
    run_ingest(
        IngestRequest(
            model=model, dataset="demo", out=store_path, resume=resume, limit_per_relation=limit_per_relation
        ),
        log=lambda m: log(f"    {m}"),
    )
    store = open_reader(store_path)
    log(f"    {store!r}")
    acc = store.sql(
        "SELECT relation_id, count(*) AS n, avg(CASE WHEN object_rank = 0 THEN 1 ELSE 0 END) AS top1 "
        "FROM examples JOIN targets USING (example_id) GROUP BY 1 ORDER BY 1"
    ).to_pylist()
    for r in acc:
        log(f"    {r['relation_id']:<20} {r['n']:>4} prompts, model's top-1 = object for {r['top1']:.0%}")
    summary: dict[str, Any] = {"store": store_path}
    summary.update(run_demo_analyses(store, out=out, episodes=episodes, step=step, log=log))
    summary["seconds"] = round(time.time() - started, 1)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
    return summary
