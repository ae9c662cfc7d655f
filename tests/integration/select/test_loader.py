"""Selection.loader: the training feed, checked against independent computations.

Every property is checked on what the loader hands out (row ids and tensors), never on its plan:
each epoch gives the selection's rows exactly once (as a multiset), each tensor row equals
``Selection.features`` for its row id, the order is a function of the seed and the epoch, a resumed
epoch gives exactly the rows the uninterrupted one had left, and the ranks of a DDP split are
disjoint and cover the selection.  Hypothesis draws the sizes, buffer sizes, batch sizes and world sizes.
"""

from __future__ import annotations

import itertools
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import assert_within_ulps
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import actstore
from actstore.core.errors import CorruptStoreError, QueryError

pytestmark = pytest.mark.usefixtures("one_thread")

HYP = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def store(store_factory: Callable[..., Path]) -> Any:
    """Tiny Llama over the demo corpus, 6 facts per relation: 36 rows in 5 segments of 8, chunks of 4
    rows (float16, as ingests store by default)."""
    return actstore.open(store_factory("llama", limit=6, storage_dtype="float16"))


@pytest.fixture(scope="module")
def oracle(store: Any) -> dict[str, np.ndarray]:
    """``features`` of every row, per kind, keyed by store row (the independent computation)."""
    sel = store.select()
    rows = sel.rows.column("row").to_numpy()
    out = {"rows": rows}
    for kind, layers in (("mlp", [1]), ("resid", [0, 2]), ("attn_head", [0]), ("z", [1])):
        out[kind] = sel.features(kind, layers=layers)
    return out


LAYERS = {"mlp": [1], "resid": [0, 2], "attn_head": [0], "z": [1]}


def drain(loader: Any) -> tuple[np.ndarray, np.ndarray]:
    ids, xs = [], []
    for i, x in loader:
        assert x.dtype == loader.dtype and x.shape[0] <= loader.batch_size
        ids.append(i.numpy())
        xs.append(x.float().numpy())
    if not ids:
        return np.zeros(0, np.int64), np.zeros((0,))
    return np.concatenate(ids), np.concatenate(xs)


def close(x: np.ndarray, want: np.ndarray, kind: str) -> None:
    """Stored kinds exactly; computed kinds (a matmul over fewer rows than ``features`` multiplies at
    once) to float32 rounding."""
    if kind in ("resid", "z"):
        np.testing.assert_array_equal(x, want)
    else:
        np.testing.assert_allclose(x, want, rtol=1e-5, atol=1e-6)


def expected(oracle: dict[str, np.ndarray], kind: str, ids: np.ndarray) -> np.ndarray:
    pos = {int(r): k for k, r in enumerate(oracle["rows"])}
    return oracle[kind][[pos[int(r)] for r in ids]]


@HYP
@given(
    n=st.integers(1, 36),
    sample_seed=st.integers(0, 3),
    batch=st.integers(1, 20),
    buffer=st.integers(1, 40),
    workers=st.sampled_from([0, 1, 2]),
    shuffle=st.booleans(),
    kind=st.sampled_from(sorted(LAYERS)),
    unit=st.sampled_from([None, 1, 4, 8, 16]),
)
def test_an_epoch_gives_every_row_once_with_its_features(
    store: Any,
    oracle: dict[str, np.ndarray],
    n: int,
    sample_seed: int,
    batch: int,
    buffer: int,
    workers: int,
    shuffle: bool,
    kind: str,
    unit: int | None,
) -> None:
    sel = store.select().sample(n, seed=sample_seed)
    ld = sel.loader(
        kind,
        layers=LAYERS[kind],
        batch_size=batch,
        buffer_rows=buffer,
        workers=workers,
        shuffle=shuffle,
        with_ids=True,
        unit_rows=unit,
    )
    ids, x = drain(ld)
    want = sel.rows.column("row").to_numpy()
    assert sorted(ids.tolist()) == sorted(want.tolist())  # exactly once: the multiset of the selection
    close(x, expected(oracle, kind, ids), kind)
    assert len(ld) == -(-n // batch)
    if not shuffle:
        assert ids.tolist() == want.tolist()  # store order
    assert ld.epoch == 1 and ld.position == 0  # the epoch advanced by itself


def test_the_order_is_fixed_by_the_seed_and_epoch(store: Any) -> None:
    sel = store.select()

    def order(seed: int, epoch: int, workers: int = 1) -> list[int]:
        ld = sel.loader(
            "mlp", layers=[1], batch_size=5, buffer_rows=9, seed=seed, workers=workers, with_ids=True
        )
        ld.set_epoch(epoch)
        return drain(ld)[0].tolist()

    a = order(0, 0)
    assert a == order(0, 0) == order(0, 0, workers=0) == order(0, 0, workers=3)
    plan = sel.loader("mlp", layers=[1], batch_size=5, buffer_rows=9, seed=0)
    assert plan.epoch_rows(0).tolist() == a and plan.epoch_rows(1).tolist() == order(0, 1)
    assert a != order(1, 0) and a != order(0, 1)
    assert a != sorted(a)  # shuffled
    # iterating again runs the next epoch
    ld = sel.loader("mlp", layers=[1], batch_size=5, buffer_rows=9, with_ids=True)
    assert drain(ld)[0].tolist() == a
    assert drain(ld)[0].tolist() == order(0, 1)


def test_windows_mix_only_nearby_chunks(store: Any) -> None:
    """Memory is bounded by the buffer: each ``buffer_rows`` window of the output holds rows of at
    most ``ceil(buffer / unit) + 1`` units of ``unit_rows // chunk_rows`` storage chunks."""
    sel = store.select()
    chunk = store.manifest.chunk_rows
    for buffer, unit in ((1, 4), (4, 4), (6, 4), (9, 4), (13, 4), (6, 8), (13, 8), (20, 8)):
        ld = sel.loader(
            "resid", layers=[0], batch_size=3, buffer_rows=buffer, seed=2, with_ids=True, unit_rows=unit
        )
        assert ld.unit_rows == unit
        ids = drain(ld)[0]
        rows = sel.rows
        seg = dict(zip(rows.column("row").to_pylist(), rows.column("segment").to_pylist()))
        srow = dict(zip(rows.column("row").to_pylist(), rows.column("seg_row").to_pylist()))
        for w in range(0, ids.size, buffer):
            chunks = {(seg[int(r)], srow[int(r)] // chunk) for r in ids[w : w + buffer]}
            assert len(chunks) <= (-(-buffer // unit) + 1) * (unit // chunk), (buffer, w, chunks)


@HYP
@given(
    n=st.integers(1, 36),
    batch=st.integers(1, 9),
    buffer=st.integers(1, 25),
    world=st.integers(1, 5),
    stop_after=st.integers(0, 12),
    seed=st.integers(0, 5),
    kind=st.sampled_from(["mlp", "resid"]),
    workers=st.sampled_from([0, 1, 2]),
)
def test_resume_mid_epoch_gives_exactly_the_rest(
    store: Any,
    oracle: dict[str, np.ndarray],
    n: int,
    batch: int,
    buffer: int,
    world: int,
    stop_after: int,
    seed: int,
    kind: str,
    workers: int,
) -> None:
    """resid of one layer is decoded straight into the windows; mlp is computed."""
    sel = store.select().sample(n, seed=seed)
    layers = [1] if kind == "mlp" else [0]
    for rank in range(world):
        kw: dict[str, Any] = dict(
            batch_size=batch,
            buffer_rows=buffer,
            seed=seed,
            rank=rank,
            world_size=world,
            with_ids=True,
            workers=workers,
        )
        full_ids, full_x = drain(sel.loader(kind, layers=layers, **kw))
        full = full_ids.tolist()
        if kind == "resid" and full_ids.size:  # a rank of a tiny selection may have no rows
            close(full_x, expected(oracle, "resid", full_ids)[:, :1], kind)
        ld = sel.loader(kind, layers=layers, **kw)
        first: list[int] = []
        it = iter(ld)
        for _ in range(stop_after):
            got = next(it, None)
            if got is None:
                break
            first += got[0].tolist()
        state = ld.state_dict()
        del it  # the interrupted iteration's threads stop
        again = sel.loader(kind, layers=layers, **kw)
        again.load_state_dict(state)
        rest = drain(again)[0].tolist()
        if state["position"] == 0 and state["epoch"] == 1:  # the interruption came after the last batch
            assert first == full
        else:
            assert first + rest == full


@HYP
@given(
    n=st.integers(1, 36),
    world=st.integers(1, 6),
    batch=st.integers(1, 8),
    buffer=st.integers(1, 30),
    epoch=st.integers(0, 3),
)
def test_ranks_are_disjoint_and_cover_the_selection(
    store: Any, n: int, world: int, batch: int, buffer: int, epoch: int
) -> None:
    sel = store.select().sample(n, seed=1)
    parts, counts = [], []
    for rank in range(world):
        ld = sel.loader(
            "z", layers=[1], batch_size=batch, buffer_rows=buffer, rank=rank, world_size=world, with_ids=True
        )
        ld.set_epoch(epoch)
        ids = drain(ld)[0].tolist()
        parts.append(set(ids))
        counts.append(len(ids))
        assert len(set(ids)) == len(ids)
    assert sum(counts) == n and set().union(*parts) == set(sel.rows.column("row").to_pylist())
    assert max(counts) - min(counts) <= 1  # near-equal shares
    # drop_last: every rank the same number of full batches (DDP needs equal step counts)
    steps = []
    for rank in range(world):
        ld = sel.loader(
            "z", layers=[1], batch_size=batch, buffer_rows=buffer, rank=rank, world_size=world, drop_last=True
        )
        sizes = [x.shape[0] for x in ld]
        assert all(s == batch for s in sizes) and len(sizes) == len(ld)
        steps.append(len(sizes))
    assert len(set(steps)) == 1 and steps[0] == (n // world) // batch


def test_dtype_flatten_and_breaking_out_stop_the_threads(store: Any, oracle: dict[str, np.ndarray]) -> None:
    sel = store.select()
    ld = sel.loader("attn_head", layers=[0], batch_size=8, dtype=torch.bfloat16, flatten=True, with_ids=True)
    i, x = next(iter(ld))
    assert x.dtype == torch.bfloat16 and x.shape == (8, 4 * 64)
    want = expected(oracle, "attn_head", i.numpy()).reshape(8, -1)
    np.testing.assert_allclose(x.float().numpy(), want, rtol=1e-2, atol=1e-2)
    before = threading.active_count()
    for _ in range(3):
        for _x in sel.loader("mlp", layers=[1], batch_size=2, buffer_rows=4, workers=2):
            break
    assert threading.active_count() <= before
    plain = next(iter(sel.loader("mlp", layers=[1], batch_size=4, shuffle=False)))
    assert isinstance(plain, torch.Tensor) and plain.dtype == torch.float32 and plain.shape == (4, 1, 64)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"batch_size": 0}, "batch_size must be at least 1"),
        ({"batch_size": 2.5}, "batch_size must be an integer"),
        ({"buffer_rows": 0}, "buffer_rows must be at least 1"),
        ({"workers": -1}, "workers must be between 0 and 256"),
        ({"rank": 2, "world_size": 2}, "rank must be between 0 and 1"),
        ({"world_size": 0}, "world_size must be at least 1"),
        ({"seed": -3}, "seed must be at least 0"),
        ({"dtype": "int8"}, "dtype must be one of"),
        ({"shuffle": "yes"}, "shuffle must be True or False"),
        ({"layers": [9]}, "layer 9 out of range"),
        ({"kind": "nope"}, "unknown feature kind"),
        ({"unit_rows": 0}, "unit_rows must be at least 1"),
    ],
)
def test_bad_arguments_are_one_line(store: Any, kw: dict[str, Any], match: str) -> None:
    kind = kw.pop("kind", "mlp")
    with pytest.raises(QueryError, match=match) as e:
        store.select().loader(kind, **kw)
    assert "\n" not in str(e.value)


def test_bad_states_and_empty_selections_are_one_line(store: Any) -> None:
    sel = store.select()
    ld = sel.loader("mlp", layers=[1], batch_size=4)
    state = ld.state_dict()
    for bad, match in (
        ({**state, "seed": 1}, "the state has seed=1"),
        ({**state, "world_size": 2}, "the state has world_size=2"),
        ({**state, "position": 10**6}, "position must be between"),
        ({"epoch": 0}, "not a loader state"),
    ):
        with pytest.raises(QueryError, match=match) as e:
            ld.load_state_dict(bad)
        assert "\n" not in str(e.value)
    other = sel.limit(10).loader("mlp", layers=[1], batch_size=4)
    with pytest.raises(QueryError, match="n_rows"):
        other.load_state_dict(state)
    with pytest.raises(QueryError, match="the selection is empty"):
        store.select("example_id < 0").loader("mlp")


def test_source_kinds_are_padded_to_the_selection(store: Any) -> None:
    sel = store.select().limit(12)
    ld = sel.loader("attn_prob", layers=[1], batch_size=5, with_ids=True, shuffle=False)
    ids, x = drain(ld)
    np.testing.assert_array_equal(x, sel.features("attn_prob", layers=[1]))
    assert ids.tolist() == sel.rows.column("row").to_pylist()


def test_a_loader_reads_a_store_on_s3(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the store's storage layer, on an S3-compatible server (moto): same rows, same values
    as the in-memory features of the same store."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    from s3server import moto_server, use_server_env

    from actstore.ingest.align import tokenize_records
    from actstore.ingest.datasets.dispatch import load_dataset
    from actstore.ingest.models.tiny import tiny_model
    from actstore.ingest.pipeline import ingest_prompts
    from actstore.ingest.settings import IngestConfig

    with moto_server() as server:
        use_server_env(monkeypatch, server)
        loaded = tiny_model("llama")
        prompts = tokenize_records(load_dataset("demo", limit_per_relation=2).records, loaded.tokenizer)
        url = f"s3://{server.bucket}/stores/feed"
        cfg = IngestConfig(out=url, batch_size=4, segment_size=8, chunk_rows=4, chunk_flat=64, progress=False)
        ingest_prompts(
            loaded.model,
            loaded.tokenizer,
            {"name": loaded.name, "weight_hash": loaded.weight_hash},
            prompts,
            cfg,
        )
        s3 = actstore.open(url)
        assert not s3.location.paths_open_directly()
        sel = s3.select()
        ld = sel.loader("resid", layers=[1], batch_size=5, buffer_rows=7, workers=2, with_ids=True)
        ids, x = drain(ld)
        rows = sel.rows.column("row").to_numpy()
        assert sorted(ids.tolist()) == sorted(rows.tolist())
        ref = sel.features("resid", layers=[1])
        pos = {int(r): k for k, r in enumerate(rows)}
        np.testing.assert_array_equal(x, ref[[pos[int(r)] for r in ids]])
        state = ld.state_dict()
        assert state["epoch"] == 1 and state["position"] == 0


def test_to_hf_dataset_is_saelens_cached_activations_layout(store: Any, tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    sel = store.select().limit(20)
    ds = sel.to_hf_dataset(tmp_path / "hf", "resid", layers=[0, 2])
    L = store.geometry.n_layers
    names = ["blocks.0.hook_resid_pre", f"blocks.{L - 1}.hook_resid_post"]
    assert ds.column_names == [*names, "row", "example_id"]
    assert isinstance(ds.features[names[0]], datasets.Array2D) and ds.features[names[0]].shape == (1, 64)
    again = datasets.Dataset.load_from_disk(str(tmp_path / "hf"))  # as SAELens's ActivationsStore opens it
    again.set_format("torch", columns=names)
    x = sel.features("resid", layers=[0, 2])
    got = again[0:20]
    for j, name in enumerate(names):
        assert got[name].shape == (20, 1, 64)
        np.testing.assert_array_equal(got[name][:, 0].numpy(), x[:, j])
    assert ds["row"] == sel.rows.column("row").to_pylist()
    z = sel.to_hf_dataset(tmp_path / "z", "z", layers=[1], dtype="float16")
    assert z.column_names[0] == "blocks.1.attn.hook_z" and z.features["blocks.1.attn.hook_z"].shape == (
        1,
        4 * 16,
    )
    with pytest.raises(QueryError, match="exists and is not empty"):
        sel.to_hf_dataset(tmp_path / "z", "z", layers=[1])
    with pytest.raises(QueryError, match="ragged source axis"):
        sel.to_hf_dataset(tmp_path / "p", "attn_prob")


@pytest.mark.parametrize("storage", ["float32", "bfloat16"])
def test_stored_kinds_in_every_storage_dtype(store_factory: Callable[..., Path], storage: str) -> None:
    """resid and z are shuffled in the storage dtype and converted by torch: the values still equal
    ``features`` (float32) exactly, and the requested dtype comes out."""
    s = actstore.open(store_factory("llama", limit=2, storage_dtype=storage))
    sel = s.select()
    rows = sel.rows.column("row").to_numpy()
    pos = {int(r): k for k, r in enumerate(rows)}
    for kind, layers in (("resid", [0, 2]), ("z", [1])):
        want = sel.features(kind, layers=layers)
        ids, x = drain(sel.loader(kind, layers=layers, batch_size=5, buffer_rows=7, with_ids=True))
        np.testing.assert_array_equal(x, want[[pos[int(r)] for r in ids]])
        half = next(iter(sel.loader(kind, layers=layers, batch_size=4, dtype="float16")))
        assert half.dtype == torch.float16


@pytest.mark.parametrize("kind, layers", [("resid", [1]), ("resid", [0, 2]), ("z", [1]), ("mlp", [1])])
def test_batches_outlive_the_reused_window_buffers(store: Any, kind: str, layers: list[int]) -> None:
    """The window buffers are reused across windows and epochs (resid of one layer is decoded straight
    into them, by the reader threads too): the batches handed out are tensors of their own, so two
    whole epochs kept until the end still equal ``features`` row by row, in float16 and float32,
    shuffled and not, with 0, 1 and 3 workers."""
    sel = store.select()
    want = sel.features(kind, layers=layers)
    pos = {int(r): k for k, r in enumerate(sel.rows.column("row").to_numpy())}
    for shuffle, dtype, workers in itertools.product((True, False), ("float32", "float16"), (0, 1, 3)):
        ld = sel.loader(
            kind,
            layers=layers,
            batch_size=3,
            buffer_rows=5,
            shuffle=shuffle,
            dtype=dtype,
            with_ids=True,
            workers=workers,
            prefetch=16,  # the reader threads run windows ahead, into buffers that are free
        )
        kept = [(i, x) for _ in range(2) for i, x in ld]  # epochs 0 and 1, every batch held
        assert len(kept) == 2 * len(ld)
        for i, x in kept:
            assert x.dtype == getattr(torch, dtype)
            expect = want[[pos[int(r)] for r in i]].astype(dtype)
            if kind == "mlp" and dtype == "float16":  # computed (the down projection), then rounded
                assert_within_ulps(x.numpy(), expect, dtype)  # one float16 ulp (docs/testing.md)
            elif kind == "mlp":  # computed in float32 by two code paths: their last bits may differ
                np.testing.assert_allclose(x.numpy(), expect, rtol=1e-5, atol=1e-6)
            else:  # stored bytes, only copied and converted: exact
                np.testing.assert_array_equal(x.numpy(), expect)


@pytest.mark.parametrize("layers", [[0], [0, 2]])
def test_a_corrupt_chunk_is_one_line(
    store_factory: Callable[..., Path], tmp_path: Path, layers: list[int]
) -> None:
    """A flipped byte in a stored chunk fails its CRC32C: the loader (decoding into its window, or reading
    several layers) raises one CorruptStoreError line naming the array, as the store's own reads do."""
    src = store_factory("llama", limit=2, storage_dtype="float16")
    dst = tmp_path / "s"
    shutil.copytree(src, dst)
    shard = dst / "segments" / "000000" / "resid" / "c.0.0.0"
    data = bytearray(shard.read_bytes())
    for k in range(20, len(data) - 400, 97):  # every inner chunk's data (the index at the end kept)
        data[k] ^= 0xFF
    shard.write_bytes(bytes(data))
    s = actstore.open(dst)
    for workers in (0, 2):
        with pytest.raises(CorruptStoreError) as e:
            drain(s.select().loader("resid", layers=layers, batch_size=4, workers=workers, with_ids=True))
        assert "\n" not in str(e.value) and "resid" in str(e.value) and "chunk read failed" in str(e.value)
