"""Logit lens and tuned lens over the stored residual stream."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import KNOWN_STORE_KW

import actstore
from actstore.ingest.models.tiny import tiny_model
from actstore.query.analyses.lens import (
    FinalReadout,
    LensError,
    TunedLens,
    lens_study,
    read_objects,
    split_facts,
    stored_residuals,
)

STORE_KW = KNOWN_STORE_KW  # invented facts

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_logit_lens_at_the_last_layer_is_the_models_output(
    arch: str, store_factory: Callable[..., Path]
) -> None:
    """Stored resid at index L through the stored final norm and unembedding = the model's logits."""
    store = actstore.open(store_factory(arch, **STORE_KW))
    ids = store.sql("SELECT example_id FROM targets ORDER BY 1").column("example_id").to_numpy()
    resid, obj, top = stored_residuals(store, ids)
    reading = read_objects(FinalReadout.from_store(store), resid, obj)
    np.testing.assert_array_equal(reading.top[:, -1], top)
    lp = store.sql("SELECT object_logprob, object_rank FROM targets ORDER BY example_id").to_pandas()
    np.testing.assert_allclose(np.log(reading.prob[:, -1]), lp["object_logprob"], rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(reading.rank[:, -1], lp["object_rank"])
    # ... and the model's own logits, recomputed.
    loaded = tiny_model(arch)
    toks = (
        store.sql(
            "SELECT list(token_id ORDER BY position) AS ids FROM tokens GROUP BY example_id "
            "ORDER BY example_id"
        )
        .column("ids")
        .to_pylist()
    )
    with torch.no_grad():
        ref = loaded.model(input_ids=torch.tensor([toks[0]])).logits[0, -1]
    got = FinalReadout.from_store(store).logits(torch.as_tensor(resid[0, -1]))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_tuned_lens_recovers_an_affine_map() -> None:
    rng = np.random.default_rng(0)
    n, d = 200, 8
    X = rng.normal(size=(n, d))
    A = np.eye(d) + 0.3 * rng.normal(size=(d, d))
    Y = X @ A + rng.normal(size=d)
    resid = np.stack([X, Y], axis=1).astype(np.float32)  # [n, 2, d]: index 0 and the last index
    lens = TunedLens.fit_ridge(resid, alphas=(1e-9,))
    pred = lens.translate(resid)
    np.testing.assert_allclose(pred[:, 0].numpy(), Y, atol=1e-3)
    np.testing.assert_array_equal(pred[:, 1].numpy(), resid[:, 1])  # the last index is not translated
    shrunk = TunedLens.fit_ridge(
        resid, alphas=(1e6,)
    )  # a huge ridge: the translator is the identity plus a shift
    assert float(shrunk.D.abs().max()) < 1e-3


def test_lens_study_holds_facts_out(store_factory: Callable[..., Path]) -> None:
    store = actstore.open(store_factory("llama", **STORE_KW))
    ids = store.sql("SELECT example_id FROM targets ORDER BY 1").column("example_id").to_numpy()
    train, held = split_facts(ids, 0.6, seed=1)
    assert not np.intersect1d(train, held).size and np.union1d(train, held).size == ids.size
    study, lens = lens_study(store, held, train)
    assert study.tuned is not None and lens is not None
    L = store.geometry.n_layers
    assert study.logit.prob.shape == study.tuned.prob.shape == (held.size, L + 1)
    np.testing.assert_allclose(study.tuned.prob[:, -1], study.logit.prob[:, -1])  # index L: no translator
    with pytest.raises(LensError, match="both training and evaluation"):
        lens_study(store, held, ids)
    with pytest.raises(LensError, match="too few"):
        split_facts(ids[:3], 0.5)


def test_cli_lens_json(store_factory: Callable[..., Path], tmp_path: Path) -> None:
    from actstore.cli import main

    path = store_factory("llama", **STORE_KW)
    res = CliRunner().invoke(
        main, ["lens", str(path), "--json", "--train-fraction", "0.6", "--figures", str(tmp_path)]
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    L = actstore.open(path).geometry.n_layers
    assert len(out["per_index"]) == L + 1 and out["final_index_matches_model"] == 1.0
    assert {"logit_prob", "tuned_prob", "logit_rank_median", "tuned_top1"} <= set(out["per_index"][0])
    assert (tmp_path / "lens_curves.png").stat().st_size > 0
    n = (
        actstore.open(path)
        .sql(f"SELECT count(*) AS n FROM lens WHERE run_id = '{out['run_id']}'")
        .column("n")[0]
    )
    assert n.as_py() == 2 * out["n_eval"] * (L + 1)
