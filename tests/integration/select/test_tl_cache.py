"""TransformerLens names and caches of a store (Store.hook_names, Selection.to_activation_cache): the
real transformer-lens's analysis methods on the cache equal actstore's own readings of the same rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import actstore
from actstore.core.errors import QueryError
from actstore.query.analyses.readout import FinalReadout, read_objects
from actstore.query.select.tl_cache import kind_names

RTOL = 1e-5  # float32 computed by two code paths (docs/testing.md, Tolerances), relative to the largest entry


def test_names() -> None:
    assert kind_names("resid", 0, 2) == {
        "hook": "blocks.0.hook_resid_pre",
        "module": "model.embed_tokens",
        "side": "output",
    }
    assert kind_names("resid", 2, 2)["hook"] == "blocks.1.hook_resid_post"
    assert kind_names("resid", 2, 2)["module"] == "model.layers.1"  # before the final norm
    assert kind_names("z", 1, 2) == {
        "hook": "blocks.1.attn.hook_z",
        "module": "model.layers.1.self_attn.o_proj",
        "side": "input",
    }
    assert kind_names("attn_prob", 0, 2)["hook"] == "blocks.0.attn.hook_pattern"
    assert kind_names("mlp_post", 0, 2, "gpt2") == {
        "hook": "blocks.0.mlp.hook_post",
        "module": "transformer.h.0.mlp.c_proj",
        "side": "input",
    }
    with pytest.raises(QueryError, match="layers 0..1"):
        kind_names("z", 2, 2)


def test_activation_cache(tiny_store: Path) -> None:
    from transformer_lens import ActivationCache

    store = actstore.open(tiny_store)
    names = store.hook_names()
    L, H = store.geometry.n_layers, store.geometry.n_heads
    assert [n["hook"] for n in names["resid"]][-1] == f"blocks.{L - 1}.hook_resid_post"
    sel = store.select().limit(12)
    cache = sel.to_activation_cache()
    assert isinstance(cache, ActivationCache)
    # stack_head_results: [L * H, rows, pos, d_model] = the store's attn_head, layer-major
    heads = cache.stack_head_results(layer=-1).numpy()[:, :, 0]
    want = sel.features("attn_head").transpose(1, 2, 0, 3).reshape(L * H, len(sel), -1)
    np.testing.assert_array_equal(heads, want)
    objects = torch.as_tensor(
        store.sql(
            "SELECT object_token_id FROM targets WHERE example_id IN (SELECT unnest(?)) ORDER BY example_id",
            [sel.example_ids.tolist()],
        )
        .column(0)
        .to_numpy()
        .astype(np.int64)
    )
    readout = FinalReadout.from_store(store)
    resid = sel.features("resid")
    lens = readout.logits(torch.from_numpy(resid)).numpy()  # [rows, L + 1, V]: actstore's logit lens
    # the logit lens as TransformerLens writes it: the accumulated residual, normalised, times W_U
    stack = cache.accumulated_resid(layer=-1, apply_ln=True)[:, :, 0]  # [L + 1, rows, d]
    tl_lens = (stack @ cache.model.W_U).numpy().transpose(1, 0, 2)
    np.testing.assert_allclose(tl_lens, lens, rtol=0, atol=RTOL * np.abs(lens).max())
    # actstore's lens readings (object probability and rank) from those logits
    reading = read_objects(readout, resid, objects.numpy())
    logp = torch.log_softmax(torch.from_numpy(tl_lens).double(), -1)
    tl_prob = logp.gather(-1, objects[:, None, None].expand(-1, L + 1, 1))[..., 0].exp().numpy()
    np.testing.assert_allclose(tl_prob, reading.prob, rtol=1e-4)
    np.testing.assert_array_equal(logp.argmax(-1).numpy(), reading.top)
    # the direct logit attribution: embedding, each attention and MLP output, summing to the final logit
    parts = cache.decompose_resid(layer=-1)  # [1 + 2L, rows, pos=1, d]
    assert parts.shape[0] == 1 + 2 * L
    np.testing.assert_allclose(
        parts.sum(0)[:, 0].numpy(), resid[:, L], rtol=0, atol=RTOL * np.abs(resid).max()
    )
    dla = cache.logit_attrs(parts, tokens=objects[:, None]).sum(0)[:, 0].numpy()  # [rows]
    final = lens[np.arange(len(sel)), L, objects.numpy()]
    np.testing.assert_allclose(dla, final, rtol=0, atol=RTOL * np.abs(lens).max())


@pytest.mark.parametrize(
    ("arch", "names", "export"),
    [
        # architecture: kind_names' resid 0, resid 2, mlp 1, attn_prob 1 modules; the export's resid 0, 2, attn 1
        *(
            (
                a,
                ("model.embed_tokens", "model.layers.1", "model.layers.1.mlp", "model.layers.1.self_attn"),
                ("model.embed_tokens", "model.layers.1", "model.layers.1.self_attn"),
            )
            for a in ("llama", "qwen2", "mistral", "gemma3", "gemma3_text")
        ),
        (
            "gpt2",
            ("transformer.drop", "transformer.h.1", "transformer.h.1.mlp", "transformer.h.1.attn"),
            (None, "transformer.h.1", "transformer.h.1.attn"),  # index 0: the caller names it
        ),
        (
            "gpt_neox",
            (
                "gpt_neox.emb_dropout",
                "gpt_neox.layers.1",
                "gpt_neox.layers.1.mlp",
                "gpt_neox.layers.1.attention",
            ),
            ("gpt_neox.embed_in", "gpt_neox.layers.1", "gpt_neox.layers.1.attention"),
        ),
        (  # unknown: TransformerLens-side names fall back to Llama's, the export refuses
            "mamba",
            ("model.embed_tokens", "model.layers.1", "model.layers.1.mlp", "model.layers.1.self_attn"),
            (None, None, None),
        ),
    ],
)
def test_one_module_table_for_names_and_the_export(
    arch: str, names: tuple[str, ...], export: tuple[str | None, ...]
) -> None:
    """Store.hook_names' modules and the SAELens export's column names come from one table
    (tl_cache.MODULES); their differences (GPT-2's residual 0, GPT-NeoX's embedding) are kept."""
    from actstore.query.select.hf_export import module_path

    got = (
        kind_names("resid", 0, 2, arch)["module"],
        kind_names("resid", 2, 2, arch)["module"],
        kind_names("mlp", 1, 2, arch)["module"],
        kind_names("attn_prob", 1, 2, arch)["module"],
    )
    assert got == names
    for (kind, layer), want in zip((("resid", 0), ("resid", 2), ("attn", 1)), export):
        if want is None:
            with pytest.raises(QueryError, match="hook_name="):
                module_path(kind, layer, arch)
        else:
            assert module_path(kind, layer, arch) == want


def test_without_transformer_lens(tiny_store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "transformer_lens", None)  # import fails as if not installed
    sel = actstore.open(tiny_store).select().limit(3)
    cache = sel.to_activation_cache(kinds=["resid"], layers=[0])
    assert isinstance(cache, dict) and sorted(cache) == ["blocks.0.hook_resid_pre", "hook_embed"]
    assert tuple(cache["blocks.0.hook_resid_pre"].shape) == (3, 1, 64)
