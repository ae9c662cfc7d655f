"""The chunk and segment sizes a corpus store gets by default, read back with Zarr directly.

A corpus store (``--positions all``) is read a thousand positions at a time (the training loader, the
SAELens export, scans), so its defaults are sized in bytes: segments of about 16 MiB of stored
activations (a multiple of 256 positions, at most 16,384) and chunks of about 256 KiB of the widest
kept array (a power of two, 32 rows to the segment).  Prompt stores keep 256-example segments and
32-row chunks; sizes given explicitly are kept; a store written with other sizes resumes with its own.
The expected sizes below are worked out by hand from the model's shape, not by the ingest's code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
from helpers import uncompact

import actstore
from actstore.core.manifest import Geometry
from actstore.ingest.corpus import corpus_chunk_rows, corpus_segment_rows

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = "the quiet river runs past an old stone bridge a red house stands on the hill near lake".split()


def corpus(path: Path, docs: int, words: int = 30) -> str:
    g = torch.Generator().manual_seed(0)
    lines = [
        " ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (words,), generator=g)) for _ in range(docs)
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return f"text:{path}"


def ingest(tmp_path: Path, name: str, docs: int = 8, **kw: Any) -> actstore.Store:
    settings: dict[str, Any] = {
        "model": "tiny-llama",
        "dataset": corpus(tmp_path / f"{name}.txt", docs),
        "positions": "all",
        "kinds": ("resid",),
        "layers": (1,),
        "batch_size": 4,
    }
    return actstore.ingest_corpus(tmp_path / name, **(settings | kw))


def stored_chunk_rows(store: actstore.Store, array: str = "resid") -> int:
    """Rows of one chunk file (a shard of layer chunks) of segment 0's ``array``, as Zarr reads it."""
    a = zarr.open_array(str(Path(store.url) / "segments" / "000000" / array), mode="r")
    rows = (a.shards or a.chunks)[0]
    assert a.chunks[0] == rows  # the layer chunks of a shard hold the shard's rows
    return int(rows)


def test_a_corpus_store_is_chunked_by_bytes(tmp_path: Path) -> None:
    store = ingest(tmp_path, "s", docs=100, context_length=64, pack=True, keep_special=True)
    assert len(store.select()) > 2048
    g = store.geometry
    assert g.d_model == 64  # tiny-llama: one kept layer of resid in float16 is 128 bytes a position
    # 256 KiB / 128 bytes = 2048 rows a chunk; 16 MiB / 128 bytes is past 16,384 positions a segment
    assert store.manifest.segment_size == 16384
    assert store.manifest.chunk_rows == 2048
    assert stored_chunk_rows(store) == 2048
    assert stored_chunk_rows(store, "mlp") == 2048  # one size for every per-position array


def test_sizes_given_are_kept_and_a_prompt_store_keeps_32_rows(tmp_path: Path) -> None:
    store = ingest(tmp_path, "s", segment_size=256, chunk_rows=32)
    assert (store.manifest.segment_size, stored_chunk_rows(store)) == (256, 32)
    prompts = actstore.ingest_corpus(tmp_path / "p", model="tiny-llama", dataset="demo", limit_per_relation=8)
    assert (prompts.manifest.segment_size, prompts.manifest.chunk_rows) == (256, 32)
    a = zarr.open_array(str(Path(prompts.url) / "segments" / "000000" / "z"), mode="r")
    assert a.shape[0] > 32 and (a.shards or a.chunks)[0] == 32


def test_the_default_sizes_follow_the_widest_kept_array() -> None:
    # SmolLM2-135M's shape: mlp is 1536 wide (3,072 bytes a position in float16): 85 rows -> 64;
    # resid alone 576 (1,152 bytes): 227 rows -> 128; four kept layers of both: 14,912 bytes a position
    g = Geometry(n_layers=30, n_heads=9, n_kv_heads=3, d_head=64, d_model=576, d_mlp=1536, vocab_size=49152)
    kept = {"z": [], "mlp": [6, 12, 18, 24], "resid": [6, 12, 18, 24]}
    assert corpus_chunk_rows(g, kept, "float16", 1, 16384) == 64
    assert corpus_chunk_rows(g, {"z": [], "mlp": [], "resid": [6]}, "float16", 1, 16384) == 128
    assert corpus_chunk_rows(g, kept, "float16", 1, 48) == 48  # never past the segment
    # all layers in one chunk (chunk_layers 0): 31 x 1,152 bytes a row of resid: 7 rows -> the floor, 32
    assert corpus_chunk_rows(g, {"z": [], "mlp": [], "resid": [6]}, "float16", 0, 16384) == 32
    # 16 MiB / 16,896 bytes a position = 992.9: 768 (a multiple of 256), then whole batches of 5 windows
    assert corpus_segment_rows(4 * (1536 + 576) * 2, 16) == 768
    assert corpus_segment_rows(4 * (1536 + 576) * 2, 5) == 770
    assert corpus_segment_rows(1 << 20, 16) == 256 and corpus_segment_rows(2, 16) == 16384


def test_a_store_of_other_sizes_resumes_with_its_own(tmp_path: Path) -> None:
    """A store written with other sizes (as before the byte-sized defaults: small segments, 32-row
    chunks) resumes under the defaults with its own sizes, and gives what an uninterrupted run gives."""
    old = {"segment_size": 8, "chunk_rows": 4, "compact_every": 2}
    whole = ingest(tmp_path, "whole", **old)
    part = ingest(tmp_path, "part", **old)
    n_seg = part.manifest.n_segments
    assert n_seg >= 3
    uncompact(Path(part.url))
    (Path(part.url) / "commits" / f"{n_seg - 2:06d}.json").unlink()  # as if killed before that commit
    resumed = ingest(tmp_path, "part", resume=True)  # no sizes given: the defaults
    assert (resumed.manifest.segment_size, stored_chunk_rows(resumed)) == (8, 4)
    sql = "SELECT * FROM positions ORDER BY row"
    assert resumed.sql(sql).equals(whole.sql(sql))
    np.testing.assert_array_equal(
        resumed.select().features("resid", layers=[1]), whole.select().features("resid", layers=[1])
    )


def test_the_loader_covers_a_default_store_once_an_epoch_and_resumes(tmp_path: Path) -> None:
    """Several 2,048-row chunks, windows smaller than the selection: every row once an epoch (a plain
    set), two epochs in different orders, each batch the rows ``features`` gives, and a state taken
    mid-epoch gives the rest of the order an uninterrupted feed gives."""
    store = ingest(tmp_path, "s", docs=260, context_length=64, pack=True, keep_special=True)
    sel = store.select()
    n = len(sel)
    assert n > 3 * 2048 and stored_chunk_rows(store) == 2048
    want = sel.features("resid", layers=[1])
    ids = sel.rows.column("row").to_numpy()
    make = lambda: sel.loader(  # noqa: E731
        "resid", layers=[1], batch_size=500, buffer_rows=3000, seed=5, with_ids=True, epochs=2
    )
    feed = make()
    assert feed.n_units == -(-n // 2048)
    epochs: list[list[int]] = [[], []]
    seen = 0
    for row_ids, x in feed:
        e = 0 if seen < n else 1
        epochs[e] += row_ids.tolist()
        seen += len(row_ids)
        np.testing.assert_array_equal(x.numpy(), want[np.searchsorted(ids, row_ids.numpy())])
    assert [len(e) for e in epochs] == [n, n]
    assert set(epochs[0]) == set(epochs[1]) == set(ids.tolist())
    assert epochs[0] != epochs[1]
    again = make()
    it = iter(again)
    head = [next(it)[0] for _ in range(5)]
    state = again.state_dict()
    del it
    resumed = make()
    resumed.load_state_dict(state)
    rest = [r for r, _ in resumed]
    got = torch.cat([*head, *rest]).tolist()
    assert got == epochs[0] + epochs[1]
