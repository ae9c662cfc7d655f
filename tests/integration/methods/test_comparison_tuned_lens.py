"""The method comparison's tuned lens (issue 18): trained with Adam on the KL by default, the ridge fit
an option, in ``actstore agree`` and the study's readings alike; checked against a lens trained here by
calling ``train_tuned_lens`` directly on the facts not compared, read from the store independently."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import KNOWN_STORE_KW, tiny_text_corpus

import actstore
from actstore.core.errors import ActstoreError, InvalidSetting
from actstore.jobs.settings import AgreeConfig
from actstore.query.analyses.lens import FinalReadout, LensError, TunedLens
from actstore.query.analyses.tuned_lens import TrainConfig, train_tuned_lens
from actstore.query.methods.readings import (
    MethodReading,
    StoredOutputs,
    lens_reading,
    stored_outputs,
    tuned_lens_reading,
)
from actstore.query.methods.study import study_readings

STORE_KW = {**KNOWN_STORE_KW, "limit": 6}  # a store of this module's own (it adds a trace run)
CFG = TrainConfig(steps=12, batch=4, seed=3)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def traced(store_factory: Callable[..., Path]) -> tuple[str, str]:
    """(store path, trace run id) of 3 traced facts."""
    from actstore.cli import main

    path = str(store_factory("llama", **STORE_KW))
    res = CliRunner().invoke(
        main,
        [
            "trace",
            "--model",
            "tiny-llama",
            path,
            "--quiet",
            "--all-facts",
            "--limit",
            "3",
            "--samples",
            "1",
            "--window",
            "2",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    return path, json.loads(res.stdout)["run_id"]


def _direct(store: Any, compared: np.ndarray, method: str) -> tuple[TunedLens, int]:
    """A lens fit here on every fact with an object token that is not compared, its residuals read
    through ``store.select`` (not the library's ``stored_residuals``)."""
    ids = np.asarray(
        store.sql("SELECT example_id FROM targets WHERE object_token_id >= 0 ORDER BY 1")
        .column("example_id")
        .to_pylist(),
        dtype=np.int64,
    )
    train = ids[~np.isin(ids, compared)]
    sel = store.select(f"example_id IN ({', '.join(str(int(i)) for i in train)})")
    assert np.array_equal(sel.example_ids, train)
    resid = sel.features("resid")
    if method == "ridge":
        return TunedLens.fit_ridge(resid, seed=CFG.seed), train.size
    return train_tuned_lens(FinalReadout.from_store(store), resid, replace(CFG, optimizer=method)), train.size


def _same(a: MethodReading, b: MethodReading) -> None:
    np.testing.assert_allclose(a.profile, b.profile, rtol=1e-5, atol=1e-7)
    assert np.array_equal(a.key_layer, b.key_layer) and list(a.verdict) == list(b.verdict)


def _agree(path: str, run: str, *args: str) -> Any:
    """``actstore agree`` on ``run``'s facts with the trace and the tuned lens."""
    from actstore.cli import main

    return CliRunner().invoke(main, ["agree", path, "--run", run, "--methods", "trace,tuned_lens", *args])


def _outputs(store: Any, run: str) -> StoredOutputs:
    ids = store.sql("SELECT DISTINCT example_id FROM trace_effects WHERE run_id = ? ORDER BY 1", [run])
    return stored_outputs(store, ids.column("example_id").to_numpy())


@pytest.mark.parametrize("method", ["adam", "sgd"])
def test_comparison_lens_equals_a_lens_trained_directly(traced: tuple[str, str], method: str) -> None:
    path, run = traced
    store = actstore.open(path)
    out = _outputs(store, run)
    got = tuned_lens_reading(store, out, method, CFG)
    lens, n_train = _direct(store, out.example_ids, method)
    _same(got, lens_reading(store, out, lens))
    assert (
        got.method == "tuned_lens"
        and got.info["method"] == method
        and got.info["label"] == f"tuned lens ({method})"
    )
    assert got.info["train_facts"] == n_train >= 5
    assert (
        got.info["config"]["steps"] == 12
        and got.info["config"]["batch"] == 4
        and got.info["config"]["seed"] == 3
    )
    # the training moved the translators: the reading is not the logit lens's
    assert not np.allclose(got.profile, lens_reading(store, out).profile, atol=1e-6)


def test_ridge_is_reachable_and_differs(traced: tuple[str, str]) -> None:
    path, run = traced
    store = actstore.open(path)
    out = _outputs(store, run)
    ridge = tuned_lens_reading(store, out, "ridge", CFG)
    lens, _ = _direct(store, out.example_ids, "ridge")
    _same(ridge, lens_reading(store, out, lens))
    assert ridge.info["method"] == "ridge" and ridge.info["config"]["alphas"] == lens.alphas
    adam = tuned_lens_reading(store, out, "adam", CFG)
    assert not np.allclose(ridge.profile, adam.profile, atol=1e-6)


def test_study_readings_and_agree_read_the_same_trained_lens(traced: tuple[str, str]) -> None:

    path, run = traced
    store = actstore.open(path)
    out = _outputs(store, run)
    lens, n_train = _direct(store, out.example_ids, "adam")
    want = lens_reading(store, out, lens)
    got = study_readings(store, ["trace", "tuned_lens"], [run], tuned="adam", tuned_config=CFG)
    _same(got["tuned_lens"], want)
    assert got["tuned_lens"].info["train_facts"] == n_train
    # the command line: --tuned adam with --tuned-steps / --tuned-batch / --seed, recorded with the run
    res = _agree(
        path,
        run,
        "--quiet",
        "--json",
        "--tuned",
        "adam",
        "--tuned-steps",
        "12",
        "--tuned-batch",
        "4",
        "--seed",
        "3",
    )
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    assert r["tuned_lens"]["method"] == "adam" and r["tuned_lens"]["train_facts"] == n_train
    assert (r["tuned_lens"]["config"]["steps"], r["tuned_lens"]["config"]["batch"]) == (12, 4)
    t = store.sql(
        "SELECT example_id, key_layer, verdict FROM method_readings WHERE run_id = ? "
        "AND method = 'tuned_lens' ORDER BY example_id",
        [r["run_id"]],
    ).to_pydict()
    assert t["example_id"] == out.example_ids.tolist()
    assert t["key_layer"] == want.key_layer.tolist() and t["verdict"] == list(want.verdict)
    cfg = json.loads(
        store.sql("SELECT config FROM runs WHERE run_id = ?", [r["run_id"]]).column("config")[0].as_py()
    )
    assert cfg["tuned_lens"]["method"] == "adam" and cfg["tuned_lens"]["config"]["batch"] == 4
    # the table names the lens with its rule
    text = _agree(path, run, "--quiet", "--no-save", "--tuned", "ridge")
    assert text.exit_code == 0, text.output
    assert "trace vs tuned lens (ridge)" in text.stdout and "tuned lens (adam)" not in text.stdout


def test_a_wrong_method_name_is_one_clear_error(traced: tuple[str, str]) -> None:
    from actstore.cli import main

    path, run = traced
    store = actstore.open(path)
    out = _outputs(store, run)
    for call in (
        lambda: tuned_lens_reading(store, out, "adamw"),
        lambda: study_readings(store, ["trace", "tuned_lens"], [run], tuned="adamw"),
    ):
        with pytest.raises(LensError, match="unknown tuned-lens method 'adamw'") as e:
            call()
        assert isinstance(e.value, ActstoreError)
    with pytest.raises(InvalidSetting, match="tuned: unknown tuned-lens method 'adamw'"):
        AgreeConfig(tuned="adamw")
    res = CliRunner().invoke(main, ["agree", path, "--tuned", "adamw"])
    assert res.exit_code == 2  # a refused setting is a usage error (tests/cli/cli/test_exit_codes.py)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "--tuned" in lines[0] and "adamw" in lines[0]


def test_agree_reads_the_translators_a_corpus_lens_run_stored(
    traced: tuple[str, str], tmp_path: Path
) -> None:
    """``--tuned corpus:STORE``: the facts read through the translators trained on a corpus store of
    the same model, as stored by ``actstore corpus-lens``; compared with a reading through the
    trained lens object itself (not read back from the table)."""
    from actstore.jobs.corpus_lens import run_corpus_lens
    from actstore.jobs.settings import CorpusLensConfig

    path, run = traced
    store = actstore.open(path)
    out = _outputs(store, run)
    corpus = tiny_text_corpus(tmp_path / "corpus")
    first = run_corpus_lens(corpus, CorpusLensConfig(steps=4, batch=16, max_train_rows=48))
    second = run_corpus_lens(corpus, CorpusLensConfig(steps=6, batch=16, max_train_rows=48, seed=5))
    assert first.lens is not None and second.lens is not None
    spec = f"corpus:{corpus.url}"
    got = tuned_lens_reading(store, out, spec)
    _same(got, lens_reading(store, out, second.lens))  # the newest run by default
    pinned = tuned_lens_reading(store, out, f"{spec}#{first.run_id}")
    _same(pinned, lens_reading(store, out, first.lens))
    assert not np.allclose(got.profile, pinned.profile, atol=1e-6)
    assert got.info["method"] == "corpus" and got.info["run_id"] == second.run_id
    assert got.info["train_positions"] == 48 and got.info["label"] == "tuned lens (corpus)"
    # the command line: recorded with the run, the table names the lens
    res = _agree(path, run, "--quiet", "--json", "--tuned", spec)
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    assert r["tuned_lens"]["run_id"] == second.run_id
    t = store.sql(
        "SELECT key_layer FROM method_readings WHERE run_id = ? AND method = 'tuned_lens' ORDER BY example_id",
        [r["run_id"]],
    ).column("key_layer")
    assert t.to_pylist() == lens_reading(store, out, second.lens).key_layer.tolist()
    text = _agree(path, run, "--quiet", "--no-save", "--tuned", spec)
    assert text.exit_code == 0 and "trace vs tuned lens (corpus)" in text.stdout, text.output
    # the printed table has each pair's agreement beside its chance level, as the JSON gives them
    pair = r["pairs"][0]
    lines = text.stdout.splitlines()
    below = lines[next(i for i, x in enumerate(lines) if x.startswith("against chance")) :]
    row = next(x for x in below if x.startswith("trace vs tuned lens (corpus)")).split()
    assert row[5] == f"{100 * pair['key_layer_agreement']:.1f}%"
    assert row[6] == f"{100 * pair['key_layer_chance']:.1f}%"
    assert row[7] == f"{100 * pair['key_layer_excess']:+.1f}"
    # refusals, one line each: no such run, a store without translators, another model, no store named
    for bad, why in (
        (f"{spec}#corpus_lens-nope", "no corpus-lens run"),
        (f"corpus:{path}", "no stored translators"),
        ("corpus:", "unknown tuned-lens method"),
        (f"corpus:{tmp_path / 'absent'}", "--tuned corpus:"),
    ):
        res = _agree(path, run, "--quiet", "--tuned", bad)
        assert res.exit_code != 0 and why in res.stderr, (bad, res.output)
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    other = tiny_text_corpus(tmp_path / "gpt2", model="tiny-gpt2")
    run_corpus_lens(other, CorpusLensConfig(steps=2, batch=8, max_train_rows=16))
    with pytest.raises(LensError, match="hold different models"):
        tuned_lens_reading(store, out, f"corpus:{other.url}")
