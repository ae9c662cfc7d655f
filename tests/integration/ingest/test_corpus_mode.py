"""Corpus mode (``actstore ingest --positions all``) against independent computations.

The counts are checked against the tokenizer called directly (every token of every document, minus
the special ones); the stored ``resid``, ``mlp`` and ``attn_head`` at every kept position against a
plain forward of each window alone with ordinary hooks on the model (``output_hidden_states``, the
MLP down projection's output, the attention output projection's input split per head and multiplied
by that head's slice of the projection weight).  Nothing of the capture code computes an expected
value here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import uncompact

import actstore
import actstore.ingest.corpus as cc
from actstore.core.errors import ActstoreError, QueryError, StorageError
from actstore.core.verify import verify_store
from actstore.ingest.capture.fused import FusedCapture
from actstore.ingest.models.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

DOCS = [
    "The cat sat on the mat.",
    "Paris is the capital of France and a large city on the river Seine, with many bridges.",
    "hello world",
    "Rome, Madrid and Lisbon are capitals too.",
]
RTOL = 1e-4


def write_docs(path: Path, docs: list[str] = DOCS) -> str:
    path.write_text("\n".join(docs) + "\n", encoding="utf-8")
    return f"text:{path}"


def ingest(tmp_path: Path, name: str, arch: str = "llama", **kw: Any) -> actstore.Store:
    settings: dict[str, Any] = {
        "model": f"tiny-{arch}",
        "dataset": write_docs(tmp_path / "docs.txt"),
        "positions": "all",
        "storage_dtype": "float32",
        "batch_size": 2,
        "segment_size": 8,
        "compact_every": 2,
    }
    return actstore.ingest_corpus(tmp_path / name, **(settings | kw))


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.abs(got - want).max() / np.abs(want).max())


def test_positions_are_the_tokens_minus_the_special_ones(tmp_path: Path) -> None:
    store = ingest(tmp_path, "s")
    tok = tiny_model("llama").tokenizer
    special = set(tok.all_special_ids)
    want_ids: list[int] = []
    want_doc: list[int] = []
    for d, text in enumerate(DOCS):
        ids = [i for i in tok(text)["input_ids"] if i not in special]  # the tokenizer itself, BOS included
        want_ids += ids
        want_doc += [d] * len(ids)
    assert any(
        i in special for i in tok(DOCS[0])["input_ids"]
    )  # tiny Llama adds a BOS: something is excluded
    pos = store.sql("SELECT * FROM positions ORDER BY row", format="pandas")
    assert pos["token_id"].tolist() == want_ids
    assert pos["document"].tolist() == want_doc
    assert pos["row"].tolist() == list(range(len(want_ids)))
    assert len(store.select()) == len(want_ids) == store.manifest.n_examples
    for d, text in enumerate(DOCS):  # each document's positions 0.. and the token text its characters
        mine = pos[pos["document"] == d]
        assert mine["position"].tolist() == list(range(len(mine)))
        assert "".join(mine["token"]) == text
    policy = store.manifest.ingest
    assert policy["positions"] == "all" and policy["special"] == "excluded" and not policy["pack"]
    assert store.snapshot is not None and "positions" in store.snapshot.tables
    report = verify_store(store)
    assert report.ok, report.problems


def test_keep_special_keeps_bos(tmp_path: Path) -> None:
    store = ingest(tmp_path, "s", keep_special=True)
    tok = tiny_model("llama").tokenizer
    want = [i for text in DOCS for i in tok(text)["input_ids"]]
    got = store.sql("SELECT token_id FROM positions ORDER BY row").column(0).to_pylist()
    assert got == want
    assert store.manifest.ingest["special"] == "kept"


def test_long_documents_are_cut_into_windows(tmp_path: Path) -> None:
    context = 6
    store = ingest(tmp_path, "s", context_length=context)
    tok = tiny_model("llama").tokenizer
    pos = store.sql("SELECT * FROM positions ORDER BY row", format="pandas")
    for d, text in enumerate(DOCS):
        content = tok(text, add_special_tokens=False)["input_ids"]
        mine = pos[pos["document"] == d]
        assert mine["token_id"].tolist() == content  # nothing lost or repeated at the cuts
        per_window = context - 1  # one BOS per window
        assert mine["window_index"].tolist() == [k // per_window for k in range(len(content))]
        assert mine["window_position"].tolist() == [1 + k % per_window for k in range(len(content))]
    assert store.manifest.ingest["cut_documents"] == sum(
        1 for t in DOCS if len(tok(t, add_special_tokens=False)["input_ids"]) > context - 1
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_position_equals_hooks_on_the_model(tmp_path: Path, arch: str) -> None:
    context = 9  # cut the long documents: windows are run alone below
    store = ingest(tmp_path, "s", arch=arch, context_length=context)
    loaded = tiny_model(arch)
    model, tok = loaded.model, loaded.tokenizer
    L = model.config.num_hidden_layers
    H = model.config.num_attention_heads
    pos = store.sql("SELECT * FROM positions ORDER BY row", format="pandas")
    want_resid, want_mlp, want_head = [], [], []
    special = set(tok.all_special_ids)
    for text in DOCS:
        content = tok(text, add_special_tokens=False)["input_ids"]
        full = tok(text)["input_ids"]
        prefix = full[: len(full) - len(content)] if full[-len(content) :] == content else []
        per_window = context - len(prefix)
        for a in range(0, len(content), per_window):
            ids = prefix + content[a : a + per_window]
            hidden, mlp_out, o_in = hooked_forward(model, ids)
            keep = [p for p, i in enumerate(ids) if i not in special]
            want_resid.append(torch.stack(hidden, 1)[keep].numpy())
            want_mlp.append(torch.stack(mlp_out, 1)[keep].numpy())
            heads = []
            for lay, z in zip(model.model.layers, o_in):  # z [T, H*d_head]; head h: columns h*dh..
                W = lay.self_attn.o_proj.weight  # [d_model, H*d_head]
                dh = W.shape[1] // H
                per_head = [z[:, h * dh : (h + 1) * dh] @ W[:, h * dh : (h + 1) * dh].T for h in range(H)]
                heads.append(torch.stack(per_head, 1))
            want_head.append(torch.stack(heads, 1)[keep].numpy())
    sel = store.select()
    assert len(sel) == len(pos) == sum(x.shape[0] for x in want_resid)
    # the last hidden state of transformers is after the final norm; the store's is before it
    got_resid = sel.features("resid", layers=list(range(L)))
    assert rel_err(got_resid, np.concatenate(want_resid)[:, :L]) < RTOL
    assert rel_err(sel.features("mlp"), np.concatenate(want_mlp)) < RTOL
    assert rel_err(sel.features("attn_head"), np.concatenate(want_head)) < RTOL


def hooked_forward(
    model: torch.nn.Module, ids: list[int]
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """One window alone through the model: its hidden states (embeddings first), each MLP's output and
    each attention output projection's input, [T, ...] each, from ordinary forward hooks."""
    o_in: list[torch.Tensor] = []
    mlp_out: list[torch.Tensor] = []
    layers = list(model.model.layers)  # type: ignore[union-attr, arg-type]
    hooks = [
        lay.self_attn.o_proj.register_forward_hook(lambda m, i, o: o_in.append(i[0][0])) for lay in layers
    ]
    hooks += [lay.mlp.register_forward_hook(lambda m, i, o: mlp_out.append(o[0])) for lay in layers]
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    return [h[0] for h in out.hidden_states], mlp_out, o_in


def test_loader_visits_every_row_once(tmp_path: Path) -> None:
    store = ingest(tmp_path, "s", kinds=("resid",), layers=(1,))
    sel = store.select()
    n = len(sel)
    feed = sel.loader(
        "resid", layers=[1], batch_size=5, buffer_rows=7, unit_rows=4, seed=3, with_ids=True, workers=0
    )
    ids, xs = zip(*feed)
    got = torch.cat(ids).numpy()
    assert sorted(got.tolist()) == list(range(n))
    assert not np.array_equal(got, np.arange(n))  # shuffled
    x = torch.cat(xs).numpy()
    want = sel.features("resid", layers=[1])
    np.testing.assert_array_equal(x, want[got])


def test_kinds_and_layers_choose_what_is_kept(tmp_path: Path) -> None:
    store = ingest(tmp_path, "s", kinds=("resid", "mlp"), layers=(1,))
    sel = store.select()
    assert sel.features("resid", layers=[1]).shape[1] == 1
    assert sel.features("mlp", layers=[1]).shape[1] == 1
    for kind, layers in (("resid", [0]), ("mlp", [0]), ("attn_head", [1]), ("z", [1]), ("attn_prob", [1])):
        with pytest.raises(QueryError) as e:
            sel.features(kind, layers=layers)
        assert "\n" not in str(e.value)
    z = store.array(0, "z")[:]  # not kept: zeros, never activations
    assert not z.any()
    assert store.manifest.ingest["kept"] == {"z": [], "mlp": [1], "resid": [1]}


def test_pack_joins_documents(tmp_path: Path) -> None:
    store = ingest(tmp_path, "s", pack=True, context_length=12)
    tok = tiny_model("llama").tokenizer
    want = [i for text in DOCS for i in tok(text, add_special_tokens=False)["input_ids"]]
    got = store.sql("SELECT token_id, document FROM positions ORDER BY row", format="pandas")
    assert got["token_id"].tolist() == want  # separators are special tokens: excluded
    assert store.manifest.ingest["pack"] and store.manifest.ingest["separator_ids"]


def test_too_little_free_space_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cc, "free_bytes", lambda loc: 1000)
    with pytest.raises(StorageError) as e:
        ingest(tmp_path, "s")
    assert "free" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "s").exists()


def test_target_mode_is_unchanged(tmp_path: Path) -> None:
    with pytest.raises(ActstoreError):
        ingest(tmp_path, "s", positions="target")  # a text corpus needs --positions all
    s = actstore.ingest_corpus(tmp_path / "t", model="tiny-llama", dataset="demo", limit_per_relation=1)
    assert "positions" not in s.table_files()
    assert "positions" not in json.loads((tmp_path / "t" / "manifest.json").read_text())["ingest"]


def test_resume_rewrites_a_lost_segment_identically(tmp_path: Path) -> None:
    whole = ingest(tmp_path, "whole")
    part = ingest(tmp_path, "part")
    n_seg = part.manifest.n_segments
    assert n_seg >= 3
    uncompact(Path(part.url))
    (Path(part.url) / "commits" / f"{n_seg - 2:06d}.json").unlink()  # as if killed before that commit
    resumed = ingest(tmp_path, "part", resume=True)
    sql = "SELECT * FROM positions ORDER BY row"
    assert resumed.sql(sql).equals(whole.sql(sql))
    for kind in ("resid", "mlp", "attn_head"):
        np.testing.assert_array_equal(resumed.select().features(kind), whole.select().features(kind))


def test_a_hugging_face_data_set_reads_its_text_column(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``hf:NAME`` goes through ``datasets.load_dataset``; a local folder stands in for the hub here
    (its text builder gives one ``text`` row a line), so nothing is downloaded."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    folder = tmp_path / "hub"
    folder.mkdir()
    write_docs(folder / "train.txt")
    from_hub = ingest(tmp_path, "hub-store", dataset=f"hf:{folder}")
    from_file = ingest(tmp_path, "file-store")
    sql = "SELECT document, position, token_id FROM positions ORDER BY row"
    assert from_hub.sql(sql).equals(from_file.sql(sql))


def test_verify_checks_the_positions_shards(tmp_path: Path) -> None:
    store = ingest(tmp_path, "s")
    shard = Path(store.url) / "tables" / "positions" / "000001.parquet"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    report = verify_store(actstore.open(store.url))
    assert any("tables/positions/000001.parquet" in p for p in report.problems), report.problems


def test_each_window_runs_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows go through the model in fixed batches; a batch holding rows of two segments is run once
    and shared (segments of 8 positions, batches of 2 windows of up to 9 tokens here)."""
    calls: list[int] = []
    run = FusedCapture.run

    def counted(self: FusedCapture, input_ids: torch.Tensor, *args: Any, **kw: Any) -> Any:
        calls.append(int(input_ids.shape[0]))
        return run(self, input_ids, *args, **kw)

    monkeypatch.setattr(FusedCapture, "run", counted)
    store = ingest(tmp_path, "s", context_length=9)
    n_windows = store.manifest.ingest["windows"]
    assert store.manifest.n_segments > 2
    assert sum(calls) == n_windows and len(calls) == -(-n_windows // 2)


@pytest.mark.parametrize("pack", [False, True])
def test_the_plan_is_the_same_tokenized_a_few_documents_at_a_time(
    monkeypatch: pytest.MonkeyPatch, pack: bool
) -> None:
    """plan_corpus tokenizes TOKENIZE_DOCS documents at a time: the windows, their rows and the policy
    equal those of one call over the whole corpus, also when a part boundary falls inside a window
    (packed) and with parts of one document."""
    import actstore.ingest.corpus_windows as cw
    from actstore.ingest.datasets.text_corpus import Documents

    texts = [
        f"{w} " * (3 + i % 5) + "end" for i, w in enumerate(["the", "river", "stone", "old", "north"] * 3)
    ]
    docs = Documents("text:x", texts, [f"line {i + 1}" for i in range(len(texts))], "0" * 64)
    tok = tiny_model("llama").tokenizer
    kw: dict[str, Any] = {"context_length": 6, "keep_special": False, "pack": pack, "separator": None}
    whole = cw.plan_corpus(docs, tok, **kw)
    for size in (1, 2, 7):
        monkeypatch.setattr(cw, "TOKENIZE_DOCS", size)
        parts = cw.plan_corpus(docs, tok, **kw)
        assert parts.policy == whole.policy and np.array_equal(parts.row_start, whole.row_start)
        assert len(parts.windows) == len(whole.windows)
        for a, b in zip(parts.windows, whole.windows, strict=True):
            assert a.number == b.number
            for name in ("ids", "document", "position", "char_start", "char_end", "kept"):
                assert np.array_equal(getattr(a, name), getattr(b, name)), name
