"""Selection.to_hf_dataset(context_size=N) against an independent computation: the store's positions
table read with pyarrow and grouped into windows by hand, and Selection.features of the same rows;
for selections that are a run of rows, that cut a window, that skip windows, and on a store whose
windows straddle its segments (a window's rows in two blocks), written on the writing thread or
inline.  Also: an error of the writing thread ends the export with nothing left, the TransformerLens
names read from its source file are the ones it imports, a preallocated file is the plain one, and
whether a core is free is read from the machine's running tasks."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import quiet

import actstore
import actstore.query.select.hf_export as hf_export
from actstore.ingest.models.tiny import tiny_model

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
datasets = pytest.importorskip("datasets")
N = 8
DOCS = [
    "the quiet river runs past an old stone bridge and the road goes on",
    "a red house stands on the hill near the lake",
    "kings and queens of the north built great halls",
] * 5


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    """Packed corpus stores of whole windows of N kept positions: segments of 16 rows (two windows)
    and of 12 rows (a window in two segments every other segment)."""
    t = tmp_path_factory.mktemp("hfwin")
    m = tiny_model("llama")
    m.model.save_pretrained(t / "model")
    m.tokenizer.save_pretrained(t / "model")
    (t / "docs.txt").write_text("\n".join(DOCS) + "\n", encoding="utf-8")
    out = {}
    for size in (16, 12):
        with quiet():
            out[size] = actstore.ingest_corpus(
                t / f"s{size}",
                model=str(t / "model"),
                dataset=f"text:{t / 'docs.txt'}",
                positions="all",
                kinds=("resid",),
                pack=True,
                keep_special=True,
                context_length=N,
                batch_size=4,
                segment_size=size,
            )
    return out


def expected(sel: Any) -> tuple[np.ndarray, np.ndarray]:
    """The windows of ``sel`` computed by hand: the positions table (pyarrow), the selection's rows in
    order, grouped into runs of one window; a run of N rows at window positions 0..N-1 is a row of
    the export, its values the rows of ``features`` (float32) and its token ids the table's."""
    pos = sel.store.table("positions", ["row", "window_index", "window_position", "token_id"])
    by_row = {r: i for i, r in enumerate(pos.column("row").to_pylist())}
    win = pos.column("window_index").to_pylist()
    wpos = pos.column("window_position").to_pylist()
    tok = pos.column("token_id").to_pylist()
    rows = sel.rows.column("row").to_pylist()
    feats = sel.features("resid", layers=[1])[:, 0]
    xs, ts = [], []
    i = 0
    while i < len(rows):
        j = i
        while j < len(rows) and win[by_row[rows[j]]] == win[by_row[rows[i]]]:
            j += 1
        if j - i == N and [wpos[by_row[r]] for r in rows[i:j]] == list(range(N)):
            xs.append(feats[i:j])
            ts.append([tok[by_row[r]] for r in rows[i:j]])
        i = j
    return np.array(xs, dtype=np.float32), np.array(ts, dtype=np.int64)


def selections(store: Any) -> dict[str, Any]:
    n = len(store.select())
    return {
        "all": store.select(),
        "a run cutting its last window": store.select().limit(5 * N + 3),
        "from row 3 (the first window cut)": store.select(
            query="SELECT example_id FROM positions WHERE row >= 3"
        ),
        "every other window": store.select(
            query="SELECT example_id FROM positions WHERE window_index % 2 = 0"
        ),
        "windows 1 and 4..": store.select(
            query=f"SELECT example_id FROM positions WHERE window_index = 1 OR (window_index >= 4 AND row < {n - 5})"
        ),
    }


@pytest.mark.parametrize("size", [16, 12])
@pytest.mark.parametrize("batch_rows", [N, 3 * N + 1, 4096])
@pytest.mark.parametrize("reads", ["large", "small, on the thread", "small, inline"])
def test_the_export_is_the_windows_of_the_rows(
    stores: dict[int, Any],
    size: int,
    batch_rows: int,
    reads: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if reads != "large":  # reads of batch_rows positions: many blocks, both buffers
        monkeypatch.setattr(hf_export, "READ_BYTES", 0)
    # written by the writing thread, or inline (where no core is free)
    monkeypatch.setattr(hf_export, "free_core", lambda: reads != "small, inline")
    store = stores[size]
    for name, sel in selections(store).items():
        xs, ts = expected(sel)
        assert len(xs), name
        out = tmp_path / f"{len(list(tmp_path.iterdir()))}"
        ds = sel.to_hf_dataset(out, "resid", layers=[1], context_size=N, batch_rows=batch_rows)
        got = ds.with_format("numpy")[:]
        col = next(c for c in ds.column_names if c != "token_ids")
        assert got[col].dtype == np.float32 and got[col].shape == xs.shape, name
        assert np.array_equal(got[col], xs), name
        assert np.array_equal(got["token_ids"], ts), name
        again = datasets.Dataset.load_from_disk(str(out)).with_format("numpy")[:]  # as written
        assert np.array_equal(again[col], xs) and np.array_equal(again["token_ids"], ts), name
        half = sel.to_hf_dataset(
            tmp_path / f"h{out.name}",
            "resid",
            layers=[1],
            context_size=N,
            batch_rows=batch_rows,
            dtype="float16",
        )
        assert np.array_equal(half.with_format("numpy")[:][col], xs.astype(np.float16)), name


def test_an_error_of_the_writing_thread_ends_the_export_with_nothing_left(
    stores: dict[int, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from actstore.query.select.hf_arrow import Writer

    real, threads = Writer._write_one, []

    def fills_at_the_second(self: Any, rb: Any) -> None:
        threads.append(threading.current_thread())
        if len(threads) == 2:
            raise OSError(28, "No space left on device")
        real(self, rb)

    monkeypatch.setattr(hf_export, "READ_BYTES", 0)  # blocks of N rows: written on the thread
    monkeypatch.setattr(hf_export, "free_core", lambda: True)  # (as where a core is free)
    monkeypatch.setattr(Writer, "_write_one", fills_at_the_second)
    sel = stores[16].select()
    with pytest.raises(OSError, match="No space"):
        sel.to_hf_dataset(tmp_path / "x", "resid", layers=[1], context_size=N, batch_rows=N)
    assert len(threads) >= 2 and threading.main_thread() not in threads
    assert list(tmp_path.iterdir()) == []
    assert not [
        t for t in threading.enumerate() if t.name.startswith("actstore-hf-write")
    ]  # none outlives it
    monkeypatch.setattr(Writer, "_write_one", real)
    ds = sel.to_hf_dataset(tmp_path / "x", "resid", layers=[1], context_size=N, batch_rows=N)
    assert np.array_equal(ds.with_format("numpy")[:]["token_ids"], expected(sel)[1])


def test_transformer_lens_names_read_from_its_source_are_the_imported_ones() -> None:
    with quiet():
        supported = pytest.importorskip("transformer_lens.supported_models")
    from actstore.query.select.hf_export import _literal_names

    assert _literal_names(str(Path(supported.__file__))) == frozenset(supported.OFFICIAL_MODEL_NAMES)
    assert len(supported.OFFICIAL_MODEL_NAMES) > 100  # a list of names, not an empty match


@pytest.mark.parametrize("free", [True, False])
@pytest.mark.parametrize("batch_rows", [5, 4096])
def test_the_per_position_export_is_the_features_in_blocks_on_the_thread(
    stores: dict[int, Any], batch_rows: int, free: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without context_size (one row a position): blocks of 5 rows are written on the writing thread
    where a core is free, else inline, one block inline; all equal ``features`` of the rows, with
    their row and example ids."""
    from actstore.query.select.hf_arrow import Writer

    real, flags = Writer.__init__, []

    def noted(self: Any, layout: Any, path: Any, background: bool = False, size: int = 0) -> None:
        flags.append(background)
        real(self, layout, path, background, size)

    monkeypatch.setattr(Writer, "__init__", noted)
    monkeypatch.setattr(hf_export, "free_core", lambda: free)
    sel = stores[12].select(query="SELECT example_id FROM positions WHERE row % 3 <> 1")
    ds = sel.to_hf_dataset(tmp_path / "p", "resid", layers=[0, 2], batch_rows=batch_rows)
    assert flags == [batch_rows == 5 and free]
    got = datasets.Dataset.load_from_disk(str(tmp_path / "p")).with_format("numpy")[:]
    x = sel.features("resid", layers=[0, 2])
    names = [c for c in ds.column_names if c not in ("row", "example_id")]
    assert len(names) == 2 and (batch_rows == 4096 or len(x) > 2 * batch_rows)
    for j, name in enumerate(names):
        assert np.array_equal(got[name][:, 0], x[:, j])
    assert np.array_equal(got["row"], sel.rows.column("row").to_numpy())
    assert np.array_equal(got["example_id"], sel.rows.column("example_id").to_numpy())


@pytest.mark.parametrize("size", ["none", "at least", "too much"])
def test_a_preallocated_file_holds_the_same_stream(tmp_path: Path, size: str) -> None:
    """The Writer's file given its bytes before it is written (fallocate) is byte for byte the file
    written without (and cut back where more was given); pyarrow reads the batches' values back."""
    import pyarrow as pa

    from actstore.query.select.hf_arrow import Writer, preallocate, window_layout

    rng = np.random.default_rng(0)
    layout = window_layout("h", N, 4, "float32")
    batches = [
        {
            "h": rng.standard_normal((w, N, 4)).astype(np.float32),
            "token_ids": rng.integers(0, 1000, (w, N)).astype(np.int32),
        }
        for w in (3, 1, 5)
    ]
    lower = 9 * (N * (4 * 4 + 8) + 4)  # the export's estimate: values, token ids, offsets
    given = {"none": 0, "at least": lower, "too much": 10 << 20}[size]
    files = {}
    for name, n_bytes in (("plain", 0), ("given", given)):
        files[name] = tmp_path / f"{name}.arrow"
        with Writer(layout, files[name], background=True, size=n_bytes) as writer:
            for k, batch in enumerate(batches):
                writer.write(batch, slot=k % 2)
    assert files["given"].read_bytes() == files["plain"].read_bytes()
    assert files["plain"].stat().st_size > lower  # the estimate is a lower bound
    with pa.OSFile(str(files["given"])) as f:
        got = pa.ipc.open_stream(f).read_all()
    assert np.array_equal(
        np.array(got.column("h").to_pylist(), dtype=np.float32), np.concatenate([b["h"] for b in batches])
    )
    assert got.column("token_ids").to_pylist() == np.concatenate([b["token_ids"] for b in batches]).tolist()
    probe = tmp_path / "probe"
    probe.touch()
    if preallocate(probe, 1 << 20):  # where the file system can: the bytes are the file's
        assert probe.stat().st_size == 1 << 20 and probe.stat().st_blocks * 512 >= 1 << 20


@pytest.mark.parametrize(
    ("loadavg", "cpus", "free"),
    [
        ("0.5 0.4 0.3 1/200 77\n", 2, True),
        ("2.9 2.8 2.4 3/150 77\n", 2, False),
        ("3.0 3.0 3.0 3/150 77\n", 8, True),
    ],
)
def test_a_core_is_free_where_fewer_tasks_run_than_the_machine_has_cpus(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, loadavg: str, cpus: int, free: bool
) -> None:
    import builtins

    from actstore.query.select import hf_arrow

    if not hasattr(hf_arrow.os, "sched_getaffinity"):
        pytest.skip("no sched_getaffinity here")
    fake = tmp_path / "loadavg"
    fake.write_text(loadavg, encoding="ascii")
    real_open = builtins.open
    monkeypatch.setattr(
        builtins, "open", lambda f, *a, **k: real_open(fake if f == "/proc/loadavg" else f, *a, **k)
    )
    monkeypatch.setattr(hf_arrow.os, "cpu_count", lambda: cpus)
    monkeypatch.setattr(hf_arrow.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert hf_arrow.free_core() is free
    monkeypatch.setattr(hf_arrow.os, "sched_getaffinity", lambda pid: {0})  # one usable CPU: never
    assert hf_arrow.free_core() is False


def test_an_export_reuses_the_last_ones_buffers_and_none_of_their_values(
    stores: dict[int, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hf_export, "READ_BYTES", 0)  # blocks of 3 windows: both buffers filled
    monkeypatch.setattr(hf_export, "_SPARE", [])
    store = stores[16]
    store.select().to_hf_dataset(tmp_path / "a", "resid", layers=[1], context_size=N, batch_rows=3 * N)
    (kept,) = hf_export._SPARE
    for xs, ts in kept:  # what the next export must overwrite or leave out
        xs[...], ts[...] = np.nan, -1
    sel = selections(store)["windows 1 and 4.."]
    ds = sel.to_hf_dataset(tmp_path / "b", "resid", layers=[1], context_size=N, batch_rows=3 * N)
    assert hf_export._SPARE == [kept] and hf_export._SPARE[0] is kept  # taken, and handed back
    xs, ts = expected(sel)
    got = ds.with_format("numpy")[:]
    assert np.array_equal(got[ds.column_names[0]], xs) and np.array_equal(got["token_ids"], ts)
