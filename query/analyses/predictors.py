"""Predictors of per-relation probe accuracy and their correlations ("Tracing Relational Knowledge Recall", ACL 2026 Findings).

For a probe run (typically 16-way 5-shot over all relations), per relation:

- ``f1``: F1 of the run's pooled query predictions (table ``relation_metrics``);
- ``output_range``: distinct objects of the relation (object Q-id when the record carries one, else
  the lower-cased object text), and ``output_range_ratio`` = that count / the instances counted
  (fairer when relations differ in size).  With ``dataset_file`` (the FewRel JSON the store was
  ingested from) over *every* instance of the relation in that file, object-first ones included
  (``output_range="dataset"``, the default when a file is given): our reading of arXiv 2604.19934's output
  range, which counts a relation's objects in Wikidata.  Without one, over the run's stored
  selection (``"sample"``: only the instances that qualified for ingest, e.g. P155 keeps 99);
  ``output_range_source`` says which;
- ``connectivity``: mean number of properties shared by subject and object in a knowledge
  graph given as Q-id triple files (``head<TAB>property<TAB>tail``); an entity's properties are
  those it has as head (``direction="out"``, Wikidata's statements) or in either position
  (``"both"``).  Only instances whose subject and object are both in the graph count;
  ``connectivity_coverage`` is their share;
- ``tfidf_similarity``: mean pairwise cosine similarity between the TF-IDF vectors
  (scikit-learn, fitted on every instance of the selection) of the relation's prompt texts;
- ``head_concentration``: the number of units (heads) needed to reach 95% of the relation's total
  HeadScore, largest first.  By default (``concentration="predicted-abs"``) over the predictions the
  probe *assigned* to the relation, summing each unit's |HeadScore| (``head_scores.pred_abs_score``):
  a property of the probe that needs no labels, as Tracing Relational Knowledge Recall in Large Language Models (arXiv 2604.19934) presents it, and every prediction's dW
  points at the class it is grouped under.  ``"gold-signed"`` is the earlier version: predictions
  grouped by their gold relation (errors included, with a dW aimed at another class) and the
  |mean signed score| per unit (``head_scores.score``), where heads of opposite sign cancel.  A run
  stored before ``pred_abs_score`` existed has only the gold-signed column: asking it for the default
  is one error line that names ``--concentration gold-signed`` (or re-run the probe).

Each predictor is correlated with F1 across relations (Spearman and Pearson with p-values,
scipy); NaN values (e.g. no coverage) are left out and the count used is reported.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from actstore.core.errors import InvalidSetting, QueryError
from actstore.core.sql import run_sql
from actstore.core.store import StoreReader
from actstore.query.analyses import plotting
from actstore.query.analyses.attribution import run_row
from actstore.query.analyses.dask_tasks import client_threads, run_tasks, store_of
from actstore.query.analyses.predictor_measures import (
    KnowledgeGraph,
    _meta,
    connectivity,
    correlate,
    dataset_output_ranges,
    document_frequencies,
    head_concentration,
    inverse_document_frequency,
    mean_pairwise_similarity,
    output_ranges,
)
from actstore.query.select.selection import Selection

PREDICTORS = ("output_range", "output_range_ratio", "connectivity", "tfidf_similarity", "head_concentration")
CONCENTRATIONS = ("predicted-abs", "gold-signed")
OUTPUT_RANGES = ("dataset", "sample")


@dataclass(frozen=True)
class PredictorResult:
    run_id: str
    relations: pa.Table  # one row per relation: f1 and the predictors
    correlations: pa.Table  # one row per predictor
    kb_files: tuple[str, ...]
    kb_coverage: float  # share of all instances whose subject and object are in the graph (nan without one)


def relation_predictors(
    store: StoreReader,
    run_id: str,
    *,
    kb: Sequence[str | os.PathLike[str]] = (),
    direction: str = "out",
    share: float = 0.95,
    client: Any = None,
    segments_per_task: int | None = None,
    relations_per_task: int | None = None,
    concentration: str = "predicted-abs",
    dataset_file: str | os.PathLike[str] | None = None,
    output_range: str | None = None,
) -> PredictorResult:
    """Per-relation F1 and predictors for a probe run, and their correlations with F1.

    ``concentration``: ``"predicted-abs"`` (default) or ``"gold-signed"`` (module docstring).
    ``output_range``: ``"dataset"`` (every instance in ``dataset_file``; the default when it is given)
    or ``"sample"`` (the run's stored selection; the default without a file).

    The work is split into tasks (see :func:`actstore.query.analyses.dask_tasks.run_tasks`): one per
    ``segments_per_task`` segments reads their ``examples`` rows (object keys, entity ids and
    document frequencies); then one per knowledge-graph file reads the graph for the entities
    those rows name, and one per ``relations_per_task`` relations computes their TF-IDF
    similarity and HeadScore concentration.  ``client``: a ``dask.distributed.Client`` runs
    them on its workers (which open the store by URL and read the graph files by path),
    ``None`` runs them here.  By default there is one task of each kind here, and about two
    per worker thread on a cluster.  The merge is in task order with exact arithmetic (set
    unions, integer sums) and each relation is computed whole, so the result is the same, bit
    for bit, however the work is split.
    """
    if direction not in ("out", "both"):
        raise QueryError(f"direction must be 'out' or 'both', not {direction!r}")
    if concentration not in CONCENTRATIONS:
        raise QueryError(f"concentration must be one of {', '.join(CONCENTRATIONS)}, not {concentration!r}")
    if output_range is None:
        output_range = "dataset" if dataset_file is not None else "sample"
    if output_range not in OUTPUT_RANGES:
        raise QueryError(f"output range must be one of {', '.join(OUTPUT_RANGES)}, not {output_range!r}")
    if output_range == "dataset" and dataset_file is None:
        raise InvalidSetting(
            "dataset_file",
            "the output range over the data set needs its file (the FewRel JSON "
            "the store was ingested from), or the output range 'sample'",
        )
    for name, value in (("segments_per_task", segments_per_task), ("relations_per_task", relations_per_task)):
        if value is not None and value < 1:
            raise QueryError(f"{name} must be at least 1, not {value}")
    # the run's rows, as it selected them; the tasks get their ids (bound, never a pasted predicate)
    chosen = Selection.from_sql(store, json.loads(str(run_row(store, run_id)["config"])).get("where")).rows
    ids_list = [int(i) for i in chosen.column("example_id").to_pylist()]
    seg_of = np.asarray(chosen.column("segment").to_numpy(), dtype=np.int64)
    ids_arr = np.asarray(ids_list, dtype=np.int64)

    def ids_in(segments: tuple[int, ...]) -> list[int]:  # a rows task gets the ids of its segments only
        return [int(i) for i in ids_arr[np.isin(seg_of, segments)]]

    metrics = {
        r["relation_id"]: r
        for r in store.sql("SELECT * FROM relation_metrics WHERE run_id = ?", [run_id]).to_pylist()
    }
    score_col = _concentration_column(store, run_id, concentration)
    file_ranges = (
        dataset_output_ranges(dataset_file)
        if output_range == "dataset" and dataset_file is not None
        else None
    )
    if file_ranges is not None:
        missing = sorted(set(metrics) - set(file_ranges))
        if missing:
            raise InvalidSetting(
                "dataset_file",
                f"{os.fspath(dataset_file or '')}: relation(s) "
                f"{', '.join(missing[:5])} of run {run_id} are not in it (not the file the store "
                "was ingested from?)",
            )
    range_source = (
        f"data set file {os.path.basename(os.fspath(dataset_file or ''))}: every instance, object-first "
        "ones included (ours; arXiv 2604.19934 counts objects in Wikidata)"
        if file_ranges is not None
        else "stored sample: the run's selected instances"
    )
    src: str | StoreReader = store if client is None else store.url
    segs = sorted(store.commits)
    parts = run_tasks(
        client, _rows_task, [(src, b, ids_in(b)) for b in _split(segs, segments_per_task, client)]
    )
    df: Counter[str] = Counter()
    n_docs = 0
    for _, d, n in parts:  # task order; integer sums
        df.update(d)
        n_docs += n
    rows = pa.concat_tables([p[0] for p in parts]).sort_by("example_id").to_pylist()
    ranges = output_ranges(rows)
    terms, idf = inverse_document_frequency(df, n_docs)
    files = tuple(str(f) for f in kb)
    rels = sorted(metrics)
    groups = _split(rels, relations_per_task, client)
    jobs = [("kg", (f,)) for f in files] + [("relations", g) for g in groups]
    done = run_tasks(
        client,
        _relations_or_graph_task,
        [(src, run_id, ids_list, kind, x) for kind, x in jobs],
        shared={
            "terms": terms,
            "idf": idf,
            "share": share,
            "direction": direction,
            "score_col": score_col,
            "wanted": _entities(rows) if files else frozenset(),
        },
    )
    graph = _merge_graphs(files, done[: len(files)]) if files else None
    per_rel = {r: v for part in done[len(files) :] for r, v in part.items()}
    conn = connectivity(rows, graph) if graph is not None else {}
    table = []
    for rel in rels:
        n_inst, distinct = ranges.get(rel, (0, 0))
        r_inst, r_distinct = file_ranges[rel] if file_ranges is not None else (n_inst, distinct)
        c = conn.get(rel, (float("nan"), float("nan"), 0))
        sim, conc = per_rel[rel]
        table.append(
            {
                "run_id": run_id,
                "relation_id": rel,
                "relation_name": metrics[rel].get("relation_name"),
                "f1": float(metrics[rel]["f1"]),
                "n_queries": int(metrics[rel]["n_queries"]),
                "n_instances": n_inst,
                "output_range": float(r_distinct),
                "output_range_ratio": r_distinct / r_inst if r_inst else float("nan"),
                "output_range_instances": r_inst,
                "output_range_source": range_source,
                "connectivity": c[0],
                "connectivity_coverage": c[1],
                "connectivity_covered": c[2],
                "tfidf_similarity": sim,
                "head_concentration": conc,
                "head_concentration_method": concentration,
            }
        )
    rel_table = pa.Table.from_pylist(table)
    f1 = [r["f1"] for r in table]
    covered = sum(r["connectivity_covered"] for r in table)
    coverage = covered / max(1, sum(r["n_instances"] for r in table)) if graph is not None else float("nan")
    corr = []
    for name in PREDICTORS:
        if name == "connectivity" and graph is None:
            continue
        stat = correlate([r[name] for r in table], f1)
        corr.append(
            {
                "run_id": run_id,
                "predictor": name,
                "n": int(stat["n"]),
                **{k: v for k, v in stat.items() if k != "n"},
                "coverage": coverage if name == "connectivity" else float("nan"),
                "kb": ",".join(os.path.basename(f) for f in graph.files)
                if graph and name == "connectivity"
                else None,
                "definition": (
                    concentration
                    if name == "head_concentration"
                    else output_range
                    if name.startswith("output_range")
                    else None
                ),
            }
        )
    return PredictorResult(
        run_id, rel_table, pa.Table.from_pylist(corr), graph.files if graph else (), coverage
    )


def _concentration_column(store: StoreReader, run_id: str, concentration: str) -> str:
    """The ``head_scores`` column the concentration reads; one error line when the run lacks it."""
    if concentration == "gold-signed":
        return "score"
    cols = (
        store.sql("SELECT * FROM head_scores LIMIT 0").column_names
        if "head_scores" in store.table_files()
        else []
    )
    have = (
        "pred_abs_score" in cols
        and store.sql("SELECT count(pred_abs_score) AS n FROM head_scores WHERE run_id = ?", [run_id])
        .column("n")[0]
        .as_py()
    )
    if not have:
        raise QueryError(
            f"probe run {run_id} was stored before per-predicted-class head scores "
            "(head_scores.pred_abs_score): re-run the probe, or use --concentration gold-signed (the "
            "gold-label signed version, which is what this run has)"
        )
    return "pred_abs_score"


def _split(items: Sequence[Any], per_task: int | None, client: Any) -> list[tuple[Any, ...]]:
    """``items`` in consecutive groups: ``per_task`` each, else all in one group without a
    client and about two groups per worker thread with one."""
    if not items:
        return []
    if per_task is None:
        per_task = len(items) if client is None else -(-len(items) // (2 * client_threads(client)))
    return [tuple(items[i : i + per_task]) for i in range(0, len(items), per_task)]


def _rows_task(
    store: str | StoreReader, segments: tuple[int, ...], ids: list[int]
) -> tuple[pa.Table, dict[str, int], int]:
    """One task: the ``examples`` rows of ``segments`` among ``ids`` (without their text) and the
    document frequencies of their texts."""
    st = store_of(store)
    t = st.sql(
        "SELECT example_id, relation_id, object, text, meta FROM examples "
        "WHERE list_contains($segs, segment) AND list_contains($ids, example_id) ORDER BY example_id",
        {"segs": [int(s) for s in segments], "ids": ids},
    )
    df = document_frequencies(str(x or "") for x in t.column("text").to_pylist())
    return t.drop_columns(["text"]), dict(df), t.num_rows


def _relations_or_graph_task(
    store: str | StoreReader,
    run_id: str,
    ids: list[int],
    kind: str,
    what: tuple[str, ...],
    *,
    terms: list[str],
    idf: np.ndarray,
    share: float,
    direction: str,
    wanted: frozenset[str],
    score_col: str = "score",
) -> Any:
    """One task: ``{relation: (TF-IDF similarity, HeadScore concentration)}`` for the relations
    ``what``, or for ``kind="kg"`` the graph file ``what[0]`` cut down to the ``wanted`` entities
    (properties, entities present, triples read)."""

    if kind == "kg":
        g = KnowledgeGraph.load(what, direction)
        return ({e: g.properties[e] for e in wanted if e in g.properties}, wanted & g.entities, g.n_triples)
    st = store_of(store)
    con = st.connect()  # one connection for both reads
    listed = list(what)
    ex = run_sql(
        st,
        "SELECT relation_id, text FROM examples WHERE list_contains($rels, relation_id) "
        "AND list_contains($ids, example_id) ORDER BY example_id",
        con,
        params={"rels": listed, "ids": ids},
    )
    only = " AND pred_n > 0" if score_col == "pred_abs_score" else ""  # never-predicted relations: no scores
    if score_col not in ("score", "pred_abs_score"):  # a column name (pasted): only the two known ones
        raise QueryError(f"unknown head score column {score_col!r}")
    hs = run_sql(
        st,
        f"SELECT relation_id, {score_col} AS score FROM head_scores WHERE run_id = $run "
        f"AND list_contains($rels, relation_id){only}",
        con,
        params={"run": run_id, "rels": listed},
    )
    con.close()
    ex_rel = np.asarray(ex.column("relation_id").to_pylist(), dtype=object)
    texts = [str(x or "") for x in ex.column("text").to_pylist()]
    hs_rel = np.asarray(hs.column("relation_id").to_pylist(), dtype=object)
    scores = hs.column("score").to_numpy(zero_copy_only=False)
    out = {}
    for r in what:
        sim = mean_pairwise_similarity([texts[i] for i in np.flatnonzero(ex_rel == r)], terms, idf)
        s = scores[hs_rel == r]
        out[r] = (sim, float(head_concentration(s, share)) if s.size else float("nan"))
    return out


def _entities(rows: Sequence[Mapping[str, Any]]) -> frozenset[str]:
    """Subject and object ids of the rows that carry both (the only ones connectivity looks up)."""
    out: set[str] = set()
    for r in rows:
        m = _meta(r)
        s, o = m.get("subject_qid"), m.get("object_qid")
        if s and o:
            out.update((str(s), str(o)))
    return frozenset(out)


def _merge_graphs(files: tuple[str, ...], parts: Sequence[Any]) -> KnowledgeGraph:
    """One :class:`KnowledgeGraph` (restricted to the looked-up entities) from per-file parts."""
    props: dict[str, set[str]] = {}
    entities: set[str] = set()
    n = 0
    for p, present, count in parts:  # file order; unions and integer sums are exact
        for e, ps in p.items():
            props.setdefault(e, set()).update(ps)
        entities |= present
        n += count
    return KnowledgeGraph({k: frozenset(v) for k, v in props.items()}, frozenset(entities), files, n)


def scatter_plots(result: PredictorResult, out_dir: str | os.PathLike[str]) -> list[str]:
    """One PNG per predictor: predictor vs F1, one labelled point per relation."""

    os.makedirs(out_dir, exist_ok=True)
    rel = result.relations.to_pylist()
    paths = []
    for c in result.correlations.to_pylist():
        name = c["predictor"]
        fig, axes = plotting.new_figure(figsize=(5, 4))
        ax = axes[0, 0]
        xs = [r[name] for r in rel]
        ys = [r["f1"] for r in rel]
        ax.scatter(xs, ys)
        for r, x, y in zip(rel, xs, ys):
            if np.isfinite(x):
                ax.annotate(
                    str(r["relation_id"]), (x, y), fontsize=7, xytext=(2, 2), textcoords="offset points"
                )
        ax.set_xlabel(name)
        ax.set_ylabel("F1")
        ax.set_title(
            f"{name}: Spearman {c['spearman_rho']:.2f} (p={c['spearman_p']:.2g}), n={c['n']}", fontsize=9
        )
        fig.tight_layout()
        path = os.path.join(str(out_dir), f"{result.run_id}_{name}.png")
        plotting.save_png(fig, path, dpi=100)
        paths.append(path)
    return paths
