"""Predictors of per-relation probe accuracy and their correlations (SPEC section 5, seed 000).

For a probe run (typically 16-way 5-shot over all relations), per relation:

- ``f1``: F1 of the run's pooled query predictions (table ``relation_metrics``);
- ``output_range``: distinct objects among the relation's instances in the run's selection
  (object Q-id when the record carries one, else the lower-cased object text), and
  ``output_range_ratio`` = that count / instances (fairer when relations differ in size);
- ``connectivity``: mean number of properties shared by subject and object in a knowledge
  graph given as Q-id triple files (``head<TAB>property<TAB>tail``); an entity's properties are
  those it has as head (``direction="out"``, Wikidata's statements) or in either position
  (``"both"``).  Only instances whose subject and object are both in the graph count;
  ``connectivity_coverage`` is their share;
- ``tfidf_similarity``: mean pairwise cosine similarity between the TF-IDF vectors
  (scikit-learn, fitted on every instance of the selection) of the relation's prompt texts;
- ``head_concentration``: the number of units (heads) needed to reach 95% of the total
  |mean HeadScore| of the relation's predictions, largest first.

Each predictor is correlated with F1 across relations (Spearman and Pearson with p-values,
scipy); NaN values (e.g. no coverage) are left out and the count used is reported.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from actstore.errors import QueryError
from actstore.store import Store
from query.attribution import run_row, sql_quote

PREDICTORS = ("output_range", "output_range_ratio", "connectivity", "tfidf_similarity", "head_concentration")


@dataclass(frozen=True)
class KnowledgeGraph:
    """Properties per entity from Q-id triple files."""

    properties: dict[str, frozenset[str]]
    entities: frozenset[str]
    files: tuple[str, ...]
    n_triples: int

    @classmethod
    def load(cls, paths: Iterable[str | os.PathLike[str]], direction: str = "out") -> KnowledgeGraph:
        if direction not in ("out", "both"):
            raise QueryError(f"direction must be 'out' or 'both', not {direction!r}")
        props: dict[str, set[str]] = {}
        entities: set[str] = set()
        files = tuple(str(p) for p in paths)
        if not files:
            raise QueryError("no knowledge-graph files given")
        n = 0
        for path in files:
            with open(path, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    parts = line.rstrip("\n").split("\t")
                    if len(parts) != 3:
                        if line.strip():
                            raise QueryError(f"{path}:{lineno}: expected head<TAB>property<TAB>tail")
                        continue
                    h, p, t = parts
                    n += 1
                    entities.update((h, t))
                    props.setdefault(h, set()).add(p)
                    if direction == "both":
                        props.setdefault(t, set()).add(p)
        return cls({k: frozenset(v) for k, v in props.items()}, frozenset(entities), files, n)

    def shared(self, subject: str, obj: str) -> int | None:
        """Properties shared by the two entities, or None when either is not in the graph."""
        if subject not in self.entities or obj not in self.entities:
            return None
        return len(self.properties.get(subject, frozenset()) & self.properties.get(obj, frozenset()))


def _instances(store: Store, where: str | None) -> list[dict[str, object]]:
    cond = where if where and where.strip() else "TRUE"
    return store.sql(f"SELECT example_id, relation_id, object, text, meta FROM examples WHERE {cond} "
                     "ORDER BY example_id").to_pylist()


def _meta(row: Mapping[str, Any]) -> dict[str, object]:
    raw = row.get("meta")
    try:
        m = json.loads(str(raw)) if raw else {}
    except json.JSONDecodeError:
        return {}
    return m if isinstance(m, dict) else {}


def output_ranges(rows: Sequence[Mapping[str, Any]]) -> dict[str, tuple[int, int]]:
    """relation -> (instances, distinct objects)."""
    objs: dict[str, list[str]] = {}
    for r in rows:
        qid = _meta(r).get("object_qid")
        objs.setdefault(str(r["relation_id"]), []).append(str(qid) if qid else str(r["object"] or "").strip().lower())
    return {k: (len(v), len(set(v))) for k, v in objs.items()}


def connectivity(rows: Sequence[Mapping[str, Any]], kg: KnowledgeGraph) -> dict[str, tuple[float, float, int]]:
    """relation -> (mean shared properties over covered instances, coverage, covered count)."""
    acc: dict[str, list[int | None]] = {}
    for r in rows:
        m = _meta(r)
        s, o = m.get("subject_qid"), m.get("object_qid")
        val = kg.shared(str(s), str(o)) if s and o else None
        acc.setdefault(str(r["relation_id"]), []).append(val)
    out = {}
    for rel, vals in acc.items():
        cov = [v for v in vals if v is not None]
        out[rel] = (float(np.mean(cov)) if cov else float("nan"), len(cov) / len(vals), len(cov))
    return out


def tfidf_similarity(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """relation -> mean pairwise cosine similarity of its instances' TF-IDF vectors."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    texts = [str(r["text"] or "") for r in rows]
    X = TfidfVectorizer().fit_transform(texts)  # rows are L2-normalised
    rel = np.asarray([str(r["relation_id"]) for r in rows], dtype=object)
    out = {}
    for r in sorted(set(rel.tolist())):
        idx = np.flatnonzero(rel == r)
        if idx.size < 2:
            out[r] = float("nan")
            continue
        sim = (X[idx] @ X[idx].T).toarray()
        out[r] = float((sim.sum() - np.trace(sim)) / (idx.size * (idx.size - 1)))
    return out


def head_concentration(scores: np.ndarray, share: float = 0.95) -> int:
    """Units needed (largest |score| first) to reach ``share`` of the total |score|."""
    a = np.sort(np.abs(np.asarray(scores, dtype=np.float64)))[::-1]
    total = a.sum()
    if total <= 0:
        return 0
    return int(np.searchsorted(np.cumsum(a) / total, share - 1e-12) + 1)


def correlate(x: Sequence[float], y: Sequence[float]) -> dict[str, float]:
    """Spearman and Pearson correlation with p-values over the finite pairs."""
    from scipy import stats

    xa, ya = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    ok = np.isfinite(xa) & np.isfinite(ya)
    xa, ya = xa[ok], ya[ok]
    out = {"n": float(ok.sum()), "spearman_rho": float("nan"), "spearman_p": float("nan"),
           "pearson_r": float("nan"), "pearson_p": float("nan")}
    if xa.size >= 3 and np.ptp(xa) > 0 and np.ptp(ya) > 0:
        s = stats.spearmanr(xa, ya)
        p = stats.pearsonr(xa, ya)
        out.update(spearman_rho=float(s.statistic), spearman_p=float(s.pvalue),
                   pearson_r=float(p.statistic), pearson_p=float(p.pvalue))
    return out


@dataclass(frozen=True)
class PredictorResult:
    run_id: str
    relations: pa.Table  # one row per relation: f1 and the predictors
    correlations: pa.Table  # one row per predictor
    kb_files: tuple[str, ...]
    kb_coverage: float  # share of all instances whose subject and object are in the graph (nan without one)


def relation_predictors(store: Store, run_id: str, *, kb: Sequence[str | os.PathLike[str]] = (),
                        direction: str = "out", share: float = 0.95) -> PredictorResult:
    """Per-relation F1 and predictors for a probe run, and their correlations with F1."""
    where = json.loads(str(run_row(store, run_id)["config"])).get("where")
    rows = _instances(store, where)
    metrics = {r["relation_id"]: r for r in
               store.sql(f"SELECT * FROM relation_metrics WHERE run_id = '{sql_quote(run_id)}'").to_pylist()}
    hs = store.sql(f"SELECT relation_id, score FROM head_scores WHERE run_id = '{sql_quote(run_id)}'").to_pandas()
    ranges = output_ranges(rows)
    sims = tfidf_similarity(rows)
    graph = KnowledgeGraph.load(kb, direction) if kb else None
    conn = connectivity(rows, graph) if graph is not None else {}
    table = []
    for rel in sorted(metrics):
        n_inst, distinct = ranges.get(rel, (0, 0))
        c = conn.get(rel, (float("nan"), float("nan"), 0))
        scores = hs.loc[hs["relation_id"] == rel, "score"].to_numpy()
        table.append({"run_id": run_id, "relation_id": rel, "relation_name": metrics[rel].get("relation_name"),
                      "f1": float(metrics[rel]["f1"]), "n_queries": int(metrics[rel]["n_queries"]),
                      "n_instances": n_inst, "output_range": float(distinct),
                      "output_range_ratio": distinct / n_inst if n_inst else float("nan"),
                      "connectivity": c[0], "connectivity_coverage": c[1], "connectivity_covered": c[2],
                      "tfidf_similarity": sims.get(rel, float("nan")),
                      "head_concentration": float(head_concentration(scores, share)) if scores.size else float("nan")})
    rel_table = pa.Table.from_pylist(table)
    f1 = [r["f1"] for r in table]
    covered = sum(r["connectivity_covered"] for r in table)
    coverage = covered / max(1, sum(r["n_instances"] for r in table)) if graph is not None else float("nan")
    corr = []
    for name in PREDICTORS:
        if name == "connectivity" and graph is None:
            continue
        stat = correlate([r[name] for r in table], f1)
        corr.append({"run_id": run_id, "predictor": name, "n": int(stat["n"]),
                     **{k: v for k, v in stat.items() if k != "n"},
                     "coverage": coverage if name == "connectivity" else float("nan"),
                     "kb": ",".join(os.path.basename(f) for f in graph.files) if graph and name == "connectivity" else None})
    return PredictorResult(run_id, rel_table, pa.Table.from_pylist(corr), graph.files if graph else (), coverage)


def scatter_plots(result: PredictorResult, out_dir: str | os.PathLike[str]) -> list[str]:
    """One PNG per predictor: predictor vs F1, one labelled point per relation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    rel = result.relations.to_pylist()
    paths = []
    for c in result.correlations.to_pylist():
        name = c["predictor"]
        fig, ax = plt.subplots(figsize=(5, 4))
        xs = [r[name] for r in rel]
        ys = [r["f1"] for r in rel]
        ax.scatter(xs, ys)
        for r, x, y in zip(rel, xs, ys):
            if np.isfinite(x):
                ax.annotate(str(r["relation_id"]), (x, y), fontsize=7, xytext=(2, 2), textcoords="offset points")
        ax.set_xlabel(name)
        ax.set_ylabel("F1")
        ax.set_title(f"{name}: Spearman {c['spearman_rho']:.2f} (p={c['spearman_p']:.2g}), n={c['n']}", fontsize=9)
        fig.tight_layout()
        path = os.path.join(str(out_dir), f"{result.run_id}_{name}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
