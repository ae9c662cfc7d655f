"""Method readings (probes, attention attribution, lenses), agreement figures, and the agree command."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import KNOWN_STORE_KW

import actstore
from actstore.query.methods.agreement import agreement
from actstore.query.methods.probe import LayerProbeConfig, probe_reading
from actstore.query.methods.readings import MethodReading, attention_reading, lens_reading, stored_outputs

STORE_KW = KNOWN_STORE_KW  # invented facts

pytestmark = pytest.mark.usefixtures("one_thread")


def _reading(method: str, keys: list[int], verdicts: list[str], L: int = 10) -> MethodReading:
    n = len(keys)
    profile = np.zeros((n, L))
    profile[np.arange(n), keys] = 1.0
    profile += np.linspace(0, 0.1, L)
    return MethodReading(
        method,
        np.arange(n, dtype=np.int64),
        profile,
        np.asarray(keys, np.int64),
        np.asarray(verdicts, dtype=object),
    )


def test_agreement_figures() -> None:
    a = _reading("trace", [2, 5, 7, 9], ["mlp", "mlp", "attn", "mlp"])
    b = _reading("patch", [2, 6, 3, 9], ["mlp", "attn", "attn", "mlp"])
    c = _reading("probe", [2, 5, 7, 0], ["", "", "", ""])
    res = agreement([a, b, c], tolerance=1)
    pairs = {(p["method_a"], p["method_b"]): p for p in res["pairs"]}
    ab = pairs[("trace", "patch")]
    assert ab["key_layer_agreement"] == 0.75 and ab["key_layer_exact"] == 0.5
    assert ab["verdict_agreement"] == 0.75 and ab["n_verdict"] == 4
    assert ab["paper_key_layer"] == 0.825
    # against chance, no strata: the 16 (trace, patch) key pairs, 5 within one layer
    # ((2,2), (2,3), (5,6), (7,6), (9,9)): chance 5/16, excess 3/4 - 5/16, kappa (3/4 - 5/16) / (11/16)
    assert ab["key_layer_chance"] == pytest.approx(5 / 16)
    assert ab["key_layer_excess"] == pytest.approx(7 / 16) and ab["key_layer_kappa"] == pytest.approx(7 / 11)
    # with each fact its own stratum, every shuffle is the identity: chance = observed
    own = agreement([a, b], tolerance=1, strata={i: str(i) for i in range(4)}, resamples=100)
    assert (
        own["pairs"][0]["key_layer_chance"] == pytest.approx(0.75)
        and own["pairs"][0]["key_layer_excess"] == 0
    )
    assert (
        pairs[("trace", "probe")]["n_verdict"] == 0 and pairs[("trace", "probe")]["verdict_agreement"] is None
    )
    # all three within 1 layer: fact 0 (2,2,2) and fact 1 (5,6,5); not fact 2 (7,3,7) nor fact 3 (9,9,0)
    assert res["consensus"] == 0.5 and res["consensus_facts"] == 4
    same = agreement([a, _reading("patch", [2, 5, 7, 9], ["mlp"] * 4)], tolerance=0)
    assert same["pairs"][0]["profile_correlation"] == pytest.approx(1.0)


def test_attention_reading_and_additivity(store_factory: Callable[..., Path]) -> None:
    store = actstore.open(store_factory("llama", **STORE_KW))
    ids = store.sql("SELECT example_id FROM examples ORDER BY 1").column("example_id").to_numpy()
    out = stored_outputs(store, ids)
    assert out.additive  # Llama: resid_{l+1} - resid_l = attn_l + mlp_l
    r = attention_reading(store, out)
    A = store.select().features("attn_prob")  # [n, L, H, S]
    spans = store.sql("SELECT subject_start, subject_end FROM examples ORDER BY example_id").to_pylist()
    manual = np.stack(
        [A[i, :, :, s["subject_start"] : s["subject_end"]].sum(-1).max(-1) for i, s in enumerate(spans)]
    )
    np.testing.assert_allclose(r.profile, manual, rtol=1e-6)
    assert ((r.profile >= 0) & (r.profile <= 1 + 1e-6)).all()
    assert set(r.verdict) <= {"mlp", "attn"}
    lens = lens_reading(store, out)
    assert lens.profile.shape == (ids.size, store.geometry.n_layers) and set(lens.verdict) <= {"mlp", "attn"}


def test_gemma_sublayers_are_not_additive(store_factory: Callable[..., Path]) -> None:
    """Gemma 3 normalises each sublayer's output before adding it: lens/probe verdicts are undefined there."""
    store = actstore.open(store_factory("gemma3", **STORE_KW))
    ids = store.sql("SELECT example_id FROM examples ORDER BY 1").column("example_id").to_numpy()
    out = stored_outputs(store, ids)
    assert not out.additive
    assert set(lens_reading(store, out).verdict) == {""}


def test_probe_reading(store_factory: Callable[..., Path]) -> None:
    store = actstore.open(store_factory("llama", **STORE_KW))
    ids = store.sql("SELECT example_id FROM examples ORDER BY 1").column("example_id").to_numpy()
    out = stored_outputs(store, ids)
    r, summary = probe_reading(store, out, LayerProbeConfig(min_count=2, folds=2, steps=20))
    L = store.geometry.n_layers
    assert summary["classes"] >= 2 and len(summary["accuracy_per_index"]) == L + 1
    assert r.profile.shape == (summary["evaluated_facts"], L)
    assert set(r.verdict) <= {"mlp", "attn"} and ((r.key_layer >= 0) & (r.key_layer < L)).all()


def test_cli_agree_end_to_end(store_factory: Callable[..., Path], tmp_path: Path) -> None:
    from actstore.cli import main

    path = str(store_factory("llama", **STORE_KW))
    cli = CliRunner()
    common = ["--model", "tiny-llama", path, "--quiet"]
    res = cli.invoke(
        main,
        [
            "trace",
            *common,
            "--all-facts",
            "--limit",
            "3",
            "--samples",
            "1",
            "--window",
            "2",
            "--figures",
            str(tmp_path),
        ],
    )
    assert res.exit_code == 0, res.output
    assert (tmp_path / "trace_average.png").exists()
    res = cli.invoke(main, ["patch", *common, "--pair", "0:1", "--pair", "5:8"])
    assert res.exit_code == 0, res.output
    res = cli.invoke(
        main,
        [
            "agree",
            path,
            "--quiet",
            "--json",
            "--probe-min-count",
            "2",
            "--probe-folds",
            "2",
            "--figures",
            str(tmp_path),
        ],
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert len(out["pairs"]) == 15 and out["tolerance"] == 1
    assert out["n_facts"]["trace"] == 3 and out["n_facts"]["patch"] == 2
    assert 0 <= out["causal_shares"]["trace_mlp_share"] <= 1
    s = actstore.open(path)
    t = s.sql(
        f"SELECT method, count(*) AS n FROM method_readings WHERE run_id = '{out['run_id']}' "
        "GROUP BY 1 ORDER BY 1"
    ).to_pylist()
    assert {r["method"] for r in t} == {"trace", "patch", "probe", "attention", "logit_lens", "tuned_lens"}
    bad = cli.invoke(main, ["agree", path, "--run", "nope"])
    assert bad.exit_code == 1 and "no run 'nope'" in bad.stderr
    assert out["null_grouping"] == "relation"  # (no methods2k strata in this store: its relations)
    flat = cli.invoke(
        main,
        [
            "agree",
            path,
            "--quiet",
            "--json",
            "--methods",
            "trace,patch",
            "--null-grouping",
            "none",
            "--permutations",
            "20",
            "--no-save",
        ],
    )
    assert flat.exit_code == 0, flat.output
    assert json.loads(flat.stdout)["null_grouping"] == ""


def test_key_layer_is_the_middle_of_the_peak_plateau() -> None:
    from actstore.query.methods.readings import key_layer

    p = np.array([0.0, 0.1, 0.95, 1.0, 0.97, 0.96, 0.2, 0.0])
    assert key_layer(p, 1.0) == 3  # plain argmax
    assert key_layer(p, 0.9) == 3  # plateau 2..5 -> middle 3
    flat = np.array([0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0])  # a window smearing one layer over five
    assert key_layer(flat, 0.9) == 3
    assert key_layer(np.array([np.nan, np.nan]), 0.9) == -1
