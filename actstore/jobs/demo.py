"""The demo, end to end on a laptop (``actstore demo``): ingest the built-in demo corpus
(ingest/data/demo.json) with SmolLM2-135M, run each analysis over the store, and write the HTML
report.

    summary = run_demo(DemoConfig(out="demo-out"))   # demo-out/store, report.html, summary.json

A step that fails is skipped with a note in the summary, so the demo always ends with a report;
a missing module is not a failure of a step but of the installation, and raises.  The
settings are kept modest so that ingest plus analyses finish in a few minutes on two CPU
cores: one seed of ``episodes`` 5-way 5-shot episodes per probe, TokenScores for every query
prediction of the ``attn_head`` probe, static MAPS scores for every relation of the store (one
pass over the heads serves all relations) and dynamic MAPS scores for one of them (the
optional steps give way to a time budget, see :func:`run_demo_analyses`).
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from actstore.core.progress import progress_bar, say_nothing
from actstore.core.store import StoreReader, open_reader
from actstore.jobs.correlate import CorrelateConfig, run_correlate
from actstore.jobs.ingest import IngestRequest, run_ingest
from actstore.jobs.probe import run_probe
from actstore.jobs.record import record_run
from actstore.jobs.settings import DEMO_EPISODES, DemoConfig, ProbeRequest
from actstore.jobs.shortcuts import ShortcutsConfig, run_shortcuts
from actstore.query.analyses.probe_config import ProbeConfig
from actstore.query.maps.dynamic import correlation_summary, correlation_table, dynamic_ranks, head_table
from actstore.query.maps.pairs import TokenPairs, store_pairs
from actstore.query.maps.static import StaticScores, relation_summary, scores_table, static_scores
from actstore.query.report.builder import write_report

Step = Callable[[str], None]


@dataclass
class DemoLog:
    """What ran, how long it took, and what was skipped and why."""

    step: Step
    log: Step = say_nothing  # the steps' detail lines
    timings: dict[str, float] = field(default_factory=dict)  # wall-clock seconds per step
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds per step (all threads)
    notes: list[str] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)

    def run(self, name: str, title: str, fn: Callable[[], Any]) -> Any:
        """Run one step; a failure is noted and the demo goes on, but an ImportError (a packaging
        mistake, not a failed analysis) propagates."""
        self.step(title)
        started, cpu = time.time(), time.process_time()
        try:
            out = fn()
        except ImportError:
            raise
        except Exception as e:  # a failing analysis must not cost the user the rest of the demo
            self.notes.append(f"{name}: failed ({type(e).__name__}: {' '.join(str(e).split())[:200]})")
            self.log(f"    skipped: {type(e).__name__}: {e}")
            return None
        finally:
            self.timings[name] = round(time.time() - started, 1)
            self.cpu[name] = round(time.process_time() - cpu, 1)
        if out is not None:
            self.results[name] = out
        return out


# ----------------------------------------------------------------------------------- steps
def probe_step(
    store: StoreReader,
    kind: str,
    episodes: int,
    token_scores: str,
    log: Step = say_nothing,
    progress: bool = True,
) -> dict[str, Any]:

    cfg = ProbeConfig(
        kind=kind,
        n_way=5,
        k_shot=5,
        queries=5,
        episodes=episodes,
        seeds=(0,),
        token_scores=token_scores,
        threads=1,
    )
    out = run_probe(store, ProbeRequest(probe=cfg, progress=progress)).output
    lo, hi = out.ci95
    log(
        f"    {kind} 5-way 5-shot: accuracy {100 * out.accuracy:.1f}% (95% CI {100 * lo:.1f}-{100 * hi:.1f}) "
        f"over {len(out.episodes)} episodes in {out.seconds:.0f}s"
    )
    return {"run_id": out.run_id, "accuracy": round(out.accuracy, 4), "ci95": [round(lo, 4), round(hi, 4)]}


def predictors_step(store: StoreReader, run_id: str) -> dict[str, Any]:

    out = run_correlate(store, CorrelateConfig(probe_run=run_id))
    return {r["predictor"]: r["spearman_rho"] for r in out.result.correlations.to_pylist()}


def shortcuts_step(store: StoreReader, run_id: str) -> dict[str, Any]:

    out = run_shortcuts(store, ShortcutsConfig(probe_run=run_id))
    return dict(out.result.summary.to_pylist()[0])


def store_token_pairs(store: StoreReader, relations: list[str] | None = None) -> list[Any]:
    """Each relation's distinct (subject's first token, object's first token) pairs, from the
    store's own prompts (no tokenizer needed): the MAPS pairs of the demo corpus."""

    t = store_pairs(store)
    rel = np.asarray(t.column("relation_id").to_pylist())
    src, dst = t.column("src_id").to_numpy(), t.column("dst_id").to_numpy()
    out = []
    for name in sorted(set(rel.tolist())):
        if relations is not None and name not in relations:
            continue
        m = rel == name
        pairs = np.unique(np.stack([src[m], dst[m]], axis=1), axis=0)
        out.append(
            TokenPairs(
                name, pairs[:, 0].astype(np.int64), pairs[:, 1].astype(np.int64), int(pairs.shape[0]), 0, 0
            )
        )
    return out


def maps_step(
    store: StoreReader,
    proj: Any,
    k: int = 10,
    threshold: float = 0.15,
    log: Step = say_nothing,
    progress: bool = True,
) -> dict[str, Any]:

    started = time.time()
    pairs = store_token_pairs(store)
    g = store.geometry
    parts = []  # one pass per layer, for the progress bar; other layers' ranks are -1 in each part
    for layer in progress_bar(range(g.n_layers), desc="MAPS static", unit="layer", enabled=progress):
        parts.append(static_scores(proj, pairs, heads=[(layer, h) for h in range(g.n_heads)]))
    scores = {
        name: StaticScores(
            parts[0][name].pairs,
            np.max([p[name].rank_up for p in parts], axis=0),
            np.max([p[name].rank_down for p in parts], axis=0),
        )
        for name in parts[0]
    }
    summaries = [relation_summary(name, sc, k, threshold) for name, sc in scores.items()]
    tables = {
        "maps_scores": scores_table(scores, k, threshold, store.geometry.kv_group),
        "maps_relations": pa.Table.from_pylist(summaries),
    }
    config = {"pairs": "store prompts", "k": k, "threshold": threshold}
    run_id = record_run(store, "maps", config, tables, started=started).run_id
    for s in summaries:
        log(
            f"    {s['relation']:<22} {s['n_used']:>3} pairs, {s['n_implementing']:>3} heads implement it, "
            f"best {s['best_layer']}.{s['best_head']} (phi={s['max_score']:.2f})"
        )
    return {"run_id": run_id, "relations": {s["relation"]: s["n_implementing"] for s in summaries}}


def maps_dynamic_step(
    store: StoreReader, proj: Any, relations: list[str], k: int = 10, log: Step = say_nothing
) -> dict[str, Any]:

    started = time.time()
    ranks = dynamic_ranks(store, relations=relations, proj=proj)
    summaries = [correlation_summary(d, k) for d in ranks.values()]
    tables = {
        "maps_dynamic": pa.concat_tables([head_table(d, k) for d in ranks.values()]),
        "maps_correlation": correlation_table(summaries),
    }
    config = {"relations": relations, "k": k}
    run_id = record_run(store, "maps-dynamic", config, tables, started=started).run_id
    for s in summaries:
        log(
            f"    {s['relation']:<22} static vs dynamic r = {s['corr_wo_context']:.2f} (no context), "
            f"{s['corr_w_context']:.2f} (context)"
        )
    return {"run_id": run_id, "correlation": {s["relation"]: s["corr_wo_context"] for s in summaries}}


def _demo_relations(store: StoreReader, n: int) -> list[str]:
    """The ``n`` relations with the most prompts the model answers (ties by name)."""
    rows = store.sql(
        "SELECT e.relation_id, sum(CASE WHEN t.object_rank = 0 THEN 1 ELSE 0 END) AS ok "
        "FROM examples e JOIN targets t USING (example_id) WHERE e.subject_start >= 0 "
        "GROUP BY 1 ORDER BY ok DESC, 1"
    ).to_pylist()
    return [str(r["relation_id"]) for r in rows[:n]]


# ----------------------------------------------------------------------------------- entry point
def run_demo_analyses(
    store: StoreReader,
    *,
    out: str,
    episodes: int = DEMO_EPISODES,
    step: Step = say_nothing,
    probe_kinds: tuple[str, ...] = ("attn_head", "attn"),
    dynamic_relations: int = 1,
    budget_s: float = 300.0,
    log: Step = say_nothing,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the demo's analyses over ``store``, write ``out/report.html``; return a summary dict
    with ``report`` (the path), per-step results, ``timings`` and ``cpu_seconds`` per step, and
    ``notes`` (what was skipped and why).  ``step(title)`` is called as each step starts, ``log``
    with the steps' detail lines; ``progress``: the steps' progress bars on stderr.

    The main steps run first: the first probe kind with HeadScore and TokenScore (stored for
    every prediction, so the report shows correct predictions as well as errors), predictors,
    shortcuts and static MAPS.  The optional ones (further probe kinds, dynamic MAPS) are skipped
    with a note once the analyses have taken ``budget_s`` seconds, so a slow or busy machine
    still gets its report in time."""
    runs = DemoLog(step, log)
    started = time.time()

    def over_budget(name: str) -> bool:
        if time.time() - started <= budget_s:
            return False
        runs.notes.append(f"{name}: skipped (the analyses took over {budget_s:.0f}s already)")
        step(f"{name}: skipped to stay within the time budget")
        return True

    def probe(kind: str, token_scores: str) -> Any:
        title = f"probe {kind}: {episodes} episodes, 5-way 5-shot, HeadScore" + (
            "/TokenScore" if token_scores != "none" else ""
        )
        return runs.run(
            f"probe_{kind}",
            title,
            functools.partial(probe_step, store, kind, episodes, token_scores, log, progress),
        )

    first = probe(probe_kinds[0], "all") if probe_kinds else None
    if first is not None:
        run_id = str(first["run_id"])
        runs.run("predictors", "predictors of per-relation F1", lambda: predictors_step(store, run_id))
        runs.run("shortcuts", "lexical shortcuts in probe errors", lambda: shortcuts_step(store, run_id))
    proj_cache: dict[str, Any] = {}

    def proj() -> Any:
        if "p" not in proj_cache:
            from actstore.query.maps.projection import VocabProjection

            proj_cache["p"] = VocabProjection(store)
        return proj_cache["p"]

    runs.run(
        "maps",
        "MAPS static scores of every head (weights only)",
        lambda: maps_step(store, proj(), log=log, progress=progress),
    )
    for kind in probe_kinds[1:]:
        if not over_budget(f"probe_{kind}"):
            probe(kind, "none")
    if dynamic_relations > 0 and not over_budget("maps_dynamic"):
        rels = _demo_relations(store, dynamic_relations)
        runs.run(
            "maps_dynamic",
            f"MAPS dynamic scores from stored head outputs ({', '.join(rels)})",
            lambda: maps_dynamic_step(store, proj(), rels, log=log),
        )
    proj_cache.clear()
    summary: dict[str, Any] = dict(runs.results)
    report_path = os.path.join(out, "report.html")
    res = runs.run("report", "HTML report", lambda: write_report(store, report_path))
    if res is not None:
        summary["report"] = res
    summary["timings"] = runs.timings
    summary["cpu_seconds"] = runs.cpu
    summary["notes"] = runs.notes
    for n in runs.notes:
        log(f"    note: {n}")
    return summary


def run_demo(
    cfg: DemoConfig, *, step: Step = say_nothing, log: Step = say_nothing, progress: bool = False
) -> dict[str, Any]:
    """Ingest the demo corpus into ``cfg.out/store`` (resuming a store already there), run the analyses
    (:func:`actstore.jobs.demo.run_demo_analyses`) and write ``cfg.out/summary.json``; return the summary.
    ``step(title)`` is called as each step starts, ``log`` with the detail lines; ``progress``: the
    ingest's and the steps' progress bars on stderr."""

    started = time.time()
    out, model = cfg.out, cfg.model
    store_path = os.path.join(out, "store")
    os.makedirs(out, exist_ok=True)
    resume = os.path.exists(os.path.join(store_path, "manifest.json"))
    step(f"ingest the demo corpus with {model} -> {store_path}" + (" (resuming)" if resume else ""))
    run_ingest(
        IngestRequest(
            model=model,
            dataset="demo",
            out=store_path,
            resume=resume,
            limit_per_relation=cfg.limit_per_relation,
            progress=progress,
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
    summary.update(
        run_demo_analyses(store, out=out, episodes=cfg.episodes, step=step, log=log, progress=progress)
    )
    summary["seconds"] = round(time.time() - started, 1)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
    return summary
