"""Any direction decomposed on a corpus store with sources (``actstore dfa``).

The shares are checked against the store's own feature kinds (``attn_head_token``, ``attn_head`` and
``mlp``, themselves checked against an eager forward in tests/integration/ingest/test_corpus_sources.py)
and against the residual stream: sources + remainders + the attention biases + the MLPs at every layer
are ``u . (resid[L] - resid[0])``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import actstore
from actstore.cli import main
from actstore.core.errors import QueryError
from actstore.query.analyses.dfa import dfa_rows, dfa_top, load_direction

pytestmark = pytest.mark.usefixtures("one_thread")

DOCS = [
    "The cat sat on the mat.",
    "Paris is the capital of France and a large city on the river Seine, with many bridges.",
    "hello world",
    "Rome, Madrid and Lisbon are capitals too.",
]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> actstore.Store:
    d = tmp_path_factory.mktemp("dfa")
    docs = d / "docs.txt"
    docs.write_text("\n".join(DOCS) + "\n", encoding="utf-8")
    settings: dict[str, Any] = {
        "model": "tiny-llama",
        "dataset": f"text:{docs}",
        "positions": "all",
        "storage_dtype": "float32",
        "batch_size": 2,
        "segment_size": 8,
        "context_length": 9,
        "sources": "3",
    }
    return actstore.ingest_corpus(d / "s", **settings)


def test_shares_equal_the_features_and_the_residual_stream(store: actstore.Store, tmp_path: Path) -> None:
    g = store.geometry
    u = np.random.default_rng(1).standard_normal(g.d_model).astype(np.float32)
    np.save(tmp_path / "u.npy", u)
    assert np.array_equal(load_direction(store, str(tmp_path / "u.npy")), u)
    sel = store.select()
    rows = np.arange(len(sel))
    r = dfa_rows(store, rows, u)
    tok = sel.features("attn_head_token")  # [n, L, H, K, d]
    np.testing.assert_allclose(r.source, tok @ u, rtol=1e-4, atol=1e-5)
    head = sel.features("attn_head") @ u  # [n, L, H]
    np.testing.assert_allclose(r.source.sum(-1) + r.remainder, head, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(r.mlp, sel.features("mlp") @ u, rtol=1e-4, atol=1e-5)
    resid = sel.features("resid", layers=[0, g.n_layers]) @ u  # [n, 2]
    b_o = store.weight("b_O") @ u if store.has_weight("b_O") else np.zeros(g.n_layers)
    total = r.source.sum((2, 3)) + r.remainder.sum(2) + r.mlp + b_o
    np.testing.assert_allclose(total.sum(1), resid[:, 1] - resid[:, 0], rtol=1e-4, atol=1e-4)


def test_streamed_top_k_equals_brute_force(store: actstore.Store) -> None:
    u = load_direction(store, "token:5")
    rows = np.arange(store.manifest.n_examples)
    r = dfa_rows(store, rows, u)
    flat = np.abs(r.source).reshape(-1)
    want = np.sort(flat)[::-1][:7]
    for batch in (3, 1000):
        res = dfa_top(store, rows, u, k=7, batch_rows=batch)
        got = np.abs(res.terms.column("score").to_numpy())
        np.testing.assert_allclose(got, want, rtol=1e-6)
        t = res.totals.to_pandas()
        src = t[t.part == "sources"].sort_values(["layer", "head"])["total"].to_numpy()
        np.testing.assert_allclose(src, r.source.sum((0, 3)).reshape(-1), rtol=1e-5, atol=1e-6)
    # each term names its row, layer, head and source: its score is that source's share
    for t in res.terms.to_pylist():
        one = dfa_rows(store, [t["row"]], u, layers=[t["layer"]])
        slot = list(one.source_row[0, 0, t["head"]]).index(t["source_row"])
        assert one.source[0, 0, t["head"], slot] == pytest.approx(t["score"], rel=1e-6)


def test_directions(store: actstore.Store, tmp_path: Path) -> None:
    g = store.geometry
    np.testing.assert_array_equal(load_direction(store, "neuron:1:3"), store.weight("W_down", 1)[3])
    emb = store.weight("unembed") if store.has_weight("unembed") else store.weight("embed")
    tok = load_direction(store, "token:7")
    assert np.corrcoef(tok, emb[7])[0, 1] > 0.5  # the unembedding row times the final norm's weight
    dec = np.random.default_rng(0).standard_normal((6, g.d_model)).astype(np.float32)
    np.save(tmp_path / "sae.npy", dec)
    np.testing.assert_array_equal(load_direction(store, f"sae:{tmp_path / 'sae.npy'}:4"), dec[4])
    torch.save(
        {"encoder.weight": torch.from_numpy(dec), "decoder.weight": torch.from_numpy(dec.T.copy())},
        tmp_path / "ae.pt",
    )
    # read as dictionary_learning's from_pretrained reads it: the decoder column normalised, the encoder
    # row scaled by its norm
    n2 = np.linalg.norm(dec[2])
    np.testing.assert_allclose(load_direction(store, f"sae:{tmp_path / 'ae.pt'}:2"), dec[2] / n2, rtol=1e-6)
    np.testing.assert_allclose(
        load_direction(store, f"sae:{tmp_path / 'ae.pt'}:2:enc"), dec[2] * n2, rtol=1e-6
    )
    from safetensors.numpy import save_file

    lens = tmp_path / "saelens"
    lens.mkdir()
    (lens / "cfg.json").write_text(json.dumps({"d_in": g.d_model, "d_sae": 6}))
    save_file({"W_dec": dec, "W_enc": dec.T.copy()}, str(lens / "sae_weights.safetensors"))
    np.testing.assert_array_equal(load_direction(store, f"sae:{lens}:5"), dec[5])
    np.testing.assert_array_equal(load_direction(store, f"sae:{lens}:5:enc"), dec[5])


def tree_hash(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(path)).encode() + p.read_bytes())
    return h.hexdigest()


def test_cli_writes_a_run_and_bad_input_leaves_the_store(store: actstore.Store, tmp_path: Path) -> None:
    path = Path(store.url)
    np.save(tmp_path / "wide.npy", np.zeros(store.geometry.d_model + 1, np.float32))
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    before = tree_hash(path)
    for direction, words in (
        (str(tmp_path / "wide.npy"), "residual width"),
        (f"sae:{tmp_path / 'junk.pt'}:0", "checkpoint"),
        (f"sae:{tmp_path}:0", "not an SAE checkpoint"),
        ("neuron:0:100000", "out of range"),
        ("token:-1", "out of range"),
    ):
        res = CliRunner().invoke(main, ["dfa", str(path), "--direction", direction])
        assert res.exit_code != 0, direction
        err = res.stderr.strip()
        assert words in err and len(err.splitlines()) == 1, err
        assert tree_hash(path) == before
    res = CliRunner().invoke(main, ["dfa", str(path), "--direction", "token:3", "--k", "5", "--json"])
    assert res.exit_code == 0, res.stderr
    out = json.loads(res.stdout)
    assert len(out["terms"]) == 5
    runs = store.sql("SELECT run_id, kind FROM runs", format="pandas")
    assert out["run_id"] in set(runs[runs.kind == "dfa"].run_id)
    n = store.sql(f"SELECT count(*) FROM dfa_terms WHERE run_id = '{out['run_id']}'").column(0)[0].as_py()
    assert n == 5


def test_a_store_without_sources_is_refused(tmp_path: Path) -> None:
    docs = tmp_path / "docs.txt"
    docs.write_text("hello world\n", encoding="utf-8")
    s = actstore.ingest_corpus(tmp_path / "s", model="tiny-llama", dataset=f"text:{docs}", positions="all")
    with pytest.raises(QueryError, match="--sources"):
        dfa_rows(s, [0], np.zeros(s.geometry.d_model, np.float32))
    res = CliRunner().invoke(main, ["dfa", str(tmp_path / "s"), "--direction", "token:1"])
    assert res.exit_code != 0 and "--sources" in res.stderr
