"""Causal tracing and activation patching: identities on tiny models, batching, bad input."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import KNOWN_STORE_KW

import actstore
from actstore.core.errors import EmptySelectionWarning, InvalidSetting, PatchError
from actstore.ingest.capture.architectures import architecture_for as architecture_for_model
from actstore.ingest.models.tiny import tiny_model
from actstore.interventions.patching import ActivationPatcher, PatchPair
from actstore.interventions.runner import Intervention, InterventionRunner, RunItem
from actstore.interventions.settings import PatchConfig, TraceConfig
from actstore.interventions.tracing import (
    CausalTracer,
    GroupedEditRunner,
    StoredFact,
    TraceError,
    stored_facts,
    subject_embedding_std,
    window_layers,
)
from actstore.query.select.selection import Selection

STORE_KW = KNOWN_STORE_KW  # invented facts


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    n = torch.get_num_threads()  # tiny tensors: extra threads only contend with each other
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture()
def llama_store(store_factory: Callable[..., Path]) -> Path:
    return store_factory("llama", **STORE_KW)


def _tracer(
    arch: str, cfg: TraceConfig, noise: float | None = None, grouped: bool = True
) -> tuple[Any, CausalTracer]:
    loaded = tiny_model(arch)
    runner = (GroupedEditRunner if grouped else InterventionRunner)(loaded.model)
    return loaded, CausalTracer(runner, cfg, 0.1 if noise is None else noise)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_restoring_the_last_layer_at_the_last_position_recovers_the_clean_output(
    arch: str, store_factory: Callable[..., Path]
) -> None:
    """Necessary identity: IE(resid, L-1, last) = TE, and p_restored there = p_clean."""
    store = actstore.open(store_factory(arch, **STORE_KW))
    facts = stored_facts(store, correct_only=False, limit=2)
    loaded, tracer = _tracer(arch, TraceConfig(samples=2, window=1, components=("resid",)))
    tracer.noise_std = 3 * subject_embedding_std(loaded.model, store)
    for r in tracer.trace(facts):
        assert abs(r.total_effect) > 0  # the noise does change the output
        ie = r.indirect_effect("resid")
        assert ie[-1, -1] == pytest.approx(r.total_effect, abs=1e-6)
        assert r.restored["resid"][-1, -1] == pytest.approx(r.p_clean, abs=1e-6)
        # Positions before the subject: the noise cannot reach them; IE = 0 exactly.
        assert np.all(ie[:, : r.fact.subject_span[0]] == 0)


def test_stored_facts_of_chosen_examples(llama_store: Path) -> None:
    store = actstore.open(llama_store)
    every = stored_facts(store, correct_only=False)
    pick = [every[-1].example_id, every[0].example_id, 10**9]  # any order; an unknown id selects nothing
    with pytest.warns(EmptySelectionWarning, match="1000000000"):  # and is named
        got = stored_facts(store, Selection.from_ids(store, pick), correct_only=False)
    assert [f.example_id for f in got] == sorted(pick[:2]) and got[0] == every[0] and got[1] == every[-1]
    assert stored_facts(store, Selection.from_ids(store, []), correct_only=False) == []


def test_restoring_every_position_recovers_the_clean_probability(llama_store: Path) -> None:
    store = actstore.open(llama_store)
    fact = stored_facts(store, correct_only=False, limit=1)[0]
    loaded, tracer = _tracer("llama", TraceConfig(samples=1, window=1), noise=0.5)
    clean = tracer.clean([fact])[0]
    noise = tracer._noise_edit(fact, 0)
    items = [RunItem(fact.input_ids, (noise,), fact.target_id)]
    for layer in range(tracer.n_layers):
        value = clean.states[("resid", layer + 1)]
        items.append(
            RunItem(
                fact.input_ids,
                (noise, Intervention("resid", layer + 1, "set", None, value=value)),
                fact.target_id,
            )
        )
    p = np.exp(tracer.runner.run(items).target_logprob)
    assert abs(p[0] - clean.p) > 1e-6
    np.testing.assert_allclose(p[1:], clean.p, rtol=1e-5, atol=1e-7)


def test_zero_noise_gives_zero_effect(llama_store: Path) -> None:
    store = actstore.open(llama_store)
    facts = stored_facts(store, correct_only=False, limit=1)
    _, tracer = _tracer("llama", TraceConfig(samples=2, window=2), noise=0.0)
    r = tracer.trace(facts)[0]
    assert r.total_effect == pytest.approx(0, abs=1e-7)
    for c in r.restored:
        np.testing.assert_allclose(r.indirect_effect(c), 0, atol=1e-7)


def test_batched_restorations_equal_one_at_a_time_runs(llama_store: Path) -> None:
    """Many restorations per forward pass (vectorised edits, two facts of different lengths per batch)
    give what one restoration per forward pass of the plain runner gives (the full-recomputation runner)."""
    store = actstore.open(llama_store)
    facts = stored_facts(store, correct_only=False, limit=2)
    assert facts[0].n_tokens != facts[1].n_tokens or facts[0].subject_span != facts[1].subject_span
    cfg = TraceConfig(samples=1, window=2, batch_size=4096, incremental=False)
    _, batched = _tracer("llama", cfg, noise=0.2)
    _, single = _tracer("llama", replace(cfg, batch_size=1), noise=0.2, grouped=False)
    for a, b in zip(batched.trace(facts), single.trace(facts)):
        assert a.p_corrupt == pytest.approx(b.p_corrupt, rel=1e-5)
        for c in a.restored:
            np.testing.assert_allclose(a.restored[c], b.restored[c], rtol=1e-4, atol=1e-7)


def test_window_layers_follow_rome() -> None:
    assert list(window_layers(0, 10, 30)) == list(range(0, 5))
    assert list(window_layers(15, 10, 30)) == list(range(10, 20))
    assert list(window_layers(29, 10, 30)) == list(range(24, 30))
    assert list(window_layers(3, 1, 30)) == [3]


def test_bad_tracing_input_is_refused() -> None:
    fact = StoredFact(7, "P1", "Mars", "Sol", (1, 2, 3), ("a", "b", "c"), (-1, -1), 5, True)
    with pytest.raises(TraceError, match="subject 'Mars' is not in its prompt"):
        fact.check()
    with pytest.raises(InvalidSetting, match="larger than the model"):  # a refused setting: exit 2
        TraceConfig(window=3).validate(2)
    with pytest.raises(InvalidSetting, match="samples: must be at least 1, not 0"):
        TraceConfig(samples=0).validate(2)


def test_patching_the_last_layer_at_the_last_position_recovers_fully(llama_store: Path) -> None:
    store = actstore.open(llama_store)
    facts = {f.example_id: f for f in stored_facts(store, correct_only=False)}
    loaded = tiny_model("llama")
    patcher = ActivationPatcher(GroupedEditRunner(loaded.model), PatchConfig(batch_size=256))
    r = patcher.patch([PatchPair(facts[0], facts[1])])[0]
    L, H = patcher.n_layers, patcher.n_heads
    assert r.recovery[("resid", "last")][-1] == pytest.approx(1.0, abs=1e-4)
    assert r.head_recovery["last"].shape == (L, H) and np.isfinite(r.head_recovery["last"]).all()
    # Patching the last layer's output at the subject (not the last token) cannot change the output.
    assert r.recovery[("resid", "subject_last")][-1] == pytest.approx(0.0, abs=1e-4)
    other = next(f for f in facts.values() if f.relation_id != facts[0].relation_id)
    with pytest.raises(PatchError, match="same relation"):
        PatchPair(facts[0], other).check()


def test_cli_trace_json_and_bad_input_exits(llama_store: Path) -> None:
    from actstore.cli import main

    runner = CliRunner()
    args = ["--model", "tiny-llama", str(llama_store), "--all-facts", "--quiet"]
    res = runner.invoke(
        main, ["trace", *args, "--limit", "1", "--samples", "1", "--window", "2", "--json", "--no-save"]
    )
    assert res.exit_code == 0, res.output
    import json

    out = json.loads(res.stdout)
    fact = out["facts"][0]
    L = actstore.open(llama_store).geometry.n_layers
    assert set(fact["indirect_effect"]) == {"resid", "mlp", "attn"}
    assert np.array(fact["indirect_effect"]["mlp"]).shape == (L, len(fact["tokens"]))
    assert "total_effect" in fact
    bad = runner.invoke(main, ["trace", *args, "--window", "99"])
    assert bad.exit_code == 2 and bad.stderr.strip().count("\n") == 0, bad.stderr
    assert "error: --window: a window of 99 layers is larger than the model (2 layers)" in bad.stderr
    s = actstore.open(llama_store)
    rel = s.sql("SELECT example_id, relation_id FROM examples ORDER BY 1").to_pylist()
    a = rel[0]
    b = next(r for r in rel if r["relation_id"] != a["relation_id"])
    bad = runner.invoke(
        main,
        [
            "patch",
            "--model",
            "tiny-llama",
            str(llama_store),
            "--pair",
            f"{a['example_id']}:{b['example_id']}",
            "--quiet",
        ],
    )
    assert bad.exit_code == 1 and "same relation" in bad.stderr and bad.stderr.strip().count("\n") == 0


def _fewrel_instance(sentence: str, head: list[int], tail: list[int]) -> dict[str, Any]:
    tokens = sentence.split(" ")
    return {
        "tokens": tokens,
        "h": [" ".join(tokens[i] for i in head).lower(), "Q9000001", [head]],
        "t": [" ".join(tokens[i] for i in tail).lower(), "Q9000002", [tail]],
    }


def test_cli_fact_whose_subject_is_not_in_its_prompt_exits_with_one_line(tmp_path: Path) -> None:
    """A stored fact without its subject's tokens (a FewRel instance whose object precedes the subject,
    kept with keep_object_first: the prompt ends before the object): trace and patch refuse it with one
    error line, before loading the model; selecting only well-formed facts works."""
    import json

    from helpers import build_store

    from actstore.cli import main

    fewrel = tmp_path / "val_wiki.json"  # FewRel format, invented sentences: the middle one is object-first
    fewrel.write_text(
        json.dumps(
            {
                "P364": [
                    _fewrel_instance("Silent Harbour is a drama film shot in Velmish .", [0, 1], [8]),
                    _fewrel_instance(
                        "Most Velmish cinema of the decade , like Grey Morning , was silent .", [8, 9], [1]
                    ),
                    _fewrel_instance("The comedy Lark Song was written and filmed in Ostrish .", [2, 3], [9]),
                ]
            }
        )
    )
    path = build_store(
        tmp_path / "store", dataset=f"fewrel:{fewrel}", limit=3, relations=("P364",), keep_object_first=True
    )
    s = actstore.open(path)
    spans = s.sql("SELECT example_id, subject, subject_start FROM examples ORDER BY 1").to_pylist()
    bad = [r for r in spans if r["subject_start"] < 0]
    good = [r for r in spans if r["subject_start"] >= 0]
    assert bad and len(good) >= 1
    with pytest.raises(TraceError, match="not in its prompt"):
        stored_facts(s, correct_only=False)
    assert len(stored_facts(s, correct_only=False, check=False)) == len(spans)
    b, g = bad[0]["example_id"], good[0]["example_id"]
    cli = CliRunner()
    for cmd in (
        ["trace", "--all-facts", "--window", "1"],
        ["patch", "--all-facts"],
        ["patch", "--pair", f"{g}:{b}"],
        ["patch", "--pair", f"{b}:{g}"],
    ):
        res = cli.invoke(main, [cmd[0], "--model", "tiny-llama", str(path), *cmd[1:], "--quiet"])
        assert res.exit_code == 1, (cmd, res.output)
        assert res.stderr.startswith("error: ") and res.stderr.strip().count("\n") == 0, res.stderr
        assert f"subject {bad[0]['subject']!r} is not in its prompt" in res.stderr, res.stderr
    res = cli.invoke(
        main,
        [
            "trace",
            "--model",
            "tiny-llama",
            str(path),
            "--all-facts",
            "--where",
            "subject_start >= 0",
            "--samples",
            "1",
            "--window",
            "1",
            "--no-save",
            "--quiet",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    assert sorted(f["example_id"] for f in json.loads(res.stdout)["facts"]) == [r["example_id"] for r in good]


# ------------------------------------------------------------------------------------ incremental tracing

SHARP = 0.2  # tiny models' init std: larger than the default 0.02, so that the noise has visible effects


def _trace_both(
    arch: str, facts: list[StoredFact], cfg: TraceConfig, store: Any, incremental_batch: int | None = None
) -> tuple[list[Any], list[Any], Any]:
    """The same trace by the full-recomputation runner and by the incremental one (same model, noise)."""
    loaded = tiny_model(arch, initializer_range=SHARP)
    runner = InterventionRunner(loaded.model)
    std = 3 * subject_embedding_std(loaded.model, store)
    full = CausalTracer(runner, replace(cfg, incremental=False), std).trace(facts)
    inc_cfg = replace(cfg, incremental=True, batch_size=incremental_batch or cfg.batch_size)
    inc = CausalTracer(runner, inc_cfg, std).trace(facts)
    return full, inc, loaded


def _assert_same_effects(full: list[Any], inc: list[Any]) -> None:
    """Equal within 1e-5 and within 1e-3 of the largest indirect effect (tiny models' effects are small,
    so the relative bound is what makes the comparison sharp), corrupted baselines included."""
    assert [r.fact.example_id for r in full] == [r.fact.example_id for r in inc]
    biggest = 0.0
    for a, b in zip(full, inc):
        assert set(a.restored) == set(b.restored)
        np.testing.assert_allclose(b.p_corrupt_samples, a.p_corrupt_samples, rtol=1e-5, atol=0)
        assert b.p_clean == pytest.approx(a.p_clean, rel=1e-5)
        for c in a.restored:
            ie = np.abs(a.indirect_effect(c)).max()
            biggest = max(biggest, ie)
            diff = np.abs(a.restored[c] - b.restored[c]).max()
            assert diff <= 1e-5 and diff <= 1e-3 * ie, (a.fact.example_id, c, diff, ie)
    assert biggest > 1e-4  # the noise does move the output: equality is not between two constants


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox", "qwen2", "gemma3"])
def test_incremental_tracing_equals_full_recomputation(arch: str, store_factory: Callable[..., Path]) -> None:
    """Every tiny architecture (Gemma 3: sliding window 4 < the prompts' 18-23 tokens), every component,
    windows 1, 2 and the whole model, two noise samples, facts of different lengths and subject spans in one
    call; the incremental batches once one restoration per pass and once hundreds (rows of different start
    layers and past lengths: left-padded pasts)."""
    store = actstore.open(store_factory(arch, **STORE_KW))
    facts = stored_facts(store, correct_only=False, limit=4)
    assert len({f.n_tokens for f in facts}) > 1
    L = store.geometry.n_layers
    for window, inc_batch in ((1, 1), (2, 512), (L, 3)):
        cfg = TraceConfig(samples=2, window=window, batch_size=16)
        full, inc, loaded = _trace_both(arch, facts, cfg, store, inc_batch)
        _assert_same_effects(full, inc)
    # The layers' forwards and hooks are as they were.
    for layer in loaded.model.modules():
        assert "forward" not in layer.__dict__
        assert not layer._forward_hooks and not layer._forward_pre_hooks


@pytest.mark.parametrize("arch", ["gpt2", "gemma3"])
def test_incremental_tracing_equals_full_recomputation_in_float64(
    arch: str, store_factory: Callable[..., Path]
) -> None:
    """In float64 the two runners differ only by the float32 rounding of the logits (both compute the
    log-softmax in float32): far below float32's own noise."""
    store = actstore.open(store_factory(arch, **STORE_KW))
    facts = stored_facts(store, correct_only=False, limit=2)
    loaded = tiny_model(arch, initializer_range=SHARP)
    loaded.model.double()
    runner = InterventionRunner(loaded.model)
    std = 3 * subject_embedding_std(loaded.model, store)
    cfg = TraceConfig(samples=1, window=2, batch_size=8)
    full = CausalTracer(runner, replace(cfg, incremental=False), std).trace(facts)
    inc = CausalTracer(runner, cfg, std).trace(facts)
    for a, b in zip(full, inc):
        assert np.abs(a.indirect_effect("mlp")).max() > 1e-5
        for c in a.restored:
            assert np.abs(a.restored[c] - b.restored[c]).max() < 1e-8


@pytest.mark.parametrize(
    "arch,dtype",
    [
        ("llama", torch.float32),
        ("gpt2", torch.float32),
        ("gpt_neox", torch.float32),
        ("qwen2", torch.float32),
        ("gemma3", torch.float32),
        ("gemma3", torch.float64),
    ],
)
def test_incremental_restores_equal_full_restores(
    arch: str, dtype: torch.dtype, store_factory: Callable[..., Path]
) -> None:
    """The restore interventions of method effectiveness computed from the corrupted run (``span``: the clean
    output set at every position from the subject on) equal full restores: every layer of both components
    as a located site (the last layer's MLP included, which the incremental pass runs at the last position
    only), random sites as well, facts of different lengths, two noise samples, batches of one row and of
    many.  In float64 only the float32 log-softmax is left between the two."""
    from actstore.interventions.effectiveness import EffectConfig, site_effects

    store = actstore.open(store_factory(arch, **STORE_KW))
    facts = stored_facts(store, correct_only=False, limit=3)
    assert len({f.n_tokens for f in facts}) > 1
    loaded = tiny_model(arch, initializer_range=SHARP)
    loaded.model.to(dtype)
    runner = InterventionRunner(loaded.model)
    L = store.geometry.n_layers
    std = 3 * subject_embedding_std(loaded.model, store)
    sites = {f.example_id: [(c, layer) for c in ("mlp", "attn") for layer in range(L)] for f in facts[:2]}
    cfg = EffectConfig(mode="restore", samples=2, random_draws=2, batch_size=16)
    full = site_effects(runner, facts, sites, replace(cfg, incremental=False), std).to_pylist()
    biggest = max(abs(r["effect"]) for r in full)
    assert biggest > 1e-4  # the noise moves the output: the comparison is not between constants
    tol = 1e-8 if dtype == torch.float64 else min(1e-5, 1e-3 * biggest)
    for batch in (1, 64):
        inc = site_effects(runner, facts, sites, replace(cfg, batch_size=batch), std).to_pylist()
        key = [(r["example_id"], r["component"], r["layer"], r["random"]) for r in full]
        assert [(r["example_id"], r["component"], r["layer"], r["random"]) for r in inc] == key
        assert sum(not r["random"] for r in inc) == 2 * 2 * L
        for a, b in zip(full, inc):
            assert abs(b["p_base"] - a["p_base"]) <= tol
            assert abs(b["p_intervened"] - a["p_intervened"]) <= tol, (a, b)
    for layer in loaded.model.modules():
        assert "forward" not in layer.__dict__
        assert not layer._forward_hooks and not layer._forward_pre_hooks


def test_incremental_tracing_all_positions_and_one_component(store_factory: Callable[..., Path]) -> None:
    """Positions before the subject run too (skip_before_subject off); one component at a time; zero noise."""
    store = actstore.open(store_factory("llama", **STORE_KW))
    facts = stored_facts(store, correct_only=False, limit=3)
    assert all(f.subject_span[0] > 0 for f in facts)  # a BOS token: there are positions before the subject
    for comps in (("mlp",), ("attn", "resid")):
        cfg = TraceConfig(samples=1, window=2, components=comps, skip_before_subject=False, batch_size=8)
        full, inc, _ = _trace_both("llama", facts, cfg, store)
        _assert_same_effects(full, inc)
        for r in inc:  # before the subject the noise cannot reach: IE ~ 0 without being forced to 0
            for c in comps:
                np.testing.assert_allclose(r.indirect_effect(c)[:, : r.fact.subject_span[0]], 0, atol=1e-8)
    _, tracer = _tracer("llama", TraceConfig(samples=2, window=2), noise=0.0)
    for r in tracer.trace(facts):
        for c in r.restored:
            np.testing.assert_allclose(r.indirect_effect(c), 0, atol=1e-8)


def _count_positions(model: Any) -> tuple[dict[str, int], list[Any]]:
    """Positions x layers computed, per block: every call of a layer's attention output projection ("attn")
    or MLP down projection ("mlp") adds its rows x positions."""
    from actstore.ingest.capture.architectures import architecture_for

    count = {"attn": 0, "mlp": 0}

    def hook(kind: str) -> Callable[..., None]:
        def add(module: Any, args: tuple[Any, ...], output: Any) -> None:
            count[kind] += int(args[0].shape[0] * args[0].shape[1])

        return add

    blocks = architecture_for(model).blocks(model)
    return count, (
        [m.register_forward_hook(hook("attn")) for m in blocks.out_proj]
        + [m.register_forward_hook(hook("mlp")) for m in blocks.down_proj]
    )


@pytest.mark.parametrize("arch,layers,window", [("llama", None, 2), ("gpt2", None, 1), ("llama", 12, 4)])
def test_incremental_tracing_computes_only_the_changed_positions_and_layers(
    arch: str, layers: int | None, window: int, store_factory: Callable[..., Path]
) -> None:
    """Counted with hooks, the incremental trace computes exactly: the clean pass and the corrupted passes
    (T x L each), then for each restoration at (layer l, position p) only the layers from its first changed
    one (resid: l + 1; mlp/attn: the window's first layer) at positions p..T-1, the last layer's MLP at the
    last position only.  The full runner computes T x L for every restoration.  One fact per call, so
    nothing is padded."""
    store = actstore.open(store_factory(arch, **STORE_KW))
    facts = stored_facts(store, correct_only=False, limit=2 if layers else 3)
    loaded = tiny_model(arch, **({"num_hidden_layers": layers} if layers else {}))
    L = architecture_for_model(loaded.model).geometry(loaded.model).n_layers
    S = 2
    cfg = TraceConfig(samples=S, window=window, batch_size=4)
    runner = InterventionRunner(loaded.model)
    measured = {}
    for incremental in (False, True):
        tracer = CausalTracer(runner, replace(cfg, incremental=incremental), 0.3)
        count, handles = _count_positions(loaded.model)
        for f in facts:
            tracer.trace([f])
        for h in handles:
            h.remove()
        measured[incremental] = count
    full = attn = mlp = 0
    for f in facts:
        T, positions = f.n_tokens, range(f.subject_span[0], f.n_tokens)
        full += T * L + S * (1 + 3 * L * len(positions)) * T * L
        attn += T * L + S * T * L
        mlp += T * L + S * T * L
        for layer in range(L):
            for start in (
                layer + 1,
                window_layers(layer, window, L).start,
                window_layers(layer, window, L).start,
            ):
                if start < L:
                    attn += S * sum((L - start) * (T - p) for p in positions)
                    mlp += S * sum((L - 1 - start) * (T - p) + 1 for p in positions)
    assert measured[False] == {"attn": full, "mlp": full}
    assert measured[True] == {"attn": attn, "mlp": mlp}
    assert 2 * full / (attn + mlp) > (3 if L >= 12 else 1.5)
