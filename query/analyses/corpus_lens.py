"""The tuned lens trained as Belrose et al. train it: on the residual stream at every position of a text
corpus, evaluated on documents it never saw.

A corpus store (``actstore ingest --positions all --kinds resid``) holds residual index ``i``
(0: embeddings, ``i``: output of block ``i - 1``) at every kept token.  The documents are split
once, by a seeded permutation of their numbers in the ``positions`` table: a share of them
(``held_out``) is never trained on.  Rows are sampled from each side (``max_train_rows``,
``max_eval_rows``), the translators are trained on the KL to the model's own final distribution
(:func:`actstore.query.analyses.tuned_lens.train_tuned_lens`), and both lenses are read on the held-out
positions: the mean KL per residual index, the logit lens's and the tuned lens's.

The translators are stored with the run (the ``tuned_lens_translators`` table: one row per residual
index ``i`` < L, ``D`` flattened row-major [d, d] and ``b`` [d], float32), so that another store of the
same model reads facts through them (``actstore agree --tuned corpus:STORE``,
:func:`load_corpus_lens`) without training again.

Cost: reading the split reads two integer columns of ``positions`` (linear in the store's
positions); the features read are the sampled rows only (``rows x (L + 1) x d_model`` values);
training is ``steps x batch x L`` products with the unembedding (the vocabulary dominates).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from actstore.core.errors import ActstoreError, LensError
from actstore.core.store import StoreReader, open_reader
from actstore.query.analyses.lens_methods import CORPUS_PREFIX
from actstore.query.analyses.readout import FinalReadout, TunedLens
from actstore.query.analyses.tuned_lens import TrainConfig, kl_per_index, train_tuned_lens
from actstore.query.select.selection import Selection


@dataclass(frozen=True)
class CorpusSplit:
    """Rows (example ids) of the training and the held-out documents, as sampled."""

    train_documents: np.ndarray
    eval_documents: np.ndarray
    train_rows: np.ndarray
    eval_rows: np.ndarray


@dataclass
class CorpusLensStudy:
    split: CorpusSplit
    kl_logit: np.ndarray  # [L + 1] mean KL(final || logit lens) on the held-out rows, nats
    kl_tuned: np.ndarray  # [L + 1] the same through the tuned lens (index L: 0)
    lens: TunedLens

    def summary(self) -> list[dict[str, Any]]:
        """One dict per residual index: the two KLs and their ratio."""
        return [
            {
                "index": i,
                "kl_logit": float(a),
                "kl_tuned": float(b),
                "tuned_better": bool(b < a) if i < len(self.kl_logit) - 1 else None,
            }
            for i, (a, b) in enumerate(zip(self.kl_logit, self.kl_tuned, strict=True))
        ]


def check_corpus_residuals(store: StoreReader) -> int:
    """L + 1 (the residual indices) when ``store`` is a corpus store that kept every index of
    ``resid``; one error line otherwise."""
    ingest = store.manifest.ingest
    if ingest.get("positions") != "all":
        raise LensError(
            f"{store.url}: not a corpus store (ingest it with --positions all --kinds resid over a text corpus)"
        )
    n_index = store.geometry.n_layers + 1
    kept = (ingest.get("kept") or {}).get("resid") or []
    missing = sorted(set(range(n_index)) - set(kept))
    if missing:
        raise LensError(
            f"{store.url}: the tuned lens needs resid at every residual index 0..{n_index - 1}; "
            f"index {missing[0]} was not kept (ingest with --kinds resid and no --layers)"
        )
    return n_index


def split_documents(
    store: StoreReader, held_out: float, max_train_rows: int, max_eval_rows: int, seed: int
) -> CorpusSplit:
    """Documents permuted by ``seed``; the first ``held_out`` share (at least one) is held out.
    Rows are drawn without replacement from each side, at most the given numbers, in store order."""
    if not 0 < held_out < 1:
        raise LensError(f"held_out must be a share in (0, 1), not {held_out}")
    t = store.sql("SELECT example_id, document FROM positions WHERE document >= 0")
    ids = t.column("example_id").to_numpy()
    docs = t.column("document").to_numpy()
    uniq = np.unique(docs)
    if uniq.size < 2:
        raise LensError(f"{store.url}: the corpus has {uniq.size} document(s); a held-out split needs two")
    rng = np.random.default_rng(seed)
    order = rng.permutation(uniq)
    n_eval = min(uniq.size - 1, max(1, round(held_out * uniq.size)))
    eval_docs, train_docs = np.sort(order[:n_eval]), np.sort(order[n_eval:])
    held = np.isin(docs, eval_docs)

    def draw(pool: np.ndarray, n: int) -> np.ndarray:
        return np.sort(pool if pool.size <= n else rng.choice(pool, n, replace=False))

    return CorpusSplit(
        train_docs, eval_docs, draw(ids[~held], max_train_rows), draw(ids[held], max_eval_rows)
    )


def corpus_residuals(store: StoreReader, rows: np.ndarray) -> np.ndarray:
    """``resid`` [n, L + 1, d_model] of the rows (example ids, increasing)."""
    return Selection.from_ids(store, rows.tolist()).features("resid")


def corpus_lens_study(
    store: StoreReader,
    *,
    held_out: float = 0.2,
    max_train_rows: int = 16384,
    max_eval_rows: int = 4096,
    config: TrainConfig | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> CorpusLensStudy:
    """Train the tuned lens on the training documents' positions and compare it with the logit lens on
    the held-out documents' positions (``config``: the training; its seed also draws the split)."""
    check_corpus_residuals(store)
    cfg = config or TrainConfig()
    cfg.check()
    split = split_documents(store, held_out, max_train_rows, max_eval_rows, cfg.seed)
    readout = FinalReadout.from_store(store)
    lens = train_tuned_lens(readout, corpus_residuals(store, split.train_rows), cfg, progress=progress)
    held = corpus_residuals(store, split.eval_rows)
    return CorpusLensStudy(split, kl_per_index(readout, held), kl_per_index(readout, held, lens), lens)


TRANSLATORS_TABLE = "tuned_lens_translators"


def translators_table(lens: TunedLens) -> pa.Table:
    """The translators of ``lens`` as a table: ``index`` (int32), ``D`` (d*d float32, row-major) and
    ``b`` (d float32), one row per residual index 0..L-1."""
    D = lens.D.detach().to(torch.float32).cpu().numpy()
    b = lens.b.detach().to(torch.float32).cpu().numpy()
    L, d, _ = D.shape
    return pa.table(
        {
            "index": pa.array(np.arange(L), pa.int32()),
            "D": pa.FixedSizeListArray.from_arrays(pa.array(D.reshape(-1)), d * d),
            "b": pa.FixedSizeListArray.from_arrays(pa.array(b.reshape(-1)), d),
        }
    )


def lens_from_table(table: pa.Table, n_layers: int, d_model: int, where: str) -> TunedLens:
    """The :class:`TunedLens` a :func:`translators_table` holds; one error line (naming ``where``) when
    its rows or sizes are not those of a model with ``n_layers`` layers of width ``d_model``."""
    if table.num_rows != n_layers or set(table.column_names) < {"index", "D", "b"}:
        raise LensError(
            f"{where}: the translators table has {table.num_rows} rows and columns "
            f"{', '.join(table.column_names)}; expected {n_layers} rows of index, D, b"
        )
    t = table.sort_by("index")
    if t.column("index").to_pylist() != list(range(n_layers)):
        raise LensError(f"{where}: the translators' indices are not 0..{n_layers - 1}")
    try:
        D = np.stack([np.asarray(x, np.float32) for x in t.column("D").to_pylist()])
        b = np.stack([np.asarray(x, np.float32) for x in t.column("b").to_pylist()])
    except (TypeError, ValueError) as e:
        raise LensError(f"{where}: unreadable translators ({e})") from None
    if D.shape != (n_layers, d_model * d_model) or b.shape != (n_layers, d_model):
        raise LensError(f"{where}: translators of width {b.shape[-1]}, the model's is {d_model}")
    return TunedLens(
        torch.from_numpy(D.reshape(n_layers, d_model, d_model)), torch.from_numpy(b), method="adam"
    )


def same_model(a: StoreReader, b: StoreReader) -> str | None:
    """Why the stores ``a`` and ``b`` hold different models (None when they hold the same one): the
    geometry, then the weights' hash where both manifests record one, else the model's name."""
    ga, gb = a.geometry, b.geometry
    for name in ("n_layers", "d_model", "vocab_size"):
        if getattr(ga, name) != getattr(gb, name):
            return f"{name} {getattr(ga, name)} against {getattr(gb, name)}"
    ma, mb = a.manifest.model, b.manifest.model
    if ma.get("weight_hash") and mb.get("weight_hash"):
        if ma["weight_hash"] != mb["weight_hash"]:
            return "different weights (weight_hash)"
    elif ma.get("name") != mb.get("name"):
        return f"model {ma.get('name')!r} against {mb.get('name')!r}"
    return None


def load_corpus_lens(spec: str, target: StoreReader) -> TunedLens:
    """The translators of a corpus-lens run for reading ``target``'s facts: ``spec`` is
    ``corpus:STORE`` (the newest ``corpus-lens`` run of STORE) or ``corpus:STORE#RUN_ID``.  One error
    line when STORE has no such run or holds another model than ``target``.  ``lens.info`` names the
    source store and run, and the run's training settings."""
    body = spec[len(CORPUS_PREFIX) :] if spec.startswith(CORPUS_PREFIX) else ""
    url, _, run = body.partition("#")
    if not url:
        raise LensError(f"{spec!r}: name the corpus store as corpus:STORE or corpus:STORE#RUN_ID")
    try:
        source = open_reader(url)
    except ActstoreError as e:
        raise LensError(f"--tuned {spec}: {e}") from None
    why = same_model(source, target)
    if why is not None:
        raise LensError(f"{source.url} and {target.url} hold different models ({why})")
    files = source.table_files().get(TRANSLATORS_TABLE)
    if not files:
        raise LensError(
            f"{source.url}: no stored translators (run 'actstore corpus-lens {url}' first; runs before "
            "this version did not store them)"
        )
    by_run = {f.rsplit("/", 1)[-1].removesuffix(".parquet"): f for f in files}  # a result file per run
    runs = source.sql("SELECT run_id, started FROM runs WHERE kind = 'corpus_lens'").to_pydict()
    started = dict(zip(runs["run_id"], runs["started"], strict=True))
    # oldest first, by the runs table's start times (ids made in one second do not sort)
    have = sorted(by_run, key=lambda r: (started.get(r, float("-inf")), r))
    if run and run not in have:
        raise LensError(f"{source.url}: no corpus-lens run {run!r} with translators (have {', '.join(have)})")
    run = run or have[-1]
    # read as Arrow, not through DuckDB: a run's translators are one file of L rows of d*d floats
    # (SmolLM2: 40 MB), which DuckDB would widen into lists beyond its memory limit
    table = source.table(TRANSLATORS_TABLE, ["index", "D", "b"], files=[by_run[run]])
    g = source.geometry
    lens = lens_from_table(table, g.n_layers, g.d_model, f"{source.url} run {run}")
    config = source.sql("SELECT config FROM runs WHERE run_id = ?", [run]).column("config").to_pylist()
    lens.info = {"source": source.url, "run_id": run, "config": json.loads(config[0]) if config else None}
    return lens


__all__ = [
    "TRANSLATORS_TABLE",
    "CorpusLensStudy",
    "CorpusSplit",
    "check_corpus_residuals",
    "corpus_lens_study",
    "corpus_residuals",
    "lens_from_table",
    "load_corpus_lens",
    "same_model",
    "split_documents",
    "translators_table",
]
