"""An independent oracle for causal tracing and activation patching (issue 36): the effects computed
here with plain torch forward hooks on the Hugging Face modules of a tiny random Llama (built from a
config, no download), from the definitions in the module docstrings of
actstore/interventions/tracing.py and patching.py, none of actstore's intervention code (runner,
edits, architecture table, window helper) used.  The runner's effects must match to 1e-6."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from actstore.ingest.models.tiny import tiny_model
from actstore.interventions.facts import StoredFact
from actstore.interventions.patching import ActivationPatcher, PatchConfig, PatchPair
from actstore.interventions.runner import InterventionRunner
from actstore.interventions.tracing import CausalTracer, GroupedEditRunner, TraceConfig

TOL = 1e-6
Hook = tuple[torch.nn.Module, Callable[..., Any]]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def loaded() -> Any:
    # larger weights than the default: peaked outputs, so effects are far above the tolerance
    return tiny_model("llama", num_hidden_layers=4, initializer_range=0.2)


def _fact(loaded: Any, text: str, subject: str, example_id: int) -> StoredFact:
    """A fact whose object token is the model's own top token on the prompt (a recalled fact)."""
    tok = loaded.tokenizer
    start = text.index(subject)
    enc = tok(text, return_offsets_mapping=True)
    ids, offs = enc["input_ids"], enc["offset_mapping"]
    toks = [i for i, (a, b) in enumerate(offs) if b > start and a < start + len(subject)]
    with torch.inference_mode():
        target = int(loaded.model(torch.tensor([ids])).logits[0, -1].argmax())
    span = (toks[0], toks[-1] + 1)
    return StoredFact(
        example_id, "r", subject, str(target), tuple(ids), tuple(map(str, ids)), span, target, True
    )


# ------------------------------------------------------------------------------------ the oracle


def _first(out: Any) -> torch.Tensor:
    """A module's hidden-state output: the tensor itself or the first element of its tuple."""
    return out if isinstance(out, torch.Tensor) else out[0]


def _with_first(out: Any, x: torch.Tensor) -> Any:
    return x if isinstance(out, torch.Tensor) else (x, *out[1:])


def _modules(model: Any, component: str) -> list[torch.nn.Module]:
    """The Hugging Face modules whose outputs are the states of ``component`` per layer."""
    layers = model.model.layers
    return {
        "resid": list(layers),
        "mlp": [layer.mlp for layer in layers],
        "attn": [layer.self_attn for layer in layers],
    }[component]


def _last_logits(model: Any, ids: tuple[int, ...], hooks: list[Hook]) -> torch.Tensor:
    handles = [m.register_forward_hook(h) for m, h in hooks]
    try:
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0, -1].double()
    finally:
        for h in handles:
            h.remove()


def _record(model: Any, ids: tuple[int, ...]) -> dict[tuple[str, int], torch.Tensor]:
    """Every per-layer state of a clean run, [T, d]."""
    got: dict[tuple[str, int], torch.Tensor] = {}
    hooks: list[Hook] = []
    for comp in ("resid", "mlp", "attn"):
        for layer, m in enumerate(_modules(model, comp)):

            def keep(mod: Any, args: Any, out: Any, key: tuple[str, int] = (comp, layer)) -> None:
                got[key] = _first(out)[0].detach().clone()

            hooks.append((m, keep))
    _last_logits(model, ids, hooks)
    return got


def _setter(pos: int, value: torch.Tensor) -> Callable[..., Any]:
    def hook(mod: Any, args: Any, out: Any) -> Any:
        x = _first(out).clone()
        x[0, pos] = value
        return _with_first(out, x)

    return hook


def _window(label: int, w: int, n_layers: int) -> list[int]:
    """ROME's window as tracing.py's docstring states it: max(0, l - w//2) .. min(L, l + ceil(w/2)) - 1."""
    return list(range(max(0, label - w // 2), min(n_layers, label + (w + 1) // 2)))


def oracle_trace(
    model: Any, fact: StoredFact, std: float, samples: int, window: int, seed: int = 0
) -> dict[str, Any]:
    """p_clean, p_corrupt and the restored probabilities [L, T] of every component, by hooks."""
    L = model.config.num_hidden_layers
    d = model.config.hidden_size
    s0, s1 = fact.subject_span
    o = fact.target_id
    clean = _record(model, fact.input_ids)

    def prob(hooks: list[Hook]) -> float:
        return float(torch.softmax(_last_logits(model, fact.input_ids, hooks), -1)[o])

    def noise_hook(sample: int) -> Hook:
        gen = torch.Generator().manual_seed(seed * 100_003 + sample)  # sample s seeded with (seed, s)
        noise = torch.randn((s1 - s0, d), generator=gen, dtype=torch.float32) * std

        def hook(mod: Any, args: Any, out: Any) -> Any:
            x = out.clone()
            x[0, s0:s1] += noise
            return x

        return model.model.embed_tokens, hook

    p_clean = prob([])
    p_corrupt = float(np.mean([prob([noise_hook(s)]) for s in range(samples)]))
    restored: dict[str, np.ndarray] = {}
    T = fact.n_tokens
    for comp in ("resid", "mlp", "attn"):
        mods = _modules(model, comp)
        grid = np.full((L, T), p_corrupt)  # before the subject the noise cannot reach: p = p_corrupt
        for layer in range(L):
            layers = [layer] if comp == "resid" else _window(layer, window, L)
            for pos in range(s0, T):
                sets = [(mods[j], _setter(pos, clean[(comp, j)][pos])) for j in layers]
                grid[layer, pos] = np.mean([prob([noise_hook(s), *sets]) for s in range(samples)])
        restored[comp] = grid
    return {"p_clean": p_clean, "p_corrupt": p_corrupt, "restored": restored}


def oracle_patch(model: Any, c: StoredFact, x: StoredFact) -> dict[tuple[str, str], np.ndarray]:
    """Recovery (LD_patched - LD_cf) / (LD_clean - LD_cf) per (component, position) and layer,
    LD = logit(o) - logit(o') at the last token, c's state written into x's run."""
    L = model.config.num_hidden_layers
    o, o_cf = c.target_id, x.target_id

    def ld(ids: tuple[int, ...], hooks: list[Hook]) -> float:
        lg = _last_logits(model, ids, hooks)
        return float(lg[o] - lg[o_cf])

    clean = _record(model, c.input_ids)
    ld_clean, ld_cf = ld(c.input_ids, []), ld(x.input_ids, [])
    pos_of = {"subject_last": lambda f: f.subject_span[1] - 1, "last": lambda f: f.n_tokens - 1}
    out: dict[tuple[str, str], np.ndarray] = {}
    for comp in ("resid", "attn", "mlp"):
        mods = _modules(model, comp)
        for name, where in pos_of.items():
            rec = np.zeros(L)
            for layer in range(L):
                hook = _setter(where(x), clean[(comp, layer)][where(c)])
                rec[layer] = (ld(x.input_ids, [(mods[layer], hook)]) - ld_cf) / (ld_clean - ld_cf)
            out[(comp, name)] = rec
    return out


# ------------------------------------------------------------------------------------ the checks


@pytest.mark.parametrize("incremental", [True, False])
@pytest.mark.parametrize("window", [1, 3])
def test_tracing_matches_the_hook_oracle(loaded: Any, incremental: bool, window: int) -> None:
    fact = _fact(loaded, "Everyone in Ostravia drinks from the", "Ostravia", 3)
    std, samples = 0.6, 2
    cfg = TraceConfig(
        samples=samples, window=window, components=("resid", "mlp", "attn"), incremental=incremental
    )
    got = CausalTracer(GroupedEditRunner(loaded.model), cfg, std).trace([fact])[0]
    want = oracle_trace(loaded.model, fact, std, samples, window)
    assert got.p_clean == pytest.approx(want["p_clean"], abs=TOL)
    assert got.p_corrupt == pytest.approx(want["p_corrupt"], abs=TOL)
    assert abs(want["p_clean"] - want["p_corrupt"]) > 1e-2  # the noise moves the output: the check has teeth
    for comp, grid in want["restored"].items():
        ie_want = grid - want["p_corrupt"]
        np.testing.assert_allclose(got.indirect_effect(comp), ie_want, rtol=0, atol=TOL)
        assert np.abs(ie_want).max() > 1e-3  # some restoration matters (1,000 x the tolerance)


def test_tracing_oracle_sees_a_different_window(loaded: Any) -> None:
    """The oracle is sensitive to what it checks: the runner's window-3 MLP effects are not its
    window-1 ones."""
    fact = _fact(loaded, "Everyone in Ostravia drinks from the", "Ostravia", 3)
    cfg = TraceConfig(samples=1, window=3, components=("mlp",))
    got = CausalTracer(InterventionRunner(loaded.model), cfg, 0.5).trace([fact])[0]
    want = oracle_trace(loaded.model, fact, 0.5, 1, window=1)
    assert np.abs(got.indirect_effect("mlp") - (want["restored"]["mlp"] - want["p_corrupt"])).max() > 1e-4


def test_patching_matches_the_hook_oracle(loaded: Any) -> None:
    c = _fact(loaded, "Everyone in Ostravia drinks from the", "Ostravia", 1)
    x = _fact(loaded, "Everyone in Brundalek drinks from the", "Brundalek", 2)
    assert c.target_id != x.target_id and c.n_tokens != x.n_tokens  # positions must be aligned by name
    cfg = PatchConfig(components=("resid", "attn", "mlp"), heads=False)
    got = ActivationPatcher(GroupedEditRunner(loaded.model), cfg).patch([PatchPair(c, x)])[0]
    want = oracle_patch(loaded.model, c, x)
    assert set(got.recovery) == set(want)
    for key, rec in want.items():
        np.testing.assert_allclose(got.recovery[key], rec, rtol=0, atol=TOL, err_msg=str(key))
    assert want[("resid", "last")][-1] == pytest.approx(1.0, abs=1e-9)  # the oracle's own identity
    assert np.abs(want[("mlp", "subject_last")]).max() > 1e-3
