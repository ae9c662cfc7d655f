"""Corpus stores with per-source factors (``--positions all --sources K``) against an eager forward.

The expected values come from each window run alone through the model in eager attention with
ordinary hooks: the attention probabilities from ``output_attentions``, V from the value
projection's output, the per-head output from the output projection's input and weight, all in
numpy.  Nothing of the capture code computes an expected value.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import actstore
from actstore.core.errors import ActstoreError, QueryError
from actstore.core.verify import verify_store
from actstore.ingest.models.tiny import tiny_model
from actstore.query.select.corpus_sources import contributions, source_factors, source_sum

pytestmark = pytest.mark.usefixtures("one_thread")

DOCS = [
    "The cat sat on the mat.",
    "Paris is the capital of France and a large city on the river Seine, with many bridges.",
    "hello world",
    "Rome, Madrid and Lisbon are capitals too.",
]
CONTEXT = 9


def ingest(tmp_path: Path, name: str, arch: str = "llama", **kw: Any) -> actstore.Store:
    docs = tmp_path / "docs.txt"
    docs.write_text("\n".join(DOCS) + "\n", encoding="utf-8")
    settings: dict[str, Any] = {
        "model": f"tiny-{arch}",
        "dataset": f"text:{docs}",
        "positions": "all",
        "storage_dtype": "float32",
        "batch_size": 2,
        "segment_size": 8,
        "context_length": CONTEXT,
    }
    return actstore.ingest_corpus(tmp_path / name, **(settings | kw))


def eager_windows(arch: str) -> list[dict[str, np.ndarray]]:
    """Each window alone (in corpus order), kept positions only: A [T, L, H, T] over kept sources,
    V [T, L, H_kv, dh] and the per-head outputs [T, L, H, d_model] (plus W_O [L, H, dh, d])."""
    loaded = tiny_model(arch)
    model, tok = loaded.model, loaded.tokenizer
    model.set_attn_implementation("eager")
    cfg = model.config
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    layers = list(model.model.layers)
    dh = layers[0].self_attn.o_proj.weight.shape[1] // H
    special = set(tok.all_special_ids)
    out = []
    for text in DOCS:
        content = tok(text, add_special_tokens=False)["input_ids"]
        full = tok(text)["input_ids"]
        prefix = full[: len(full) - len(content)] if full[-len(content) :] == content else []
        per_window = CONTEXT - len(prefix)
        for a in range(0, len(content), per_window):
            ids = prefix + content[a : a + per_window]
            v_out: list[torch.Tensor] = []
            o_in: list[torch.Tensor] = []
            hooks = [
                lay.self_attn.v_proj.register_forward_hook(lambda m, i, o, acc=v_out: acc.append(o[0]))
                for lay in layers
            ]
            hooks += [
                lay.self_attn.o_proj.register_forward_hook(lambda m, i, o, acc=o_in: acc.append(i[0][0]))
                for lay in layers
            ]
            try:
                with torch.no_grad():
                    res = model(torch.tensor([ids]), output_attentions=True)
            finally:
                for h in hooks:
                    h.remove()
            keep = np.array([p for p, i in enumerate(ids) if i not in special])
            T = len(ids)
            A = np.stack([x[0].numpy() for x in res.attentions], 1)  # [H, ...] -> [H, L, T, T]
            A = A.transpose(2, 1, 0, 3)  # [T(query), L, H, T(key)]
            V = np.stack([v.numpy().reshape(T, Hkv, dh) for v in v_out], 1)
            WO = np.stack(
                [lay.self_attn.o_proj.weight.detach().numpy().T.reshape(H, dh, -1) for lay in layers]
            )
            z = np.stack([x.numpy().reshape(T, H, dh) for x in o_in], 1)
            head = np.einsum("tlhd,lhde->tlhe", z, WO)
            out.append({"A": A[keep][..., keep], "V": V[keep], "head": head[keep], "WO": WO})
    return out


@pytest.mark.parametrize(
    ("arch", "dtype"),
    [
        ("llama", "float32"),
        ("qwen2", "float32"),
        ("qwen3", "float32"),
        ("gemma3", "float32"),
        ("llama", "float16"),
        ("gemma3", "float16"),
    ],
)
def test_top_sources_equal_an_eager_forward(tmp_path: Path, arch: str, dtype: str) -> None:
    """float16 stores: the sources are chosen in float32 (the same sets), then stored rounded: weights
    and contributions within float16's rounding (about 5e-4 relative a factor)."""
    K = 3
    store = ingest(tmp_path, "s", arch=arch, sources=str(K), storage_dtype=dtype)
    tol = {"rtol": 1e-5, "atol": 1e-7} if dtype == "float32" else {"rtol": 2e-3, "atol": 1e-4}
    ctol = {"rtol": 1e-4, "atol": 1e-5} if dtype == "float32" else {"rtol": 5e-3, "atol": 2e-3}
    assert store.manifest.ingest["sources"] == K
    wins = eager_windows(arch)
    g = store.geometry
    start = np.concatenate([[0], np.cumsum([w["A"].shape[0] for w in wins])])
    assert store.manifest.n_examples == start[-1]
    rng = np.random.default_rng(0)
    picked = np.sort(rng.choice(start[-1], size=12, replace=False))
    f = source_factors(store, picked)
    contrib, rem = contributions(store, f)
    for i, r in enumerate(picked):
        w = int(np.searchsorted(start, r, side="right") - 1)
        t = int(r - start[w])
        win = wins[w]
        for lay in range(g.n_layers):
            for h in range(g.n_heads):
                a = win["A"][t, lay, h]  # over the window's kept positions
                order = np.argsort(-a, kind="stable")[:K]
                want_src = [int(start[w] + j) for j in order if a[j] > 0]
                got_src = [int(x) for x in f.source_row[i, lay, h] if x >= 0]
                assert sorted(got_src) == sorted(want_src), (r, lay, h)
                for k, src in enumerate(f.source_row[i, lay, h]):
                    if src < 0:
                        continue
                    j = int(src - start[w])
                    np.testing.assert_allclose(f.weight[i, lay, h, k], a[j], **tol)
                    want = a[j] * win["V"][j, lay, h // g.kv_group] @ win["WO"][lay, h]
                    np.testing.assert_allclose(contrib[i, lay, h, k], want, **ctol)
                np.testing.assert_allclose(f.mass[i, lay, h], a[order].sum(), rtol=tol["rtol"])
                # the kept sources plus the remainder are the head's output
                total = contrib[i, lay, h].sum(0) + rem[i, lay, h]
                np.testing.assert_allclose(total, win["head"][t, lay, h], **ctol)
    # features: attn_head_token [n, L, H, K, d] and attn_prob [n, L, H, K]
    sel = store.select()
    x = sel.features("attn_head_token")
    assert x.shape == (start[-1], g.n_layers, g.n_heads, K, g.d_model)
    np.testing.assert_allclose(x[picked], contrib, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(sel.features("attn_prob")[picked], f.weight, rtol=1e-6)
    assert verify_store(store).ok


def test_all_sources_equal_the_eager_attention_row(tmp_path: Path) -> None:
    """``--sources all``: every kept source of the window; their sum is the head's output (BOS, not
    kept, is the remainder's)."""
    store = ingest(tmp_path, "s", sources="all")
    assert store.manifest.ingest["sources"] == CONTEXT
    wins = eager_windows("llama")
    f = source_factors(store, np.arange(store.manifest.n_examples))
    r = 0
    for win in wins:
        for t in range(win["A"].shape[0]):
            for lay in range(f.weight.shape[1]):
                for h in range(f.weight.shape[2]):
                    got = {
                        int(s - (r - t)): w
                        for s, w in zip(f.source_row[r, lay, h], f.weight[r, lay, h])
                        if s >= 0
                    }
                    want = {j: win["A"][t, lay, h, j] for j in range(t + 1)}
                    assert set(got) == set(want)
                    np.testing.assert_allclose(
                        [got[j] for j in sorted(got)], [want[j] for j in sorted(want)], rtol=1e-5
                    )
            r += 1
    # attn_entity-style sums over all of a window's rows are the kept mass's share of the head
    c, rem = contributions(store, f)
    rows = np.arange(5)
    np.testing.assert_allclose(source_sum(store, rows, np.arange(5)), c[rows].sum(3), rtol=1e-5, atol=1e-6)


def test_entity_sums_equal_a_plain_loop_and_attn_entity_names_source_sum(tmp_path: Path) -> None:
    """A corpus marks no subject span, so ``attn_entity`` is refused with one line naming
    ``source_sum``; ``source_sum`` over the rows a caller names (here an "entity": the first three
    tokens of the second document) equals, per (layer, head), a plain loop over the eager forward's
    attention of those rows that are among the top K, times V and W_O."""
    K = 3
    store = ingest(tmp_path, "s", sources=str(K))
    with pytest.raises(QueryError) as e:
        store.select().features("attn_entity")
    assert "source_sum" in str(e.value) and "\n" not in str(e.value)
    wins = eager_windows("llama")
    start = np.concatenate([[0], np.cumsum([w["A"].shape[0] for w in wins])])
    w = int(
        np.searchsorted(
            start,
            store.sql("SELECT min(row) FROM positions WHERE document = 1").column(0)[0].as_py(),
            side="right",
        )
        - 1
    )
    entity = [int(start[w] + j) for j in range(3)]
    rows = np.arange(start[w], start[w + 1])
    got = source_sum(store, rows, entity)
    assert np.abs(got).max() > 0
    g = store.geometry
    win = wins[w]
    for i, r in enumerate(rows):
        t = int(r - start[w])
        for lay in range(g.n_layers):
            for h in range(g.n_heads):
                a = win["A"][t, lay, h]
                top = set(np.argsort(-a, kind="stable")[:K].tolist())
                want = np.zeros(g.d_model)
                for j in range(3):
                    if j in top and a[j] > 0:
                        want += a[j] * win["V"][j, lay, h // g.kv_group] @ win["WO"][lay, h]
                np.testing.assert_allclose(got[i, lay, h], want, rtol=1e-4, atol=1e-5)


def tree_hash(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(path)).encode() + p.read_bytes())
    return h.hexdigest()


def test_bad_sources_settings_write_nothing(tmp_path: Path) -> None:
    with pytest.raises(ActstoreError) as e:
        ingest(tmp_path, "s", sources=str(CONTEXT + 1))
    assert "more than the window's" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "s").exists() or not any((tmp_path / "s").iterdir())
    with pytest.raises(ActstoreError, match="number of sources"):
        ingest(tmp_path, "s2", sources="x")
    with pytest.raises(ActstoreError, match="positions all"):
        actstore.ingest_corpus(tmp_path / "s3", model="tiny-llama", sources="4")


def test_a_store_without_sources_names_the_option(tmp_path: Path) -> None:
    store = ingest(tmp_path, "s")
    with pytest.raises(QueryError, match="--sources"):
        store.select().features("attn_head_token")
    with pytest.raises(QueryError, match="--sources"):
        source_factors(store, [0])


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_all_equals_the_target_mode_store_of_the_same_prompts(tmp_path: Path, arch: str) -> None:
    """``--sources all`` at each document's last token against a target-mode store of the same texts
    (tiny Qwen2 and Qwen3 add no BOS, so every source of a target-mode prompt is a kept corpus position)."""
    docs = [d for d in DOCS if len(tiny_model(arch).tokenizer(d)["input_ids"]) <= CONTEXT]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    (tmp_path / "docs.txt").write_text("\n".join(docs) + "\n", encoding="utf-8")
    target = actstore.ingest_corpus(
        tmp_path / "t", model=f"tiny-{arch}", dataset=f"jsonl:{prompts}", storage_dtype="float32"
    )
    corpus = actstore.ingest_corpus(
        tmp_path / "c",
        model=f"tiny-{arch}",
        dataset=f"text:{tmp_path / 'docs.txt'}",
        positions="all",
        storage_dtype="float32",
        context_length=CONTEXT,
        sources="all",
    )
    last = corpus.sql(
        "SELECT max(row) AS r FROM positions GROUP BY document ORDER BY document", format="pandas"
    )["r"].to_numpy()
    t_sel = target.select()
    want_tok = t_sel.features("attn_head_token")  # [n, L, H, S, d], sources in position order
    want_prob = t_sel.features("attn_prob")
    n_src = t_sel.rows.column("n_src").to_numpy()
    assert len(last) == len(n_src) == len(docs)
    f = source_factors(corpus, last)
    contrib, rem = contributions(corpus, f)
    for i, r in enumerate(last):
        for lay in range(f.weight.shape[1]):
            for h in range(f.weight.shape[2]):
                src = f.source_row[i, lay, h]
                order = np.argsort(src[src >= 0])
                got_pos = (src[src >= 0] - (r - n_src[i] + 1))[order]
                np.testing.assert_array_equal(got_pos, np.arange(n_src[i]))
                np.testing.assert_allclose(
                    f.weight[i, lay, h][src >= 0][order], want_prob[i, lay, h, : n_src[i]], rtol=1e-5
                )
                np.testing.assert_allclose(
                    contrib[i, lay, h][src >= 0][order], want_tok[i, lay, h, : n_src[i]], rtol=1e-4, atol=1e-6
                )
                np.testing.assert_allclose(rem[i, lay, h], 0, atol=1e-5)  # every source kept
