"""MAPS: static scores against a brute-force computation from the model's own weights, dynamic
scores against plain forward hooks, the ablation experiment, the command line and bad input.

Pairs are invented fixtures in the MAPS authors' layout (tests/data/maps/datasets, written by
tests/data/make_fixtures.py); the real pair files are not needed."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from click.testing import CliRunner
from helpers import FIXTURES, real_data

import actstore
from actstore.cli import main
from actstore.ingest.models.tiny import tiny_model
from actstore.query.maps.dynamic import correlation_summary, dynamic_ranks
from actstore.query.maps.pairs import load_pair_files, store_pairs, tokenize_pairs
from actstore.query.maps.projection import VocabProjection
from actstore.query.maps.static import salient_operations, static_scores
from actstore.query.select.store_tokenizer import stored_tokenizer

MAPS_DATA = FIXTURES / "maps" / "datasets"
RELS = ("country_to_capital_wikidata", "adj_antonym")


@pytest.fixture(scope="module")
def maps_store(store_factory: Callable[..., Path]) -> Path:
    return store_factory(
        "llama", dataset=f"maps:{MAPS_DATA}", template="This is a document about {}", relations=RELS, limit=12
    )


# ----------------------------------------------------------------------------------- brute force


def full_maps(model: Any, layer: int, head: int, final_norm: bool) -> torch.Tensor:
    """M = E W_V W_O U for the whole (tiny) vocabulary, float64, from the model's modules."""
    cfg = model.config
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    dh = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    attn = model.model.layers[layer].self_attn
    Wv = attn.v_proj.weight.double()  # [Hkv*dh, d]  (nn.Linear: out x in)
    Wo = attn.o_proj.weight.double()  # [d, H*dh]
    kv = head // (H // Hkv)
    W_vo = Wv[kv * dh : (kv + 1) * dh].T @ Wo[:, head * dh : (head + 1) * dh].T  # [d, d]
    E = model.model.embed_tokens.weight.double()
    U = model.lm_head.weight.double()  # [V, d]
    if final_norm:
        w = model.model.norm.weight.double()
        if "Gemma" in type(model.model.norm).__name__:
            w = 1.0 + w
        U = U * w
    return E @ W_vo @ U.T


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("final_norm", [True, False])
def test_static_scores_equal_brute_force(
    arch: str, final_norm: bool, store_factory: Callable[..., Path]
) -> None:
    store = actstore.open(store_factory(arch, limit=1))
    model = tiny_model(arch).model
    tok = stored_tokenizer(store)
    rels = load_pair_files([MAPS_DATA], list(RELS))
    # The "first" variant (ours): the tiny vocabulary splits most names, so first tokens stand in (the
    # published single-token default is checked in test_paper_defaults.py).
    pairs = [tokenize_pairs(r, tok, vocab_size=store.geometry.vocab_size, multi_token="first") for r in rels]
    assert pairs[0].n_multi_token > 0
    scores = static_scores(VocabProjection(store, final_norm=final_norm), pairs)
    g = store.geometry
    for layer, head in [(0, 0), (g.n_layers - 1, 1), (1, g.n_heads - 1)]:
        M = full_maps(model, layer, head, final_norm)
        for p in pairs:
            s = scores[p.relation]
            for k in (1, 10):
                top = torch.topk(M[torch.from_numpy(p.src)], k, dim=1).indices
                phi = (top == torch.from_numpy(p.dst)[:, None]).any(1).double().mean().item()
                bot = torch.topk(-M[torch.from_numpy(p.src)], k, dim=1).indices
                sup = (bot == torch.from_numpy(p.dst)[:, None]).any(1).double().mean().item()
                assert s.score(k)[layer, head] == pytest.approx(phi, abs=1e-12), (p.relation, layer, head, k)
                assert s.suppression(k)[layer, head] == pytest.approx(sup, abs=1e-12)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_first_mlp_static_scores_equal_brute_force(arch: str, store_factory: Callable[..., Path]) -> None:
    """Layers >= 1 read MLP0(norm(e)) (Gemma: post-norm too); layer 0 the embeddings."""
    from actstore.ingest.capture.first_mlp import first_mlp_transform

    store = actstore.open(store_factory(arch, limit=1))
    model = tiny_model(arch).model
    rel = load_pair_files([MAPS_DATA], [RELS[1]])[0]
    pairs = tokenize_pairs(
        rel, stored_tokenizer(store), vocab_size=store.geometry.vocab_size, multi_token="first"
    )
    proj = VocabProjection(store, first_mlp=first_mlp_transform(model))
    s = static_scores(proj, [pairs])[RELS[1]]
    block = model.model.layers[0]
    scale = float(getattr(model.model.embed_tokens, "embed_scale", 1.0))
    E = model.model.embed_tokens.weight.detach() * scale
    with torch.no_grad():
        if arch == "gemma3":
            eff = block.post_feedforward_layernorm(block.mlp(block.pre_feedforward_layernorm(E)))
        else:
            eff = block.mlp(block.post_attention_layernorm(E))
    g = store.geometry
    for layer, head in [(0, 1), (1, 0), (g.n_layers - 1, g.n_heads - 1)]:
        src_rows = (E if layer == 0 else eff).double()
        attn = model.model.layers[layer].self_attn
        kv = head // g.kv_group
        W_vo = (
            attn.v_proj.weight.double()[kv * 16 : (kv + 1) * 16].T
            @ attn.o_proj.weight.double()[:, head * 16 : (head + 1) * 16].T
        )
        w = model.model.norm.weight.double() + (1.0 if arch == "gemma3" else 0.0)
        rows = src_rows[torch.from_numpy(pairs.src)] @ W_vo @ (model.lm_head.weight.double() * w).T
        top = torch.topk(rows, 10, dim=1).indices
        phi = (top == torch.from_numpy(pairs.dst)[:, None]).any(1).double().mean().item()
        assert s.score(10)[layer, head] == pytest.approx(phi, abs=1e-12), (arch, layer, head)


@pytest.mark.real_data
def test_real_pair_files_score_like_brute_force(store_factory: Callable[..., Path]) -> None:
    """The MAPS authors' own 20 pair files load, tokenize and score as the brute force says (one head)."""
    real = real_data("maps/datasets")
    store = actstore.open(store_factory("llama", limit=1))
    model = tiny_model("llama").model
    rels = load_pair_files([real])
    assert len(rels) == 20 and {r.relation for r in rels} >= set(CONTROL_RELS)
    pairs = [
        tokenize_pairs(r, stored_tokenizer(store), vocab_size=store.geometry.vocab_size, multi_token="first")
        for r in rels
    ]
    assert all(p.n_used + p.n_unknown == p.n_pairs for p in pairs)
    scores = static_scores(VocabProjection(store), pairs)
    M = full_maps(model, 1, 2, True)
    for p in pairs:
        rows = M[torch.from_numpy(p.src)]
        target = rows[torch.arange(p.n_used), torch.from_numpy(p.dst)][:, None]
        phi = float(((rows > target).sum(1) < 10).double().mean())
        assert scores[p.relation].score(10)[1, 2] == pytest.approx(phi, abs=1e-12), p.relation


def test_salient_operations_equal_brute_force(store_factory: Callable[..., Path]) -> None:
    store = actstore.open(store_factory("llama", limit=1))
    model = tiny_model("llama").model
    V = len(stored_tokenizer(store))
    ops = salient_operations(VocabProjection(store), [(1, 2)], n_tokens=5, n_mappings=3, vocab_limit=V)
    attn = model.model.layers[1].self_attn
    dh = 16
    W_vo = attn.v_proj.weight.double()[1 * dh : 2 * dh].T @ attn.o_proj.weight.double()[:, 2 * dh : 3 * dh].T
    E = model.model.embed_tokens.weight.double()[:V]
    sigma = ((E @ W_vo).norm(dim=1) / E.norm(dim=1)).nan_to_num(0.0)  # the padding row is all zeros
    top = torch.topk(sigma, 5).indices
    assert ops[0].token_ids.tolist() == top.tolist()
    np.testing.assert_allclose(ops[0].sigma, sigma[top].numpy(), rtol=1e-4)
    M = full_maps(model, 1, 2, True)
    assert ops[0].mapped_ids.tolist() == torch.topk(M[top], 3, dim=1).indices.tolist()


# ----------------------------------------------------------------------------------- dynamic


def test_dynamic_ranks_equal_forward_hooks(maps_store: Path) -> None:
    """From the store alone == from hooks on a fresh forward pass of each prompt."""
    store = actstore.open(maps_store)
    ranks = dynamic_ranks(store)
    assert set(ranks) == set(RELS)
    model = tiny_model("llama").model
    g = store.geometry
    pairs = store_pairs(store).to_pylist()
    ids = store.sql("SELECT example_id, list(token_id ORDER BY position) AS ids FROM tokens GROUP BY 1")
    token_ids = dict(zip(ids.column("example_id").to_pylist(), ids.column("ids").to_pylist()))
    seen: dict[str, torch.Tensor] = {}
    layer = g.n_layers - 1
    attn = model.model.layers[layer].self_attn
    h1 = attn.o_proj.register_forward_hook(lambda m, a, o: seen.__setitem__("z", a[0]))
    h2 = attn.v_proj.register_forward_hook(lambda m, a, o: seen.__setitem__("v", o))
    U = model.lm_head.weight.double() * model.model.norm.weight.double()
    try:
        for p in pairs[:6]:
            with torch.no_grad():
                model(input_ids=torch.tensor([token_ids[p["example_id"]]]))
            d = ranks[p["relation_id"]]
            i = int(np.flatnonzero(d.example_ids == p["example_id"])[0])
            for head in range(g.n_heads):
                Wo = attn.o_proj.weight.double()[:, head * 16 : (head + 1) * 16]
                z = seen["z"][0, -1, head * 16 : (head + 1) * 16].double()
                row = (z @ Wo.T) @ U.T
                kv = head // g.kv_group
                v = seen["v"][0, p["src_position"], kv * 16 : (kv + 1) * 16].double()
                row_wo = (v @ Wo.T) @ U.T
                # ranks are censored at k_max; allow one rank of float32-vs-float64 rounding
                rank_w = min(int((row > row[p["dst_id"]]).sum()), d.k_max)
                rank_wo = min(int((row_wo > row_wo[p["dst_id"]]).sum()), d.k_max)
                assert abs(rank_w - int(d.w_up[i, layer, head])) <= 1
                assert abs(rank_wo - int(d.wo_up[i, layer, head])) <= 1
    finally:
        h1.remove()
        h2.remove()
    summary = correlation_summary(ranks[RELS[0]], k=10)
    assert summary["n_prompts"] == 12 and summary["n_templates"] == 1


def test_dynamic_groups_templates(tmp_path: Path) -> None:
    from helpers import build_store

    data = json.loads((MAPS_DATA / RELS[0] / f"{RELS[0]}.json").read_text())[:4]
    lines = []
    for t in ("No {} means no", "The story of {} contains"):
        for s, o in data:
            lines.append(
                {"text": t.format(s), "subject": s, "object": o, "relation_id": RELS[0], "template": t}
            )
    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in lines))
    store = actstore.open(build_store(tmp_path / "s", dataset=f"jsonl:{f}", limit=20))
    d = dynamic_ranks(store)[RELS[0]]
    assert d.templates == sorted({"No {} means no", "The story of {} contains"})
    assert np.bincount(d.group).tolist() == [4, 4]
    # The static score only depends on the pair: identical across the two templates.
    st = d.per_template(d.static_up, 10)
    np.testing.assert_array_equal(st[0], st[1])


def test_dynamic_alt_static_variant_equals_separate_run(maps_store: Path) -> None:
    """--compare-first-mlp: one dynamic pass with a second static side == two separate runs."""
    from actstore.ingest.capture.first_mlp import first_mlp_transform

    store = actstore.open(maps_store)
    mlp = VocabProjection(store, first_mlp=first_mlp_transform(tiny_model("llama").model))
    both = dynamic_ranks(store, alt_proj=mlp)
    plain = dynamic_ranks(store)
    alone = dynamic_ranks(store, proj=mlp)
    for rel in RELS:
        d, alt = both[rel], both[rel].alt
        assert alt is not None and alt.first_mlp and not d.first_mlp
        for a, b in ((d, plain[rel]), (alt, alone[rel])):
            np.testing.assert_array_equal(a.example_ids, b.example_ids)
            for key in ("static_up", "static_down", "w_up", "wo_up"):
                # the alternative static ranks go through another product order: allow rare
                # one-rank moves from float rounding at near-ties
                assert (np.abs(getattr(a, key) - getattr(b, key)) > 1).sum() == 0, (rel, key)
                assert (getattr(a, key) != getattr(b, key)).mean() < 0.01, (rel, key)
        assert not np.array_equal(alt.static_up, d.static_up)  # layers >= 1 read other sources


# ----------------------------------------------------------------------------------- ablation


def test_ablation_experiment(maps_store: Path) -> None:
    from actstore.interventions.ablation import run_ablation
    from actstore.interventions.runner import InterventionRunner
    from actstore.query.maps.settings import AblationConfig

    store = actstore.open(maps_store)
    runner = InterventionRunner(tiny_model("llama").model)
    # 12 prompts per relation in the fixture store: below the authors' minimum of 30 pairs, so lowered here
    res = run_ablation(runner, store, AblationConfig(RELS[0], k=50, top_m=3, random_draws=2, min_pairs=1))
    m = res.summary
    # The runner reproduces the greedy predictions recorded at ingest.
    assert m["base"] == pytest.approx(m["store_base"])
    conditions = [r["condition"] for r in res.rows]
    assert conditions[:2] == ["none", "relation_heads"] and conditions.count("random_heads") == 2
    assert all(r["n_heads"] == len(res.heads) for r in res.rows if r["condition"] == "random_heads")
    random_heads = {h for r in res.rows if r["condition"] == "random_heads" for h in r["heads"].split(",")}
    assert not random_heads & {f"{a}.{b}" for a, b in res.heads}
    explicit = run_ablation(
        runner,
        store,
        AblationConfig(RELS[0], heads=((0, 0), (1, 3)), controls=(RELS[1],), random_draws=0, mode="mean"),
    )
    assert explicit.summary["n_heads"] == 2 and explicit.summary["controls"][0]["relation"] == RELS[1]


def test_store_pairs_of_chosen_relations_are_bound_not_pasted(maps_store: Path) -> None:
    from actstore.interventions.ablation import pairs_from_store

    store = actstore.open(maps_store)
    every = store_pairs(store)
    rel = np.asarray(every.column("relation_id").to_pylist())
    one = store_pairs(store, relations=[RELS[1]])
    assert one.to_pylist() == every.filter(pa.array(rel == RELS[1])).to_pylist() and one.num_rows > 0
    assert store_pairs(store, store.select("example_id % 2 = 0"), relations=list(RELS)).to_pylist() == [
        r for r in every.to_pylist() if r["example_id"] % 2 == 0
    ]
    assert store_pairs(store, relations=["it's'); DROP TABLE examples; --"]).num_rows == 0
    tp = pairs_from_store(store, RELS[0])
    mine = {(r["src_id"], r["dst_id"]) for r in every.to_pylist() if r["relation_id"] == RELS[0]}
    assert sorted(zip(tp.src.tolist(), tp.dst.tolist())) == sorted(mine) and tp.n_used == len(mine)


CONTROL_RELS = (
    "country_to_capital_wikidata",
    "adj_antonym",
    "name_copying",
    "verb_past_tense",
    "adj_comparative",
)


def test_automatic_controls_stored_equal_recomputed(store_factory: Callable[..., Path]) -> None:
    """The control choice reads a matching stored `maps` run or recomputes the scores; both give the same
    choice, and the overlaps and base accuracies reported equal a brute-force computation from the model."""
    from actstore.interventions.ablation import run_ablation
    from actstore.interventions.runner import InterventionRunner
    from actstore.query.maps.settings import AblationConfig

    path = store_factory(
        "llama",
        dataset=f"maps:{MAPS_DATA}",
        template="This is a document about {}",
        relations=CONTROL_RELS,
        limit=12,
    )
    store = actstore.open(path)
    loaded = tiny_model("llama")
    g = store.geometry
    k, m = 20, 3
    rels = load_pair_files([MAPS_DATA], list(CONTROL_RELS))
    # the fixture's words are mostly several tiny-tokenizer tokens: the "first" variant, and no minimum
    pairs = {
        r.relation: tokenize_pairs(r, loaded.tokenizer, vocab_size=g.vocab_size, multi_token="first")
        for r in rels
    }
    # Independent phi_R of every head: full |V| x |V| maps from the model's modules, targets' ranks by counting.
    full = {
        (layer, h): full_maps(loaded.model, layer, h, final_norm=True)
        for layer in range(g.n_layers)
        for h in range(g.n_heads)
    }

    def brute_phi(rel: str) -> np.ndarray:
        tp = pairs[rel]
        out = np.zeros((g.n_layers, g.n_heads))
        for (layer, h), M in full.items():
            rows = M[torch.from_numpy(tp.src)]
            val = rows[torch.arange(len(tp.src)), torch.from_numpy(tp.dst)][:, None]
            out[layer, h] = float(((rows > val).sum(1) < k).double().mean())
        return out

    phi = {r: brute_phi(r) for r in CONTROL_RELS}
    relation = CONTROL_RELS[0]
    flat = np.argsort(-phi[relation].ravel(), kind="stable")[:m]
    heads = {(int(i // g.n_heads), int(i % g.n_heads)) for i in flat}
    base = store.sql(
        "SELECT e.relation_id AS r, avg((t.top_token_id = t.object_token_id)::DOUBLE) AS acc "
        "FROM examples e JOIN targets t USING (example_id) WHERE t.object_token_id >= 0 GROUP BY 1"
    )
    store_base = dict(zip(base.column("r").to_pylist(), base.column("acc").to_pylist()))

    runner = InterventionRunner(loaded.model)
    # The tiny random model answers nothing (base 0 everywhere): let controls with base 0 qualify here.
    cfg = AblationConfig(
        relation,
        k=k,
        top_m=m,
        random_draws=0,
        max_head_overlap=0.5,
        max_controls=2,
        min_control_base=-1.0,
        min_pairs=1,
        multi_token="first",
        first_mlp=False,
    )
    computed = run_ablation(runner, store, cfg, pairs=pairs).summary  # no stored run yet: computed
    assert set(computed["static_scores"].values()) == {"computed from its pair file"}
    # the brute force above reads the embeddings: --no-first-mlp (the authors' first MLP is the default)
    variant = ["--multi-token", "first", "--min-pairs", "1", "--no-first-mlp"]
    r = CliRunner().invoke(
        main,
        [
            "maps",
            str(path),
            "--pairs",
            str(MAPS_DATA),
            "--relations",
            ",".join(CONTROL_RELS),
            "--k",
            str(k),
            "--salient-heads",
            "none",
            "--json",
            *variant,
        ],
    )
    assert r.exit_code == 0, r.output + str(r.stderr)
    run_id = json.loads(r.stdout)["run_id"]
    # A stored run with another k does not match and is not used.
    r = CliRunner().invoke(
        main,
        [
            "maps",
            str(path),
            "--pairs",
            str(MAPS_DATA),
            "--relations",
            ",".join(CONTROL_RELS),
            "--k",
            str(k + 1),
            "--salient-heads",
            "none",
            *variant,
        ],
    )
    assert r.exit_code == 0, r.output + str(r.stderr)
    stored = run_ablation(runner, store, cfg, pairs=pairs).summary
    assert stored["static_scores"] == {rel: f"stored run {run_id}" for rel in CONTROL_RELS}
    assert stored["heads"] == computed["heads"]
    assert {tuple(map(int, h.split("."))) for h in stored["heads"].split(",")} == heads
    assert stored["control_choice"] == [
        {**c, "score_source": f"stored run {run_id}"} for c in computed["control_choice"]
    ]
    # The settings must match: through the first MLP (the default), nothing is stored, so everything is computed.
    mlp = run_ablation(
        runner,
        store,
        AblationConfig(relation, k=k, top_m=m, random_draws=0, min_pairs=1, multi_token="first"),
        pairs=pairs,
    ).summary
    assert all(v.startswith("computed") for v in mlp["static_scores"].values())

    choice = {c["relation"]: c for c in stored["control_choice"]}
    assert set(choice) == set(CONTROL_RELS[1:])
    expected = []
    for c in CONTROL_RELS[1:]:
        cf = np.argsort(-phi[c].ravel(), kind="stable")[:m]
        c_heads = {(int(i // g.n_heads), int(i % g.n_heads)) for i in cf if phi[c].ravel()[i] > 0}
        overlap = len(c_heads & heads) / m
        gap = abs(store_base[c] - store_base[relation])
        assert choice[c]["head_overlap"] == pytest.approx(overlap), c
        assert choice[c]["store_base"] == pytest.approx(store_base[c]), c
        if overlap < 0.5 and gap < 0.2:
            expected.append((gap, overlap, c))
    chosen = [c for _, _, c in sorted(expected)[:2]]
    assert [c["relation"] for c in stored["controls"]] == chosen
    assert sorted(c for c in choice if choice[c]["chosen"]) == sorted(chosen)
    assert chosen, "the test needs at least one control that qualifies"
    assert any(not choice[c]["chosen"] for c in choice), "and at least one that does not"
    for c in stored["controls"]:  # the chosen controls are run: their measured base is the recorded one
        assert c["base"] == pytest.approx(store_base[c["relation"]])
    strict = run_ablation(
        runner,
        store,
        AblationConfig(
            relation,
            k=k,
            top_m=m,
            random_draws=0,
            max_head_overlap=0.5,
            max_accuracy_gap=0.0,
            min_control_base=-1.0,
            min_pairs=1,
            multi_token="first",
            first_mlp=False,
        ),
        pairs=pairs,
    ).summary
    assert strict["controls"] == [] and all(
        "gap >= 0.0" in c["reason"] or "head overlap" in c["reason"] for c in strict["control_choice"]
    )
    default = run_ablation(
        runner,
        store,
        AblationConfig(
            relation,
            k=k,
            top_m=m,
            random_draws=0,
            max_head_overlap=0.5,
            min_pairs=1,
            multi_token="first",
            first_mlp=False,
        ),
        pairs=pairs,
    ).summary  # by default a control with base accuracy 0 does not qualify
    assert default["controls"] == [] and {
        c["relation"] for c in default["control_choice"] if "no drop to measure" in c["reason"]
    } == {c for _, _, c in expected}
    # The command line: text output names each candidate's decision and where the scores came from.
    args = [
        "ablate",
        "--model",
        "tiny-llama",
        str(path),
        "--relation",
        relation,
        "--pairs",
        str(MAPS_DATA),
        "--k",
        str(k),
        "--top-m",
        str(m),
        "--random-draws",
        "0",
        "--max-head-overlap",
        "0.5",
        "--no-save",
        "--quiet",
        *variant,
    ]
    r = CliRunner().invoke(main, [*args, "--scores-store", str(path)])
    assert r.exit_code == 0, r.output + str(r.stderr)
    assert f"static scores stored run {run_id}: {relation}" in r.stdout
    assert all(f"skipped {c:<40} base accuracy 0.00 <= 0.0" in r.stdout for _, _, c in expected), r.stdout
    other = store_factory("gemma3", limit=1)  # another model's store: its scores cannot stand in
    r = CliRunner().invoke(main, [*args, "--scores-store", str(other)])
    # a refused setting: a usage error (docs/commands.md, "Errors and exit codes")
    assert r.exit_code == 2 and r.stderr.strip().count("\n") == 0 and "another model's weights" in r.stderr, (
        r.stderr
    )


# ----------------------------------------------------------------------------------- command line


def test_cli_maps_json_and_tables(maps_store: Path, tmp_path: Path) -> None:
    variant = ["--multi-token", "first", "--min-pairs", "1"]  # the fixture's words are several tiny tokens
    r = CliRunner().invoke(
        main,
        [
            "maps",
            str(maps_store),
            "--pairs",
            str(MAPS_DATA),
            "--relations",
            ",".join(RELS),
            "--salient-heads",
            "1.*",
            "--figures",
            str(tmp_path / "fig"),
            "--json",
            *variant,
        ],
    )
    assert r.exit_code == 0, r.output + str(r.stderr)
    out = json.loads(r.stdout)
    assert {x["relation"] for x in out["relations"]} == set(RELS)
    rel = out["relations"][0]
    assert {"relation", "layer", "head", "score", "suppression"} <= set(rel["heads"][0])
    assert len(rel["heads"]) == 2 * 4 and rel["n_multi_token"] > 0
    assert len(out["salient"]) == 4 and len(out["salient"][0]["tokens"][0]["mapped"]) == 5
    assert all(Path(p).is_file() for p in out["heatmaps"])
    s = actstore.open(maps_store)
    n = (
        s.sql(f"SELECT count(*) AS n FROM maps_scores WHERE run_id = '{out['run_id']}'")
        .column("n")[0]
        .as_py()
    )
    assert n == 2 * 8
    r = CliRunner().invoke(
        main, ["maps-dynamic", str(maps_store), "--json", "--no-save", "--no-first-mlp", *variant]
    )
    assert r.exit_code == 0, r.output + str(r.stderr)
    dyn = json.loads(r.stdout)
    assert {x["relation"] for x in dyn["relations"]} == set(RELS)
    assert "corr_w_context" in dyn["relations"][0] and len(dyn["relations"][0]["heads"]) == 8
    r = CliRunner().invoke(
        main, ["maps-dynamic", str(maps_store), "--json", "--quiet", "--compare-first-mlp", *variant]
    )
    assert r.exit_code == 0, r.output + str(r.stderr)
    both = json.loads(r.stdout)
    assert sorted((x["relation"], x["first_mlp"]) for x in both["relations"]) == sorted(
        (rel, f) for rel in RELS for f in (False, True)
    )
    plain = {x["relation"]: x for x in dyn["relations"]}
    for x in both["relations"]:
        if not x["first_mlp"]:  # the plain variant is the --no-first-mlp run
            assert x["corr_w_context"] == pytest.approx(plain[x["relation"]]["corr_w_context"], nan_ok=True)
    t = s.sql(
        f"SELECT first_mlp, count(*) AS n FROM maps_correlation WHERE run_id = '{both['run_id']}' GROUP BY 1"
    )
    assert sorted(t.column("n").to_pylist()) == [2, 2]


def test_cli_ablate_json(maps_store: Path) -> None:
    args = ["ablate", "--model", "tiny-llama", str(maps_store), "--relation", RELS[0], "--heads", "1.0,1.1"]
    args += ["--random-draws", "1", "--no-controls", "--json", "--quiet"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output + str(r.stderr)
    out = json.loads(r.stdout)
    assert out["relations"][0]["n_heads"] == 2 and len(out["rows"]) == 3
    # --where keeps the relation's prompts it selects (checked before the model loads, then run)
    half = CliRunner().invoke(main, [*args, "--where", "example_id % 2 = 0"])
    assert half.exit_code == 0, half.output + str(half.stderr)
    n_all, n_half = out["relations"][0]["n_prompts"], json.loads(half.stdout)["relations"][0]["n_prompts"]
    assert 0 < n_half < n_all, (n_half, n_all)


@pytest.mark.parametrize(
    "case",
    ["not_pairs", "not_pair_items", "unknown_words", "head_out_of_range", "ablate_head", "no_relation"],
)
def test_bad_input_is_one_line(case: str, maps_store: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    store = str(maps_store)
    if case == "not_pairs":
        bad.write_text(json.dumps({"France": "Paris"}))
        args = ["maps", store, "--pairs", str(bad)]
    elif case == "not_pair_items":
        bad.write_text(json.dumps([["France", "Paris"], ["Spain"], ["Italy", 3]]))
        args = ["maps", store, "--pairs", str(bad)]
    elif case == "unknown_words":
        bad.write_text(json.dumps([["", " "], [" ", ""]]))
        args = ["maps", store, "--pairs", str(bad)]
    elif case == "head_out_of_range":
        args = ["maps", store, "--pairs", str(MAPS_DATA / RELS[1]), "--salient-heads", "7.2"]
    elif case == "ablate_head":
        args = ["ablate", "--model", "tiny-llama", store, "--relation", RELS[0], "--heads", "0.9"]
    else:
        args = ["ablate", "--model", "tiny-llama", store, "--relation", "no_such_relation"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == (2 if case == "no_relation" else 1), r.output  # a refused --relation: usage (2)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    expect = {
        "not_pairs": "list of [source, target]",
        "not_pair_items": 'item 1 is ["Spain"], not a [source, target]',
        "unknown_words": "usable pairs needed (usable/pairs: bad 0/2)",
        "head_out_of_range": "out of range",
        "ablate_head": "out of range",
        "no_relation": "no prompts",
    }[case]
    assert expect in lines[0]
