"""Defaults that follow a published method, each held to it by a test that fails if the default drifts.

MAPS (Elhelo & Geva 2025; the authors' code, github.com/amitelhelo/MAPS): a multi-token pair never enters a
default score, a relation below 30 usable pairs never enters a summary, k is 1 for copying relations and 10
otherwise, and layers >= 1 read the first MLP's output.  The relational-probing seed (000): the HeadScore
concentration groups predictions by the class the probe predicted (a wrongly predicted row never enters its
gold relation's concentration), both readings of the contrast dW against numpy, ``--no-relspec`` uses every
feature, and the output range counts every instance of the data set file, object-first ones included.

The references are written here (numpy, float64 matrices from the tiny model's modules) or taken from
tests/integration/analyses/test_oracles_probe.py's independent probe reference (numpy RelSpec, autograd contrast, plain
``nn.Linear`` training), which calls none of the library's selection, attribution or unit bookkeeping.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import test_oracles_probe as oracle
import torch
from click.testing import CliRunner
from helpers import FIXTURES, build_store

import actstore
from actstore.cli import main
from actstore.ingest.models.tiny import tiny_model
from actstore.jobs.probe import record_probe
from actstore.query.analyses.probe import ProbeConfig, run_probe

pytestmark = pytest.mark.usefixtures("one_thread")

# The independent probe reference and its fixtures (a spy on the library's trainer, private store copies).
spy = oracle.spy
open_copy = oracle.open_copy
store_paths = oracle.store_paths

FEWREL_FIXTURE = FIXTURES / "fewrel" / "val_wiki.json"


# ----------------------------------------------------------------------------------- MAPS pairs


def tiny_words() -> tuple[list[str], list[str]]:
    """Words that are one token of the tiny tokenizer with a leading space, and words that are several."""
    tok = tiny_model("llama").tokenizer
    vocab = sorted(w[1:] for w in tok.get_vocab() if w.startswith("Ġ") and len(w) > 3 and w[1:].isalpha())
    single = [w for w in vocab if len(tok(" " + w, add_special_tokens=False)["input_ids"]) == 1]
    multi = [
        w
        for w in (
            "Germany",
            "Berlin",
            "Portugal",
            "Lisbon",
            "Brazil",
            "Japanese",
            "Spain",
            "Madrid",
            "mountain",
            "bridges",
        )
        if len(tok(" " + w, add_special_tokens=False)["input_ids"]) > 1
    ]
    assert len(single) >= 32 and len(multi) >= 8
    return single, multi


def write_pairs(root: Path, relation: str, pairs: list[tuple[str, str]]) -> None:
    d = root / relation
    d.mkdir(parents=True)
    (d / f"{relation}.json").write_text(json.dumps([list(p) for p in pairs]))


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[tuple[str, str]]]]:
    """Three relations: ``word_shift`` (32 single-token pairs, k = 10) and ``word_copying`` (31, a copying
    relation: k = 1), each with multi-token pairs mixed in, and ``few_shift`` with 29 single-token pairs
    (one below the authors' minimum of 30) and many multi-token ones."""
    single, multi = tiny_words()
    n = len(single)
    rels = {
        "word_shift": [(single[i], single[(i + 1) % n]) for i in range(32)]
        + [(multi[i], single[i]) for i in range(4)]
        + [(single[i], multi[i + 4]) for i in range(4)],
        "word_copying": [(w, w) for w in single[:31]] + [(w, w) for w in multi[:6]],
        "few_shift": [(single[i], single[(i + 3) % n]) for i in range(29)] + [(m, m) for m in multi],
    }
    root = tmp_path_factory.mktemp("pairs")
    for name, pairs in rels.items():
        write_pairs(root, name, pairs)
    return root, rels


def brute_phi(
    model: Any, pairs: list[tuple[str, str]], k: int, first_mlp: bool, only_single: bool
) -> np.ndarray:
    """phi_R of every head, float64 from the model's modules: M = S W_V W_O (diag(w) U)^T with S the
    embeddings at layer 0 and MLP0(post_attention_norm(E)) at layers >= 1; first tokens of " " + word."""
    tok = tiny_model("llama").tokenizer
    ids = [
        (
            tok(" " + a, add_special_tokens=False)["input_ids"],
            tok(" " + b, add_special_tokens=False)["input_ids"],
        )
        for a, b in pairs
    ]
    if only_single:
        ids = [(a, b) for a, b in ids if len(a) == 1 and len(b) == 1]
    src = torch.tensor([a[0] for a, _ in ids])
    dst = torch.tensor([b[0] for _, b in ids])
    cfg = model.config
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    dh = cfg.hidden_size // H
    E = model.model.embed_tokens.weight.detach().double()
    with torch.no_grad():
        block = model.model.layers[0]
        eff = block.mlp(block.post_attention_layernorm(model.model.embed_tokens.weight)).double()
    U = model.lm_head.weight.double() * model.model.norm.weight.double()
    out = np.zeros((cfg.num_hidden_layers, H))
    for layer in range(cfg.num_hidden_layers):
        S = (eff if first_mlp and layer > 0 else E)[src]
        attn = model.model.layers[layer].self_attn
        for h in range(H):
            kv = h // (H // Hkv)
            W_vo = (
                attn.v_proj.weight.double()[kv * dh : (kv + 1) * dh].T
                @ attn.o_proj.weight.double()[:, h * dh : (h + 1) * dh].T
            )
            rows = S @ W_vo @ U.T
            val = rows[torch.arange(len(dst)), dst][:, None]
            out[layer, h] = float(((rows > val).sum(1) < k).double().mean())
    return out


def grid(heads: list[dict[str, Any]], key: str = "score") -> np.ndarray:
    L = 1 + max(h["layer"] for h in heads)
    H = 1 + max(h["head"] for h in heads)
    g = np.zeros((L, H))
    for h in heads:
        g[h["layer"], h["head"]] = h[key]
    return g


def test_maps_default_is_the_authors_method(
    pair_dir: tuple[Path, dict[str, list[tuple[str, str]]]],
    store_factory: Callable[..., Path],
    tmp_path: Path,
) -> None:
    """`actstore maps` with no options: single-token pairs only, the authors' k per relation (1 for copying,
    10 otherwise), layers >= 1 through the first MLP; each equals a float64 brute force, and each
    alternative (first tokens of multi-token words, k = 10 for copying, the raw embeddings) differs."""
    root, rels = pair_dir
    store = store_factory("llama", limit=1)
    r = CliRunner().invoke(
        main,
        [
            "maps",
            str(store),
            "--pairs",
            str(root),
            "--salient-heads",
            "none",
            "--json",
            "--figures",
            str(tmp_path / "fig"),
        ],
    )
    assert r.exit_code == 0, r.output + str(r.stderr)
    out = json.loads(r.stdout)
    assert out["first_mlp"] is True and out["multi_token"] == "skip" and out["k_policy"] == "paper"
    got = {x["relation"]: x for x in out["relations"]}
    assert set(got) == {"word_shift", "word_copying"}
    model = tiny_model("llama").model
    tok = tiny_model("llama").tokenizer
    changed = {"multi": False, "k": False, "mlp": False}
    for name, k in (("word_shift", 10), ("word_copying", 1)):
        x = got[name]
        single = sum(
            len(tok(" " + a, add_special_tokens=False)["input_ids"]) == 1
            and len(tok(" " + b, add_special_tokens=False)["input_ids"]) == 1
            for a, b in rels[name]
        )
        assert x["k"] == k and x["n_pairs"] == len(rels[name])
        want = brute_phi(model, rels[name], k, first_mlp=True, only_single=True)
        np.testing.assert_allclose(grid(x["heads"]), want, atol=1e-12)
        assert x["n_used"] == (32 if name == "word_shift" else 31) == single
        assert x["n_skipped_multi_token"] == len(rels[name]) - x["n_used"] and x["n_multi_token"] == 0
        changed["multi"] |= not np.array_equal(want, brute_phi(model, rels[name], k, True, only_single=False))
        changed["mlp"] |= not np.array_equal(want, brute_phi(model, rels[name], k, False, only_single=True))
        if name == "word_copying":
            changed["k"] = not np.array_equal(want, brute_phi(model, rels[name], 10, True, only_single=True))
    assert all(changed.values()), changed  # so each part of the default is really checked


def test_maps_relation_below_minimum_enters_no_summary(
    pair_dir: tuple[Path, dict[str, list[tuple[str, str]]]],
    store_factory: Callable[..., Path],
    tmp_path: Path,
) -> None:
    root, rels = pair_dir
    src = store_factory("llama", limit=1)
    store = tmp_path / "store"
    shutil.copytree(src, store)
    fig = tmp_path / "fig"
    r = CliRunner().invoke(
        main,
        [
            "maps",
            str(store),
            "--pairs",
            str(root),
            "--salient-heads",
            "none",
            "--json",
            "--figures",
            str(fig),
        ],
    )
    assert r.exit_code == 0, r.output + str(r.stderr)
    out = json.loads(r.stdout)
    assert [x["relation"] for x in out["relations"]] == ["word_copying", "word_shift"]
    (ex,) = out["excluded"]
    assert ex["relation"] == "few_shift" and ex["n_used"] == 29 and ex["n_pairs"] == len(rels["few_shift"])
    assert ex["min_pairs"] == 30
    assert not any("few_shift" in p for p in out["heatmaps"]) and not any(
        "few_shift" in p.name for p in fig.iterdir()
    )
    s = actstore.open(store)
    run = out["run_id"]
    for table in ("maps_scores", "maps_relations"):
        names = set(
            s.sql(f"SELECT DISTINCT relation FROM {table} WHERE run_id = '{run}'").column(0).to_pylist()
        )
        assert names == {"word_copying", "word_shift"}, table
    row = s.sql(f"SELECT relation, n_used, n_pairs FROM maps_excluded WHERE run_id = '{run}'").to_pylist()
    assert row == [{"relation": "few_shift", "n_used": 29, "n_pairs": len(rels["few_shift"])}]
    # The text output: no table row for it, one line naming it with its count.
    r = CliRunner().invoke(
        main, ["maps", str(store), "--pairs", str(root), "--salient-heads", "none", "--no-save"]
    )
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert [ln for ln in lines if "few_shift" in ln] == [
        f"excluded, fewer than 30 usable pairs (usable/pairs): few_shift 29/{len(rels['few_shift'])}"
    ]
    # At the minimum it is in: 29 usable pairs pass --min-pairs 29.
    r = CliRunner().invoke(
        main,
        [
            "maps",
            str(store),
            "--pairs",
            str(root),
            "--salient-heads",
            "none",
            "--no-save",
            "--min-pairs",
            "29",
            "--json",
        ],
    )
    assert {x["relation"] for x in json.loads(r.stdout)["relations"]} == set(rels)


def test_maps_dynamic_uses_single_token_prompts_and_excludes(
    pair_dir: tuple[Path, dict[str, list[tuple[str, str]]]], tmp_path: Path
) -> None:
    """maps-dynamic: a prompt whose subject or object is several tokens never enters a correlation, and a
    relation below 30 usable pairs is excluded (counted in its pair file with --pairs)."""
    root, rels = pair_dir
    lines = []
    for name in ("word_shift", "few_shift"):
        for s, o in rels[name]:
            lines.append(
                {
                    "text": f"This is a document about {s}",
                    "subject": s,
                    "object": o,
                    "relation_id": name,
                    "template": "This is a document about {}",
                }
            )
    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in lines))
    store = build_store(tmp_path / "s", dataset=f"jsonl:{f}", limit=100, segment_size=64)
    r = CliRunner().invoke(
        main, ["maps-dynamic", str(store), "--json", "--no-save", "--quiet", "--pairs", str(root)]
    )
    assert r.exit_code == 0, r.output + str(r.stderr)
    out = json.loads(r.stdout)
    (rel,) = out["relations"]
    assert rel["relation"] == "word_shift" and rel["first_mlp"] is True and rel["k"] == 10
    assert rel["n_prompts"] == 32 and rel["n_prompts_store"] == len(
        rels["word_shift"]
    )  # 8 multi-token prompts out
    (ex,) = out["excluded"]
    assert (ex["relation"], ex["n_used"], ex["counted_from"]) == ("few_shift", 29, "pair file")
    # The variant keeps every prompt (and, below the minimum, needs it lowered).
    r = CliRunner().invoke(
        main,
        [
            "maps-dynamic",
            str(store),
            "--json",
            "--no-save",
            "--quiet",
            "--multi-token",
            "first",
            "--min-pairs",
            "1",
        ],
    )
    got = {x["relation"]: x["n_prompts"] for x in json.loads(r.stdout)["relations"]}
    assert got == {"word_shift": len(rels["word_shift"]), "few_shift": len(rels["few_shift"])}


# ----------------------------------------------------------------------------------- probe: contrast, concentration


def np_seed_contrast(probs: np.ndarray, pred: int) -> np.ndarray:
    """onehot(c_hat) - pi_c for c != c_hat (the full softmax), a loop over classes."""
    return np.array([1.0 if c == pred else -float(probs[c]) for c in range(probs.size)])


def test_both_contrast_readings_equal_numpy() -> None:
    from actstore.query.analyses.attribution import contrast_coefficients

    g = torch.Generator().manual_seed(11)
    for C in (2, 5, 16):
        probs = torch.softmax(torch.randn(30, C, generator=g, dtype=torch.float64) * 2, -1)
        pred = probs.argmax(-1)
        seed = contrast_coefficients(probs, pred, "seed").numpy()
        ren = contrast_coefficients(probs, pred, "renormalised").numpy()
        default = contrast_coefficients(probs, pred).numpy()
        for i in range(30):
            p = probs[i].numpy()
            np.testing.assert_allclose(seed[i], np_seed_contrast(p, int(pred[i])), rtol=0, atol=1e-15)
            np.testing.assert_allclose(ren[i], oracle.np_contrast(p, int(pred[i])), rtol=0, atol=1e-15)
        np.testing.assert_array_equal(default, ren)  # the documented default
        assert np.abs(seed - ren).max() > 1e-3  # the two readings really differ
    with pytest.raises(ValueError, match="contrast must be one of"):
        contrast_coefficients(probs, pred, "literal")


def test_probe_with_seed_contrast_equals_numpy(open_copy: Any, spy: Any) -> None:
    """A run with ``contrast="seed"``: each prediction's dW . x' and the stored per-relation HeadScores equal
    numpy's seed reading on the reference's inputs and the recorded probe; the run records which ran."""
    cfg = oracle.small(ProbeConfig(kind="attn_head"), contrast="seed")
    store = open_copy("llama")
    out = run_probe(store, cfg)
    record_probe(store, out)
    refs, layout, _ = oracle.reference_episodes(store, cfg, out, spy)
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, int] = {}
    for e, r in enumerate(refs):
        for qi in range(r.xq.shape[0]):
            dW = r.W @ np_seed_contrast(r.probs[qi], int(r.pred[qi]))
            units = oracle.brute_force_units(dW * r.xq[qi], r.sel.index, layout).reshape(-1)
            terms = np.abs(dW * r.xq[qi]).sum()
            assert abs(out.head_total[e, qi] - units.sum()) <= 1e-4 * terms
            renorm = float(r.units[qi].sum())
            assert abs(units.sum() - renorm) > 1e-6 * terms  # not the other reading
            sums[r.gold[qi]] = sums.get(r.gold[qi], 0) + units
            counts[r.gold[qi]] = counts.get(r.gold[qi], 0) + 1
    rows = store.sql(
        f"SELECT relation_id, layer, head, score FROM head_scores WHERE run_id = '{out.run_id}' "
        "ORDER BY relation_id, layer, head"
    ).to_pylist()
    scale = max(float(np.abs(v / counts[k]).max()) for k, v in sums.items())
    labels = oracle.unit_labels(store, cfg, layout)
    got = {(x["relation_id"], x["layer"], x["head"]): x["score"] for x in rows}
    for rel, v in sums.items():
        for (layer, head), want in zip(labels, v / counts[rel]):
            assert abs(got[rel, layer, head] - want) <= 1e-4 * scale
    run = store.sql(f"SELECT contrast, config FROM probe_runs WHERE run_id = '{out.run_id}'").to_pylist()[0]
    assert run["contrast"] == "seed" and json.loads(run["config"])["contrast"] == "seed"


def test_concentration_groups_by_predicted_class(open_copy: Any, spy: Any) -> None:
    """head_scores.pred_abs_score is, per relation, the mean |HeadScore| over the predictions the probe
    assigned to it (numpy over the reference's per-prediction scores); an error row (gold A, predicted B)
    is in B's aggregate and never in A's; the default predictor reads exactly that."""
    from actstore.query.analyses.predictor_measures import head_concentration
    from actstore.query.analyses.predictors import relation_predictors

    cfg = oracle.small(ProbeConfig(kind="attn_head"))
    store = open_copy("llama")
    out = run_probe(store, cfg)
    record_probe(store, out)
    refs, layout, _ = oracle.reference_episodes(store, cfg, out, spy)
    ep = out.episodes
    per_pred: dict[str, list[np.ndarray]] = {}
    per_gold: dict[str, list[np.ndarray]] = {}
    errors = []
    for e, r in enumerate(refs):
        for qi in range(r.xq.shape[0]):
            predicted = ep.relations[ep.classes[e, r.pred[qi]]]
            u = np.abs(r.units[qi].reshape(-1))
            per_pred.setdefault(predicted, []).append(u)
            per_gold.setdefault(r.gold[qi], []).append(u)
            if predicted != r.gold[qi]:
                errors.append((r.gold[qi], predicted, u))
    assert errors, "the test needs a wrong prediction"
    rows = store.sql(
        f"SELECT relation_id, layer, head, pred_abs_score, pred_n FROM head_scores "
        f"WHERE run_id = '{out.run_id}'"
    ).to_pylist()
    labels = oracle.unit_labels(store, cfg, layout)
    got: dict[str, np.ndarray] = {}
    n_pred: dict[str, int] = {}
    for x in rows:
        got.setdefault(x["relation_id"], np.zeros(len(labels)))[labels.index((x["layer"], x["head"]))] = x[
            "pred_abs_score"
        ]
        n_pred[x["relation_id"]] = x["pred_n"]
    scale = max(float(np.mean(v, 0).max()) for v in per_pred.values())
    for rel, vals in per_pred.items():
        assert n_pred[rel] == len(vals)
        assert np.abs(got[rel] - np.mean(vals, 0)).max() <= 1e-4 * scale, rel
    for gold, _predicted, u in errors:
        # The error is counted in its predicted class's aggregate (checked above) and not in its gold one's:
        # the stored value differs from what that row would make it, or the gold class was never predicted.
        mine = per_pred.get(gold, [])
        if mine:
            assert np.abs(got[gold] - np.mean([*mine, u], 0)).max() > 1e-6 * scale
        else:
            assert n_pred[gold] == 0
    res = relation_predictors(store, out.run_id)
    conc = dict(
        zip(
            res.relations.column("relation_id").to_pylist(),
            res.relations.column("head_concentration").to_pylist(),
        )
    )
    for rel in conc:
        want = head_concentration(np.mean(per_pred[rel], 0)) if rel in per_pred else float("nan")
        assert conc[rel] == want or (np.isnan(want) and np.isnan(conc[rel])), rel
    gold_signed = relation_predictors(store, out.run_id, concentration="gold-signed").relations
    assert set(gold_signed.column("head_concentration_method").to_pylist()) == {"gold-signed"}


def test_old_store_without_predicted_scores_is_one_clear_error(open_copy: Any) -> None:
    from actstore.query.analyses.predictors import relation_predictors
    from actstore.query.analyses.probe_tables import probe_tables

    store = open_copy("llama")
    out = run_probe(store, oracle.small(ProbeConfig(kind="attn_head")))
    out.hsp_sum = out.hsp_abs = out.hsp_n = None  # what a run stored before the predicted-class columns holds
    from actstore.core.writer import write_result_table

    for name, t in probe_tables(out).items():
        write_result_table(store, name, out.run_id, t)
    assert "pred_abs_score" not in store.sql("SELECT * FROM head_scores LIMIT 0").column_names
    with pytest.raises(
        ValueError, match="stored before per-predicted-class head scores.*--concentration gold-signed"
    ):
        relation_predictors(store, out.run_id)
    res = relation_predictors(store, out.run_id, concentration="gold-signed")  # what the old store has
    assert res.relations.num_rows > 0


# ----------------------------------------------------------------------------------- probe: no RelSpec


def test_no_relspec_uses_every_feature(open_copy: Any, spy: Any) -> None:
    """``relspec=False``: every episode trains on all F features, standardised with the support mean and
    population std (numpy), and predicts as a plain nn.Linear trained on those inputs."""
    cfg = oracle.small(ProbeConfig(kind="attn_head"), relspec=False)
    store = open_copy("llama")
    out = run_probe(store, cfg)
    ep = out.episodes
    X = store.select(None).features("attn_head").reshape(len(out.example_ids), -1).astype(np.float64)
    F = X.shape[1]
    assert (out.n_selected == F).all()
    assert len(spy.selected) == 0  # RelSpec never ran
    y = np.repeat(np.arange(ep.n_way), ep.k_shot)
    for e in range(len(ep)):
        sup, qry = X[ep.support[e]], X[ep.query[e]]
        mu, sd = sup.mean(0), sup.std(0)
        sd = np.where(sd > 0, sd, 1.0)
        xs, xq = (sup - mu) / sd, (qry - mu) / sd
        t = spy.trained[e]
        assert t.xs.shape == (xs.shape[0], F) and oracle.close(t.xs, xs)
        W, b = oracle.plain_train(xs, y, ep.n_way, cfg.epochs, cfg.lr)
        logits = xq @ W + b
        m = np.sort(logits, 1)
        clear = m[:, -1] - m[:, -2] > 0.05 * np.abs(logits).max()
        assert np.array_equal(logits.argmax(1)[clear], out.pred[e][clear])
    with_relspec = run_probe(store, oracle.small(ProbeConfig(kind="attn_head")))
    assert (with_relspec.n_selected < F).all()  # the default selects


def test_cli_probe_no_relspec_and_contrast(open_copy: Any) -> None:
    store = open_copy("llama")
    base = [
        "probe",
        str(store.url),
        "--kind",
        "attn_head",
        "--n-way",
        "3",
        "--k-shot",
        "3",
        "--queries",
        "2",
        "--episodes",
        "2",
        "--seeds",
        "1",
        "--epochs",
        "5",
        "--quiet",
    ]
    r = CliRunner().invoke(main, [*base, "--no-relspec", "--contrast", "seed", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["relspec"] is False and d["contrast"] == "seed"
    F = store.select(None).features("attn_head").reshape(len(store.select(None).example_ids), -1).shape[1]
    assert d["mean_selected_features"] == F
    r = CliRunner().invoke(main, base)
    assert "RelSpec top 3000" in r.stdout and "HeadScore contrast: renormalised" in r.stdout


# ----------------------------------------------------------------------------------- output range


def test_output_range_counts_every_instance_of_the_file(
    store_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """With the data set file the output range counts every instance of the relation in it, the
    object-first ones (which ingest skips) included; without, the stored sample, and the output says which."""
    data = json.loads(FEWREL_FIXTURE.read_text(encoding="utf-8"))
    rel = "P177"
    inst = json.loads(json.dumps(data[rel][0]))
    toks = ["The", "Zyx", "River", "is", "crossed", "by", "the", "Qwe", "Bridge", "."]
    # object (tail) before subject (head): ingest skips it, the data set still holds its object
    data[rel].append(
        {"tokens": toks, "h": ["qwe bridge", "Q1234567", [[7, 8]]], "t": ["zyx river", "Q7654321", [[1, 2]]]}
    )
    assert inst["t"][1] != "Q7654321"
    path = tmp_path / "val_wiki.json"
    path.write_text(json.dumps(data))
    src = store_factory("llama", dataset=f"fewrel:{path}", limit=50, segment_size=64)
    store_path = tmp_path / "store"
    shutil.copytree(src, store_path)
    store = actstore.open(store_path)
    n_rel = len(data)
    out = run_probe(
        store,
        ProbeConfig(
            kind="attn_head", n_way=n_rel, k_shot=2, queries=2, episodes=1, seeds=(0,), top_k=20, epochs=3
        ),
    )
    record_probe(store, out)
    assert store.sql("SELECT count(*) FROM examples WHERE meta LIKE '%Q7654321%'").column(0)[0].as_py() == 0
    r = CliRunner().invoke(
        main,
        [
            "correlate",
            str(store_path),
            "--run",
            out.run_id,
            "--dataset-file",
            str(path),
            "--no-save",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    got = {x["relation_id"]: x for x in d["relations"]}
    assert "every instance" in d["output_range"] and "ours" in d["output_range"]
    sample = {
        x["relation_id"]: x
        for x in json.loads(
            CliRunner()
            .invoke(main, ["correlate", str(store_path), "--run", out.run_id, "--no-save", "--json"])
            .stdout
        )["relations"]
    }
    for name, insts in data.items():
        objects = {i["t"][1] for i in insts}  # plain count over the file
        assert got[name]["output_range"] == len(objects) and got[name]["output_range_instances"] == len(insts)
        stored = {
            json.loads(m)["object_qid"]
            for m in store.sql(f"SELECT meta FROM examples WHERE relation_id = '{name}'")
            .column(0)
            .to_pylist()
        }
        assert sample[name]["output_range"] == len(stored)
        assert sample[name]["output_range_source"].startswith("stored sample")
    assert got[rel]["output_range"] > sample[rel]["output_range"]  # Q7654321 is only in the file
    r = CliRunner().invoke(
        main, ["correlate", str(store_path), "--run", out.run_id, "--output-range", "dataset"]
    )
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "--dataset-file" in r.stderr
