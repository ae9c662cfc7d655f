"""The tuned lens trained on a corpus store, against computations made with the model's own modules.

The logit lens's KL is recomputed here with the Hugging Face model's final norm and ``lm_head``
applied to the stored residuals (not actstore's readout), the final distribution's argmax against
the greedy token the ingest stored, the document split against the ``positions`` table read
directly, and the tuned lens's KL by a plain loop over rows and indices.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import actstore
from actstore.core.errors import LensError
from actstore.ingest.models.tiny import tiny_model
from actstore.query.analyses.corpus_lens import corpus_lens_study, corpus_residuals, split_documents
from actstore.query.analyses.tuned_lens import TrainConfig

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = "the cat sat on a mat while rivers run past old stone bridges in quiet towns".split()


def corpus(path: Path, n_docs: int = 12) -> str:
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(WORDS, int(rng.integers(4, 12)))) for _ in range(n_docs)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return f"text:{path}"


def ingest(tmp_path: Path, **kw: object) -> actstore.Store:
    settings: dict[str, object] = {
        "model": "tiny-llama",
        "dataset": corpus(tmp_path / "docs.txt"),
        "positions": "all",
        "kinds": ("resid",),
        "storage_dtype": "float32",
        "batch_size": 4,
        "segment_size": 16,
    }
    return actstore.ingest_corpus(tmp_path / "s", **(settings | kw))


def model_kl(model: torch.nn.Module, resid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean KL(final || logit lens) per residual index and the final argmax, with the model's modules."""
    with torch.no_grad():
        h = torch.from_numpy(resid)
        logits = model.lm_head(model.model.norm(h)).double()  # type: ignore[operator, union-attr]
    logp = torch.log_softmax(logits, dim=-1).numpy()  # [n, K, V]
    final = logp[:, -1:, :]
    kl = (np.exp(final) * (final - logp)).sum(-1).mean(0)
    return kl, logp[:, -1].argmax(-1)


def test_the_corpus_lens_against_the_models_own_modules(tmp_path: Path) -> None:
    store = ingest(tmp_path)
    cfg = TrainConfig(steps=30, batch=64, seed=3)
    study = corpus_lens_study(store, held_out=0.25, max_train_rows=200, max_eval_rows=40, config=cfg)
    split = study.split

    # the split: whole documents on each side, rows of those documents only
    pos = store.sql("SELECT example_id, document FROM positions").to_pandas().set_index("example_id")
    assert set(split.train_documents).isdisjoint(split.eval_documents)
    assert len(split.train_documents) + len(split.eval_documents) == pos["document"].nunique() == 12
    assert set(pos.loc[split.train_rows, "document"]) <= set(split.train_documents)
    assert set(pos.loc[split.eval_rows, "document"]) <= set(split.eval_documents)
    assert len(split.eval_rows) == min(40, pos["document"].isin(split.eval_documents).sum())

    model = tiny_model("llama").model
    held = corpus_residuals(store, split.eval_rows)
    want_kl, final_top = model_kl(model, held)
    np.testing.assert_allclose(study.kl_logit, want_kl, rtol=1e-5, atol=1e-7)
    assert study.kl_logit[-1] == 0 and study.kl_tuned[-1] == 0
    stored_top = store.sql(
        "SELECT top_token_id FROM targets WHERE example_id IN (SELECT unnest($ids)) ORDER BY example_id",
        {"ids": split.eval_rows.tolist()},
    ).column(0)
    assert final_top.tolist() == stored_top.to_pylist()

    # the tuned lens's KL, by a plain loop over rows and indices through the model's modules
    K = held.shape[1]
    tuned = np.zeros(K)
    for row in held:
        with torch.no_grad():
            logp_final = torch.log_softmax(
                model.lm_head(model.model.norm(torch.from_numpy(row[-1]))).double(), -1
            )
            for k in range(K - 1):
                hk = study.lens.translate_index(torch.from_numpy(row[k])[None], k)[0]
                logq = torch.log_softmax(model.lm_head(model.model.norm(hk)).double(), -1)
                tuned[k] += float((logp_final.exp() * (logp_final - logq)).sum())
    np.testing.assert_allclose(study.kl_tuned, tuned / len(held), rtol=1e-5, atol=1e-7)
    assert study.lens.info["loss_last"] < study.lens.info["loss_first"]  # training lowered the KL


def test_the_split_is_a_function_of_the_seed(tmp_path: Path) -> None:
    store = ingest(tmp_path)
    a = split_documents(store, 0.25, 1000, 1000, seed=0)
    b = split_documents(store, 0.25, 1000, 1000, seed=0)
    c = split_documents(store, 0.25, 1000, 1000, seed=1)
    assert np.array_equal(a.eval_documents, b.eval_documents)
    assert not np.array_equal(a.eval_documents, c.eval_documents)
    every = store.sql("SELECT example_id FROM positions WHERE document >= 0").column(0).to_numpy()
    assert np.array_equal(np.sort(np.concatenate([a.train_rows, a.eval_rows])), np.sort(every))


def test_refusals(tmp_path: Path) -> None:
    store = ingest(tmp_path, layers=(0, 1))  # not every residual index
    with pytest.raises(LensError, match="index 2 was not kept"):
        corpus_lens_study(store)
    target = actstore.ingest_corpus(tmp_path / "t", model="tiny-llama", dataset="demo", limit_per_relation=1)
    with pytest.raises(LensError, match="not a corpus store"):
        corpus_lens_study(target)
    with pytest.raises(LensError, match="held_out"):
        split_documents(store, 1.0, 10, 10, 0)


def test_the_command_records_its_run(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from actstore.cli import main

    store = ingest(tmp_path)
    args = ["corpus-lens", str(store.url), "--steps", "5", "--batch", "32", "--max-train-rows", "64"]
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 0, out.output
    assert "index  logit KL  tuned KL" in out.output
    s = actstore.open(tmp_path / "s")
    rows = s.sql("SELECT index, kl_logit, kl_tuned FROM corpus_lens ORDER BY index").to_pylist()
    assert [r["index"] for r in rows] == list(range(s.geometry.n_layers + 1))
    assert s.sql("SELECT count(*) FROM runs WHERE kind = 'corpus_lens'").column(0)[0].as_py() == 1
    bad = CliRunner().invoke(main, ["corpus-lens", str(store.url), "--held-out", "1.5"])
    assert bad.exit_code == 2 and "held-out" in bad.output
