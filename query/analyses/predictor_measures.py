"""The measures that predict a relation's probe accuracy: output range, knowledge-graph connectivity,
TF-IDF similarity of its prompts, HeadScore concentration; each a plain function of rows or scores."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from actstore.core.dependencies import sklearn_text
from actstore.core.errors import InvalidSetting, QueryError
from actstore.query.analyses.stats import pearson, spearman

MAX_DATASET_BYTES = 1 << 30


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
        objs.setdefault(str(r["relation_id"]), []).append(
            str(qid) if qid else str(r["object"] or "").strip().lower()
        )
    return {k: (len(v), len(set(v))) for k, v in objs.items()}


def dataset_output_ranges(path: str | os.PathLike[str]) -> dict[str, tuple[int, int]]:
    """relation -> (instances, distinct objects) over every instance of a FewRel-format file
    (``{relation: [{"tokens": [...], "h": [name, qid, spans], "t": [name, qid, spans]}, ...]}``), objects
    that precede their subject included; the object is its Q-id, else its lower-cased name."""
    p = os.fspath(path)
    try:
        if not os.path.isfile(p):
            raise InvalidSetting("dataset_file", f"{p}: not a regular file")
        if os.path.getsize(p) > MAX_DATASET_BYTES:
            raise InvalidSetting("dataset_file", f"{p}: larger than {MAX_DATASET_BYTES >> 20} MiB")
        with open(p, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidSetting("dataset_file", f"{p}: cannot read ({e})") from None
    except (json.JSONDecodeError, RecursionError) as e:
        raise InvalidSetting("dataset_file", f"{p}: not JSON ({e})") from None
    if not isinstance(data, dict) or not all(isinstance(v, list) for v in data.values()):
        raise InvalidSetting(
            "dataset_file", f"{p}: expected FewRel's layout, an object of relation -> list of instances"
        )
    out: dict[str, tuple[int, int]] = {}
    for rel, insts in data.items():
        objs = []
        for i, inst in enumerate(insts):
            t = inst.get("t") if isinstance(inst, dict) else None
            if not (isinstance(t, list) and len(t) >= 2):
                raise InvalidSetting(
                    "dataset_file", f"{p}: {rel} instance {i} has no object ('t': [name, qid, spans])"
                )
            qid, name = t[1], t[0]
            objs.append(str(qid) if qid else str(name or "").strip().lower())
        out[str(rel)] = (len(objs), len(set(objs)))
    return out


def connectivity(
    rows: Sequence[Mapping[str, Any]], kg: KnowledgeGraph
) -> dict[str, tuple[float, float, int]]:
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


def _analyzer() -> Callable[[str], list[str]]:
    """scikit-learn's default word analyzer (lower-case, tokens of two or more word characters)."""
    analyze: Callable[[str], list[str]] = sklearn_text.TfidfVectorizer().build_analyzer()
    return analyze


def document_frequencies(texts: Iterable[str]) -> Counter[str]:
    """term -> number of texts holding it (what TF-IDF's inverse document frequency needs)."""
    analyze = _analyzer()
    df: Counter[str] = Counter()
    for t in texts:
        df.update(set(analyze(t)))
    return df


def inverse_document_frequency(df: Mapping[str, int], n_docs: int) -> tuple[list[str], np.ndarray]:
    """(sorted terms, smoothed idf) exactly as scikit-learn's ``TfidfTransformer.fit`` computes
    them from the same counts: ``ln((1 + n) / (1 + df)) + 1`` in float64."""
    terms = sorted(df)
    if not terms:
        raise QueryError("TF-IDF: the selected texts hold no words")
    d = np.asarray([df[t] for t in terms], dtype=np.float64)
    d += 1.0
    idf = np.full_like(d, fill_value=n_docs + 1, dtype=np.float64)
    idf /= d
    np.log(idf, out=idf)
    idf += 1.0
    return terms, idf


def mean_pairwise_similarity(texts: Sequence[str], terms: Sequence[str], idf: np.ndarray) -> float:
    """Mean cosine similarity over the distinct pairs of ``texts``' TF-IDF vectors (scikit-learn's
    count vectorizer over ``terms`` and its TF-IDF transformer with ``idf``: L2-normalised rows)."""
    n = len(texts)
    if n < 2:
        return float("nan")
    counts = sklearn_text.CountVectorizer(vocabulary={t: i for i, t in enumerate(terms)}).transform(
        list(texts)
    )
    tf = sklearn_text.TfidfTransformer()
    tf.idf_ = idf
    tf.n_features_in_ = len(terms)
    X = tf.transform(counts)  # each row's terms in column order, whatever else was fitted
    sim = (X @ X.T).toarray()
    return float((sim.sum() - np.trace(sim)) / (n * (n - 1)))


def tfidf_similarity(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """relation -> mean pairwise cosine similarity of its instances' TF-IDF vectors (idf fitted
    on every row).  Equal to scikit-learn's ``sklearn_text.TfidfVectorizer().fit_transform`` of all texts up
    to the order in which each row's terms are summed (1e-12, see the tests); computed this way
    so that :func:`relation_predictors` gets the same numbers from any split of the rows."""
    texts = [str(r["text"] or "") for r in rows]
    terms, idf = inverse_document_frequency(document_frequencies(texts), len(texts))
    rel = np.asarray([str(r["relation_id"]) for r in rows], dtype=object)
    return {
        r: mean_pairwise_similarity([texts[i] for i in np.flatnonzero(rel == r)], terms, idf)
        for r in sorted(set(rel.tolist()))
    }


def head_concentration(scores: np.ndarray, share: float = 0.95) -> int:
    """Units needed (largest |score| first) to reach ``share`` of the total |score|."""
    a = np.sort(np.abs(np.asarray(scores, dtype=np.float64)))[::-1]
    total = a.sum()
    if total <= 0:
        return 0
    return int(np.searchsorted(np.cumsum(a) / total, share - 1e-12) + 1)


def correlate(x: Sequence[float], y: Sequence[float]) -> dict[str, float]:
    """Spearman and Pearson correlation with p-values over the finite pairs (:mod:`actstore.query.analyses.stats`)."""
    xa, ya = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    rho, rho_p = spearman(xa, ya)
    r, r_p = pearson(xa, ya)
    return {
        "n": float((np.isfinite(xa) & np.isfinite(ya)).sum()),
        "spearman_rho": rho,
        "spearman_p": rho_p,
        "pearson_r": r,
        "pearson_p": r_p,
    }
