"""The data of the explorer's views, as JSON-ready dicts: store, relation, HeadScore heatmap, head,
method comparison and table previews.  Every function reads what the store holds (no model); the
report's own readers are reused where they exist (:mod:`actstore.query.report`)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from actstore.core.model_names import describe_model
from actstore.core.sizes import StoreSize, human_size, store_size
from actstore.core.store import StoreReader
from actstore.core.tables import table_kind
from actstore.jobs import probe as probe_job
from actstore.query.analyses.stats import proportion_interval
from actstore.query.report.predictors import PREDICTOR_COLUMNS
from actstore.query.report.summary import CORPUS_WITH_TARGETS
from actstore.query.select.weights import weights
from actstore.serve.common import (
    MAX_PAGE_SIZE,
    block_sample,
    cached_rows,
    columns,
    example_ids,
    example_texts,
    grid,
    has_table,
    jsonable,
    kept,
    latest_run,
    relations_index,
    runs_of,
    sql,
    table_files,
)

#: The run kinds the store page lists, and the result tables that mark each.
RUN_TABLES = {
    "probe": "probe_runs",
    "maps": "maps_scores",
    "maps-dynamic": "maps_dynamic",
    "tracing": "trace_effects",
    "patching": "patch_effects",
    "lens": "lens",
    "method comparison": "method_agreement",
    "predictors": "relation_predictors",
}


# ----------------------------------------------------------------------------------- store
def store_summary(store: StoreReader, *, with_size: bool = True) -> dict[str, Any]:
    """Model, geometry, rows per relation, runs per analysis, tables and sizes."""
    m, g = store.manifest, store.geometry
    relations = sql(store, CORPUS_WITH_TARGETS)
    files = table_files(store)
    tables = []
    for name, fs in sorted(files.items()):
        n = sql(store, f'SELECT count(*) AS n FROM "{name}"')[0]["n"] if fs else 0
        tables.append(
            {
                "table": name,
                "kind": table_kind(name),
                "files": len(fs),
                "rows": n,
            }
        )
    runs: list[dict[str, Any]] = []
    if has_table(store, "runs"):
        cols = columns(store, "runs")
        pick = [c for c in ("run_id", "kind", "started", "finished") if c in cols]
        for r in sql(
            store,
            f"SELECT {', '.join(pick)} FROM runs ORDER BY {'started' if 'started' in cols else 'run_id'}",
        ):
            s, f = r.get("started"), r.get("finished")
            r["seconds"] = (
                float(f) - float(s) if isinstance(s, int | float) and isinstance(f, int | float) else None
            )
            if isinstance(s, int | float):
                r["started"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(s)))
            r.pop("finished", None)
            runs.append(r)
    analyses = {kind: len(runs_of(store, t)) for kind, t in RUN_TABLES.items() if has_table(store, t)}
    size = store_size(store) if with_size else StoreSize(None, None)
    return jsonable(
        {
            "url": store.url,
            "model": describe_model(m.model),
            "architecture": m.model.get("architecture"),
            "format": m.format_version,
            "geometry": g.to_dict(),
            "rows": store.n_rows,
            "examples": m.n_examples,
            "segments": f"{len(store.commits)}/{m.n_segments}",
            "complete": store.complete,
            "storage_dtype": m.storage_dtype,
            "size": human_size(size.total),
            "size_bytes": size.total,
            "weights_size": human_size(size.weights) if size.where == "store" else size.weights_line(),
            "weights_bytes": size.weights,
            "relations": relations,
            "tables": tables,
            "analyses": analyses,
            "runs": runs[-50:],
            "n_runs": len(runs),
        }
    )


# ----------------------------------------------------------------------------------- relation
def relation_view(store: StoreReader, rel: str, run: str | None = None) -> dict[str, Any]:
    """A relation: its name and prompts, probe accuracy and F1 with 95% intervals per run, its
    confusions (latest or chosen run), and its predictors."""
    index = relations_index(store)
    info = index[rel]
    probes: list[dict[str, Any]] = []
    if has_table(store, "relation_metrics") and has_table(store, "probe_runs"):
        runs = {r["run_id"]: r for r in cached_rows(store, "probe_runs")}
        for m in sql(store, "SELECT * FROM relation_metrics WHERE relation_id = ?", [rel]):
            pr = runs.get(m.get("run_id"), {})
            tp, n_gold, n_pred = (
                int(m.get("tp") or 0),
                int(m.get("n_queries") or 0),
                int(m.get("n_predicted") or 0),
            )
            lo, hi = proportion_interval(tp, n_gold) if n_gold else (None, None)
            f_lo, f_hi = f1_interval(tp, n_pred - tp, n_gold - tp)
            probes.append(
                {
                    "run_id": m.get("run_id"),
                    "kind": pr.get("kind"),
                    "setting": f"{pr.get('n_way', '?')}-way {pr.get('k_shot', '?')}-shot",
                    "started": pr.get("started"),
                    "run_accuracy": pr.get("accuracy"),
                    "run_ci95": [pr.get("ci95_low"), pr.get("ci95_high")],
                    "n_queries": n_gold,
                    "n_predicted": n_pred,
                    "accuracy": tp / n_gold if n_gold else None,
                    "accuracy_ci95": [lo, hi],
                    "precision": m.get("precision"),
                    "recall": m.get("recall"),
                    "f1": m.get("f1"),
                    "f1_ci95": [f_lo, f_hi],
                }
            )
        probes.sort(key=lambda r: -(r.get("started") or 0))
    chosen = latest_run(store, "probe_predictions", run)
    confusions: dict[str, list[dict[str, Any]]] = {"predicted_as": [], "mistaken_for_it": []}
    if chosen is not None:
        pairs = sql(
            store,
            "SELECT relation_id, predicted, count(*) AS n FROM probe_predictions "
            "WHERE run_id = ? AND (relation_id = ? OR predicted = ?) GROUP BY 1, 2",
            [chosen, rel, rel],
        )
        pairs.sort(key=lambda r: (-int(r["n"]), str(r["predicted"]), str(r["relation_id"])))
        confusions["predicted_as"] = [
            {
                "relation_id": r["predicted"],
                "relation_name": index.get(str(r["predicted"]), {}).get("relation_name"),
                "n": r["n"],
            }
            for r in pairs
            if r["relation_id"] == rel
        ][:20]
        confusions["mistaken_for_it"] = [
            {"relation_id": r["relation_id"], "n": r["n"]}
            for r in pairs
            if r["predicted"] == rel and r["relation_id"] != rel
        ][:20]
    predictors: list[dict[str, Any]] = []
    if has_table(store, "relation_predictors"):
        cols = [c for c in ("run_id", "f1", *PREDICTOR_COLUMNS) if c in columns(store, "relation_predictors")]
        predictors = sql(
            store,
            f"SELECT {', '.join(cols)} FROM relation_predictors WHERE relation_id = ? ORDER BY run_id DESC",
            [rel],
        )
    return jsonable(
        {
            "relation_id": rel,
            "relation_name": info["relation_name"],
            "prompts": info["prompts"],
            "probes": probes,
            "confusion_run": chosen,
            "confusions": confusions,
            "predictors": predictors,
            "predictor_columns": list(PREDICTOR_COLUMNS),
            "headscore_runs": runs_of(store, "head_scores"),
        }
    )


def f1_interval(tp: int, fp: int, fn: int, n: int = 2000, seed: int = 0) -> tuple[float | None, float | None]:
    """A 95% percentile bootstrap interval of F1 = 2tp / (2tp + fp + fn): the (tp, fp, fn) counts
    resampled as a multinomial of their total (the predictions that involve the relation)."""
    total = tp + fp + fn
    if total == 0:
        return None, None
    draws = np.random.default_rng(seed).multinomial(total, np.array([tp, fp, fn]) / total, size=n)
    f1 = 2 * draws[:, 0] / np.maximum(1, 2 * draws[:, 0] + draws[:, 1] + draws[:, 2])
    return float(np.quantile(f1, 0.025)), float(np.quantile(f1, 0.975))


# ----------------------------------------------------------------------------------- HeadScore
def headscore_grid(store: StoreReader, rel: str | None, run: str | None) -> dict[str, Any]:
    """The stored mean HeadScore (layer x head, weighted by predictions) of a probe run, for a relation
    or over all of them: :func:`actstore.jobs.probe.headscore_grid`, as ``actstore headscore`` shows it."""

    g = store.geometry
    chosen = latest_run(store, "head_scores", run)
    if chosen is None:
        return {
            "run_id": None,
            "grid": None,
            "runs": [],
            "note": "the store holds no HeadScores (run `actstore probe`)",
        }
    if rel is not None and not sql(
        store, "SELECT 1 FROM head_scores WHERE run_id = ? AND relation_id = ? LIMIT 1", [chosen, rel]
    ):
        return {
            "run_id": chosen,
            "grid": None,
            "runs": runs_of(store, "head_scores"),
            "note": f"run {chosen} has no HeadScores for {rel}",
        }
    hs = probe_job.headscore_grid(store, chosen, rel)
    per_layer = hs.heads == [-1]
    n_cols = 1 if per_layer else g.n_heads
    rows = [
        {"layer": int(layer), "head": 0 if per_layer else int(head), "v": float(hs.scores[i, j])}
        for i, layer in enumerate(hs.layers)
        for j, head in enumerate(hs.heads)
    ]
    kind = (
        sql(store, "SELECT kind FROM probe_runs WHERE run_id = ?", [chosen])
        if has_table(store, "probe_runs")
        else []
    )
    return jsonable(
        {
            "run_id": chosen,
            "kind": kind[0]["kind"] if kind else None,
            "relation_id": rel,
            "per_layer": per_layer,
            "layers": g.n_layers,
            "heads": n_cols,
            "grid": grid(rows, "v", g.n_layers, n_cols),
            "runs": runs_of(store, "head_scores"),
            "n": hs.n_predictions,
            "contrast": hs.contrast,
        }
    )


# ----------------------------------------------------------------------------------- head
def head_view(
    store: StoreReader, layer: int, head: int, *, top: int = 20, sample: int | None = None
) -> dict[str, Any]:
    """One head: MAPS static (and dynamic) scores over the relations, its salient tokens, its stored
    HeadScore per relation, the prompts where its contribution is largest and the mean contribution
    norm per relation (|z_h W_O,h| over a sample of at most ``sample`` rows)."""

    out: dict[str, Any] = {"layer": layer, "head": head}
    if has_table(store, "maps_scores"):
        run = latest_run(store, "maps_scores")
        cols: list[str] = [
            c for c in ("relation", "score", "suppression", "k") if c in columns(store, "maps_scores")
        ]
        out["maps"] = sql(
            store,
            f"SELECT {', '.join(cols)} FROM maps_scores WHERE run_id = ? AND layer = ? AND head = ? ORDER BY score DESC",
            [run, layer, head],
        )
        out["maps_run"] = run
    if has_table(store, "maps_salient"):
        run = latest_run(store, "maps_salient")
        cols = [c for c in ("token", "sigma", "mapped_tokens") if c in columns(store, "maps_salient")]
        by = "ORDER BY sigma DESC" if "sigma" in cols else ""
        out["salient"] = sql(
            store,
            f"SELECT {', '.join(cols)} FROM maps_salient WHERE run_id = ? AND layer = ? AND head = ? {by} LIMIT 20",
            [run, layer, head],
        )
    if has_table(store, "maps_dynamic"):
        cols = [
            c
            for c in ("relation", "static_score", "dyn_wo_context", "dyn_w_context")
            if c in columns(store, "maps_dynamic")
        ]
        out["dynamic"] = sql(
            store,
            f"SELECT {', '.join(cols)} FROM maps_dynamic WHERE run_id = ? AND layer = ? AND head = ?",
            [latest_run(store, "maps_dynamic"), layer, head],
        )
    if has_table(store, "head_scores"):
        run = latest_run(store, "head_scores")
        out["headscore_run"] = run
        out["headscores"] = sql(
            store,
            "SELECT relation_id, score, n FROM head_scores WHERE run_id = ? AND layer = ? AND head = ? ORDER BY score DESC",
            [run, layer, head],
        )
    n_all = store.n_rows
    sel, texts = head_sample(store, HEAD_SAMPLE if sample is None else sample)
    norm = head_norms(store, sel, layer, head)
    ids = sel.example_ids
    rels = np.asarray(sel.rows.column("relation_id").to_pylist(), dtype=object)
    order = np.argsort(-norm, kind="stable")[:top]
    out["top_prompts"] = [
        {**texts.get(int(ids[i]), {"example_id": int(ids[i])}), "norm": float(norm[i])} for i in order
    ]
    out["norm_per_relation"] = sorted(
        (
            {"relation_id": r, "mean_norm": float(norm[rels == r].mean()), "n": int((rels == r).sum())}
            for r in sorted({str(v) for v in rels.tolist()})
        ),
        key=lambda d: -d["mean_norm"],
    )
    out["sampled"] = {"rows": int(len(ids)), "of": n_all}
    return jsonable(out)


#: Rows a head view ranks by contribution norm (a block sample, the same for every head).
HEAD_SAMPLE = 4000


def head_sample(store: StoreReader, sample: int = HEAD_SAMPLE) -> tuple[Any, dict[int, dict[str, Any]]]:
    """The rows every head view ranks (:func:`block_sample` of ``sample`` rows, seed 0) and their texts
    (example_id -> {example_id, relation_id, text}), read once and kept while the examples' and targets'
    files stay the same: a head view's top prompts are among them, so it reads no text (the texts of 20
    top prompts lie in up to 20 row groups of the examples table, 0.1 s of decoding at 10^6 rows)."""

    def build() -> tuple[Any, dict[int, dict[str, Any]]]:
        sel = block_sample(store, sample, seed=0)
        return sel, example_texts(store, sel.example_ids)

    return kept(store, f"head_sample:{sample}", ("examples", "targets"), build)  # type: ignore[no-any-return]


def head_norms(store: StoreReader, sel: Any, layer: int, head: int) -> np.ndarray:
    """|z_h W_O,h| of each row of ``sel`` at head (``layer``, ``head``), from the stored ``z`` alone:
    sqrt(z_h G z_h) with G = W_O,h W_O,h^T (d_head x d_head), so that no d_model vector is formed."""

    z = sel.features("z", layers=[layer], heads=[head])[:, 0, 0].astype(np.float64)  # [n, d_head]
    w = weights(store).layers("W_O", [layer])[0, head].numpy().astype(np.float64)  # [d_head, d_model]
    q = ((z @ (w @ w.T)) * z).sum(1)
    return np.sqrt(np.clip(q, 0, None))  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------------- methods
AGREEMENT_COLUMNS = (
    "method_a",
    "method_b",
    "n_facts",
    "key_layer_agreement",
    "key_layer_chance",
    "key_layer_excess",
    "key_layer_kappa",
    "key_layer_exact",
    "n_verdict",
    "verdict_agreement",
    "verdict_chance",
    "verdict_kappa",
    "profile_correlation",
)


def methods_view(store: StoreReader, run: str | None, page: int, size: int) -> dict[str, Any]:
    """The agreement table of a method comparison run (with every interval column it stores) and one
    page of the per-fact key layers of each method (``method_readings``)."""
    chosen = latest_run(store, "method_agreement", run)
    if chosen is None:
        return {
            "run_id": None,
            "agreement": [],
            "facts": [],
            "methods": [],
            "note": "no method comparison in the store (run `actstore agree`)",
        }
    have = columns(store, "method_agreement")
    extra = [c for c in have if c not in AGREEMENT_COLUMNS and c != "run_id"]  # intervals, p-values, ...
    cols = [c for c in AGREEMENT_COLUMNS if c in have] + extra
    quoted = ", ".join('"' + c.replace('"', '""') + '"' for c in cols)
    agreement = sql(store, f"SELECT {quoted} FROM method_agreement WHERE run_id = ?", [chosen])
    facts: list[dict[str, Any]] = []
    methods: list[str] = []
    total = 0
    if has_table(store, "method_readings"):
        mcols = columns(store, "method_readings")
        rcond = "run_id = ?" if "run_id" in mcols else "TRUE"
        rparams = [chosen] if "run_id" in mcols else []
        methods = [
            r["method"]
            for r in sql(
                store, f"SELECT DISTINCT method FROM method_readings WHERE {rcond} ORDER BY 1", rparams
            )
        ]
        total = sql(
            store, f"SELECT count(DISTINCT example_id) AS n FROM method_readings WHERE {rcond}", rparams
        )[0]["n"]
        size = min(size, MAX_PAGE_SIZE)
        rows = sql(
            store,
            f"WITH ids AS (SELECT DISTINCT example_id FROM method_readings WHERE {rcond} ORDER BY 1 LIMIT ? OFFSET ?) "
            f"SELECT m.example_id, m.method, m.key_layer, m.verdict, e.relation_id, e.subject, e.object "
            f"FROM method_readings m JOIN ids USING (example_id) LEFT JOIN examples e USING (example_id) "
            f"WHERE {rcond.replace('run_id', 'm.run_id')} ORDER BY 1, 2",
            [*rparams, size, page * size, *rparams],
        )
        by: dict[int, dict[str, Any]] = {}
        for r in rows:
            f = by.setdefault(
                int(r["example_id"]),
                {k: r[k] for k in ("example_id", "relation_id", "subject", "object")}
                | {"key_layer": {}, "verdict": {}},
            )
            f["key_layer"][r["method"]] = r["key_layer"]
            f["verdict"][r["method"]] = r["verdict"]
        facts = list(by.values())
    return jsonable(
        {
            "run_id": chosen,
            "runs": runs_of(store, "method_agreement"),
            "columns": cols,
            "agreement": agreement,
            "methods": methods,
            "facts": facts,
            "total": total,
            "page": page,
        }
    )


# ----------------------------------------------------------------------------------- tables
def table_preview(store: StoreReader, name: str, page: int, size: int) -> dict[str, Any]:
    size = min(size, MAX_PAGE_SIZE)
    if name == "examples":  # one row per example: a page is a slice of the kept ids, read by its id range
        ids = example_ids(store)
        total, part = int(ids.size), ids[page * size : (page + 1) * size]
        rows = (
            sql(
                store,
                "SELECT * FROM examples WHERE example_id BETWEEN ? AND ? ORDER BY example_id",
                [int(part[0]), int(part[-1])],
            )
            if part.size
            else []
        )
    else:
        total = sql(store, f'SELECT count(*) AS n FROM "{name}"')[0]["n"]
        rows = sql(store, f'SELECT * FROM "{name}" LIMIT ? OFFSET ?', [size, page * size])
    return jsonable(
        {
            "table": name,
            "total": total,
            "page": page,
            "size": size,
            "columns": columns(store, name),
            "rows": rows,
        }
    )
