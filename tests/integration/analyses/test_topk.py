"""actstore topk: the streaming top-k of every unit against a brute-force numpy sort."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

import actstore
from actstore.cli import main
from actstore.core.errors import QueryError
from actstore.query.analyses.topk import _top_rows, top_activations

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def store_path(store_factory: Callable[..., Path]) -> Path:
    return store_factory("llama", limit=6, storage_dtype="float16")


def brute(values: np.ndarray, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """[U, k] values and rows by a full sort of every column (value desc, row asc)."""
    vs, rs = [], []
    for u in range(values.shape[1]):
        order = np.lexsort((rows, -values[:, u]))[:k]
        vs.append(values[order, u])
        rs.append(rows[order])
    return np.stack(vs), np.stack(rs)


@pytest.mark.parametrize("k, batch_rows", [(1, 1), (5, 3), (20, 7), (100, 1024)])
def test_mlp_neurons_match_a_full_sort(store_path: Path, k: int, batch_rows: int) -> None:
    s = actstore.open(store_path)
    sel = s.select("example_id % 5 <> 2")
    layer = 1
    # independent: the stored activations read whole through zarr, every segment
    acts, rows = [], []
    by_seg = {int(g): None for g in sel.rows.column("segment").to_pylist()}
    srow = sel.rows.column("seg_row").to_numpy()
    segs = sel.rows.column("segment").to_numpy()
    for seg in by_seg:
        a = np.asarray(s.array(seg, "mlp")[:]).astype(np.float32)[:, layer]
        acts.append(a[srow[segs == seg]])
    acts_all = np.concatenate(acts)
    rows = sel.rows.column("row").to_numpy()
    want_v, want_r = brute(acts_all, rows, k)
    got = top_activations(sel, "mlp", layer, k, batch_rows=batch_rows)
    assert got.values.shape == (s.geometry.d_mlp, min(k, len(sel)))
    np.testing.assert_array_equal(got.values, want_v)
    np.testing.assert_array_equal(got.rows, want_r)
    t = got.table
    assert t.num_rows == want_v.size and t.column("rank").to_pylist()[: want_v.shape[1]] == list(
        range(want_v.shape[1])
    )


def test_head_norms_and_directions_match_a_full_sort(store_path: Path) -> None:
    s = actstore.open(store_path)
    sel = s.select()
    rows = sel.rows.column("row").to_numpy()
    x = sel.features("attn_head", layers=[0])[:, 0]  # [n, H, d]
    want_v, want_r = brute(np.linalg.norm(x, axis=-1), rows, 4)
    got = top_activations(sel, "attn_head", 0, 4, batch_rows=5)
    np.testing.assert_allclose(got.values, want_v, rtol=1e-5)
    np.testing.assert_array_equal(got.rows, want_r)
    w = np.random.default_rng(0).standard_normal((3, s.geometry.d_model)).astype(np.float32)
    r = sel.features("resid", layers=[2])[:, 0]
    want_v, want_r = brute(r @ w.T, rows, 6)
    got = top_activations(sel, "direction", 2, 6, on="resid", directions=w, batch_rows=4)
    np.testing.assert_allclose(got.values, want_v, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got.rows, want_r)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 30),
    units=st.integers(1, 4),
    k=st.integers(1, 12),
    data=st.data(),
)
def test_ties_go_to_the_smaller_row(n: int, units: int, k: int, data: Any) -> None:
    """Few distinct values (many ties): the kept rows are those of a full sort by (value desc, row asc)."""
    v = np.array(data.draw(st.lists(st.integers(0, 3), min_size=n * units, max_size=n * units)), np.float32)
    v = v.reshape(n, units)
    rows = np.array(data.draw(st.permutations(list(range(100, 100 + n)))), np.int64)
    r = np.broadcast_to(rows[:, None], v.shape)
    if n <= k:
        return
    keep = _top_rows(v, r, k)
    got = sorted(zip(*(np.take_along_axis(v, keep, 0)[:, 0], np.take_along_axis(r, keep, 0)[:, 0])))
    want_v, want_r = brute(v, rows, k)
    assert got == sorted(zip(want_v[0], want_r[0]))


def test_the_command_records_a_result_table(store_path: Path, tmp_path: Path) -> None:
    store = tmp_path / "s"
    shutil.copytree(store_path, store)
    r = CliRunner().invoke(
        main, ["topk", str(store), "--kind", "mlp", "--layer", "1", "--k", "3", "--show", "2"]
    )
    assert r.exit_code == 0, r.output
    assert "unit 0:" in r.output and "topk_contexts" in r.output
    s = actstore.open(store)
    t = s.sql("SELECT unit, rank, row, value FROM topk_contexts ORDER BY unit, rank")
    got = top_activations(s.select(), "mlp", 1, 3)
    assert t.column("row").to_pylist() == got.rows.reshape(-1).tolist()
    runs = s.sql("SELECT kind, config FROM runs WHERE kind = 'topk'").to_pylist()
    assert len(runs) == 1 and '"k": 3' in runs[0]["config"]
    joined = s.sql(
        "SELECT e.text FROM topk_contexts c JOIN examples e USING (example_id) WHERE c.unit = 0 AND c.rank = 0"
    )
    assert joined.num_rows == 1
    bad = CliRunner().invoke(main, ["topk", str(store), "--kind", "direction", "--layer", "1"])
    assert bad.exit_code == 2 and "needs --direction" in bad.stderr and bad.stderr.count("\n") == 1


def test_bad_arguments_are_one_line(store_path: Path, tmp_path: Path) -> None:
    sel = actstore.open(store_path).select()
    for kw, match in (
        ({"kind": "resid", "layer": 0, "k": 3}, "kind must be one of"),
        ({"kind": "mlp", "layer": 5, "k": 3}, "layer 5 out of range"),
        ({"kind": "mlp", "layer": 0, "k": 0}, "k must be an integer"),
        ({"kind": "direction", "layer": 0, "k": 2}, "needs directions"),
        ({"kind": "direction", "layer": 0, "k": 2, "directions": np.ones((2, 5))}, "directions must be"),
        (
            {"kind": "direction", "layer": 0, "k": 2, "on": "attn_prob", "directions": np.ones(4)},
            "fixed-size",
        ),
    ):
        with pytest.raises(QueryError, match=match) as e:
            top_activations(sel, **kw)
        assert "\n" not in str(e.value)


def test_a_corpus_stores_contexts_are_its_documents_text(tmp_path: Path) -> None:
    """On a corpus store each context is the text of the row's window around its token: checked
    against the document's own characters, cut at the token offsets the tokenizer gives directly."""
    from actstore.ingest.models.tiny import tiny_model
    from actstore.query.analyses.topk import position_contexts

    docs = [
        "the quiet river runs past an old stone bridge",
        "a red house stands on the hill near the lake",
        "kings and queens of the north built great halls",
    ]
    path = tmp_path / "docs.txt"
    path.write_text("\n".join(docs) + "\n", encoding="utf-8")
    store = actstore.ingest_corpus(
        tmp_path / "c",
        model="tiny-llama",
        dataset=f"text:{path}",
        positions="all",
        kinds=("mlp",),
        batch_size=2,
        segment_size=8,
    )
    tok = tiny_model("llama").tokenizer
    expected: list[tuple[str, str, str]] = []  # per row, in corpus order: (before, token, after)
    for text in docs:
        offs = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        for i, (a, b) in enumerate(offs):
            lo, hi = max(i - 3, 0), min(i + 2, len(offs) - 1)
            expected.append((text[offs[lo][0] : a], text[a:b], text[b : offs[hi][1]]))
    rows = list(range(len(expected)))
    got = position_contexts(store, rows, before=3, after=2)
    assert len(got) == len(expected)
    for r in rows:
        c = got[r]
        assert (c.before, c.token, c.after) == expected[r], r
    # the command shows them for the top rows of a neuron
    res = CliRunner().invoke(
        main, ["topk", str(store.url), "--kind", "mlp", "--layer", "1", "--k", "3", "--json"]
    )
    assert res.exit_code == 0, res.output
    import json

    top = json.loads(res.stdout)["shown"][0]["top"][0]
    c = position_contexts(store, [top["row"]])[top["row"]]
    assert top["text"] == f"{c.before}[{c.token}]{c.after}" and top["token"] == c.token
