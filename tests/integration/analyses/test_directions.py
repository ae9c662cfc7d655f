"""Every direction source of ``dfa``, ``topk --kind direction`` and the explorer's unit pages, in the
Python API, the command line and the explorer:

- a probe run's weights (``probe:STORE:RUN:RELATION:UNIT``), against a plain loop over the stored
  ``probe_weights`` rows;
- SAE rows from checkpoints written by the real packages' own save functions (sae-lens'
  ``save_model`` and ``save_inference_model``; dictionary_learning's ``AutoEncoder`` state dict saved
  with ``torch.save`` as its trainer does), against the packages' own loaders;
- a neuron's output weights, a token's unembedding through the final norm, a ``.npy`` row;
- a checkpoint that is not an SAE, and the other bad directions: one line, a non-zero exit, the
  store's files unchanged.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from serve_fixture import build_corpus_serve_store, build_serve_store, tree_hash

import actstore
from actstore.cli import main
from actstore.core.errors import QueryError
from actstore.query.analyses.dfa import dfa_top, load_direction

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> tuple[actstore.Store, actstore.Store, str]:
    """(a prompt store of tiny Llama with a probe run over attn_head, a corpus store of the same model
    with --sources 4, the probe run's id)."""
    prompt = actstore.open(build_serve_store(tmp_path_factory.mktemp("dir-prompt")))
    corpus = actstore.open(
        build_corpus_serve_store(tmp_path_factory.mktemp("dir-corpus"), docs=6, topk=False)
    )
    run = prompt.sql("SELECT run_id FROM probe_runs").column(0)[0].as_py()
    return prompt, corpus, run


def plain_probe_direction(
    prompt: actstore.Store, run: str, relation: str, layer: int, head: int
) -> np.ndarray:
    """The class's weight column minus the mean of the others, over std, summed feature by feature into
    the run's [L, H, d_model] attn_head vector (every layer and head), averaged over the episodes."""
    g = prompt.geometry
    eps = prompt.sql(
        "SELECT e.relations, w.n_way, w.features, w.std, w.weight FROM probe_episodes e, probe_weights w "
        f"WHERE e.run_id = w.run_id AND e.seed = w.seed AND e.episode = w.episode AND e.run_id = '{run}'"
    ).to_pylist()
    total = np.zeros((g.n_layers, g.n_heads, g.d_model))
    n = 0
    for e in eps:
        if relation not in e["relations"]:
            continue
        n += 1
        c, C = e["relations"].index(relation), e["n_way"]
        for i, f in enumerate(e["features"]):
            row = e["weight"][i * C : (i + 1) * C]
            others = sum(row[j] for j in range(C) if j != c) / (C - 1)
            lay, rest = divmod(f, g.n_heads * g.d_model)
            h, x = divmod(rest, g.d_model)
            total[lay, h, x] += (row[c] - others) / e["std"][i]
    assert n > 0
    return (total / n)[layer, head]


def test_a_probe_run_is_a_direction_in_the_api_cli_and_explorer(
    stores: tuple[actstore.Store, actstore.Store, str], tmp_path: Path
) -> None:
    prompt, corpus, run = stores
    spec = f"probe:{prompt.url}:{run}:P2:1.2"
    u = load_direction(corpus, spec)
    want = plain_probe_direction(prompt, run, "P2", 1, 2)
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(u, want, rtol=1e-4, atol=1e-6)
    # on its own store, without the path
    np.testing.assert_allclose(load_direction(prompt, f"probe:{run}:P2:1.2"), want, rtol=1e-4, atol=1e-6)
    # dfa: the command's run equals the API's top terms
    before = tree_hash(Path(corpus.url))
    res = CliRunner().invoke(main, ["dfa", corpus.url, "--direction", spec, "--k", "6", "--json"])
    assert res.exit_code == 0, res.stderr
    got = json.loads(res.stdout)
    rows = corpus.select().rows.column("row").to_numpy()
    api = dfa_top(corpus, rows, u, 6)
    assert [t["score"] for t in got["terms"]] == pytest.approx(
        api.terms.column("score").to_pylist(), rel=1e-5
    )
    # topk --kind direction on the residual: the top rows are numpy's
    res = CliRunner().invoke(
        main,
        [
            "topk",
            corpus.url,
            "--kind",
            "direction",
            "--layer",
            "2",
            "--direction",
            spec,
            "--k",
            "5",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.stderr
    proj = corpus.select().features("resid", layers=[2])[:, 0] @ u
    top = corpus.sql(
        "SELECT row FROM topk_contexts WHERE kind = 'direction' ORDER BY run_id DESC, rank LIMIT 5"
    ).column(0)
    assert top.to_pylist() == rows[np.lexsort((rows, -proj))[:5]].tolist()
    # the explorer: a named spec served as a direction unit
    from starlette.testclient import TestClient

    from actstore.serve.app import create_app
    from actstore.serve.catalog import Catalog
    from actstore.serve.corpus import load_direction_files

    dirs = load_direction_files([f"p2={spec}", "tok=token:7", "n=neuron:1:3"], corpus)
    c = TestClient(create_app(Catalog.open([corpus.url]), warm_up=False, directions=dirs))
    for name, vec in (
        ("p2", u),
        ("tok", load_direction(corpus, "token:7")),
        ("n", corpus.weight("W_down", 1)[3]),
    ):
        d = c.get(f"/api/s/corpus/units/direction/2/0?direction={name}&k=5").json()
        p = corpus.select().features("resid", layers=[2])[:, 0] @ vec
        assert [t["row"] for t in d["top"]] == rows[np.lexsort((rows, -p))[:5]].tolist(), name
        assert c.get(f"/s/corpus/unit/direction/2/0?direction={name}").status_code == 200
    c.close()
    assert tree_hash(Path(corpus.url)) != before  # dfa and topk recorded runs (the serve read only)


def test_bad_probe_directions_are_one_line(stores: tuple[actstore.Store, actstore.Store, str]) -> None:
    prompt, corpus, run = stores
    for spec, words in (
        (f"probe:{prompt.url}:nope:P2:1.2", "no probe run"),
        (f"probe:{prompt.url}:{run}:P9:1.2", "no stored episode"),
        (f"probe:{prompt.url}:{run}:P2", "add :LAYER"),
        (f"probe:{prompt.url}:{run}:P2:7.0", "no unit 7.0"),
        (f"probe:{run}:P2:0.0", "holds no probe runs"),
        ("neuron:1:3:in", "input weights"),
    ):
        with pytest.raises(QueryError) as e:
            load_direction(corpus, spec)
        assert words in str(e.value) and "\n" not in str(e.value), spec


def _sae_lens(tmp_path: Path, d: int) -> dict[str, tuple[Path, np.ndarray, np.ndarray]]:
    """SAELens checkpoints of width d written by save_model and save_inference_model, with the
    decoder [d_sae, d] and encoder [d_sae, d] rows as sae_lens's own loader reads them back."""
    with warnings.catch_warnings():  # sae_lens imports transformer_lens's deprecated utils
        warnings.simplefilter("ignore", DeprecationWarning)
        from sae_lens import (
            SAE,
            StandardSAE,
            StandardSAEConfig,
            StandardTrainingSAE,
            StandardTrainingSAEConfig,
        )

    torch.manual_seed(0)
    out = {}
    sae = StandardSAE(StandardSAEConfig(d_in=d, d_sae=24))
    with torch.no_grad():
        for p in sae.parameters():
            p.normal_()
    sae.save_model(tmp_path / "standard")
    train = StandardTrainingSAE(StandardTrainingSAEConfig(d_in=d, d_sae=24))
    with torch.no_grad():
        for p in train.parameters():
            p.normal_()
    train.save_inference_model(tmp_path / "inference")
    for name in ("standard", "inference"):
        back = SAE.load_from_disk(str(tmp_path / name), device="cpu")
        out[name] = (tmp_path / name, back.W_dec.detach().numpy(), back.W_enc.detach().numpy().T)
    return out


def test_sae_checkpoints_written_by_the_real_packages(
    stores: tuple[actstore.Store, actstore.Store, str], tmp_path: Path
) -> None:
    _, corpus, _ = stores
    d = corpus.geometry.d_model
    for name, (path, dec, enc) in _sae_lens(tmp_path, d).items():
        np.testing.assert_allclose(load_direction(corpus, f"sae:{path}:5"), dec[5], rtol=1e-6, err_msg=name)
        np.testing.assert_allclose(
            load_direction(corpus, f"sae:{path}:5:enc"), enc[5], rtol=1e-6, err_msg=name
        )
    from dictionary_learning import AutoEncoder

    torch.manual_seed(1)
    ae = AutoEncoder(d, 24)
    torch.save(ae.state_dict(), tmp_path / "ae.pt")  # as dictionary_learning's trainSAE saves it
    back = AutoEncoder.from_pretrained(str(tmp_path / "ae.pt"), device="cpu")
    np.testing.assert_allclose(
        load_direction(corpus, f"sae:{tmp_path / 'ae.pt'}:3"), back.decoder.weight[:, 3].detach().numpy()
    )
    np.testing.assert_allclose(
        load_direction(corpus, f"sae:{tmp_path / 'ae.pt'}:3:enc"), back.encoder.weight[3].detach().numpy()
    )
    # the command line and the explorer read the same rows
    res = CliRunner().invoke(
        main,
        [
            "dfa",
            corpus.url,
            "--direction",
            f"sae:{tmp_path / 'standard'}:5",
            "--k",
            "3",
            "--json",
            "--no-save",
        ],
    )
    assert res.exit_code == 0, res.stderr
    from actstore.serve.corpus import load_direction_files

    dirs = load_direction_files([f"s=sae:{tmp_path / 'ae.pt'}:3"], corpus)
    np.testing.assert_allclose(dirs["s"][0], back.decoder.weight[:, 3].detach().numpy())


def test_checkpoints_that_are_not_saes_are_one_line(
    stores: tuple[actstore.Store, actstore.Store, str], tmp_path: Path
) -> None:
    _, corpus, _ = stores
    d = corpus.geometry.d_model
    torch.save(torch.nn.Linear(d, 8).state_dict(), tmp_path / "linear.pt")
    from safetensors.torch import save_file

    folder = tmp_path / "notsae"
    folder.mkdir()
    (folder / "cfg.json").write_text(json.dumps({"d_in": d}))
    save_file(torch.nn.Linear(d, 8).state_dict(), str(folder / "sae_weights.safetensors"))
    (tmp_path / "text.pt").write_text("hello")
    (tmp_path / "wide").mkdir()
    wide = _sae_lens(tmp_path / "wide", d + 1)["standard"][0]  # an SAE of another model's width
    before = tree_hash(Path(corpus.url))
    for spec, words in (
        (f"sae:{tmp_path / 'linear.pt'}:0", "not a dictionary_learning checkpoint"),
        (f"sae:{folder}:0", "has no W_dec"),
        (f"sae:{tmp_path / 'text.pt'}:0", "not a readable checkpoint"),
        (f"sae:{tmp_path}:0", "not an SAE checkpoint"),
        (f"sae:{wide}:0", "residual width"),
        (f"sae:{tmp_path / 'wide' / 'inference'}:99", "out of range"),
    ):
        res = CliRunner().invoke(main, ["dfa", corpus.url, "--direction", spec])
        err = res.stderr.strip()
        assert res.exit_code != 0 and words in err and len(err.splitlines()) == 1, (spec, err)
    assert tree_hash(Path(corpus.url)) == before
