"""Length batching (actstore.ingest.pipeline): a segment's prompts run through the model sorted by length.

Three ingests of the same fixture corpus by the same tiny model:

* ``corpus``: batches in corpus order (the default);
* ``sorted``: ``length_batching=True``;
* ``presorted``: the corpus with each segment's prompts already sorted by length, batches in
  (that) corpus order, so its forward passes are exactly those of ``sorted`` (same batches, same
  padded lengths), with the rows written in the sorted order.

``sorted`` must hold, bit for bit, ``presorted``'s rows put back in corpus order (every per-row
and per-token array, every table column); and against ``corpus`` the same rows, tokens and tables
(float values within a few float32 ulps: torch's CPU matmul and attention give a row results that
depend on the padded length of its batch: F.linear of 12 rows of 576 numbers differs in 1.2% of
its outputs, by up to 4e-5 = 5e-4 relative, when the rows are padded to 40; sdpa likewise).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import numpy as np
import pyarrow.parquet as pq
import pytest
from helpers import FIXTURES

import actstore
from actstore.core.layout import SEGMENT_ARRAYS
from actstore.ingest.align import tokenize_records
from actstore.ingest.datasets.dispatch import load_dataset
from actstore.ingest.models.tiny import tiny_model
from actstore.ingest.pipeline import corpus_order, forward_order, ingest_prompts
from actstore.ingest.settings import IngestConfig

SEG, BATCH = 16, 4


def prompts_of(loaded: Any) -> list[Any]:
    records = load_dataset(f"fewrel:{FIXTURES / 'fewrel' / 'val_wiki.json'}", limit_per_relation=6).records
    return tokenize_records(records, loaded.tokenizer)


def ingest(
    out: Path, loaded: Any, prompts: list[Any], by_length: bool, dtype: str, side: str
) -> actstore.Store:
    cfg = IngestConfig(
        out=str(out),
        batch_size=BATCH,
        storage_dtype=dtype,
        segment_size=SEG,
        chunk_rows=4,
        chunk_flat=64,
        padding_side=side,
        progress=False,
        length_batching=by_length,
    )
    info = {"name": loaded.name, "architecture": loaded.architecture, "weight_hash": loaded.weight_hash}
    ingest_prompts(loaded.model, loaded.tokenizer, info, prompts, cfg)
    return actstore.open(out)


def rows_of(store: actstore.Store, seg: int, name: str) -> list[np.ndarray]:
    """Each example's entries of array ``name`` in segment ``seg`` (one row, or its tokens), corpus order."""
    c = store.commits[seg]
    if name in ("attn", "v"):
        ex = store.sql(
            "SELECT n_tokens, tok_start FROM examples WHERE segment = ? ORDER BY example_id", [seg]
        )
        n, start = ex.column(0).to_numpy(), ex.column(1).to_numpy()
        flat = store.read_segment_ranges(seg, name, np.array([0]), np.array([c.n_tokens]))
        return [flat[s : s + k] for s, k in zip(start, n)]
    return list(store.read_segment_rows(seg, name, np.arange(c.n_rows)))


@pytest.mark.parametrize(("dtype", "side"), [("float32", "right"), ("float16", "left")])
def test_length_batching_writes_the_rows_of_its_forward_passes_in_corpus_order(
    tmp_path: Path, dtype: str, side: str
) -> None:
    loaded = tiny_model("llama")
    prompts = prompts_of(loaded)
    n = len(prompts)
    lengths = np.array([p.target_position + 1 for p in prompts])
    order = np.concatenate([lo + forward_order(prompts[lo : lo + SEG], True) for lo in range(0, n, SEG)])
    # The corpus gives the sorting work to do: several segments, most of whose batches change.
    assert n >= 3 * SEG and (order != np.arange(n)).mean() > 0.5

    def padded(o: np.ndarray) -> int:  # tokens the forward passes run, padding included
        return sum(
            len(b) * int(lengths[b].max())
            for s in range(0, n, SEG)
            for b in np.split(o[s : s + SEG], range(BATCH, len(o[s : s + SEG]), BATCH))
        )

    assert padded(order) < 0.9 * padded(np.arange(n))
    corpus = ingest(tmp_path / "corpus", loaded, prompts, False, dtype, side)
    srt = ingest(tmp_path / "sorted", loaded, prompts, True, dtype, side)
    pre = ingest(tmp_path / "presorted", loaded, [prompts[i] for i in order], False, dtype, side)
    for seg in srt.commits:
        local = order[seg * SEG : (seg + 1) * SEG] - seg * SEG  # presorted row k holds corpus row local[k]
        inv = np.argsort(local)
        for name in SEGMENT_ARRAYS:
            got, want, near = rows_of(srt, seg, name), rows_of(pre, seg, name), rows_of(corpus, seg, name)
            assert len(got) == len(want) == len(near)
            for i in range(len(got)):  # corpus row i = presorted row inv[i], bit for bit
                assert np.array_equal(got[i], want[inv[i]]), (seg, name, i)
                assert got[i].shape == near[i].shape
                scale = max(float(np.abs(near[i]).max()), 1e-6)
                tol = 2e-6 if dtype == "float32" else 2e-3  # a float16 rounding may flip
                assert float(np.abs(got[i] - near[i]).max()) <= tol * scale, (seg, name, i)
    # Tables: examples and tokens files byte-identical to the corpus-order store; targets equal apart from
    # the object log-probability's last bits; presorted's targets permuted back equal sorted's exactly.
    for name in ("examples", "tokens"):
        for rel in srt.table_files()[name]:
            assert (tmp_path / "sorted" / rel).read_bytes() == (tmp_path / "corpus" / rel).read_bytes()
    t_s, t_c, t_p = (s.table("targets").to_pandas() for s in (srt, corpus, pre))
    t_p = t_p.iloc[np.argsort(order)].reset_index(drop=True)
    for col in t_s.columns:
        if col in (
            "example_id",
            "row",
            "seg_row",
            "src_start",
        ):  # presorted numbers its rows in its own order
            assert t_s[col].tolist() == t_c[col].tolist()
        elif col == "object_logprob":
            np.testing.assert_array_equal(t_s[col].to_numpy(), t_p[col].to_numpy())
            np.testing.assert_allclose(t_s[col].to_numpy(), t_c[col].to_numpy(), rtol=1e-5, atol=1e-5)
        else:
            assert t_s[col].tolist() == t_p[col].tolist() == t_c[col].tolist(), col
    # The manifest records the setting; run records say it too.
    assert srt.manifest.ingest["length_batching"] is True and "length_batching" not in corpus.manifest.ingest
    cfgs = [
        json.loads(
            pq.read_table(next((tmp_path / d / "tables" / "runs").glob("*.parquet")))
            .column("config")[0]
            .as_py()
        )
        for d in ("corpus", "sorted")
    ]
    assert (cfgs[0]["length_batching"], cfgs[1]["length_batching"]) == (False, True)


def test_forward_order_sorts_by_length_and_corpus_order_inverts_it() -> None:
    class P:
        def __init__(self, n: int) -> None:
            self.target_position = n - 1

    lengths = np.array([5, 2, 7, 2, 3, 7, 1])
    order = forward_order([cast(Any, P(int(k))) for k in lengths], True)
    assert order.tolist() == [6, 1, 3, 4, 0, 2, 5]  # by length, ties in corpus order
    assert forward_order([cast(Any, P(int(k))) for k in lengths], False).tolist() == list(range(7))
    rows = np.arange(7) * 10  # row i of the corpus holds 10 i
    assert corpus_order(rows[order], order).tolist() == rows.tolist()
    flat = np.array(
        [(i, j) for i in range(7) for j in range(lengths[i])]
    )  # example i owns entries (i, 0), (i, 1), ..
    captured = np.concatenate([flat[flat[:, 0] == i] for i in order])
    assert np.array_equal(corpus_order(captured, order, lengths), flat)
    assert corpus_order(rows, np.arange(7)) is rows


def test_ingest_command_length_batching_flag(tmp_path: Path) -> None:
    """``actstore ingest --length-batching`` turns it on and records it; ``--resume`` must repeat it."""
    from click.testing import CliRunner

    from actstore.cli import main

    data = f"fewrel:{FIXTURES / 'fewrel' / 'val_wiki.json'}"
    common = [
        "ingest",
        "--model",
        "tiny-llama",
        "--dataset",
        data,
        "--limit-per-relation",
        "6",
        "--batch-size",
        str(BATCH),
        "--segment-size",
        str(SEG),
        "--quiet",
        "--threads",
        "1",
    ]
    runner = CliRunner()
    on, off = tmp_path / "on", tmp_path / "off"
    r = runner.invoke(main, [*common, "--length-batching", "--out", str(on)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(main, [*common, "--out", str(off)])
    assert r.exit_code == 0, r.output
    s_on, s_off = actstore.open(on), actstore.open(off)
    assert s_on.manifest.ingest["length_batching"] is True and "length_batching" not in s_off.manifest.ingest
    assert s_on.n_rows == s_off.n_rows > SEG  # more than one segment, the same rows
    same = "SELECT example_id, text, n_tokens, tok_start, segment FROM examples ORDER BY example_id"
    assert s_on.sql(same).equals(s_off.sql(same))
    z_on, z_off = s_on.select().features("z"), s_off.select().features("z")
    np.testing.assert_allclose(z_on, z_off, rtol=1e-2, atol=1e-3)  # float16 storage; last bits may differ
    before = {p: p.read_bytes() for p in on.rglob("*") if p.is_file()}
    r = runner.invoke(
        main, [*common, "--resume", "--out", str(on)]
    )  # without the flag: a setting that differs
    assert r.exit_code != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "length_batching" in lines[0], r.stderr
    assert {p: p.read_bytes() for p in on.rglob("*") if p.is_file()} == before  # nothing stored changed
