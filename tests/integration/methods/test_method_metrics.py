"""The seed-001 method-comparison data set (methods2k), its metrics (query/methods/metrics.py) against
hand computations on small arrays, the interventions on located sites against hooks written here,
and the study driver end to end on a tiny random model over the fixture data set."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from click.testing import CliRunner, Result
from helpers import FIXTURES, build_store, tiny_text_corpus
from hypothesis import given, settings
from hypothesis import strategies as st

from actstore.cli import main
from actstore.core.errors import DatasetError
from actstore.ingest.datasets.dispatch import load_dataset
from actstore.ingest.datasets.methods2k import (
    allocate,
    build_methods2k,
    known1000_facts,
    lre_facts,
    read_methods2k,
    stratified_sample,
    tag_facts,
)
from actstore.query.methods.metrics import (
    Sites,
    consensus,
    consistency,
    effectiveness,
    localisation_precision,
    located_sites,
    pair_agreement,
    paired_correlation,
)
from actstore.query.methods.readings import MethodReading
from actstore.query.methods.tables import compute_metrics

pytestmark = pytest.mark.usefixtures("one_thread")
M2K = FIXTURES / "methods2k"


def invoke_study(*args: object) -> Result:
    """``actstore study ARGS`` in this process."""
    return CliRunner().invoke(main, ["study", *map(str, args)])


def ok(*args: object) -> Result:
    r = invoke_study(*args)
    assert r.exit_code == 0, r.output
    return r


def _zipf() -> dict[str, float]:
    return json.loads((M2K / "zipf.json").read_text())


def _pool() -> list[Any]:
    return lre_facts(M2K / "lre" / "factual") + known1000_facts(M2K / "known_1000.json")


# ------------------------------------------------------------------------------------ the data set


def test_tags_follow_the_median_split_and_the_objects_per_subject() -> None:
    tagged = {(f.relation_id, f.subject, f.object): f for f in tag_facts(_pool(), _zipf())}
    assert len(tagged) == 18
    # region_river: zipf 0, 1.2, 2, 2, 2, 3.1, 4.4 -> median 2.0; only Ostravia (3.1) and Pellador (4.4) are above
    high = {s for (r, s, _), f in tagged.items() if r == "region_river" and f.freq_band == "high"}
    assert high == {"Ostravia", "Pellador"}
    assert tagged[("region_river", "Norvessa", "Sarn")].freq_band == "low"  # tie at the median goes low
    # guild_founder: 0.5, 1, 2.5, 3.3, 4 -> median 2.5 (Brass Lantern sits on it: low)
    assert tagged[("guild_founder", "Brass Lantern", "Tavi Orsel")].freq_band == "low"
    assert tagged[("guild_founder", "Salt Anvil", "Idris Pallow")].freq_band == "high"
    # P9001: 0, 0.4, 1.5, 2.2 -> median 0.95
    assert tagged[("P9001", "Lake Omburu", "Kessa")].freq_band == "high"
    assert tagged[("P9001", "Tiberan Highlands", "Port Sella")].freq_band == "low"
    # two subjects of region_river have two objects each
    several = {(s, o) for (r, s, o), f in tagged.items() if f.uniqueness == "several"}
    assert several == {
        ("Ostravia", "Velta"),
        ("Ostravia", "Morn"),
        ("Pellador", "Morn"),
        ("Pellador", "Drisk"),
    }
    assert tagged[("region_river", "Ostravia", "Morn")].n_objects == 2
    assert tagged[("region_river", "Kaldun", "Velta")].object_subjects == 3  # Ostravia, Kaldun, Quellara
    assert tagged[("guild_founder", "Iron Thimble", "Tavi Orsel")].object_subjects == 2
    assert tagged[("region_river", "Ostravia", "Morn")].stratum == "region_river|high|several"


def test_allocation_is_water_filling() -> None:
    assert allocate({"a": 1, "b": 10, "c": 10}, 15) == {"a": 1, "b": 7, "c": 7}
    assert allocate({"a": 1, "b": 2}, 10) == {"a": 1, "b": 2}  # the pool is smaller than asked
    # 6 strata of sizes 2, 2, 2, 3, 4, 5 and 14 facts: 2 each, then the two left go to open strata in key order
    sizes = {
        "P9001|high|unique": 2,
        "P9001|low|unique": 2,
        "guild_founder|high|unique": 2,
        "guild_founder|low|unique": 3,
        "region_river|high|several": 4,
        "region_river|low|unique": 5,
    }
    got = allocate(sizes, 14)
    assert got == {**{k: 2 for k in sizes}, "guild_founder|low|unique": 3, "region_river|high|several": 3}
    with pytest.raises(DatasetError):
        allocate(sizes, -1)


def test_sample_is_stratified_seeded_and_in_pool_order() -> None:
    tagged = tag_facts(_pool(), _zipf())
    a, b = stratified_sample(tagged, 14, seed=0), stratified_sample(tagged, 14, seed=0)
    assert a == b and len(a) == 14
    counts: dict[str, int] = {}
    for f in a:
        counts[f.stratum] = counts.get(f.stratum, 0) + 1
    assert counts["region_river|low|unique"] == 2 and counts["region_river|high|several"] == 3
    order = [tagged.index(f) for f in a]
    assert order == sorted(order)
    others = [stratified_sample(tagged, 14, seed=s) for s in range(1, 6)]
    assert any(o != a for o in others)  # the seed chooses which facts


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.dictionaries(st.sampled_from("abcdefg"), st.integers(0, 12), min_size=1),
    small=st.integers(0, 60),
    extra=st.integers(0, 60),
)
def test_allocation_grows_with_the_total(sizes: dict[str, int], small: int, extra: int) -> None:
    """A larger data set takes at least as many facts from every stratum (so, with the per-stratum
    shuffles fixed by the seed, it holds the smaller one: the superset the SmolLM2 study relies on)."""
    lo, hi = allocate(sizes, small), allocate(sizes, small + extra)
    assert sum(lo.values()) == min(small, sum(sizes.values()))
    assert all(0 <= lo[k] <= hi[k] <= sizes[k] for k in sizes), (lo, hi)


def test_a_larger_sample_holds_the_smaller() -> None:
    tagged = tag_facts(_pool(), _zipf())
    samples = [stratified_sample(tagged, n, seed=3) for n in range(len(tagged) + 1)]
    for n, (a, b) in enumerate(zip(samples, samples[1:])):
        assert len(a) == n and len(b) == n + 1
        assert set(map(id, a)) < set(map(id, b)), n


def test_build_and_load(tmp_path: Path) -> None:
    path = build_methods2k(
        M2K / "lre" / "factual", M2K / "known_1000.json", tmp_path, size=12, frequency=_zipf()
    )
    doc = json.loads(path.read_text())
    assert doc["size"] == 12 and doc["pool"] == 18 and sum(doc["strata"].values()) == 12
    facts = read_methods2k(tmp_path)
    res = load_dataset(f"methods2k:{tmp_path}")
    assert res.n_kept == 12
    for f, r in zip(facts, res.records):
        assert r.subject_span is not None
        assert r.text[r.subject_span[0] : r.subject_span[1]] == f.subject == r.subject
        assert r.meta["freq_band"] == f.freq_band and r.meta["uniqueness"] == f.uniqueness
        assert r.meta["stratum"] == f"{r.relation_id}|{f.freq_band}|{f.uniqueness}"
    assert load_dataset(f"methods2k:{tmp_path}", relations=["P9001"]).n_kept == doc["strata"].get(
        "P9001|high|unique", 0
    ) + doc["strata"].get("P9001|low|unique", 0)
    with pytest.raises(DatasetError, match="no entry"):
        build_methods2k(M2K / "lre" / "factual", None, tmp_path / "x", frequency={"Ostravia": 1.0})
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "methods2k.json").write_text(json.dumps({"format": "other", "facts": []}))
    with pytest.raises(DatasetError, match="not a methods2k"):
        load_dataset(f"methods2k:{bad}")


# ------------------------------------------------------------------------------------ metrics by hand


def _reading(
    method: str,
    ids: list[int],
    keys: list[int],
    verdicts: list[str],
    mlp: Any = None,
    attn: Any = None,
    profile: Any = None,
) -> MethodReading:
    n = len(ids)
    if profile is None:
        profile = np.fmax(mlp, attn) if mlp is not None else np.zeros((n, 4))
    return MethodReading(
        method,
        np.asarray(ids, np.int64),
        np.asarray(profile, float),
        np.asarray(keys, np.int64),
        np.asarray(verdicts, dtype=object),
        None if mlp is None else np.asarray(mlp, float),
        None if attn is None else np.asarray(attn, float),
    )


MLP = [[0, 0.6, 0.2, 0], [0, 0, 0, 0.2]]
ATTN = [[0.1, 0.3, 0, -0.5], [0, 0.8, 0, 0]]


def test_precision_by_hand() -> None:
    r = _reading("trace", [7, 8], [1, 1], ["mlp", "attn"], MLP, ATTN)
    # fact 7: positive effect 0.6 + 0.2 + 0.1 + 0.3 = 1.2; the MLP at layer 1 holds 0.6, the layer 0.9
    # fact 8: 0.2 + 0.8 = 1.0; the attention at layer 1 holds 0.8
    np.testing.assert_allclose(localisation_precision(r), [0.5, 0.8])
    np.testing.assert_allclose(localisation_precision(r, by_component=False), [0.75, 0.8])
    flipped = _reading("trace", [7, 8], [1, 1], ["mlp", "attn"], np.flip(MLP, 1), np.flip(ATTN, 1))
    assert not np.allclose(localisation_precision(flipped), [0.5, 0.8])  # the layers are read by index
    swapped = _reading("trace", [7, 8], [1, 1], ["attn", "mlp"], MLP, ATTN)
    np.testing.assert_allclose(localisation_precision(swapped), [0.25, 0.0])
    none = _reading("trace", [7, 8], [-1, 1], ["", "attn"], MLP, ATTN)
    assert np.isnan(localisation_precision(none)[0])
    sites = located_sites(none)
    assert sites.layer.tolist() == [-1, 1] and sites.component.tolist() == ["", "attn"]
    # without component profiles: the profile alone
    prof = _reading("attention", [1], [2], ["attn"], profile=[[0.1, -0.4, 0.3, 0.1]])
    np.testing.assert_allclose(localisation_precision(prof), [0.6])


def test_consistency_by_hand() -> None:
    r = _reading("patch", [0, 1, 2, 3, 4, 5], [3, 4, 9, 3, 3, -1], ["mlp", "mlp", "attn", "mlp", "attn", ""])
    groups = {0: "a", 1: "a", 2: "a", 3: "b", 4: "b", 5: "b"}
    key, verdict = consistency(r, groups, tolerance=1)
    # group a: median key 4 -> 3 and 4 within 1, 9 not; group b: median 3 (fact 5 has no key layer)
    np.testing.assert_array_equal(key, [1, 1, 0, 1, 1, np.nan])
    # verdicts: a has a majority (mlp); b ties (mlp, attn): 0.5 each, so a group's mean is its modal share
    np.testing.assert_array_equal(verdict, [1, 1, 0, 0.5, 0.5, np.nan])
    key2, _ = consistency(r, {0: "a", 1: "b", 2: "b", 3: "a", 4: "a", 5: "a"}, tolerance=1)
    assert not np.array_equal(key2[:5], key[:5])  # other groups, other figures
    lone, _ = consistency(r, {0: "x", 1: "y"}, tolerance=1)
    assert np.isnan(lone).all()  # one fact per group: nothing to be consistent with


def _effects(rows: list[tuple[int, str, int, bool, float]]) -> pa.Table:
    e, c, layer, rnd, eff = zip(*rows)
    return pa.table(
        {
            "example_id": list(e),
            "component": list(c),
            "layer": list(layer),
            "random": list(rnd),
            "effect": list(eff),
        }
    )


def test_effectiveness_by_hand() -> None:
    sites = Sites(
        "trace", np.array([10, 11, 12]), np.array([2, 0, -1]), np.array(["mlp", "attn", ""], dtype=object)
    )
    table = _effects(
        [
            (10, "mlp", 2, False, 0.5),
            (10, "mlp", 0, True, 0.1),
            (10, "mlp", 3, True, 0.3),
            (10, "attn", 1, True, 0.9),
            (11, "attn", 0, False, 0.2),
            (11, "attn", 1, True, 0.4),
            (11, "attn", 2, True, 0.0),
            (11, "mlp", 0, False, 5.0),
        ]
    )
    eff = effectiveness(sites, table)
    np.testing.assert_allclose(eff.located[:2], [0.5, 0.2])
    np.testing.assert_allclose(eff.random[:2], [0.2, 0.2])  # the attention draw of fact 10 is not an MLP one
    np.testing.assert_allclose(eff.net[:2], [0.3, 0.0])
    np.testing.assert_allclose(eff.beats_random[:2], [1.0, 0.5])
    assert np.isnan(eff.located[2]) and np.isnan(eff.net[2])


def test_pair_agreement_consensus_and_correlation_by_hand() -> None:
    ra = _reading("trace", [1, 2, 3, 4], [5, 6, 7, -1], ["mlp", "attn", "mlp", "mlp"])
    rb = _reading("patch", [2, 3, 4, 5], [8, 7, 2, 0], ["attn", "", "mlp", "mlp"])
    ag = pair_agreement(ra, rb, tolerance=1)
    np.testing.assert_array_equal(ag["example_ids"], [2, 3, 4])
    np.testing.assert_array_equal(ag["key"], [0, 1, np.nan])
    np.testing.assert_array_equal(ag["exact"], [0, 1, np.nan])
    np.testing.assert_array_equal(ag["verdict"], [1, np.nan, 1])
    moved = _reading(
        "patch", [2, 3, 4, 5], [7, 8, 2, 0], ["attn", "", "mlp", "mlp"]
    )  # two facts' keys swapped
    np.testing.assert_array_equal(pair_agreement(ra, moved, 1)["key"], [1, 1, np.nan])  # 6 vs 7, 7 vs 8
    np.testing.assert_array_equal(pair_agreement(ra, moved, 1)["exact"], [0, 0, np.nan])
    rc = _reading("probe", [2, 3, 4], [7, 8, 3], ["", "", ""])
    # facts 2, 3, 4 read by all; 4 has no trace key. fact 2: keys 6, 8, 7 (spread 2); fact 3: 7, 7, 8 (1)
    np.testing.assert_array_equal(consensus([ra, rb, rc], 1), [0, 1])
    np.testing.assert_array_equal(consensus([ra, rb, rc], 2), [1, 1])
    rng = np.random.default_rng(3)
    a = rng.normal(size=40)
    b = a + rng.normal(scale=0.5, size=40)
    s = paired_correlation(a, b, resamples=500)
    assert s.n == 40 and s.value == pytest.approx(np.corrcoef(a, b)[0, 1])
    assert s.low <= s.value <= s.high and s.high - s.low < 0.5
    shuffled = paired_correlation(a, rng.permutation(b), resamples=500)
    assert abs(shuffled.value) < s.value - 0.3  # pairs are read in order
    b2 = b.copy()
    b2[0] = np.nan
    assert paired_correlation(a, b2, resamples=200).n == 39


def test_compute_metrics_groups_and_pairs() -> None:
    tr = _reading("trace", [7, 8], [1, 1], ["mlp", "attn"], MLP, ATTN)
    pt = _reading("patch", [7, 8], [1, 3], ["mlp", "mlp"], MLP, ATTN)
    strata = {"relation": {7: "r1", 8: "r2"}, "freq_band": {7: "high", 8: "high"}}
    eff = _effects(
        [
            (7, "mlp", 1, False, 0.4),
            (7, "mlp", 0, True, 0.0),
            (8, "attn", 1, False, 0.1),
            (8, "attn", 0, True, 0.3),
            (8, "mlp", 3, False, 0.6),
            (8, "mlp", 2, True, 0.2),
        ]
    )
    res = compute_metrics([tr, pt], strata, tolerance=1, effects=eff, resamples=200)
    m = {(r["method"], r["grouping"], r["group"], r["metric"]): r for r in res.metrics.to_pylist()}
    assert m[("trace", "all", "all", "precision")]["value"] == pytest.approx(0.65)
    assert m[("trace", "relation", "r2", "precision")]["value"] == pytest.approx(0.8)
    assert m[("trace", "freq_band", "high", "precision")]["n"] == 2
    assert m[("patch", "all", "all", "effectiveness")]["value"] == pytest.approx(
        ((0.4 - 0.0) + (0.6 - 0.2)) / 2
    )
    assert m[("trace", "all", "all", "effectiveness")]["value"] == pytest.approx(
        ((0.4 - 0.0) + (0.1 - 0.3)) / 2
    )
    p = {r["metric"]: r for r in res.pairs.to_pylist() if r["method_a"] == "trace"}
    assert p["key_layer"]["value"] == pytest.approx(0.5) and p["key_layer"]["paper"] == pytest.approx(0.825)
    assert p["verdict"]["value"] == pytest.approx(0.5) and p["effect_correlation"]["n"] == 2
    assert p["key_layer"]["low"] <= 0.5 <= p["key_layer"]["high"]


# ------------------------------------------------------------------------------------ interventions


def _fact(loaded: Any, text: str, subject: str, obj: str, example_id: int = 0) -> Any:
    from actstore.interventions.facts import StoredFact

    tok = loaded.tokenizer
    start = text.index(subject)
    enc = tok(text, return_offsets_mapping=True)
    ids, offs = enc["input_ids"], enc["offset_mapping"]
    toks = [i for i, (a, b) in enumerate(offs) if b > start and a < start + len(subject)]
    target = tok(" " + obj, add_special_tokens=False)["input_ids"][0]
    return StoredFact(
        example_id,
        "r",
        subject,
        obj,
        tuple(ids),
        tuple(str(i) for i in ids),
        (toks[0], toks[-1] + 1),
        int(target),
        True,
    )


def _p_object(loaded: Any, fact: Any, hooks: list[tuple[torch.nn.Module, Callable[..., Any]]]) -> float:
    handles = [m.register_forward_hook(h) for m, h in hooks]
    try:
        with torch.inference_mode():
            logits = loaded.model(torch.tensor([fact.input_ids])).logits[0, -1].float()
    finally:
        for h in handles:
            h.remove()
    return float(torch.softmax(logits, -1)[fact.target_id])


def test_knockout_effects_match_hooks_written_here() -> None:
    from actstore.ingest.capture.architectures import architecture_for
    from actstore.ingest.models.tiny import tiny_model
    from actstore.interventions.effectiveness import EffectConfig, random_layers, site_effects
    from actstore.interventions.runner import InterventionRunner

    loaded = tiny_model("llama")
    blocks = architecture_for(loaded.model).blocks(loaded.model)
    fact = _fact(loaded, "Everyone in Ostravia drinks from the", "Ostravia", "Velta", 3)
    L = len(blocks.layers)
    table = site_effects(
        InterventionRunner(loaded.model), [fact], {3: [("mlp", 1), ("attn", 0)]}, EffectConfig(random_draws=2)
    )
    rows = table.to_pylist()
    p_clean = _p_object(loaded, fact, [])
    s0 = fact.subject_span[0]

    def zero_from(module: Any, args: Any, out: Any) -> Any:
        out = out.clone()
        out[:, s0:] = 0
        return out

    for r in rows:
        module = (blocks.down_proj if r["component"] == "mlp" else blocks.out_proj)[r["layer"]]
        p = _p_object(loaded, fact, [(module, zero_from)])
        assert r["p_base"] == pytest.approx(p_clean, rel=1e-5)
        assert r["p_intervened"] == pytest.approx(p, rel=1e-5)
        assert r["effect"] == pytest.approx(p_clean - p, abs=1e-7)
    located = {(r["component"], r["layer"]) for r in rows if not r["random"]}
    assert located == {("mlp", 1), ("attn", 0)}
    for c in ("mlp", "attn"):
        draws = sorted(r["layer"] for r in rows if r["random"] and r["component"] == c)
        assert draws == random_layers(3, c, L, 2) and len(set(draws)) == 2
    assert random_layers(3, "mlp", L, 2, seed=0) == random_layers(3, "mlp", L, 2, seed=0)


def test_restore_effects_match_hooks_written_here() -> None:
    from actstore.ingest.capture.architectures import architecture_for
    from actstore.ingest.models.tiny import tiny_model
    from actstore.interventions.effectiveness import EffectConfig, site_effects
    from actstore.interventions.runner import InterventionRunner

    loaded = tiny_model("llama")
    arch = architecture_for(loaded.model)
    blocks = arch.blocks(loaded.model)
    fact = _fact(loaded, "Everyone in Ostravia drinks from the", "Ostravia", "Velta", 5)
    std, samples = 0.5, 2
    table = site_effects(
        InterventionRunner(loaded.model),
        [fact],
        {5: [("mlp", 0)]},
        EffectConfig(mode="restore", random_draws=1, samples=samples),
        noise_std=std,
    )
    s0, s1 = fact.subject_span
    d = loaded.model.config.hidden_size
    clean: dict[str, torch.Tensor] = {}

    def keep(module: Any, args: Any, out: Any) -> None:
        clean["mlp0"] = out.detach().clone()

    _p_object(loaded, fact, [(blocks.down_proj[0], keep)])

    def noised(sample: int) -> Callable[..., Any]:
        gen = torch.Generator().manual_seed(0 * 100_003 + sample)  # TraceConfig seed 0, sample s
        noise = torch.randn((s1 - s0, d), generator=gen) * std

        def hook(module: Any, args: Any, out: Any) -> Any:
            out = out.clone()
            out[:, s0:s1] += noise
            return out

        return hook

    def restore(module: Any, args: Any, out: Any) -> Any:
        out = out.clone()
        out[:, s0:] = clean["mlp0"][:, s0:]
        return out

    emb = arch.embedding(loaded.model)
    corrupt = np.mean([_p_object(loaded, fact, [(emb, noised(s))]) for s in range(samples)])
    restored = np.mean(
        [_p_object(loaded, fact, [(emb, noised(s)), (blocks.down_proj[0], restore)]) for s in range(samples)]
    )
    row = next(r for r in table.to_pylist() if not r["random"])
    assert row["p_base"] == pytest.approx(corrupt, rel=1e-5)
    assert row["effect"] == pytest.approx(restored - corrupt, abs=1e-7)


# ------------------------------------------------------------------------------------ end to end


def test_study_end_to_end_on_a_tiny_model(tmp_path: Path) -> None:
    import actstore

    data = tmp_path / "m2k"
    build_methods2k(M2K / "lre" / "factual", M2K / "known_1000.json", data, size=18, frequency=_zipf())
    store = build_store(tmp_path / "s", "llama", dataset=f"methods2k:{data}", limit=100)
    s = actstore.open(str(store))
    # the tags are example metadata that SQL selects strata by
    high = (
        s.sql("SELECT count(*) AS n FROM examples WHERE meta->>'freq_band' = 'high'").column("n")[0].as_py()
    )
    assert high == sum(1 for f in read_methods2k(data) if f.freq_band == "high")
    state, out = tmp_path / "state.json", tmp_path / "out.json"
    ok(
        *[
            "run",
            str(store),
            "--state",
            str(state),
            "--all-facts",
            "--no-patch",
            "--max-facts",
            "6",
            "--chunk",
            "3",
            "--samples",
            "1",
            "--window",
            "1",
            "--random-draws",
            "1",
            "--methods",
            "trace,logit_lens,tuned_lens,attention",
            "--resamples",
            "100",
            "--out",
            str(out),
        ]
    )
    st = json.loads(state.read_text())
    assert len(st["trace_runs"]) == 2 and len(st["traced"]) == 6
    res = json.loads(out.read_text())
    assert res["readings"] == {"trace": 6, "logit_lens": 6, "tuned_lens": 6, "attention": 6}
    # the tuned lens is trained with Adam by default on the 12 facts not traced, and recorded
    assert st["tuned_lens"]["method"] == "adam" and st["tuned_lens"]["train_facts"] == 12
    assert (st["tuned_lens"]["config"]["steps"], st["tuned_lens"]["config"]["batch"]) == (250, 64)
    tuned_run = json.loads(
        s.sql(f"SELECT config FROM runs WHERE run_id = '{st['metrics_knockout_run']}'")
        .column("config")[0]
        .as_py()
    )["tuned_lens"]
    assert tuned_run == st["tuned_lens"]
    for mode in ("knockout", "restore"):
        rid = st[f"metrics_{mode}_run"]
        t = s.sql(f"SELECT DISTINCT method, grouping FROM method_metrics WHERE run_id = '{rid}'").to_pylist()
        assert {r["method"] for r in t} == {"trace", "logit_lens", "tuned_lens", "attention"}
        assert {"all", "relation", "freq_band", "uniqueness", "stratum"} <= {r["grouping"] for r in t}
        n_eff = (
            s.sql(
                f"SELECT count(DISTINCT example_id) AS n FROM site_effects WHERE run_id = "
                f"'{st[f'effects_{mode}_run']}'"
            )
            .column("n")[0]
            .as_py()
        )
        assert n_eff == 6
    pairs = s.sql(
        f"SELECT * FROM method_pair_metrics WHERE run_id = '{st['metrics_knockout_run']}'"
    ).to_pylist()
    assert {(p["method_a"], p["method_b"]) for p in pairs if p["metric"] == "key_layer"} >= {
        ("trace", "logit_lens")
    }
    cross = {r["metric"]: r for r in s.sql("SELECT * FROM method_cross_size").to_pylist()}
    answered = s.sql("SELECT count(*) AS n FROM targets WHERE object_rank = 0").column("n")[0].as_py()
    assert cross["recall_success"]["value"] == pytest.approx(answered / 18)
    assert 0 <= cross["trace_mlp_share"]["value"] <= 1
    # the report's section reads these tables; Chromium lays it out
    from actstore.query.report.builder import build_report

    html = build_report(s)
    assert 'id="section-method-metrics"' in html
    part = html.split('id="section-method-metrics"', 1)[1].split("<section", 1)[0]
    assert "trace vs logit_lens" in part and "across model sizes" in part and "by freq band" in part
    assert (
        "trace vs tuned_lens (adam)" in part and "tuned_lens (ridge)" not in part
    )  # the fitting rule the run used
    assert "<td>tuned_lens</td>" not in part
    assert "site_effects" not in html.split('id="section-tables"', 1)[-1] or 'id="section-tables"' not in html
    # the Markdown tables name the tuned lens with its fitting rule
    printed = ok("tables", out).stdout
    assert "| tuned lens (adam) | 6 |" in printed and "trace vs tuned lens (adam)" in printed
    assert "tuned_lens" not in printed
    _chromium_shows(html, tmp_path)


def test_study_patches_incrementally(tmp_path: Path) -> None:
    """A resumed study patches only the facts traced since the last call; its runs, joined, read as
    one patch run over all the facts would (the oracle), and a state holding one ``patch_run`` (as
    written before) is carried over, not re-patched."""
    import actstore
    from actstore.interventions.settings import PatchConfig
    from actstore.jobs.patch import PatchRequest, run_patch
    from actstore.jobs.study_state import where_ids
    from actstore.query.methods.readings import patch_reading
    from actstore.query.methods.study import study_readings

    data = tmp_path / "m2k"
    build_methods2k(M2K / "lre" / "factual", M2K / "known_1000.json", data, size=18, frequency=_zipf())
    store = build_store(tmp_path / "s", "llama", dataset=f"methods2k:{data}", limit=100)
    s = actstore.open(str(store))
    state = tmp_path / "state.json"
    common = [
        "--all-facts",
        "--chunk",
        "3",
        "--samples",
        "1",
        "--window",
        "1",
        "--methods",
        "trace,patch",
        "--modes",
        "knockout",
        "--random-draws",
        "1",
        "--resamples",
        "50",
    ]
    ok("run", store, "--state", state, "--max-facts", "3", *common)
    first = json.loads(state.read_text())
    assert len(first["patch_runs"]) == 1 and sorted(first["patched"]) == sorted(first["traced"])
    # a state as written before incremental patching: one patch_run, no patched list
    old = {k: v for k, v in first.items() if k not in ("patch_runs", "patched")}
    old["patch_run"] = first["patch_runs"][0]
    state.write_text(json.dumps(old))
    ok("run", store, "--state", state, "--max-facts", "6", *common)
    st = json.loads(state.read_text())
    assert (
        "patch_run" not in st and st["patch_runs"][0] == first["patch_runs"][0] and len(st["patch_runs"]) == 2
    )
    assert len(st["traced"]) == 6 and sorted(st["patched"]) == sorted(st["traced"])
    per_run = [
        set(
            s.sql("SELECT DISTINCT example_id FROM patch_effects WHERE run_id = ?", [r])
            .column("example_id")
            .to_pylist()
        )
        for r in st["patch_runs"]
    ]
    assert not per_run[0] & per_run[1]  # the second run patched only the new facts
    assert per_run[1] <= set(st["traced"][3:])
    # the effects cover the six facts, not the three of the first call
    n_eff = (
        s.sql(
            "SELECT count(DISTINCT example_id) AS n FROM site_effects WHERE run_id = ?",
            [st["effects_knockout_run"]],
        )
        .column("n")[0]
        .as_py()
    )
    assert n_eff == 6 and st["effects_knockout_facts"] == sorted(st["traced"])
    # oracle: one patch run over all six facts reads the same as the two runs joined
    whole = run_patch(
        s,
        PatchRequest(
            where=where_ids(st["traced"]),
            quiet=True,
            all_facts=True,
            patch=PatchConfig(components=("attn", "mlp"), heads=False),
        ),
    )
    one = patch_reading(s, whole.run_id)
    joined = study_readings(s, ["patch"], patch_runs=st["patch_runs"])["patch"]
    assert np.array_equal(one.example_ids, joined.example_ids) and one.example_ids.size >= 4
    np.testing.assert_allclose(joined.profile, one.profile, rtol=1e-5, atol=1e-6)
    assert np.array_equal(joined.key_layer, one.key_layer) and np.array_equal(joined.verdict, one.verdict)


def test_study_traced_by_two_processes_and_merged(tmp_path: Path) -> None:
    """``study run --start N --trace-only`` in a second process on the same store, then ``merge``: the
    merged state traces the facts the one-process study traces, and its runs read the same keys and
    profiles (the oracle: one process, the same chunks); a fact traced twice, or a run traced with
    another window, is refused and the state left as it was."""
    import subprocess
    import sys

    import actstore
    from actstore.query.methods.study import study_readings

    data = tmp_path / "m2k"
    build_methods2k(M2K / "lre" / "factual", M2K / "known_1000.json", data, size=18, frequency=_zipf())
    store = build_store(tmp_path / "s", "llama", dataset=f"methods2k:{data}", limit=100)
    common = ["--all-facts", "--chunk", "3", "--samples", "1", "--window", "2", "--trace-only"]
    head, tail, one = tmp_path / "head.json", tmp_path / "tail.json", tmp_path / "one.json"
    second = subprocess.Popen(
        [sys.executable, "-m", "actstore.cli", "study", "run", str(store), "--state", str(tail)]
        + ["--start", "3", "--max-facts", "3", *common],
        stderr=subprocess.PIPE,
        text=True,
    )
    ok("run", store, "--state", head, "--max-facts", "3", *common)
    assert second.wait(timeout=600) == 0, second.stderr.read() if second.stderr else ""
    assert not {"patch_runs", "effects_knockout_run"} & set(json.loads(head.read_text()))  # --trace-only
    ok("merge", store, "--state", head, "--add", tail)
    merged = json.loads(head.read_text())
    ok("run", store, "--state", one, "--max-facts", "6", *common)
    single = json.loads(one.read_text())
    assert merged["traced"] == single["traced"] and len(set(merged["traced"])) == 6
    s = actstore.open(str(store))
    got = study_readings(s, ["trace"], merged["trace_runs"], [])["trace"]
    want = study_readings(s, ["trace"], single["trace_runs"], [])["trace"]
    assert np.array_equal(got.example_ids, want.example_ids) and got.example_ids.size == 6
    assert np.array_equal(got.key_layer, want.key_layer) and np.array_equal(got.verdict, want.verdict)
    np.testing.assert_allclose(got.profile, want.profile, rtol=1e-6, atol=1e-7)
    before = head.read_bytes()
    r = invoke_study("merge", store, "--state", head, "--add", tail)
    assert r.exit_code == 1 and "3 facts already traced" in r.stderr, r.output
    w1 = tmp_path / "w1.json"
    w1_args = [*common[:6], "1", "--trace-only"]  # the same options but window 1
    ok("run", store, "--state", w1, "--start", "6", "--max-facts", "1", *w1_args)
    r = invoke_study("merge", store, "--state", head, "--add", w1)
    err = r.stderr
    assert r.exit_code == 1 and "another configuration" in err and "window 2 vs 1" in err, err
    assert head.read_bytes() == before


def _chromium_shows(html: str, tmp: Path) -> None:
    import os
    import subprocess

    from helpers import require_chromium

    chromium = require_chromium()
    page = tmp / "report.html"
    page.write_text(html, encoding="utf-8")
    cmd = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={tmp / 'profile'}",
        "--virtual-time-budget=5000",
        "--dump-dom",
        page.resolve().as_uri(),
    ]
    res = subprocess.run(
        cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "HOME": str(tmp)}
    )
    assert res.returncode == 0, res.stderr[-2000:]
    dom = res.stdout.split('id="section-method-metrics"', 1)
    assert len(dom) == 2 and "precision" in dom[1].split("</section>", 1)[0]


def test_rereading_a_study_against_chance(tmp_path: Path) -> None:
    """``actstore study chance`` on a tiny study: its raw figures are the study's, its chance
    columns the library's on the same readings, and ROME's filter removes the facts SQL says it must."""
    import actstore
    from actstore.query.methods.chance import pair_chance
    from actstore.query.methods.study import store_strata, study_readings

    data = tmp_path / "m2k"
    build_methods2k(M2K / "lre" / "factual", M2K / "known_1000.json", data, size=18, frequency=_zipf())
    store = build_store(tmp_path / "s", "llama", dataset=f"methods2k:{data}", limit=100)
    state, out = tmp_path / "state.json", tmp_path / "chance.json.gz"
    ok(
        *["run", str(store), "--state", str(state), "--all-facts", "--max-facts", "8", "--chunk", "4"]
        + ["--samples", "1", "--window", "2", "--random-draws", "1", "--resamples", "50"]
        + ["--methods", "trace,patch,attention,logit_lens"]
    )
    args = [
        "chance",
        str(store),
        "--state",
        str(state),
        "--out",
        str(out),
        "--resamples",
        "50",
        "--permutations",
        "200",
        "--methods",
        "trace,patch,attention,logit_lens",
    ]
    ok(*args)
    d = json.loads(gzip.decompress(out.read_bytes()))
    s = actstore.open(str(store))
    recorded = json.loads(state.read_text())
    study = {
        (r["method_a"], r["method_b"], r["metric"]): r
        for r in s.sql(
            f"SELECT * FROM method_pair_metrics WHERE run_id = '{recorded['metrics_knockout_run']}'"
        ).to_pylist()
    }
    got = {(r["method_a"], r["method_b"], r["metric"]): r for r in d["all"]["knockout"]["pairs"]}
    assert got[("trace", "patch", "key_layer")]["value"] == pytest.approx(
        study[("trace", "patch", "key_layer")]["value"]
    )
    readings = study_readings(s, ["trace", "patch"], recorded["trace_runs"], recorded["patch_runs"])
    ids = np.unique(np.concatenate([r.example_ids for r in readings.values()]))
    want = pair_chance(
        readings["trace"], readings["patch"], d["tolerance"], store_strata(s, ids)["stratum"], 200, 50
    )
    assert got[("trace", "patch", "key_layer")]["chance"] == pytest.approx(want["key_layer"].chance)
    assert got[("trace", "patch", "key_layer")]["kappa"] == pytest.approx(
        want["key_layer"].kappa, nan_ok=True
    )
    assert d["window"] == 2 and {"trace@centre", "patch@last", "logit_lens@half"} <= set(d["readings"])
    low = s.sql(
        "SELECT count(*) AS n FROM trace_facts WHERE list_contains($r, run_id) AND total_effect <= 0",
        {"r": recorded["trace_runs"]},
    )
    assert d["rome_filter"]["removed"] == low.column("n")[0].as_py()
    assert d["rome"]["n_facts"] == 8 - d["rome_filter"]["removed"]
    ok("tables", out)
    # --tuned corpus:STORE: the tuned lens read through the translators an `actstore corpus-lens` run
    # stored (issue 36's lens keys "for the corpus-trained tuned lens"), with its @top10 and @half keys
    from actstore.jobs.corpus_lens import run_corpus_lens
    from actstore.jobs.settings import CorpusLensConfig
    from actstore.query.methods.keys import lens_variant_readings
    from actstore.query.methods.readings import lens_reading, stored_outputs

    corpus = tiny_text_corpus(tmp_path / "corpus", seed=3)
    trained = run_corpus_lens(corpus, CorpusLensConfig(steps=4, batch=16, max_train_rows=48))
    assert trained.lens is not None
    tuned_json = tmp_path / "tuned.json"
    tuned_args = [*args[:5], str(tuned_json), *args[6:], "--tuned", f"corpus:{corpus.url}"]
    ok(*tuned_args)
    t = json.loads(tuned_json.read_text())
    assert t["tuned_lens"]["run_id"] == trained.run_id and t["tuned_lens"]["method"] == "corpus"
    so = stored_outputs(s, ids)
    direct = lens_reading(s, so, trained.lens)  # the trained lens object, not read back from the store
    keyed = {"tuned_lens": direct, **lens_variant_readings(s, so, direct, tuned=trained.lens)}
    assert set(keyed) == {"tuned_lens", "tuned_lens@top10", "tuned_lens@half"}
    for name, r in keyed.items():
        k = r.key_layer[r.key_layer >= 0]
        assert t["key_layer_median"][name] == pytest.approx(float(np.median(k))), name
        assert t["key_layer_distinct"][name] == np.unique(k).size, name
    pairs = {(r["method_a"], r["method_b"]) for r in t["all"]["variants"]}
    assert ("trace", "tuned_lens@half") in pairs or ("tuned_lens@half", "trace") in pairs
    # --also-trace: a second study on the same store with another window, read as trace@w1 on the first
    # study's facts and paired with every method; its trace-vs-trace figure is pair_chance's on the two runs
    state1 = tmp_path / "state-w1.json"
    ok(
        *["run", str(store), "--state", str(state1), "--all-facts", "--max-facts", "8", "--chunk", "8"]
        + ["--samples", "1", "--window", "1", "--no-patch", "--random-draws", "1", "--resamples", "50"]
        + ["--methods", "trace,logit_lens"]
    )
    w1_json = tmp_path / "w1.json"
    w1_args = [*args[:5], str(w1_json), *args[6:], "--also-trace", str(state1)]
    ok(*w1_args)
    w = json.loads(w1_json.read_text())
    runs1 = json.loads(state1.read_text())["trace_runs"]
    r1 = study_readings(s, ["trace"], runs1, [])["trace"]
    assert w["readings"]["trace@w1"] == len(np.intersect1d(r1.example_ids, readings["trace"].example_ids)) > 0
    want1 = pair_chance(readings["trace"], r1, w["tolerance"], store_strata(s, ids)["stratum"], 200, 50)
    row = next(
        r
        for r in w["all"]["variants"]
        if {r["method_a"], r["method_b"]} == {"trace", "trace@w1"} and r["metric"] == "key_layer_exact"
    )
    assert row["value"] == pytest.approx(want1["key_layer_exact"].value)
    assert row["chance"] == pytest.approx(want1["key_layer_exact"].chance)
    # --summary: one table with a column per output; each cell is that output's own row (found in
    # either order), a figure only one output has is "-" in the other's column
    printed = ok("summary", f"w2={out}", f"w1={w1_json}").stdout
    lines = {ln.split(" | ")[0].lstrip("| "): ln.split(" | ")[1:] for ln in printed.splitlines()}
    tp = got[("trace", "patch", "key_layer")]
    kappa = "n/a" if tp["kappa"] != tp["kappa"] else f"{tp['kappa']:+.2f}"
    assert lines["trace vs patch"][0] == (
        f"{100 * tp['value']:.1f}% / {100 * tp['chance']:.1f}% / {100 * tp['excess']:+.1f} "
        f"[{100 * tp['excess_low']:+.1f}, {100 * tp['excess_high']:+.1f}] / {kappa} ({tp['n']})"
    )
    tv = got[("trace", "patch", "verdict")]
    assert lines["trace vs patch, verdict"][0].startswith(
        f"{100 * tv['value']:.1f}% / {100 * tv['chance']:.1f}% / "
    )
    assert lines["trace vs trace@w1"][0] == "-"
    w1_key = next(
        r
        for r in w["all"]["variants"]
        if {r["method_a"], r["method_b"]} == {"trace", "trace@w1"} and r["metric"] == "key_layer"
    )
    assert w1_key["value"] == pytest.approx(want1["key_layer"].value)
    assert lines["trace vs trace@w1"][1].startswith(
        f"{100 * w1_key['value']:.1f}% / {100 * w1_key['chance']:.1f}% / "
    )
    bad = invoke_study("summary", out)  # no LABEL=: a usage error, one line
    assert bad.exit_code == 2 and "LABEL=FILE" in bad.stderr and "\n" not in bad.stderr.strip(), bad.output
