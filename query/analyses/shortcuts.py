"""Lexical shortcut analysis of probe errors ("Tracing Relational Knowledge Recall", ACL 2026 Findings; our definitions).

Lexical association: every relation of the run's selection is one document, the bag of its
instances' prompt tokens (the store's tokens, stripped and lower-cased; tokens without a
letter or digit are ignored), and TF-IDF over these documents gives ``assoc[c, term]`` =
(count / document length) * ln(R / document frequency), counts from scikit-learn's
``CountVectorizer``.  The idf is unsmoothed on purpose: a term found in every relation's
document (``the``, ``of``) has association 0 and cannot be a cue.  The *lexical cues* of
class c are its ``n_cues`` highest-weighted terms (with positive weight).

For each probe error (a query predicted as c_hat != gold) with TokenScore s_j over the
prompt's tokens (summed over layers; stored by ``actstore probe`` in ``token_scores``):

- ``rho``: Spearman correlation over the prompt's tokens between s_j and assoc[c_hat, token_j]
  (NaN when either is constant); reported as the mean over errors;
- ``mass``: sum of |s_j| over tokens that are cues of c_hat, divided by sum of |s_j|;
  ``mass_baseline`` is the share of the prompt's tokens that are cues (the mass a uniform
  TokenScore would put on them);
- ``strong_align``: whether the token with the highest s_j is a cue of c_hat;
  StrongAlign-x is the share of errors where it is.

These numbers depend on ``n_cues`` and on the tokenizer, so they are comparable across runs of
this tool, not directly with the paper's.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from actstore.core.dependencies import sklearn_text
from actstore.core.errors import InvalidSetting, QueryError
from actstore.core.store import StoreReader
from actstore.query.analyses import plotting
from actstore.query.analyses.attribution import run_row
from actstore.query.analyses.stats import spearman
from actstore.query.select.rows import rows_condition
from actstore.query.select.selection import Selection


def normalize(token: str | None) -> str | None:
    t = (token or "").strip().lower()
    return t if any(ch.isalnum() for ch in t) else None


@dataclass(frozen=True)
class LexicalModel:
    relations: tuple[str, ...]
    vocab: dict[str, int]
    weights: np.ndarray  # [R, V] TF-IDF weight of each term in each relation's document
    n_cues: int

    def cues(self, relation: str) -> set[str]:
        r = self.relations.index(relation)
        row = self.weights[r]
        top = np.argsort(-row, kind="stable")[: self.n_cues]
        inv = {i: t for t, i in self.vocab.items()}
        return {inv[int(i)] for i in top if row[i] > 0}

    def assoc(self, relation: str, terms: list[str | None]) -> np.ndarray:
        row = self.weights[self.relations.index(relation)]
        return np.asarray([row[self.vocab[t]] if t is not None and t in self.vocab else 0.0 for t in terms])


def lexical_model(rows: Selection, n_cues: int = 20) -> LexicalModel:
    """Per relation, the ``n_cues`` tokens most associated with it over the prompts of ``rows``."""
    if n_cues < 1:
        raise InvalidSetting("n_cues", f"must be at least 1 (got {n_cues})")
    cond, params = rows_condition(rows, "e.example_id")
    found = rows.store.sql(
        "SELECT e.relation_id, list(t.token ORDER BY t.position) AS toks FROM examples e "
        f"JOIN tokens t USING (example_id) WHERE {cond} GROUP BY e.example_id, e.relation_id",
        params,
    ).to_pylist()
    docs: dict[str, list[str]] = {}
    for r in found:
        docs.setdefault(r["relation_id"], []).extend(t for t in map(normalize, r["toks"]) if t is not None)
    relations = tuple(sorted(docs))
    vec = sklearn_text.CountVectorizer(analyzer=lambda d: d, lowercase=False)
    counts = vec.fit_transform([docs[r] for r in relations]).toarray().astype(np.float64)  # [R, V]
    tf = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    idf = np.log(len(relations) / np.maximum((counts > 0).sum(0), 1))  # 0 for terms in every document
    return LexicalModel(relations, {t: int(i) for t, i in vec.vocabulary_.items()}, tf * idf, n_cues)


@dataclass(frozen=True)
class ShortcutResult:
    run_id: str
    errors: pa.Table  # one row per error
    summary: pa.Table  # one row


def shortcut_analysis(store: StoreReader, run_id: str, *, n_cues: int = 20) -> ShortcutResult:
    """Spearman rho, Mass and StrongAlign-x over the run's stored error TokenScores."""
    cfg = json.loads(str(run_row(store, run_id)["config"]))
    if "token_scores" not in store.table_files():
        raise QueryError(
            f"run {run_id} has no token scores (probe an attention kind with token scores of its errors)"
        )
    ts = store.sql(
        "SELECT seed, episode, example_id, relation_id, predicted, scores FROM token_scores "
        "WHERE run_id = ? AND relation_id <> predicted",
        [run_id],
    ).to_pylist()
    if not ts:
        raise QueryError(
            f"run {run_id} has no stored error token scores "
            f"(kind {cfg.get('kind')!r}, token scores {cfg.get('token_scores')!r})"
        )
    lex = lexical_model(Selection.from_sql(store, cfg.get("where")), n_cues)
    ids = sorted({int(r["example_id"]) for r in ts})
    toks = store.sql(
        "SELECT example_id, list(token ORDER BY position) AS toks FROM tokens "
        "WHERE list_contains(?, example_id) GROUP BY 1",
        [ids],
    ).to_pylist()
    tokens = {int(r["example_id"]): [normalize(t) for t in r["toks"]] for r in toks}
    cue_sets = {r: lex.cues(r) for r in lex.relations}
    out = []
    for r in ts:
        s = np.asarray(r["scores"], dtype=np.float64)
        terms = tokens[int(r["example_id"])][: s.size]
        a = lex.assoc(r["predicted"], terms)
        is_cue = np.asarray([t in cue_sets[r["predicted"]] for t in terms])
        rho = spearman(s, a)[0]
        mag = np.abs(s).sum()
        top = int(np.argmax(s))
        out.append(
            {
                "run_id": run_id,
                "seed": r["seed"],
                "episode": r["episode"],
                "example_id": r["example_id"],
                "relation_id": r["relation_id"],
                "predicted": r["predicted"],
                "rho": rho,
                "mass": float(np.abs(s[is_cue]).sum() / mag) if mag > 0 else float("nan"),
                "mass_baseline": float(is_cue.mean()),
                "strong_align": bool(is_cue[top]),
                "top_token": terms[top],
                "top_position": top,
            }
        )
    errors = pa.Table.from_pylist(out)
    rhos = np.asarray([x["rho"] for x in out])
    mass = np.asarray([x["mass"] for x in out])
    summary = pa.table(
        {
            "run_id": [run_id],
            "n_errors": [len(out)],
            "n_cues": [n_cues],
            "spearman_rho": [float(np.nanmean(rhos)) if np.isfinite(rhos).any() else float("nan")],
            "mass": [float(np.nanmean(mass)) if np.isfinite(mass).any() else float("nan")],
            "mass_baseline": [float(np.mean([x["mass_baseline"] for x in out]))],
            "strong_align": [float(np.mean([x["strong_align"] for x in out]))],
        }
    )
    return ShortcutResult(run_id, errors, summary)


def shortcut_figure(result: ShortcutResult, path: str | os.PathLike[str]) -> str:
    """Three panels: per-error rho, Mass against its baseline, StrongAlign-x."""

    e = result.errors.to_pylist()
    s = result.summary.to_pylist()[0]
    fig, axes_2d = plotting.new_figure(3, figsize=(12, 3.6))
    axes = axes_2d[0]
    rho = [x["rho"] for x in e if np.isfinite(x["rho"])]
    axes[0].hist(rho, bins=20, range=(-1, 1))
    axes[0].axvline(s["spearman_rho"], color="k", ls="--")
    axes[0].set_title(f"Spearman rho per error (mean {s['spearman_rho']:.3f})", fontsize=9)
    axes[1].hist(
        [x["mass"] for x in e if np.isfinite(x["mass"])], bins=20, range=(0, 1), alpha=0.7, label="mass"
    )
    axes[1].hist([x["mass_baseline"] for x in e], bins=20, range=(0, 1), alpha=0.5, label="baseline")
    axes[1].legend(fontsize=8)
    axes[1].set_title(
        f"TokenScore mass on cues (mean {s['mass']:.3f}, baseline {s['mass_baseline']:.3f})", fontsize=9
    )
    axes[2].bar(["aligned", "not aligned"], [s["strong_align"], 1 - s["strong_align"]])
    axes[2].set_title(f"StrongAlign-x {100 * s['strong_align']:.1f}% of {s['n_errors']} errors", fontsize=9)
    fig.tight_layout()
    plotting.save_png(fig, path, dpi=100)
    return os.fspath(path)
