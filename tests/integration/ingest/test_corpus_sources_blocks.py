"""Sources at every token in windows long enough that the capture scores query rows in several causal
blocks (``SELECT_BLOCK`` rows each), on every tiny architecture (Gemma 3's sliding window of 4 cuts
across the blocks).

Expected values come from each window run alone through the model: the residual stream from
``output_hidden_states`` with the model's default attention (the capture computes the attention
itself at the source layers, so the forward must stay the model's), the attention probabilities
from ``output_attentions`` in eager attention.  Nothing of the capture code computes an expected value.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import actstore
from actstore.ingest.capture.fused import SELECT_BLOCK, SORT_WHOLE, heads_at, rows_at, select_top
from actstore.ingest.models.tiny import TINY_ARCHS, tiny_model
from actstore.query.select.corpus_sources import source_factors

pytestmark = pytest.mark.usefixtures("one_thread")

CONTEXT = 2 * SELECT_BLOCK + 17  # three blocks of query rows
K = 4
TEXT = " ".join(
    [
        "Paris is the capital of France and a large city on the river Seine, with many bridges.",
        "Rome, Madrid and Lisbon are capitals too; the cat sat on the mat near the old stone wall.",
        "In 1969, the Apollo program landed astronauts on the Moon, and the world watched them.",
    ]
    * 2
)


def windows(store: actstore.Store, arch: str) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(input ids, store rows, their positions in the window) of each window, from the positions
    table and the tokens the tokenizer adds before a text."""
    tok = tiny_model(arch).tokenizer
    plain = tok("a", add_special_tokens=False)["input_ids"]
    prefix = tok("a")["input_ids"][: -len(plain)]
    pos = store.sql(
        "SELECT row, document, window_index, window_position, token_id FROM positions ORDER BY row",
        format="pandas",
    )
    out = []
    for _, g in pos.groupby(["document", "window_index"], sort=True):
        wp = g["window_position"].to_numpy()
        ids = np.zeros(int(wp.max()) + 1, dtype=np.int64)
        ids[: len(prefix)] = prefix
        ids[wp] = g["token_id"].to_numpy()
        out.append((ids, g["row"].to_numpy(), wp))
    return out


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_blocks_of_query_rows_equal_a_plain_and_an_eager_forward(tmp_path: Path, arch: str) -> None:
    docs = tmp_path / "docs.txt"
    # a short document first: its window shares a batch with a long one and has no rows in the later
    # blocks (the capture skips it there)
    docs.write_text("Paris is in France.\n" + TEXT + "\n", encoding="utf-8")
    store = actstore.ingest_corpus(
        tmp_path / "s",
        model=f"tiny-{arch}",
        dataset=f"text:{docs}",
        positions="all",
        storage_dtype="float32",
        batch_size=2,
        segment_size=64,
        context_length=CONTEXT,
        sources=str(K),
    )
    wins = windows(store, arch)
    assert max(ids.size for ids, _, _ in wins) > 2 * SELECT_BLOCK
    model = tiny_model(arch).model
    f = source_factors(store, np.arange(store.manifest.n_examples))
    resid = store.select().features("resid")  # [n, L+1, d]
    for ids, rows, wp in wins:
        with torch.no_grad():
            plain = model(torch.from_numpy(ids)[None], output_hidden_states=True)
        want = np.stack([h[0].numpy() for h in plain.hidden_states], 1)[wp]  # [n, L+1, d]
        # (the last hidden state is after the final norm in transformers; the store keeps it before)
        np.testing.assert_allclose(resid[rows][:, :-1], want[:, :-1], rtol=1e-4, atol=1e-5)
        previous = model.config._attn_implementation
        model.set_attn_implementation("eager")
        try:
            with torch.no_grad():
                eager = model(torch.from_numpy(ids)[None], output_attentions=True)
        finally:
            model.set_attn_implementation(previous)
        A = np.stack([a[0].numpy() for a in eager.attentions], 0)  # [L, H, T, T]
        for r, t in zip(rows, wp):
            for lay in range(A.shape[0]):
                for h in range(A.shape[1]):
                    a = A[lay, h, t, wp]  # over the window's kept positions
                    order = np.argsort(-a, kind="stable")[:K]
                    want_src = sorted(int(rows[j]) for j in order if a[j] > 0)
                    got = f.source_row[r, lay, h]
                    assert sorted(int(x) for x in got if x >= 0) == want_src, (arch, r, lay, h)
                    w = f.weight[r, lay, h]
                    assert np.all(np.diff(w) <= 0)  # descending
                    at = {int(x): k for k, x in enumerate(got) if x >= 0}
                    np.testing.assert_allclose(
                        [w[at[int(rows[j])]] for j in order if a[j] > 0],
                        [a[j] for j in order if a[j] > 0],
                        rtol=1e-5,
                        atol=1e-7,
                    )


def test_select_top_is_topk() -> None:
    """The CPU selection (a sort of each row's keys, or past ``SORT_WHOLE`` entries a partition and a
    sort of the chosen) against ``torch.topk``, on rows without ties; past the row's length it keeps
    the whole row."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand((3, 5, 97), generator=g)
    w, j = select_top(x, 7)
    tw, tj = torch.topk(x, 7)
    assert torch.equal(w, tw) and torch.equal(j, tj)
    w, j = select_top(x[..., :5], 7)
    tw, tj = torch.topk(x[..., :5], 5)
    assert torch.equal(w, tw) and torch.equal(j, tj)
    x = torch.rand((2, 3, SORT_WHOLE + 45), generator=g)  # the partition's path
    w, j = select_top(x, 7)
    tw, tj = torch.topk(x, 7)
    assert torch.equal(w, tw) and torch.equal(j, tj)


def test_rows_and_heads_at_equal_the_advanced_index() -> None:
    """The capture's gathers (``index_select`` of flattened rows) against ``x[b, p]`` and ``x[b, :, p]``
    on each layout they meet: contiguous, a projection's heads transposed, and one whose axes do not
    merge (the advanced index then)."""
    g = torch.Generator().manual_seed(1)
    B, T, H, d = 5, 9, 3, 4
    b, p = torch.nonzero(torch.rand((B, T), generator=g) < 0.6, as_tuple=True)
    for x in (
        torch.randn(B, T, H, d),
        torch.randn(B, H, T, d).transpose(1, 2),
        torch.randn(T, B, d).transpose(0, 1),
    ):
        assert torch.equal(rows_at(x, b, p), x[b, p])
    for x in (
        torch.randn(B, H, T, d),
        torch.randn(B, T, H, d).transpose(1, 2),
        torch.randn(B, H, d, T).transpose(2, 3),
        torch.randn(B, H, T),
    ):
        assert torch.equal(heads_at(x, b, p), x[b, :, p])


@pytest.mark.parametrize("n", [1, 5, 16, 17, 40, 128, 300])
def test_select_top_with_ties_negatives_and_short_rows(n: int) -> None:
    """Against a brute-force sort of every row (numpy) and ``torch.topk``: rows full of ties, negative
    values, signed zeros and infinities, and rows with fewer entries than ``k``.  The values must be
    the row's ``k`` largest, descending, bit for bit; the indices distinct and pointing at them."""
    rng = np.random.default_rng(n)
    pool = np.array([-np.inf, -3.5, -1.0, -1e-30, -0.0, 0.0, 1e-30, 0.25, 0.5, 2.0, np.inf], dtype=np.float32)
    x = torch.from_numpy(rng.choice(pool, size=(3, 4, n)))
    x[0] = torch.from_numpy(rng.standard_normal((4, n)).astype(np.float32))  # no ties
    x[1, 0] = 0.0  # one row all equal
    k = 16
    w, j = select_top(x, k)
    assert w.shape == j.shape == (3, 4, min(k, n)) and w.dtype == torch.float32 and j.dtype == torch.int64
    flat_x, flat_w, flat_j = (
        x.reshape(-1, n).numpy(),
        w.reshape(-1, min(k, n)).numpy(),
        j.reshape(-1, min(k, n)).numpy(),
    )
    for row, ww, jj in zip(flat_x, flat_w, flat_j, strict=True):
        np.testing.assert_array_equal(ww, np.sort(row)[::-1][: min(k, n)])  # the k largest, descending
        assert len(set(jj.tolist())) == jj.size and jj.min() >= 0 and jj.max() < n
        assert np.array_equal(row[jj].view(np.int32), ww.view(np.int32))  # the very entries, -0.0 included
    tw, _ = torch.topk(x, min(k, n))
    assert torch.equal(w, tw)
