"""The files of a ``datasets`` folder as ``Dataset.save_to_disk`` writes them for a dataset of one
Arrow file, written by the export (:mod:`actstore.query.select.hf_export`) without datasets' writer:
the Arrow stream file (:class:`Writer`, its record batches written on a second thread while the next
block is read, for an export of several blocks), ``state.json`` and ``dataset_info.json`` (:func:`saved`), the hidden folder they are
written in before it is renamed (:func:`staging`), and the ``Dataset`` ``load_from_disk`` gives for
them (:func:`opened`)."""

from __future__ import annotations

import ctypes
import json
import os
import secrets
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

SHARD = "data-00000-of-00001.arrow"  # save_to_disk's file of a dataset of one shard


@lru_cache(maxsize=1)
def _fallocate() -> Any:
    """libc's ``fallocate`` (Linux), or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate64
    except (AttributeError, OSError, TypeError):  # (no such function; no C library by that name)
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


def preallocate(path: Path, size: int) -> int:
    """Give the new file ``path`` ``size`` bytes of disk (``fallocate(2)``, mode 0: unwritten extents,
    the file's size set to ``size``) before it is written from its start; the bytes given (0 where the
    file system or the platform cannot: the writes then go as they would have).  A write into
    allocated extents skips ext4's delayed allocation of each page: 256 MiB written in 4 MiB writes
    took 37 ms so against 55 ms (HISTORY.md).  No emulation (glibc's ``posix_fallocate`` writes a
    byte a block where the file system cannot)."""
    fn = _fallocate()
    if fn is None or size <= 0:
        return 0
    fd = os.open(path, os.O_WRONLY)
    try:
        return size if fn(fd, 0, 0, size) == 0 else 0
    finally:
        os.close(fd)


def free_core() -> bool:
    """Whether a core is idle now, for the writing thread: fewer tasks running on the machine (Linux's
    ``/proc/loadavg``, the caller among them) than it has CPUs, and two of them usable by this process.
    On two busy cores the thread slowed the export (10^6 positions: 223 vs 199 ms, CPU 201 vs 180 ms,
    load 3.3-3.8; HISTORY.md): it overlaps the reads only where it has a core of its own.  Elsewhere
    (no ``/proc``): True."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 1
    if usable < 2:
        return False
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            running = int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return True
    return running < (os.cpu_count() or 1)


class Layout:
    """What is fixed for a dataset's features: the ``datasets.Features``, their Arrow schema (with
    its ``huggingface`` metadata, as ``ArrowWriter`` writes it), each field's type, and the text of
    ``dataset_info.json``; made once a layout (:func:`layout`): datasets builds each of them anew at
    every call, decoding its extension types each time."""

    def __init__(self, features: Any) -> None:
        import datasets

        self.features = features
        self.schema = features.arrow_schema
        self.fields = [(f.name, f.type) for f in self.schema]  # (an extension type is rebuilt at each access)
        self.names = [name for name, _ in self.fields]
        # save_to_disk's asdict (it leaves out the fields at their defaults), keys sorted, indent 2
        info = datasets.utils.py_utils.asdict(datasets.DatasetInfo(features=features))
        self.info_json = json.dumps({key: info[key] for key in sorted(info)}, indent=2)


@lru_cache(maxsize=64)
def window_layout(column: str, n: int, d_in: int, dtype: str) -> Layout:
    """SAELens's cache layout: ``{column}`` ``Array2D((n, d_in), dtype)`` and ``token_ids``
    ``Sequence(int32, length=n)``."""
    import datasets

    return Layout(
        datasets.Features(
            {
                column: datasets.Array2D(shape=(n, d_in), dtype=dtype),
                "token_ids": datasets.Sequence(datasets.Value("int32"), length=n),
            }
        )
    )


def staging(out: Path) -> Path:
    """A new empty folder beside ``out`` (hidden, a random name, the umask's permissions) that the
    export fills and then renames to ``out``: nothing is left to remove after a complete export (an
    empty temporary folder's ``rmdir`` took 0.3-3 ms here)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = out.parent / f".hf-export-{secrets.token_hex(8)}"
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:
            continue


def opened(folder: Path, features: Any, fingerprint: str) -> Any:
    """The dataset ``Dataset.load_from_disk(folder)`` gives for a folder :func:`saved` wrote (one
    file, memory-mapped unless datasets' ``IN_MEMORY_MAX_SIZE`` says it is small, no format, its
    fingerprint), made from what the export already knows: load_from_disk's reading of the JSON files
    back, its thread pool and its format copy were a fixed 3-5 ms (a test compares the two)."""
    import datasets
    from datasets.table import InMemoryTable, MemoryMappedTable
    from datasets.utils.info_utils import is_small_dataset

    path = folder / SHARD
    table = (InMemoryTable if is_small_dataset(path.stat().st_size) else MemoryMappedTable).from_file(
        str(path)
    )
    return datasets.Dataset(table, info=datasets.DatasetInfo(features=features), fingerprint=fingerprint)


def saved(folder: Path, layout: Layout) -> str:
    """Make ``folder``, which holds the Arrow stream file :data:`SHARD` of ``layout``'s features, what
    ``Dataset.save_to_disk`` writes for the dataset of that file: its ``state.json`` (a dataset of
    one file, no format, a random fingerprint) and ``dataset_info.json``, written as save_to_disk
    (datasets 5) writes them, without save_to_disk's second copy of every value (a test compares
    them with save_to_disk's).  One shard at any size (``load_from_disk`` reads any number)."""
    state: dict[str, Any] = {
        "_data_files": [{"filename": SHARD}],
        "_fingerprint": os.urandom(8).hex(),
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    with open(folder / "state.json", "w", encoding="utf-8") as f:
        json.dump(state, f, indent=2, sort_keys=True)
    with open(folder / "dataset_info.json", "w", encoding="utf-8") as f:
        f.write(layout.info_json)
    return str(state["_fingerprint"])


class Writer:
    """An Arrow stream file of a :class:`Layout` (what ``datasets.arrow_writer.ArrowWriter`` writes: the
    schema with its ``huggingface`` metadata, then record batches), its batches built from the numpy
    blocks without a copy: an ``Array2D`` column's storage is two levels of list offsets over the
    values, a ``Sequence(length=n)`` a fixed-size list (ArrowWriter converts them value by value, which
    took more than the store's read).

    ``background=True`` (for an export of more than one block): :meth:`write` hands a batch to a
    thread of this writer's own, which writes it (pyarrow writes without the GIL) while the caller
    reads the next block; a batch's arrays must stay untouched until :meth:`wait` for its ``slot``
    (or the next :meth:`write` of it) returns: the caller fills one buffer while the other is
    written.  The thread's error (a full disk) is raised by that wait; leaving the ``with`` block
    waits for every batch handed over and ends the thread (none outlives the export: a process that
    forks later has no thread of ours).

    ``size``: the bytes the file is expected to take, given it before the first write
    (:func:`preallocate`) and cut back to those written when the ``with`` block ends."""

    def __init__(self, layout: Layout, path: Path, background: bool = False, size: int = 0) -> None:
        import pyarrow as pa

        self.pa = pa
        self.layout = layout
        self.path = path
        self.sink = pa.OSFile(str(path), "wb")
        self.allocated = preallocate(path, size)  # cut back to the bytes written at the end
        self.writer = pa.ipc.new_stream(self.sink, layout.schema)
        self._offsets: dict[tuple[int, int], Any] = {}
        self._pending: dict[int, Future[None]] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="actstore-hf-write") if background else None

    def offsets(self, n: int, step: int) -> Any:
        """List offsets ``0, step, .., n * step`` (int32), made once a size."""
        key = (n, step)
        if key not in self._offsets:
            self._offsets[key] = self.pa.array(np.arange(0, n * step + 1, step, dtype=np.int32))
        return self._offsets[key]

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, kind: Any, *exc: Any) -> None:
        try:
            for slot in list(self._pending):
                try:
                    self.wait(slot)
                except Exception:
                    if kind is None:  # an error of the writing thread, not one raised already
                        raise
        finally:
            if self._pool is not None:
                self._pool.shutdown()
            self.writer.close()
            end = self.sink.tell()
            self.sink.close()
            if self.allocated > end:
                os.truncate(self.path, end)

    def wait(self, slot: int) -> None:
        """Until the batch last handed over as ``slot`` is written (its buffers free again)."""
        done = self._pending.pop(slot, None)
        if done is not None:
            done.result()

    def write(self, batch: dict[str, np.ndarray], slot: int = 0) -> None:
        """Write ``batch`` (numpy arrays by column) as one record batch, after the batch last handed
        over as ``slot``."""
        self.wait(slot)
        rb = self.record_batch(batch)
        if self._pool is None:
            self._write_one(rb)
        else:
            self._pending[slot] = self._pool.submit(self._write_one, rb)

    def _write_one(self, rb: Any) -> None:
        """Write record batch ``rb`` (on the writing thread when there is one)."""
        self.writer.write_batch(rb)

    def record_batch(self, batch: dict[str, np.ndarray]) -> Any:
        pa = self.pa
        cols = []
        for name, typ in self.layout.fields:
            x = np.ascontiguousarray(batch[name])
            if isinstance(typ, pa.ExtensionType):  # Array2D: [rows, a, b]
                rows, a, b = x.shape
                inner = pa.ListArray.from_arrays(self.offsets(rows * a, b), pa.array(x.reshape(-1)))
                outer = pa.ListArray.from_arrays(self.offsets(rows, a), inner)
                cols.append(pa.ExtensionArray.from_storage(typ, outer))
            elif pa.types.is_fixed_size_list(typ):
                cols.append(pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), x.shape[1]))
            else:
                cols.append(pa.array(x, type=typ))
        # by names, not the schema (whose extension types pyarrow decodes again at each batch: 3x the
        # cost); the writer holds the schema and its metadata, the batch's bytes are the same
        return pa.RecordBatch.from_arrays(cols, names=self.layout.names)
