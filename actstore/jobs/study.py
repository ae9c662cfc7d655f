"""The method-comparison study (``actstore study run``) of An Empirical Study of Mechanistic
Interpretability Approaches for Factual Recall (ACL 2025) on an ingested store, at the scale a time
budget allows; each step is recorded in the state file (:mod:`actstore.jobs.study_state`), so the same
call resumes it:

1. the facts the model answers (``object_rank = 0``), ordered round-robin over the strata (relation x
   frequency band x uniqueness; a seeded shuffle within each), so that every prefix of the order is
   stratified;
2. causal tracing of that order in chunks of ``chunk`` facts (one trace run each) until the state's
   trace calls add up to ``trace_minutes`` (or ``max_facts`` are traced): MLP and attention;
3. activation patching of the traced facts not patched yet (MLP and attention outputs per layer, no
   heads): each call adds one patch run (``patch_runs``, ``patched`` in the state);
4. every method's reading, the located sites, the interventions on them and on random layers, and the
   metrics (:mod:`actstore.jobs.study_metrics`).

Tracing is the bound (one process per core), so a second process can trace a later range of the same
order on the same store (``start``, ``trace_only``), and :func:`merge_states` folds its runs into the
first state before the other steps.

    out = run_study(store, StudyRunConfig(state="S.study.json", trace_minutes=30))
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actstore.core.errors import MethodsError
from actstore.core.progress import say_nothing
from actstore.core.store import StoreReader
from actstore.interventions.settings import PatchConfig, TraceConfig
from actstore.jobs.patch import PatchRequest, run_patch
from actstore.jobs.study_metrics import Log, measure_study, migrate_patch_state
from actstore.jobs.study_settings import StudyMergeConfig, StudyRunConfig
from actstore.jobs.study_state import existing_state, load_state, save_state, stratified_order, where_ids
from actstore.jobs.trace import TraceRequest, run_trace

# The trace settings every run of one state must share (a merge refuses runs that differ in one).
TRACE_KEYS = (
    "components",
    "incremental",
    "model",
    "noise_scale",
    "samples",
    "seed",
    "skip_before_subject",
    "window",
)


@dataclass
class StudyOutcome:
    """What a call of :func:`run_study` left: the state (as saved), the metrics run of each mode it
    recorded, and the summary file it wrote."""

    state: dict[str, Any]
    metrics_runs: dict[str, str] = field(default_factory=dict)
    summary: str | None = None


def _count(store: StoreReader, where: str) -> int:
    sql = f"SELECT count(*) AS n FROM examples JOIN targets USING (example_id) WHERE {where}"
    return int(store.sql(sql).column("n")[0].as_py())


def study_order(store: StoreReader, seed: int, all_facts: bool) -> tuple[list[int], int]:
    """The stratified order of the facts to trace (those the model answers, or all of them with
    ``all_facts``) and how many strata it interleaves."""
    rows = store.sql(
        """SELECT e.example_id, coalesce(e.meta->>'stratum', e.relation_id) AS stratum
           FROM examples e JOIN targets t USING (example_id)
           WHERE t.object_token_id >= 0 AND e.subject_start >= 0"""
        + ("" if all_facts else " AND t.object_rank = 0")
    ).to_pylist()
    return stratified_order(rows, seed), len({r["stratum"] for r in rows})


def run_study(store: StoreReader, cfg: StudyRunConfig, log: Log | None = None) -> StudyOutcome:
    """Trace, patch, intervene and measure as the module docstring says, the state saved after each
    run; with ``trace_only`` stop after tracing."""
    say = log or say_nothing
    state_path = Path(cfg.state)
    state = load_state(state_path)
    state.setdefault("started", time.strftime("%Y-%m-%dT%H:%M:%S"))
    answered = _count(store, "object_token_id >= 0 AND object_rank = 0")
    n_facts = _count(store, "object_token_id >= 0")
    order, strata = study_order(store, cfg.seed, cfg.all_facts)
    state.update({"answered": answered, "facts": n_facts})
    say(f"{len(order)} facts to trace ({answered} answered of {n_facts}) in {strata} strata")
    trace_facts(store, cfg, state, order, say)
    if cfg.trace_only:
        return StudyOutcome(state)
    if cfg.patch:
        patch_traced(store, cfg, state, say)
    runs = measure_study(store, cfg, state, say)
    return StudyOutcome(state, runs, cfg.out)


def trace_facts(
    store: StoreReader,
    cfg: StudyRunConfig,
    state: dict[str, Any],
    order: list[int],
    say: Log,
) -> None:
    """Trace the order from ``cfg.start`` in chunks, skipping facts the state traced, until its trace
    calls add up to ``cfg.trace_minutes`` or it holds ``cfg.max_facts`` facts."""
    trace = TraceConfig(samples=cfg.samples, window=cfg.window, components=("mlp", "attn"), seed=0)
    t_start = time.time()
    spent = float(state.get("trace_seconds", 0.0))
    traced = list(state["traced"])
    done = set(traced)
    room = len(order) if cfg.max_facts is None else max(0, cfg.max_facts - len(traced))
    todo = [i for i in order[cfg.start :] if i not in done][:room]
    while todo and spent < cfg.trace_minutes * 60:
        chunk, todo = todo[: cfg.chunk], todo[cfg.chunk :]
        t0 = time.time()
        request = TraceRequest(
            where=where_ids(chunk),
            trace=trace,
            quiet=not cfg.progress,
            all_facts=cfg.all_facts,
            device=cfg.device,
        )
        out = run_trace(store, request)
        dt = time.time() - t0
        spent += dt
        traced.extend(chunk)
        state["trace_runs"].append(out.run_id)
        state["traced"] = traced
        state["trace_seconds"] = spent
        state["trace_cpu_note"] = "wall seconds of run_trace calls (model load included)"
        save_state(Path(cfg.state), state)
        say(
            f"traced {len(traced)} facts ({len(chunk)} in {dt:.0f}s, {60 * len(chunk) / dt:.2f} facts/min); "
            f"run {out.run_id}"
        )
    say(f"tracing: {len(traced)} facts in {spent:.0f}s (this call {time.time() - t_start:.0f}s)")


def patch_traced(store: StoreReader, cfg: StudyRunConfig, state: dict[str, Any], say: Log) -> None:
    """Patch the traced facts not patched yet in one new patch run (the runs cover disjoint facts)."""
    migrate_patch_state(store, state)
    done = set(state["patched"])
    todo = [i for i in state["traced"] if i not in done]
    if not todo:
        return
    t0 = time.time()
    out = run_patch(
        store,
        PatchRequest(
            where=where_ids(todo),
            quiet=not cfg.progress,
            device=cfg.device,
            all_facts=cfg.all_facts,
            patch=PatchConfig(components=("attn", "mlp"), heads=False),
        ),
    )
    dt = time.time() - t0
    state["patch_runs"].append(out.run_id)
    state["patched"] = state["patched"] + todo
    state["patch_seconds"] = float(state.get("patch_seconds", 0.0)) + dt
    state["patch_pairs"] = int(state.get("patch_pairs", 0)) + len(out.results)
    state["patch_skipped"] = int(state.get("patch_skipped", 0)) + len(out.skipped)
    save_state(Path(cfg.state), state)
    say(
        f"patched {len(out.results)} pairs of {len(todo)} newly traced facts ({len(out.skipped)} without "
        f"a counterfactual) in {dt:.0f}s; run {out.run_id}"
    )


def merge_states(store: StoreReader, cfg: StudyMergeConfig, log: Log | None = None) -> dict[str, Any]:
    """Fold the tracing of the states ``cfg.add`` (``run --start N --trace-only`` on the same store, in
    other processes) into ``cfg.state``: their trace runs and facts are appended, their trace seconds
    added; return the merged state.  Refused, with nothing written, when a state traced a fact twice,
    or a run is missing from the store, is not a trace run, or traced with another configuration than
    the state's first run."""
    state_path = Path(cfg.state)
    state = existing_state(state_path)
    others = [(path, existing_state(Path(path))) for path in cfg.add]
    runs = list(state["trace_runs"]) + [r for _, o in others for r in o["trace_runs"]]
    rows = {
        r["run_id"]: r
        for r in store.sql(
            "SELECT run_id, kind, config FROM runs WHERE list_contains($r, run_id)", {"r": runs}
        ).to_pylist()
    }
    ref: dict[str, Any] | None = None
    for run in runs:
        row = rows.get(run)
        if row is None or row["kind"] != "trace":
            raise MethodsError(f"{run}: not a trace run of {store.url}")
        config = json.loads(row["config"])
        got = {k: config.get(k) for k in TRACE_KEYS}
        if ref is None:
            ref = got
        elif got != ref:
            diff = ", ".join(f"{k} {ref[k]!r} vs {got[k]!r}" for k in TRACE_KEYS if got[k] != ref[k])
            raise MethodsError(f"{run}: traced with another configuration than {runs[0]} ({diff})")
    seen = set(state["traced"])
    for path, o in others:
        twice = seen & set(o["traced"])
        if twice:
            raise MethodsError(f"{path}: {len(twice)} facts already traced (example_id {min(twice)}, ...)")
        seen |= set(o["traced"])
    for _, o in others:
        state["traced"] = list(state["traced"]) + list(o["traced"])
        state["trace_runs"] = list(state["trace_runs"]) + list(o["trace_runs"])
        state["trace_seconds"] = float(state.get("trace_seconds", 0.0)) + float(o.get("trace_seconds", 0.0))
    save_state(state_path, state)
    (log or say_nothing)(
        f"{cfg.state}: {len(state['traced'])} traced facts in {len(state['trace_runs'])} trace runs"
    )
    return state
