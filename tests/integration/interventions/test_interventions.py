"""The intervention runner: identities it must satisfy on tiny models of several architectures."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import actstore
from actstore.core.errors import InterventionError
from actstore.ingest.models.tiny import tiny_model
from actstore.interventions.runner import (
    Intervention,
    InterventionRunner,
    RunItem,
    head_ablation,
    stored_head_means,
)

PROMPTS = ["The capital of France is", "Tokyo is the capital of", "The Nile is a river in Africa that"]


def _items(loaded: Any, **kw: Any) -> list[RunItem]:
    return [RunItem(loaded.tokenizer(p)["input_ids"], **kw) for p in PROMPTS]


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_no_intervention_leaves_logits_unchanged(arch: str, side: str) -> None:
    loaded = tiny_model(arch)
    runner = InterventionRunner(loaded.model)
    res = runner.run(_items(loaded), keep_logits=True, batch_size=3, padding_side=side)
    assert res.logits is not None
    for i, p in enumerate(PROMPTS):
        ids = torch.tensor([loaded.tokenizer(p)["input_ids"]])
        with torch.no_grad():
            ref = loaded.model(input_ids=ids).logits[0, -1].float()
        torch.testing.assert_close(res.logits[i], ref, rtol=1e-4, atol=1e-5)
        assert res.top_ids[i] == int(ref.argmax())


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox"])
def test_zero_ablating_all_heads_leaves_the_bias(arch: str) -> None:
    loaded = tiny_model(arch)
    runner = InterventionRunner(loaded.model)
    g = runner.geometry
    layer = g.n_layers - 1
    heads = [(layer, h) for h in range(g.n_heads)]
    res = runner.run(
        _items(loaded), shared=head_ablation(heads, positions=None), record=[("attn", layer), ("head", layer)]
    )
    bias = getattr(runner.arch.blocks(loaded.model).out_proj[layer], "bias", None)
    expected = torch.zeros(g.d_model) if bias is None else bias.detach().float()
    for rec in res.records:
        assert float(rec[f"head:{layer}"].abs().max()) == 0.0
        torch.testing.assert_close(rec[f"attn:{layer}"], expected.expand_as(rec[f"attn:{layer}"]))


def test_last_position_ablation_touches_only_the_last_position() -> None:
    loaded = tiny_model("llama")
    runner = InterventionRunner(loaded.model)
    clean = runner.run(_items(loaded), record=[("head", 1)])
    ablated = runner.run(_items(loaded), shared=head_ablation([(1, 2)]), record=[("head", 1)])
    for c, a in zip(clean.records, ablated.records):
        torch.testing.assert_close(a["head:1"][:-1], c["head:1"][:-1])
        assert float(a["head:1"][-1, 2].abs().max()) == 0.0
        torch.testing.assert_close(a["head:1"][-1, [0, 1, 3]], c["head:1"][-1, [0, 1, 3]])


def test_per_row_edits_in_one_batch_equal_separate_runs() -> None:
    """Batching different edits (one per row) gives what one run per edit gives."""
    loaded = tiny_model("llama")
    runner = InterventionRunner(loaded.model)
    ids = loaded.tokenizer(PROMPTS[0])["input_ids"]
    edits = [Intervention("resid", 1, "add_noise", (p,), noise_std=1.0, seed=p) for p in range(len(ids))]
    edits += [
        Intervention("mlp", 0, "zero", (2,)),
        Intervention("attn", 1, "set", None, value=torch.ones(64)),
        Intervention("resid", 0, "add", (0, -1), value=torch.full((2, 64), 0.5)),
        Intervention("resid", 2, "set", (-1,), value=torch.zeros(64)),
        Intervention("head", 0, "add_noise", (1,), heads=(0, 3), noise_std=2.0),
    ]
    batched = runner.run([RunItem(ids, (e,)) for e in edits], keep_logits=True, batch_size=len(edits))
    for i, e in enumerate(edits):
        alone = runner.run([RunItem(ids)], shared=[e], keep_logits=True)
        assert alone.logits is not None and batched.logits is not None
        torch.testing.assert_close(batched.logits[i], alone.logits[0], rtol=1e-4, atol=1e-5)
    clean = runner.run([RunItem(ids)], keep_logits=True).logits
    assert clean is not None and batched.logits is not None
    assert all(not torch.allclose(row, clean[0]) for row in batched.logits)  # every edit changes the output


def test_mean_ablation_uses_stored_means(store_factory: Callable[..., Path]) -> None:
    path = store_factory("llama", limit=2)
    store = actstore.open(path)
    means = stored_head_means(store.select())
    z = store.select().features("z")
    np.testing.assert_allclose(means, z.mean(axis=0), rtol=1e-5, atol=1e-6)
    loaded = tiny_model("llama")
    runner = InterventionRunner(loaded.model)
    ids = (
        store.sql("SELECT list(token_id ORDER BY position) AS ids FROM tokens WHERE example_id = 0")
        .column("ids")[0]
        .as_py()
    )
    heads = [(0, 1), (1, 3)]
    res = runner.run(
        [RunItem(ids)],
        shared=head_ablation(heads, mode="mean", means=means),
        record=[("head", 0), ("head", 1)],
    )
    for layer, h in heads:
        np.testing.assert_allclose(res.records[0][f"head:{layer}"][-1, h].numpy(), means[layer, h], rtol=1e-6)
    # The mean over one prompt is that prompt's own activation: ablating with it changes nothing.
    own = stored_head_means(store.select("example_id = 0"))
    clean = runner.run([RunItem(ids)], keep_logits=True)
    same = runner.run([RunItem(ids)], shared=head_ablation(heads, mode="mean", means=own), keep_logits=True)
    assert clean.logits is not None and same.logits is not None
    torch.testing.assert_close(same.logits, clean.logits, rtol=1e-4, atol=1e-5)


def test_bad_interventions_fail_with_one_line() -> None:
    loaded = tiny_model("llama")
    runner = InterventionRunner(loaded.model)
    items = _items(loaded)
    with pytest.raises(InterventionError, match="out of range"):
        runner.run(items, shared=head_ablation([(0, 9)]))
    with pytest.raises(InterventionError, match="out of range"):
        runner.run(items, shared=[Intervention("attn", 5, "zero")])
    with pytest.raises(InterventionError, match="outside a prompt"):
        runner.run(items, shared=[Intervention("resid", 0, "zero", (40,))])
    with pytest.raises(InterventionError, match="needs a value"):
        runner.run(items, shared=[Intervention("mlp", 0, "set")])
    with pytest.raises(InterventionError, match="does not fit"):
        runner.run(items, shared=[Intervention("mlp", 0, "set", value=torch.ones(3))])
