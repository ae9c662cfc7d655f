"""Every storage backend keeps the contract of :class:`actstore.core.storage.base.StoreLocation`.

One suite, run against each backend (as zarr's ``StoreTests`` runs against each of its stores): a
local directory, S3 on a real S3-compatible server on 127.0.0.1 (moto's server, authentication on:
tests/s3server.py), and fsspec's in-process memory file system.  Expectations are computed here,
independently of the code under test (hashlib, xxhash, slices of the bytes written, the names
written), never read back through the backend's own helpers.

What is checked: atomic commit (a concurrent reader sees the old object or the whole new one; a
write that fails leaves the old object and nothing else), listing (``listdir``, ``walk_files``,
``tree_bytes``), byte ranges (``read_range``, ``read_bytes`` with a size bound), missing objects
(:class:`FileNotFoundError` from every read), zarr groups, and one writer at a time (the writer lock
of :mod:`actstore.core.lock`: a second writer, in this thread or racing in others, is refused with
one line naming the holder; a dead writer's record is taken over, another host's is not).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
import zarr
from s3server import S3Server, moto_server, use_server_env

from actstore.core.errors import CorruptStoreError, StorageError, StoreLockedError
from actstore.core.lock import LOCK_NAME, Holder, WriterLock, active_writer, read_holder
from actstore.core.storage import locate
from actstore.core.storage.base import StoreLocation
from actstore.core.storage.local import LocalLocation
from actstore.core.storage.memory import MemoryLocation
from actstore.core.storage.s3 import S3Location

BACKENDS = ["local", "s3", "memory"]
KINDS = {"local": LocalLocation, "s3": S3Location, "memory": MemoryLocation}


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    with moto_server() as server:
        yield server


@pytest.fixture(params=BACKENDS)
def loc(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[StoreLocation]:
    """A fresh, empty store root on one backend."""
    kind = request.param
    if kind == "local":
        yield locate(tmp_path / "store")
        return
    if kind == "s3":
        server = request.getfixturevalue("s3_server")
        use_server_env(monkeypatch, server)
        yield locate(f"s3://{server.bucket}/conformance/{uuid.uuid4().hex}")
        return
    where = locate(f"memory://conformance-{uuid.uuid4().hex}")
    yield where
    if where.fs.exists(where.root):
        where.fs.rm(where.root, recursive=True)


def break_commit(loc: StoreLocation, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the step that commits an atomic write fail: locally the rename of the whole temporary file
    over the target (a crash just before it), on an object store the PUT (the network gone)."""

    def fail(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("the commit failed")

    if isinstance(loc, LocalLocation):
        monkeypatch.setattr(os, "replace", fail)
    else:
        monkeypatch.setattr(loc.fs, "pipe_file", fail)


def payload(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_locate_picks_the_backend(loc: StoreLocation, request: pytest.FixtureRequest) -> None:
    assert type(loc) is KINDS[request.node.callspec.params["loc"]]
    assert loc.paths_open_directly() == isinstance(loc, LocalLocation)
    loc.probe()  # a store that does not exist yet is no error


# ------------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("size", [0, 1, 1000, 1 << 20])
def test_what_is_written_is_read(loc: StoreLocation, size: int) -> None:
    data = payload(size, size)
    loc.write_bytes_atomic("a/b/object.bin", data)
    assert loc.exists("a/b/object.bin")
    assert loc.read_bytes("a/b/object.bin") == data
    assert loc.read_bytes("a/b/object.bin", max_bytes=size) == data
    assert loc.read_if_regular("a/b/object.bin", size) == data
    if size:
        assert loc.read_if_regular("a/b/object.bin", size - 1) is None
        with pytest.raises(CorruptStoreError):
            loc.read_bytes("a/b/object.bin", max_bytes=size - 1)


def test_a_stream_write_returns_its_hashes(loc: StoreLocation) -> None:
    data = payload(300_000, 7)

    def produce(f: Any) -> str:
        for i in range(0, len(data), 65_536):
            f.write(data[i : i + 65_536])
        return "produced"

    out, sha, size, fast = loc.write_stream_atomic("tables/examples/c000000-001.parquet", produce)
    assert (out, sha, size, fast) == (
        "produced",
        hashlib.sha256(data).hexdigest(),
        len(data),
        xxhash.xxh3_128(data).hexdigest(),
    )
    assert loc.read_bytes("tables/examples/c000000-001.parquet") == data


def test_a_result_table_gets_its_hash_companion(loc: StoreLocation) -> None:
    data = payload(5000, 3)
    before = loc.tables_written()
    loc.write_bytes_atomic("tables/probe_results/run1.parquet", data)
    assert (
        loc.read_bytes("tables/probe_results/run1.parquet.sha256")
        == hashlib.sha256(data).hexdigest().encode()
    )
    assert loc.tables_written() == before + 2  # the table and its companion
    with pytest.raises(ValueError, match="sha256"):
        loc.write_stream_atomic("tables/probe_results/run2.parquet", lambda f: f.write(data))
    assert not loc.exists("tables/probe_results/run2.parquet")


# ------------------------------------------------------------------------------------ atomic commit


@pytest.mark.parametrize("how", ["bytes", "stream"])
def test_a_concurrent_reader_sees_the_old_or_the_whole_new_object(loc: StoreLocation, how: str) -> None:
    """A writer replaces an object again and again while a reader reads it: every read is one of the
    objects written, whole (no empty, truncated or mixed object), and the reader never finds it missing."""
    versions = [bytes([65 + i]) * ((1 << 20) + 4096 * i) for i in range(3)]  # distinct bytes and sizes
    loc.write_bytes_atomic("obj", versions[0])
    rounds = 30 if isinstance(loc, LocalLocation | MemoryLocation) else 8
    done = threading.Event()
    seen: list[bytes] = []
    errors: list[BaseException] = []

    def write() -> None:
        try:
            for i in range(rounds):
                data = versions[(i + 1) % len(versions)]
                if how == "bytes":
                    loc.write_bytes_atomic("obj", data)
                else:  # written in pieces: a non-atomic stream would show its parts
                    loc.write_stream_atomic(
                        "obj", lambda f, d=data: [f.write(d[k : k + 8192]) for k in range(0, len(d), 8192)]
                    )
        except BaseException as e:
            errors.append(e)
        finally:
            done.set()

    def read() -> None:
        try:
            while not done.is_set():
                seen.append(loc.read_bytes("obj"))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=write), threading.Thread(target=read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    seen.append(loc.read_bytes("obj"))
    assert seen and all(s in versions for s in seen), sorted({(len(s), s[:1], s[-1:]) for s in seen})
    assert seen[-1] == versions[rounds % len(versions)]
    assert loc.listdir("") == ["obj"]  # no temporary object left


def test_a_stream_that_fails_half_way_leaves_the_old_object(loc: StoreLocation) -> None:
    old, new = payload(10_000, 1), payload(20_000, 2)
    loc.write_bytes_atomic("seg/obj", old)

    def produce(f: Any) -> None:
        f.write(new[:10_000])
        raise RuntimeError("killed half way")

    with pytest.raises(RuntimeError, match="half way"):
        loc.write_stream_atomic("seg/obj", produce)
    assert loc.read_bytes("seg/obj") == old
    assert loc.listdir("seg") == ["obj"]
    with pytest.raises(RuntimeError):
        loc.write_stream_atomic("seg/new", produce)
    assert not loc.exists("seg/new") and loc.listdir("seg") == ["obj"]


def test_a_write_whose_commit_fails_leaves_the_old_object(
    loc: StoreLocation, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, new = payload(10_000, 1), payload(20_000, 2)
    loc.write_bytes_atomic("seg/obj", old)
    with monkeypatch.context() as m:
        break_commit(loc, m)
        with pytest.raises((ConnectionError, StorageError)):
            loc.write_bytes_atomic("seg/obj", new)
        with pytest.raises((ConnectionError, StorageError)):
            loc.write_stream_atomic("seg/obj", lambda f: f.write(new))
    assert loc.read_bytes("seg/obj") == old
    assert loc.listdir("seg") == ["obj"]  # nothing half-written left beside it
    loc.write_bytes_atomic("seg/obj", new)  # and the next write goes through
    assert loc.read_bytes("seg/obj") == new


# ------------------------------------------------------------------------------------ listing

FILES = {"a/b/1": 10, "a/b/2": 20, "a/c": 30, "a/d/e/f": 40, "top": 5}


def write_files(loc: StoreLocation) -> None:
    for i, (rel, n) in enumerate(FILES.items()):
        loc.write_bytes_atomic(rel, payload(n, i))


def test_listdir_names_what_is_directly_below(loc: StoreLocation) -> None:
    write_files(loc)
    assert loc.listdir("") == ["a", "top"]
    assert loc.listdir("a") == ["b", "c", "d"]
    assert loc.listdir("a/b") == ["1", "2"]
    assert loc.listdir("a/d/e") == ["f"]
    assert loc.listdir("missing") == [] and loc.listdir("a/missing") == []


def test_walk_files_lists_every_object_below(loc: StoreLocation) -> None:
    write_files(loc)
    assert loc.walk_files("a") == sorted(rel[2:] for rel in FILES if rel.startswith("a/"))
    assert loc.walk_files("a/d") == ["e/f"]
    assert loc.walk_files("") == sorted(FILES)
    assert loc.walk_files("missing") == []
    assert loc.walk_files("a/c") == []  # an object, not a folder
    assert loc.tree_bytes("a") == sum(n for rel, n in FILES.items() if rel.startswith("a/"))
    assert loc.tree_bytes("a/b") == 30


def test_remove_tree(loc: StoreLocation) -> None:
    write_files(loc)
    loc.remove_tree("a/b")
    assert loc.listdir("a") == ["c", "d"] and not loc.exists("a/b/1")
    loc.remove_tree("top")  # an object
    loc.remove_tree("missing")  # nothing there: nothing to do
    assert loc.walk_files("") == ["a/c", "a/d/e/f"]


def test_nothing_special_at_the_root(loc: StoreLocation) -> None:
    write_files(loc)
    assert not loc.root_is_non_directory() and not loc.root_is_link()
    assert loc.first_special_entry(loc.listdir("")) is None


# ------------------------------------------------------------------------------------ byte ranges

RANGE_DATA = bytes(range(256)) * 40  # 10,240 bytes, every offset distinguishable within 256


@pytest.mark.parametrize(
    ("offset", "length"), [(0, 10), (5, 100), (10_230, 10), (0, 10_240), (1000, 0), (255, 1)]
)
def test_a_range_is_those_bytes(loc: StoreLocation, offset: int, length: int) -> None:
    loc.write_bytes_atomic("ranged", RANGE_DATA)
    assert loc.read_range("ranged", offset, length) == RANGE_DATA[offset : offset + length]


@pytest.mark.parametrize(("offset", "length"), [(10_235, 10), (10_240, 1), (20_000, 5)])
def test_a_range_past_the_end_is_damage(loc: StoreLocation, offset: int, length: int) -> None:
    loc.write_bytes_atomic("ranged", RANGE_DATA)
    with pytest.raises(CorruptStoreError):
        loc.read_range("ranged", offset, length)


def test_a_negative_range_is_refused(loc: StoreLocation) -> None:
    loc.write_bytes_atomic("ranged", RANGE_DATA)
    for offset, length in ((-1, 5), (5, -1)):
        with pytest.raises(ValueError):
            loc.read_range("ranged", offset, length)


# ------------------------------------------------------------------------------------ missing objects


def test_a_missing_object_is_file_not_found(loc: StoreLocation) -> None:
    loc.write_bytes_atomic("present", b"x")
    for rel in ("missing", "folder/missing"):
        assert not loc.exists(rel)
        with pytest.raises(FileNotFoundError):
            loc.read_bytes(rel)
        with pytest.raises(FileNotFoundError):
            loc.read_bytes(rel, max_bytes=100)
        with pytest.raises(FileNotFoundError):
            loc.read_range(rel, 0, 1)
        with pytest.raises(FileNotFoundError):
            loc.read_range(rel, 0, 0)
        assert loc.read_if_regular(rel, 100) is None


# ------------------------------------------------------------------------------------ zarr


def test_a_zarr_group_round_trip(loc: StoreLocation) -> None:
    values = np.arange(24, dtype=np.int32).reshape(6, 4)
    digests: dict[str, str] = {}
    with loc.zarr_group_writer("segments/000000", digests=digests) as group:
        arr = group.create_array("z", shape=values.shape, dtype=values.dtype, chunks=(2, 4))
        arr[:] = values
    keys = loc.walk_files("segments/000000")
    assert "zarr.json" in keys and "z/zarr.json" in keys and len(keys) == 2 + 3  # metadata and 3 chunks
    assert digests == {k: hashlib.sha256(loc.read_bytes(f"segments/000000/{k}")).hexdigest() for k in keys}
    read = zarr.open_group(store=loc.zarr_store("segments/000000", read_only=True), mode="r")
    assert np.array_equal(read["z"][:], values)


# ------------------------------------------------------------------------------------ one writer


def quiet(message: str) -> None:
    pass


def test_a_second_writer_is_refused(loc: StoreLocation) -> None:
    first = WriterLock(loc, "actstore ingest (first)", quiet)
    assert active_writer(loc) is None and read_holder(loc) is None
    first.acquire()
    try:
        assert first.holds()
        holder = read_holder(loc)
        assert holder is not None and holder.token == first.token and holder.pid == os.getpid()
        message = active_writer(loc)
        assert message is not None and f"pid {os.getpid()} " in message and "(first)" in message
        second = WriterLock(loc, "actstore ingest (second)", quiet)
        with pytest.raises(StoreLockedError, match=f"being written by another ingest: pid {os.getpid()} "):
            second.acquire()
        assert not second.holds()
        assert read_holder(loc).token == first.token  # type: ignore[union-attr]
    finally:
        first.release()
    assert not first.holds()
    assert active_writer(loc) is None and read_holder(loc) is None and LOCK_NAME not in loc.listdir("")
    third = WriterLock(loc, "actstore ingest (third)", quiet)
    third.acquire()  # free again
    third.release()


@pytest.mark.parametrize("round_", range(3))
def test_racing_writers_one_wins(loc: StoreLocation, round_: int) -> None:
    """Writers released together (threads switching as often as the interpreter allows): one takes
    the lock, every other one is refused."""
    n = 8
    start = threading.Barrier(n)
    won: list[WriterLock] = []
    refused: list[BaseException] = []
    other: list[BaseException] = []

    def take(i: int) -> None:
        lock = WriterLock(loc, f"racer {i}", quiet)
        start.wait()
        try:
            lock.acquire()
            won.append(lock)
        except StoreLockedError as e:
            refused.append(e)
        except BaseException as e:
            other.append(e)

    threads = [threading.Thread(target=take, args=(i,)) for i in range(n)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        sys.setswitchinterval(interval)
    try:
        assert not other, other
        assert len(won) == 1 and len(refused) == n - 1, (len(won), refused)
        assert read_holder(loc).token == won[0].token  # type: ignore[union-attr]
    finally:
        for lock in won:
            lock.release()
    assert active_writer(loc) is None


HOLD = """
import sys
from actstore.core.lock import writer_lock
with writer_lock(sys.argv[1], command="ingest in another process"):
    print("held", flush=True)
    sys.stdin.read()
"""


def test_a_writer_in_another_process_is_refused(loc: StoreLocation) -> None:
    if isinstance(loc, MemoryLocation):
        pytest.skip("a memory:// store lives in one process")
    other = subprocess.Popen(
        [sys.executable, "-c", HOLD, loc.url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "held"
        with pytest.raises(StoreLockedError, match=f"pid {other.pid} .*ingest in another process"):
            WriterLock(loc, "actstore ingest", quiet).acquire()
        assert f"pid {other.pid} " in (active_writer(loc) or "")
    finally:
        assert other.stdin is not None
        other.stdin.close()
        assert other.wait(timeout=60) == 0
    assert active_writer(loc) is None and read_holder(loc) is None
    lock = WriterLock(loc, "actstore ingest", quiet)
    lock.acquire()  # released by its holder: free
    lock.release()


def dead_pid() -> int:
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(proc.stdout)


def test_a_dead_writers_record_is_taken_over(loc: StoreLocation) -> None:
    left = dataclasses.replace(Holder.me("killed ingest"), pid=dead_pid(), proc_start=None, token="dead")
    loc.write_bytes_atomic(LOCK_NAME, left.to_json())  # what a SIGKILLed writer leaves
    assert active_writer(loc) is None  # a dead writer does not count
    logged: list[str] = []
    lock = WriterLock(loc, "actstore ingest", logged.append)
    lock.acquire()
    try:
        assert any("taking over" in m and f"pid {left.pid} " in m for m in logged), logged
        assert read_holder(loc).token == lock.token  # type: ignore[union-attr]
    finally:
        lock.release()


def test_another_hosts_record_is_not_taken_over(loc: StoreLocation) -> None:
    elsewhere = dataclasses.replace(Holder.me("ingest elsewhere"), host="another-host.invalid", token="far")
    loc.write_bytes_atomic(LOCK_NAME, elsewhere.to_json())
    with pytest.raises(StoreLockedError, match="another-host.invalid") as refused:
        WriterLock(loc, "actstore ingest", quiet).acquire()
    assert "delete" in str(refused.value)  # says how to clear it when that writer is gone
    assert read_holder(loc) == elsewhere  # left as it was


def test_a_record_that_is_not_actstores_is_refused(loc: StoreLocation) -> None:
    loc.write_bytes_atomic(LOCK_NAME, b'{"kind": "something else"}')
    with pytest.raises(StorageError, match="not an actstore lock record"):
        WriterLock(loc, "actstore ingest", quiet).acquire()
    assert loc.read_bytes(LOCK_NAME) == b'{"kind": "something else"}'
