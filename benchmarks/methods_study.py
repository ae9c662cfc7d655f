"""The seed-001 method comparison on the methods2k data set, end to end, at the scale a time budget allows.

    python benchmarks/methods_study.py build --out DATA                     # methods2k.json (2,000 facts)
    actstore ingest --model smollm2-135m --dataset methods2k:DATA --out S  # the store (all 2,000 prompts)
    python benchmarks/methods_study.py study S --state S.study.json --trace-minutes 30 --samples 2

``study`` runs, each step recorded in the state file (so it resumes, and the results page can
quote the run ids):

1. the facts the model answers (``object_rank = 0``), ordered round-robin over the strata
   (relation x frequency band x uniqueness; a seeded shuffle within each), so that every prefix of
   the order is stratified;
2. causal tracing of that order in chunks of ``--chunk`` facts (one trace run each) until
   ``--trace-minutes`` have passed (or ``--max-facts`` are traced): MLP and attention, window 10;
3. activation patching of the traced facts not patched yet (MLP and attention outputs per layer, no
   heads): each call adds one patch run (``patch_runs``, ``patched`` in the state), so a resumed
   study patches only what it traced since;
4. every method's reading (:func:`actstore.query.methods.metrics.study_readings`; the tuned lens trained with
   ``--tuned`` adam, sgd or ridge on the facts not traced, ``--tuned-steps`` of ``--tuned-batch``
   facts, recorded in the state as ``tuned_lens``), the located sites, and the interventions on
   them and on random layers (``site_effects``, knock-out and restore; a run is reused only while
   it covers the same facts, ``effects_<mode>_facts``);
5. the metrics (:func:`actstore.query.methods.metrics.compute_metrics`) per method, overall and per stratum,
   the pair table with bootstrap intervals, and the cross-size row; written to the store
   (``method_metrics``, ``method_pair_metrics``, ``method_cross_size``) and to ``--json``.

Tracing is the bound (one process per core), so a second process can trace a later range of the same
order on the same store, and ``merge`` folds its runs into the first state before the other steps::

    python benchmarks/methods_study.py study S --state S.study.json --max-facts 440 --trace-only ...
    python benchmarks/methods_study.py study S --state S.tail.json --start 440 --trace-only ...   # beside it
    python benchmarks/methods_study.py merge S --state S.study.json --add S.tail.json
    python benchmarks/methods_study.py study S --state S.study.json ...   # patch, intervene, measure all

A study longer than a machine's life goes on elsewhere from a checkpoint folder (numbers and run
records only: the data set's text is left out and read back from the store it is restored into)::

    python benchmarks/methods_study.py checkpoint S --state S.study.json --out CK
    python benchmarks/methods_study.py restore S2 --from CK --state S2.study.json   # S2: same data, same model
    python benchmarks/methods_study.py study S2 --state S2.study.json ...            # resumes
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

METHODS = ("trace", "patch", "probe", "attention", "logit_lens", "tuned_lens")
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def stratified_order(rows: list[dict[str, Any]], seed: int = 0) -> list[int]:
    """Example ids round-robin over strata (sorted keys), seeded shuffle within each stratum."""
    by: dict[str, list[int]] = defaultdict(list)
    for r in rows:
        by[str(r["stratum"])].append(int(r["example_id"]))
    queues = []
    for k in sorted(by):
        ids = sorted(by[k])
        random.Random(f"{seed}:{k}").shuffle(ids)
        queues.append(ids)
    out: list[int] = []
    depth = 0
    while any(depth < len(q) for q in queues):
        out.extend(q[depth] for q in queues if depth < len(q))
        depth += 1
    return out


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    """A study's ``--json`` output; gzip-compressed when the name ends in ``.gz`` (the form kept in
    the repository: the per-relation and per-stratum rows make it about 2 MB of plain JSON)."""
    text = json.dumps(summary, indent=1, default=float) + "\n"
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode(), mtime=0))
    else:
        path.write_text(text)


def read_summary(path: Path) -> dict[str, Any]:
    """What ``write_summary`` wrote, plain or gzip-compressed."""
    data = path.read_bytes()
    return dict(json.loads(gzip.decompress(data) if path.suffix == ".gz" else data))


def load_state(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {"trace_runs": [], "traced": []}


def save_state(path: Path, state: dict[str, Any]) -> None:
    """Write the state atomically (a reader in another process never sees half a file, and a study
    killed while saving keeps the state it had)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    os.replace(tmp, path)


def cmd_build(a: argparse.Namespace) -> None:
    from actstore.ingest.datasets.methods2k import build_methods2k

    p = build_methods2k(a.lre, a.known, a.out, size=a.size, seed=a.seed)
    doc = json.loads(p.read_text())
    log(f"wrote {p}: {doc['size']} facts from a pool of {doc['pool']}, {len(doc['strata'])} strata")


def _where_ids(ids: list[int]) -> str:
    return f"example_id IN ({', '.join(str(i) for i in ids)})"


def cmd_study(a: argparse.Namespace) -> None:
    from actstore.api import open_store
    from actstore.interventions.settings import PatchConfig, TraceConfig
    from actstore.jobs.patch import PatchRequest, run_patch
    from actstore.jobs.trace import TraceRequest, run_trace

    store = open_store(a.store)
    state_path = Path(a.state)
    state = load_state(state_path)
    state.setdefault("started", time.strftime("%Y-%m-%dT%H:%M:%S"))
    rows = store.sql(
        """SELECT e.example_id, coalesce(e.meta->>'stratum', e.relation_id) AS stratum
                        FROM examples e JOIN targets t USING (example_id)
                        WHERE t.object_token_id >= 0 AND e.subject_start >= 0"""
        + ("" if a.all_facts else " AND t.object_rank = 0")
    ).to_pylist()
    answered = (
        store.sql(
            "SELECT count(*) AS n FROM examples JOIN targets USING (example_id) "
            "WHERE object_token_id >= 0 AND object_rank = 0"
        )
        .column("n")[0]
        .as_py()
    )
    n_facts = (
        store.sql(
            "SELECT count(*) AS n FROM examples JOIN targets USING (example_id) WHERE object_token_id >= 0"
        )
        .column("n")[0]
        .as_py()
    )
    order = stratified_order(rows, a.seed)
    state.update({"answered": int(answered), "facts": int(n_facts)})
    log(
        f"{len(order)} facts to trace ({answered} answered of {n_facts}) in {len({r['stratum'] for r in rows})} strata"
    )
    # ---- tracing, chunk by chunk, within the budget
    cfg = TraceConfig(samples=a.samples, window=a.window, components=("mlp", "attn"), seed=0)
    t_start = time.time()
    spent = float(state.get("trace_seconds", 0.0))
    traced = list(state["traced"])
    done_ids = set(traced)
    todo = [i for i in order[a.start :] if i not in done_ids][: max(0, a.max_facts - len(traced))]
    while todo and spent < a.trace_minutes * 60:
        chunk, todo = todo[: a.chunk], todo[a.chunk :]
        t0 = time.time()
        out = run_trace(
            store,
            TraceRequest(
                where=_where_ids(chunk), trace=cfg, quiet=True, all_facts=a.all_facts, device=a.device
            ),
        )
        dt = time.time() - t0
        spent += dt
        traced.extend(chunk)
        state["trace_runs"].append(out.run_id)
        state["traced"] = traced
        state["trace_seconds"] = spent
        state["trace_cpu_note"] = "wall seconds of run_trace calls (model load included)"
        save_state(state_path, state)
        log(
            f"traced {len(traced)} facts ({len(chunk)} in {dt:.0f}s, {60 * len(chunk) / dt:.2f} facts/min); "
            f"run {out.run_id}"
        )
    log(f"tracing: {len(traced)} facts in {spent:.0f}s (this call {time.time() - t_start:.0f}s)")
    if a.trace_only:
        return
    # ---- patching: the traced facts not patched yet, one run per call (the runs cover disjoint facts)
    if a.patch:
        migrate_patch_state(store, state)
        done = set(state["patched"])
        todo = [i for i in traced if i not in done]
        if todo:
            t0 = time.time()
            pout = run_patch(
                store,
                PatchRequest(
                    where=_where_ids(todo),
                    quiet=True,
                    device=a.device,
                    all_facts=a.all_facts,
                    patch=PatchConfig(components=("attn", "mlp"), heads=False),
                ),
            )
            dt = time.time() - t0
            state["patch_runs"].append(pout.run_id)
            state["patched"] = state["patched"] + todo
            state["patch_seconds"] = float(state.get("patch_seconds", 0.0)) + dt
            state["patch_pairs"] = int(state.get("patch_pairs", 0)) + len(pout.results)
            state["patch_skipped"] = int(state.get("patch_skipped", 0)) + len(pout.skipped)
            save_state(state_path, state)
            log(
                f"patched {len(pout.results)} pairs of {len(todo)} newly traced facts ({len(pout.skipped)} without "
                f"a counterfactual) in {dt:.0f}s; run {pout.run_id}"
            )
    effects_and_metrics(store, state, state_path, a)


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


def cmd_merge(a: argparse.Namespace) -> None:
    """Fold the tracing of other states (``study --start N --trace-only`` on the same store, in another
    process) into ``--state``: their trace runs and facts are appended, their trace seconds added.
    Refused, with nothing written, when a state traced a fact twice, or a run is missing from the
    store, is not a trace run, or traced with another configuration than the state's first run."""
    from actstore.api import open_store

    store = open_store(a.store)
    state_path = Path(a.state)
    if not state_path.exists():
        raise CheckpointError(f"{a.state}: no such state file")
    state = load_state(state_path)
    others = []
    for path in a.add:
        if not Path(path).exists():
            raise CheckpointError(f"{path}: no such state file")
        others.append((path, load_state(Path(path))))
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
            raise CheckpointError(f"{run}: not a trace run of {a.store}")
        cfg = json.loads(row["config"])
        got = {k: cfg.get(k) for k in TRACE_KEYS}
        if ref is None:
            ref = got
        elif got != ref:
            diff = ", ".join(f"{k} {ref[k]!r} vs {got[k]!r}" for k in TRACE_KEYS if got[k] != ref[k])
            raise CheckpointError(f"{run}: traced with another configuration than {runs[0]} ({diff})")
    seen = set(state["traced"])
    for path, o in others:
        twice = seen & set(o["traced"])
        if twice:
            raise CheckpointError(f"{path}: {len(twice)} facts already traced (example_id {min(twice)}, ...)")
        seen |= set(o["traced"])
    for _, o in others:
        state["traced"] = list(state["traced"]) + list(o["traced"])
        state["trace_runs"] = list(state["trace_runs"]) + list(o["trace_runs"])
        state["trace_seconds"] = float(state.get("trace_seconds", 0.0)) + float(o.get("trace_seconds", 0.0))
    save_state(state_path, state)
    log(f"{a.state}: {len(state['traced'])} traced facts in {len(state['trace_runs'])} trace runs")


def migrate_patch_state(store: Any, state: dict[str, Any]) -> None:
    """States written before incremental patching hold one ``patch_run``: it becomes the first of
    ``patch_runs``, and the facts it patched (read from the store) the first ``patched``; facts it
    skipped for want of a counterfactual are tried again, and skipped again."""
    state.setdefault("patch_runs", [])
    state.setdefault("patched", [])
    old = state.pop("patch_run", None)
    if old and old not in state["patch_runs"]:
        ids = store.sql("SELECT DISTINCT example_id FROM patch_effects WHERE run_id = ? ORDER BY 1", [old])
        state["patch_runs"].insert(0, old)
        state["patched"] = [int(i) for i in ids.column("example_id").to_pylist()] + state["patched"]


def effects_and_metrics(store: Any, state: dict[str, Any], state_path: Path, a: argparse.Namespace) -> None:
    import numpy as np

    from actstore.core.runs import new_run_id, with_run_id, write_run
    from actstore.core.writer import write_result_table
    from actstore.interventions import InterventionRunner
    from actstore.interventions.effectiveness import (
        EffectConfig,
        noise_std_for,
        site_effects,
        sites_by_fact,
    )
    from actstore.interventions.facts import stored_facts
    from actstore.jobs.methods import record_method_metrics
    from actstore.jobs.model import load_store_model, model_for_store
    from actstore.query.methods.agreement import default_tolerance
    from actstore.query.methods.metrics import located_sites
    from actstore.query.methods.readings import COMPARISON_TRAIN, key_mlp_at_subject
    from actstore.query.methods.study import store_strata, study_readings, trace_clean_probabilities
    from actstore.query.methods.tables import compute_metrics, cross_size_rows
    from actstore.query.select.selection import Selection

    started = time.time()
    methods = [m for m in a.methods.split(",") if m]
    migrate_patch_state(store, state)
    if not state["patch_runs"] and "patch" in methods:
        methods.remove("patch")
    tuned_config = replace(
        COMPARISON_TRAIN,
        steps=a.tuned_steps,
        batch=a.tuned_batch,
        lr=a.tuned_lr,
        seed=a.tuned_seed,
        device=a.device,
    )
    t_lens = time.time()

    def progress(step: int, loss: float) -> None:
        if step == 1 or step % 25 == 0 or step == a.tuned_steps:
            log(
                f"tuned lens ({a.tuned}): step {step}/{a.tuned_steps}, sum of per-index KL {loss:.4f}, "
                f"{time.time() - t_lens:.0f}s"
            )

    readings = study_readings(
        store,
        methods,
        state["trace_runs"],
        tuned=a.tuned,
        tuned_config=tuned_config,
        progress=progress,
        patch_runs=state["patch_runs"],
    )
    if "tuned_lens" in readings:
        state["tuned_lens"] = readings["tuned_lens"].info
        save_state(state_path, state)
        log(
            f"tuned lens ({a.tuned}): {state['tuned_lens']['train_facts']} training facts, "
            f"{state['tuned_lens']['seconds']:.0f}s"
        )
    log("readings: " + ", ".join(f"{m} {len(r.example_ids)}" for m, r in readings.items()))
    sites = sites_by_fact(located_sites(r) for r in readings.values())
    ids = [int(i) for i in sorted(sites)]
    effects: dict[str, Any] = {}
    loaded = None
    for mode in a.modes.split(","):
        key = f"effects_{mode}_run"
        if state.get(key) and state.get(f"effects_{mode}_facts") == ids:  # the same facts: reuse the run
            effects[mode] = store.sql(
                "SELECT * EXCLUDE (run_id) FROM site_effects WHERE run_id = ?", [state[key]]
            )
            continue
        if loaded is None:
            loaded = load_store_model(store, model_for_store(store, None), quiet=True, device=a.device)
            runner = InterventionRunner(loaded.model)
        cfg = EffectConfig(mode=mode, random_draws=a.random_draws, samples=a.samples)
        std = noise_std_for(loaded.model, store, runner, cfg.noise_scale) if mode == "restore" else 0.0
        facts = stored_facts(store, Selection.from_ids(store, ids), correct_only=False)
        t0 = time.time()
        table = site_effects(runner, facts, sites, cfg, std)
        rid = new_run_id("effects")
        write_result_table(store, "site_effects", rid, with_run_id(table, rid))
        write_run(store, rid, "effects", t0, {**cfg.__dict__, "noise_std": std, "facts": len(facts)})
        state[key] = rid
        state[f"effects_{mode}_facts"] = ids
        state[f"effects_{mode}_seconds"] = time.time() - t0
        save_state(state_path, state)
        effects[mode] = table
        log(
            f"{mode}: {table.num_rows} site effects of {len(facts)} facts in {time.time() - t0:.0f}s; run {rid}"
        )
    L = store.geometry.n_layers
    tol = default_tolerance(L)
    all_ids = np.unique(np.concatenate([r.example_ids for r in readings.values()]))
    strata = store_strata(store, all_ids)
    summary: dict[str, Any] = {
        "model": store.manifest.model.get("name"),
        "n_layers": L,
        "tolerance": tol,
        "readings": {m: int(len(r.example_ids)) for m, r in readings.items()},
        "tuned_lens": state.get("tuned_lens"),
    }
    trace = readings.get("trace")
    # the cross-size row does not depend on the intervention mode: it is computed once, with the first mode
    site = (
        np.concatenate([key_mlp_at_subject(store, r) for r in state["trace_runs"]])
        if trace is not None
        else None
    )
    p_clean = trace_clean_probabilities(store, state["trace_runs"]) if state["trace_runs"] else None
    for i, mode in enumerate(effects or {"none": None}):
        res = compute_metrics(
            list(readings.values()), strata, tol, effects.get(mode), resamples=a.resamples, p_clean=p_clean
        )
        cross = (
            cross_size_rows(
                str(summary["model"]),
                L,
                trace,
                readings.get("patch"),
                site,
                int(state["answered"]),
                int(state["facts"]),
                resamples=a.resamples,
            )
            if i == 0
            else None
        )
        rid = new_run_id("methods")
        record_method_metrics(
            store,
            rid,
            res,
            cross,
            {
                "mode": mode,
                "trace_runs": state["trace_runs"],
                "patch_runs": state["patch_runs"],
                "effects_run": state.get(f"effects_{mode}_run"),
                "methods": list(readings),
                "tolerance": tol,
                "tuned_lens": state.get("tuned_lens"),
            },
            started,
        )
        state[f"metrics_{mode}_run"] = rid
        summary[mode] = {"run_id": rid, "metrics": res.metrics.to_pylist(), "pairs": res.pairs.to_pylist()}
        if cross is not None:
            summary["cross_size"] = cross.to_pylist()
        log(f"metrics ({mode}): run {rid}")
    save_state(state_path, state)
    if a.json:
        write_summary(Path(a.json), {"state": state, **summary})
        log(f"wrote {a.json}")


# ------------------------------------------------------------------------------------ checkpoints
#
# A study's trace, patch and site-effect runs outlive its store as a checkpoint folder that holds
# numbers and run records only: the columns that repeat the data set's text (prompt tokens,
# subjects, objects, relation ids) are left out and read back from the store they are restored
# into, which must hold the same facts (checked by a fingerprint of each fact's token ids, subject
# span and object token) and the same model weights.

CHECKPOINT_FORMAT = 1
CHECKPOINT_TABLES = {
    "trace": ("trace_effects", "trace_facts"),
    "patch": ("patch_effects", "patch_pairs"),
    "effects": ("site_effects",),
}
_BY_FACT = (("example_id", "example_id"),)
DERIVED: dict[str, dict[str, tuple[str, str, tuple[tuple[str, str], ...]]]] = {
    # table -> column -> (store table, its column, ((checkpoint key, store key), ...))
    "trace_effects": {"token": ("tokens", "token", (("example_id", "example_id"), ("position", "position")))},
    "trace_facts": {
        "relation_id": ("examples", "relation_id", _BY_FACT),
        "subject": ("examples", "subject", _BY_FACT),
        "object": ("examples", "object", _BY_FACT),
    },
    "patch_pairs": {
        "relation_id": ("examples", "relation_id", _BY_FACT),
        "object": ("examples", "object", _BY_FACT),
        "counterfactual_object": ("examples", "object", (("counterfactual_id", "example_id"),)),
    },
}


class CheckpointError(ValueError):
    """A checkpoint cannot be written or restored as asked (one line)."""


def _study_runs(state: dict[str, Any]) -> list[tuple[str, str]]:
    """(kind, run id) of every run a checkpoint keeps: trace, patch and site-effect runs."""
    runs = [("trace", r) for r in state.get("trace_runs", [])] + [
        ("patch", r) for r in state.get("patch_runs", [])
    ]
    runs += [("effects", state[k]) for k in ("effects_knockout_run", "effects_restore_run") if state.get(k)]
    return runs


def fact_fingerprints(store: Any, ids: list[int]) -> dict[int, str]:
    """example id -> 16 hex digits of SHA-256 over the prompt's token ids, subject span and object token."""
    import hashlib

    rows = store.sql(
        """SELECT e.example_id, e.subject_start, e.subject_end, t.object_token_id,
                               list(tk.token_id ORDER BY tk.position) AS ids
                        FROM examples e JOIN targets t USING (example_id) JOIN tokens tk USING (example_id)
                        WHERE list_contains($ids, e.example_id) GROUP BY ALL ORDER BY e.example_id""",
        {"ids": ids},
    ).to_pylist()
    return {
        int(r["example_id"]): hashlib.sha256(
            json.dumps([r["ids"], r["subject_start"], r["subject_end"], r["object_token_id"]]).encode()
        ).hexdigest()[:16]
        for r in rows
    }


def write_checkpoint(store: Any, state: dict[str, Any], out: Path) -> dict[str, int]:
    """Write the study's runs (see :data:`CHECKPOINT_TABLES`) to the folder ``out``, one file per
    table and run (``TABLE/RUN_ID.parquet``, text columns left out; a run already there is written
    again, to the same bytes), the runs' records and the facts' fingerprints; return the rows
    written per table.  Files an earlier checkpoint in ``out`` listed and this one does not (effect
    runs redone on more facts) are removed; no other file is touched."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    doc_path = out / "checkpoint.json"
    earlier = json.loads(doc_path.read_text()).get("files", []) if doc_path.exists() else []
    ids: set[int] = set()
    counts: dict[str, int] = defaultdict(int)
    columns: dict[str, list[str]] = {}
    files: list[str] = []
    runs = store.sql(
        "SELECT * FROM runs WHERE list_contains($ids, run_id)", {"ids": [r for _, r in _study_runs(state)]}
    )
    for kind, rid in _study_runs(state):
        run = runs.filter(pc.equal(runs.column("run_id"), rid))
        if run.num_rows != 1:
            raise CheckpointError(f"{store.url}: run {rid} of the state is not in the store")
        for name, t in [
            (n, store.table(n, files=[f"tables/{n}/{rid}.parquet"])) for n in CHECKPOINT_TABLES[kind]
        ]:
            columns[name] = t.column_names
            for col in ("example_id", "counterfactual_id"):
                if col in t.column_names:
                    ids |= {int(i) for i in t.column(col).to_pylist()}
            files.append(f"{name}/{rid}.parquet")
            (out / name).mkdir(parents=True, exist_ok=True)
            pq.write_table(t.drop_columns(list(DERIVED.get(name, {}))), out / files[-1], compression="zstd")
            counts[name] += t.num_rows
        files.append(f"runs/{rid}.parquet")
        (out / "runs").mkdir(parents=True, exist_ok=True)
        pq.write_table(run, out / files[-1], compression="zstd")
    fps = fact_fingerprints(store, sorted(ids))
    if len(fps) != len(ids):
        raise CheckpointError(f"{store.url}: {len(ids) - len(fps)} facts of the runs are not in the store")
    pq.write_table(
        pa.table({"example_id": list(fps), "fingerprint": list(fps.values())}),
        out / "facts.parquet",
        compression="zstd",
    )
    model = store.manifest.model
    doc = {
        "format": CHECKPOINT_FORMAT,
        "model": {"name": model.get("name"), "weight_hash": model.get("weight_hash")},
        "columns": columns,
        "rows": counts,
        "files": files,
        "state": state,
    }
    doc_path.write_text(json.dumps(doc, indent=1) + "\n")
    for rel in sorted(set(earlier) - set(files)):
        stale = out / rel
        if stale.resolve().is_relative_to(out.resolve()) and stale.is_file():
            stale.unlink()
    return dict(counts)


def restore_checkpoint(store: Any, folder: Path) -> dict[str, Any]:
    """Write the runs of the checkpoint ``folder`` into ``store`` (which must hold the same facts
    and model weights, and none of the runs), the text columns read from the store; return the
    state, without the metric runs (they are not in a checkpoint)."""
    import duckdb
    import pyarrow as pa
    import pyarrow.parquet as pq

    from actstore.core.tables import to_parquet_bytes
    from actstore.core.writer import write_result_table

    try:
        doc = json.loads((folder / "checkpoint.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{folder}: not a study checkpoint ({e})") from e
    if doc.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"{folder}: checkpoint format {doc.get('format')!r}, this code reads {CHECKPOINT_FORMAT}"
        )
    want, have = doc["model"].get("weight_hash"), store.manifest.model.get("weight_hash")
    if want != have:
        raise CheckpointError(
            f"{store.url}: its model ({store.manifest.model.get('name')}) has other weights than "
            f"the checkpoint's ({doc['model'].get('name')})"
        )
    state = doc["state"]
    known = {n for names in CHECKPOINT_TABLES.values() for n in names} | {"runs"}
    for rel in doc.get("files", []):
        name, _, file = str(rel).partition("/")
        if name not in known or not re.fullmatch(r"[A-Za-z0-9_-]+\.parquet", file):
            raise CheckpointError(
                f"{folder}: checkpoint.json names a file {rel!r} that is not TABLE/RUN_ID.parquet"
            )
    present = set(store.sql("SELECT run_id FROM runs").column("run_id").to_pylist())
    if clash := sorted({r for _, r in _study_runs(state)} & present):
        raise CheckpointError(f"{store.url}: already holds run {clash[0]} of the checkpoint")
    facts = pq.read_table(folder / "facts.parquet")
    fps = fact_fingerprints(store, [int(i) for i in facts.column("example_id").to_pylist()])
    for i, fp in zip(
        facts.column("example_id").to_pylist(), facts.column("fingerprint").to_pylist(), strict=True
    ):
        if fps.get(int(i)) != fp:
            raise CheckpointError(
                f"{store.url}: fact {i} is not the checkpoint's fact {i} (other prompt, subject or "
                "object token, or missing): restore into a store ingested from the same data"
            )
    con = duckdb.connect()
    con.register("src_tokens", store.sql("SELECT example_id, position, token FROM tokens"))
    con.register("src_examples", store.sql("SELECT example_id, relation_id, subject, object FROM examples"))
    out: dict[str, pa.Table] = {}  # every file is made before the first is written
    for rel in doc["files"]:
        name = rel.split("/")[0]
        t = pq.read_table(folder / rel)
        if name != "runs":
            t = t.append_column("_row", pa.array(range(t.num_rows), pa.int64()))
            con.register("ck", t)
            joins, exprs = [], {c: f'ck."{c}"' for c in t.column_names}
            for j, (col, (src, src_col, keys)) in enumerate(DERIVED.get(name, {}).items()):
                on = " AND ".join(f'ck."{a}" = d{j}."{b}"' for a, b in keys)
                joins.append(f"LEFT JOIN src_{src} d{j} ON {on}")
                exprs[col] = f'd{j}."{src_col}"'
            sel = ", ".join(f'{exprs[c]} AS "{c}"' for c in doc["columns"][name])
            t = con.sql(f"SELECT {sel} FROM ck {' '.join(joins)} ORDER BY ck._row").to_arrow_table()
            con.unregister("ck")
            for col in DERIVED.get(name, {}):
                if t.column(col).null_count:
                    raise CheckpointError(
                        f"{store.url}: {t.column(col).null_count} rows of {rel} find no {col} in the store"
                    )
        out[rel] = t
    for rel, t in sorted(out.items(), key=lambda kv: kv[0].startswith("runs/")):  # a run's row last
        name, rid = rel.split("/")[0], rel.split("/")[1].removesuffix(".parquet")
        if name == "runs":  # the original record (write_run would make a new one)
            store.location.write_bytes_atomic(f"tables/{rel}", to_parquet_bytes(t))
        else:
            write_result_table(store, name, rid, t)
    store.refresh()
    return {k: v for k, v in state.items() if not k.startswith("metrics_")}


def cmd_checkpoint(a: argparse.Namespace) -> None:
    from actstore.api import open_store

    state = load_state(Path(a.state))
    if not _study_runs(state):
        raise CheckpointError(
            f"{a.state}: no runs to checkpoint (no state file, or a study that has traced nothing)"
        )
    counts = write_checkpoint(open_store(a.store), state, Path(a.out))
    log(f"wrote {a.out}: " + ", ".join(f"{n} {k} rows" for k, n in counts.items()))


def cmd_restore(a: argparse.Namespace) -> None:
    from actstore.api import open_store

    state_path = Path(a.state)
    if state_path.exists():
        raise CheckpointError(f"{state_path} exists; restore writes a new state file")
    state = restore_checkpoint(open_store(a.store), Path(a.checkpoint))
    save_state(state_path, state)
    log(
        f"restored {len(state['traced'])} traced facts ({len(state['trace_runs'])} trace runs, "
        f"{len(state.get('patch_runs', []))} patch runs) into {a.store}; state {state_path}"
    )


def _ci(r: dict[str, Any], pct: bool = False) -> str:
    def f(x: Any) -> str:
        if x is None or x != x:
            return "n/a"
        return f"{100 * x:.1f}%" if pct else f"{x:+.3f}" if abs(x) < 10 else f"{x:.0f}"

    if r.get("value") is None or r["value"] != r["value"]:
        return "n/a"
    if r.get("low") is None or r["low"] != r["low"]:
        return f(r["value"])
    return f"{f(r['value'])} [{f(r['low'])}, {f(r['high'])}]"


def method_label(method: str, d: dict[str, Any]) -> str:
    """How the tables name a method: the tuned lens with its fitting rule, "tuned lens (adam)".  Outputs
    written before the rule was recorded come from the ridge fit (the only one the study had)."""
    if method != "tuned_lens":
        return method
    tl = d.get("tuned_lens") or d.get("state", {}).get("tuned_lens") or {}
    return f"tuned lens ({tl.get('method', 'ridge')})"


def cmd_tables(a: argparse.Namespace) -> None:
    """Markdown tables of a study's --json output (for docs/results-methods.md)."""
    d = read_summary(Path(a.json))
    modes = [m for m in ("knockout", "restore") if m in d]
    pct_metrics = {"consistency", "verdict_consistency", "beats_random"}
    lines: list[str] = []
    for mode in modes:
        rows = d[mode]["metrics"]
        lines.append(f"\n#### Per method, all facts ({mode}; run {d[mode]['run_id']})\n")
        metrics = [
            "precision",
            "layer_precision",
            "consistency",
            "verdict_consistency",
            "located_effect",
            "random_effect",
            "effectiveness",
            "beats_random",
        ]
        lines.append("| method | facts | " + " | ".join(metrics) + " |")
        lines.append("|---" * (len(metrics) + 2) + "|")
        for m in d["readings"]:
            got = {r["metric"]: r for r in rows if r["method"] == m and r["grouping"] == "all"}
            n = max((r["n"] for r in got.values()), default=0)
            lines.append(
                f"| {method_label(m, d)} | {n} | "
                + " | ".join(
                    _ci(got[k], k in pct_metrics) + f" (n={got[k]['n']})"
                    if k in got and got[k]["n"] != n
                    else _ci(got[k], k in pct_metrics)
                    if k in got
                    else "n/a"
                    for k in metrics
                )
                + " |"
            )
        for grouping in a.groupings.split(","):
            groups = sorted({r["group"] for r in rows if r["grouping"] == grouping})
            if not groups:
                continue
            lines.append(f"\n#### By {grouping} ({mode})\n")
            lines.append(
                "| method | "
                + " | ".join(f"{g}: n / precision / consistency / effectiveness" for g in groups)
                + " |"
            )
            lines.append("|---" * (len(groups) + 1) + "|")
            for m in d["readings"]:
                cells = []
                for g in groups:
                    got = {
                        r["metric"]: r
                        for r in rows
                        if r["method"] == m and r["grouping"] == grouping and r["group"] == g
                    }
                    n = got["precision"]["n"] if "precision" in got else 0
                    cells.append(
                        f"{n} / "
                        + " / ".join(
                            _ci(got[k], k == "consistency") if k in got else "n/a"
                            for k in ("precision", "consistency", "effectiveness")
                        )
                    )
                lines.append(f"| {method_label(m, d)} | " + " | ".join(cells) + " |")
        lines.append(f"\n#### Pairs ({mode})\n")
        lines.append("| methods | facts | key layer | seed | exact | MLP/attn | seed | effect r | seed |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        pairs: dict[tuple[str, str], dict[str, Any]] = {}
        for r in d[mode]["pairs"]:
            pairs.setdefault((r["method_a"], r["method_b"]), {})[r["metric"]] = r
        for (x, y), got in pairs.items():
            if x == "all":
                c = got["consensus"]
                lines.append(f"| all methods (consensus) | {c['n']} | {_ci(c, True)} | 47.6% | | | | | |")
                continue

            def paper(k: str, pct: bool, got: dict[str, Any] = got) -> str:
                p = got.get(k, {}).get("paper")
                return "" if p is None else (f"{100 * p:.1f}%" if pct else f"{p:.2f}")

            lines.append(
                f"| {method_label(x, d)} vs {method_label(y, d)} | {got['key_layer']['n']} | {_ci(got['key_layer'], True)} | "
                f"{paper('key_layer', True)} | {_ci(got['key_layer_exact'], True)} | "
                f"{_ci(got['verdict'], True)} (n={got['verdict']['n']}) | {paper('verdict', True)} | "
                + (
                    f"{_ci(got['effect_correlation'])} (n={got['effect_correlation']['n']})"
                    if "effect_correlation" in got
                    else "n/a"
                )
                + f" | {paper('effect_correlation', False)} |"
            )
    if d.get("cross_size"):
        lines.append("\n#### Cross-size row\n")
        lines.append("| model | metric | n | mean [95% CI] | IQR |")
        lines.append("|---|---|---|---|---|")
        for r in d["cross_size"]:
            q = "" if r["q25"] is None or r["q25"] != r["q25"] else f"{r['q25']:.2f}-{r['q75']:.2f}"
            lines.append(f"| {r['model']} | {r['metric']} | {r['n']} | {_ci(r)} | {q} |")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write methods2k.json")
    b.add_argument("--lre", default=str(SHARED / "lre_relations" / "data" / "factual"))
    b.add_argument("--known", default=str(SHARED / "known_1000" / "known_1000.json"))
    b.add_argument("--out", required=True)
    b.add_argument("--size", type=int, default=2000)
    b.add_argument("--seed", type=int, default=0)
    b.set_defaults(func=cmd_build)
    s = sub.add_parser("study", help="trace, patch, intervene and measure on an ingested store")
    s.add_argument("store")
    s.add_argument("--state", required=True, help="JSON file recording the runs (resumable)")
    s.add_argument("--trace-minutes", type=float, default=30.0)
    s.add_argument("--max-facts", type=int, default=10**9)
    s.add_argument("--chunk", type=int, default=8)
    s.add_argument(
        "--start",
        type=int,
        default=0,
        help="trace the stratified order from its N-th fact (another process traces the facts before; see merge)",
    )
    s.add_argument(
        "--trace-only", action="store_true", help="stop after tracing (no patching, interventions or metrics)"
    )
    s.add_argument("--samples", type=int, default=2)
    s.add_argument("--window", type=int, default=10)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--no-patch", dest="patch", action="store_false")
    s.add_argument("--all-facts", action="store_true", help="also facts the model gets wrong (tests)")
    s.add_argument("--methods", default=",".join(METHODS))
    s.add_argument("--modes", default="knockout,restore")
    s.add_argument("--random-draws", type=int, default=4)
    s.add_argument("--resamples", type=int, default=2000)
    s.add_argument("--json", default=None, help="the summary to write (gzip-compressed if it ends in .gz)")
    s.add_argument("--device", default="cpu", help="torch device of the model (cuda on a GPU)")
    s.add_argument(
        "--tuned",
        choices=("adam", "sgd", "ridge"),
        default="adam",
        help="the tuned lens: trained on the KL with adam or sgd, or the closed-form ridge fit",
    )
    s.add_argument("--tuned-steps", type=int, default=250, help="tuned-lens training steps (adam, sgd)")
    s.add_argument("--tuned-batch", type=int, default=64, help="training facts per step (adam, sgd)")
    s.add_argument("--tuned-lr", type=float, default=None, help="learning rate (default: 1e-3 adam, 0.1 sgd)")
    s.add_argument("--tuned-seed", type=int, default=0, help="seed of the tuned lens's batches")
    s.set_defaults(func=cmd_study)
    c = sub.add_parser(
        "checkpoint", help="the study's trace, patch and effect runs, text left out, to a folder"
    )
    c.add_argument("store")
    c.add_argument("--state", required=True)
    c.add_argument("--out", required=True)
    c.set_defaults(func=cmd_checkpoint)
    r = sub.add_parser(
        "restore", help="a checkpoint's runs into a store ingested from the same data; a new state"
    )
    r.add_argument("store")
    r.add_argument("--from", dest="checkpoint", required=True)
    r.add_argument("--state", required=True, help="the state file to write (must not exist)")
    r.set_defaults(func=cmd_restore)
    m = sub.add_parser(
        "merge", help="fold the trace runs of other states (study --start N --trace-only) into a state"
    )
    m.add_argument("store")
    m.add_argument("--state", required=True, help="the state to extend")
    m.add_argument("--add", nargs="+", required=True, help="the states whose tracing is added")
    m.set_defaults(func=cmd_merge)
    t = sub.add_parser("tables", help="Markdown tables of a study's --json output")
    t.add_argument("json", help="a study's --json output (.json or .json.gz)")
    t.add_argument("--groupings", default="freq_band,uniqueness,source_set")
    t.set_defaults(func=cmd_tables)
    a = p.parse_args(argv)
    from actstore.core.errors import ActstoreError

    try:
        a.func(a)
    except (CheckpointError, ActstoreError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
