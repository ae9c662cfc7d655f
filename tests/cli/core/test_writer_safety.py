"""One writer per store, nothing deleted that is not actstore's, ranks that run no foreign code
(issue 14 items 3, 4, 5, and the ``--segment-size``, ``--relations ""`` cases of item 9).

Every refusal is checked the same way: a non-zero exit, exactly one ``error:`` line on stderr,
and every file of the store and of the user's folders byte-identical afterwards (each file
hashed before and after; links and special files recorded as such).  The two-writer cases run
real ``actstore ingest`` processes: the first writer is paused with SIGSTOP once it holds the
lock (or has committed segments), the second runs to its refusal, then the first is resumed
and must finish a store that ``actstore verify`` passes.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from actstore.cli import main
from actstore.core.errors import StoreLockedError
from actstore.core.lock import LOCK_NAME, Holder, WriterLock
from actstore.core.manifest import FORMAT_VERSION, seal
from actstore.core.ownership import CREATING, creating_marker
from actstore.core.storage import locate

ACTSTORE = str(
    Path(sys.executable).parent / "actstore"
)  # the console script: its folder, not the cwd, on sys.path
TINY = ["--model", "tiny-llama", "--batch-size", "4", "--segment-size", "4", "--dtype", "float16"]
SMALL = [*TINY, "--dataset", "demo", "--limit-per-relation", "2", "--quiet"]  # 12 prompts, 3 segments
BIG = [*TINY, "--dataset", "demo", "--limit-per-relation", "30"]  # 180 prompts, 45 segments


def env() -> dict[str, str]:
    e = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACTSTORE_WRITER_LOCK")
    }
    e["OMP_NUM_THREADS"] = "1"
    return e


def run(
    args: list[str], *, cwd: Path | None = None, extra_env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ACTSTORE, *args],
        cwd=cwd,
        env={**env(), **(extra_env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [ACTSTORE, *args], env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def invoke(args: list[str]) -> tuple[int, str]:
    """``actstore ARGS`` in this process (click's runner): (exit code, stderr)."""
    result = CliRunner().invoke(main, args)
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), (
        result.exception
    )
    return result.exit_code, result.stderr


def one_error(code: int, stderr: str) -> str:
    """The single ``error:`` line of a failed command."""
    assert code != 0
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def snapshot(*roots: Path) -> dict[str, str]:
    """Every entry under ``roots`` (links and special files not followed): SHA-256 of each file,
    the target of each link, the kind of anything else; directories by name."""
    out: dict[str, str] = {}
    for root in roots:
        if not os.path.lexists(root):
            out[str(root)] = "absent"
            continue
        for here, dirs, files in os.walk(root, followlinks=False):
            for name in dirs + files:
                p = os.path.join(here, name)
                st = os.lstat(p)
                if stat.S_ISLNK(st.st_mode):
                    out[p] = "link:" + os.readlink(p)
                elif stat.S_ISDIR(st.st_mode):
                    out[p] = "dir"
                elif stat.S_ISREG(st.st_mode):
                    out[p] = hashlib.sha256(Path(p).read_bytes()).hexdigest()
                else:
                    out[p] = f"special:{stat.S_IFMT(st.st_mode)}"
    return out


def pause(proc: subprocess.Popen[str]) -> None:
    """SIGSTOP ``proc`` and wait until every one of its threads has stopped: the signal is delivered
    asynchronously, and a thread still finishing a write would change the store after a snapshot."""
    proc.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        states = []
        for task in Path(f"/proc/{proc.pid}/task").iterdir():
            try:
                text = (task / "stat").read_text()
            except OSError:
                continue
            states.append(text[text.rindex(")") + 2])
        if states and all(st in "tT" for st in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"pid {proc.pid} did not stop within 60 s of SIGSTOP")


def wait_until(ok: Callable[[], bool], proc: subprocess.Popen[str], what: str) -> None:
    """Poll ``ok`` while ``proc`` runs; fail (with its stderr) if it exits first."""
    deadline = time.monotonic() + 300
    while not ok():
        if proc.poll() is not None:
            raise AssertionError(
                f"the first writer exited ({proc.returncode}) before {what}: {proc.stderr.read()}"
            )
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def lock_record(out: Path) -> dict[str, object] | None:
    try:
        d = json.loads((out / LOCK_NAME).read_bytes())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def held_by(out: Path, pid: int) -> Callable[[], bool]:
    return lambda: (lock_record(out) or {}).get("pid") == pid


def commits(out: Path) -> int:
    return len(list((out / "commits").glob("*.json"))) if (out / "commits").is_dir() else 0


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small real store, written by the CLI (copied by the tests that change it)."""
    out = tmp_path_factory.mktemp("ref") / "store"
    code, err = invoke(["ingest", *SMALL, "--out", str(out)])
    assert code == 0, err
    assert not (out / LOCK_NAME).exists()  # the lock goes with the writer
    return out


def copy_store(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def manifest_of(out: Path) -> dict[str, object]:
    d = json.loads((out / "manifest.json").read_text())
    assert isinstance(d, dict)
    return d


def verify_ok(out: Path) -> None:
    result = CliRunner().invoke(main, ["verify", str(out)])
    assert result.exit_code == 0 and result.stdout.startswith("ok: "), (result.stdout, result.stderr)


# --------------------------------------------------------------------------- item 3: --overwrite deletes only stores


def npm_project(root: Path) -> Path:
    proj = root / "webapp"
    (proj / "node_modules" / "left-pad").mkdir(parents=True)
    (proj / "manifest.json").write_text(json.dumps({"name": "webapp", "short_name": "app", "start_url": "/"}))
    (proj / "package.json").write_text(json.dumps({"name": "webapp", "version": "1.0.0"}))
    (proj / "node_modules" / "left-pad" / "index.js").write_text("module.exports = s => s;\n")
    return proj


def test_overwrite_refuses_a_directory_that_is_not_a_store(tmp_path: Path) -> None:
    proj = npm_project(tmp_path)
    before = snapshot(tmp_path)
    line = one_error(*invoke(["ingest", *SMALL, "--overwrite", "--out", str(proj)]))
    assert "not an actstore store" in line and "nothing was deleted" in line, line
    assert snapshot(tmp_path) == before  # no lock file left either


def _newer(d: dict[str, object]) -> dict[str, object]:
    return seal({**{k: v for k, v in d.items() if k != "checksum"}, "format_version": FORMAT_VERSION + 1})


def _bool_version(d: dict[str, object]) -> dict[str, object]:
    return seal({**{k: v for k, v in d.items() if k != "checksum"}, "format_version": True})


def _other_format(d: dict[str, object]) -> dict[str, object]:
    return seal({**{k: v for k, v in d.items() if k != "checksum"}, "format": "zarr-store"})


def _flipped(d: dict[str, object]) -> dict[str, object]:
    return {**d, "n_examples": int(str(d["n_examples"])) + 1}  # checksum no longer matches


@pytest.mark.parametrize(
    "change, needle",
    [
        (_newer, f"format version {FORMAT_VERSION + 1}"),
        (_bool_version, "format version True"),
        (_other_format, "not an actstore manifest"),
        (_flipped, "checksum"),
    ],
    ids=["newer-version", "version-true", "other-format", "bad-checksum"],
)
def test_overwrite_refuses_an_invalid_manifest(
    store: Path, tmp_path: Path, change: Callable[[dict[str, object]], dict[str, object]], needle: str
) -> None:
    out = copy_store(store, tmp_path / "s")
    (out / "manifest.json").write_text(json.dumps(change(manifest_of(out)), indent=2, sort_keys=True))
    before = snapshot(tmp_path)
    line = one_error(*invoke(["ingest", *SMALL, "--overwrite", "--out", str(out)]))
    assert "not an actstore store" in line and needle in line, line
    assert snapshot(tmp_path) == before


def test_overwrite_never_follows_links_or_special_files(store: Path, tmp_path: Path) -> None:
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "thesis.tex").write_text("\\section{Results}\n")
    # a store whose manifest.json is a link to a real store's manifest
    linked = tmp_path / "linked-manifest"
    linked.mkdir()
    os.symlink(store / "manifest.json", linked / "manifest.json")
    (linked / "notes.txt").write_text("mine")
    # a real store with a link inside pointing out of it
    inner = copy_store(store, tmp_path / "inner-link")
    os.symlink(outside, inner / "tables" / "results")
    # a real store with a named pipe inside
    fifo = copy_store(store, tmp_path / "fifo")
    os.mkfifo(fifo / "segments" / "pipe")
    # a real store the user put a file of their own into
    foreign = copy_store(store, tmp_path / "foreign")
    (foreign / "my-notes.txt").write_text("do not lose")
    # --out itself a link to a real store
    via_link = tmp_path / "via-link"
    os.symlink(copy_store(store, tmp_path / "target"), via_link)
    # a manifest.json that is a named pipe (must not hang)
    pipe_manifest = tmp_path / "pipe-manifest"
    pipe_manifest.mkdir()
    os.mkfifo(pipe_manifest / "manifest.json")
    cases = [
        (linked, "not an actstore store"),
        (inner, "'tables/results'"),
        (fifo, "'segments/pipe'"),
        (foreign, "'my-notes.txt'"),
        (via_link, "symbolic link"),
        (pipe_manifest, "not an actstore store"),
    ]
    for out, needle in cases:
        before = snapshot(tmp_path, store)
        line = one_error(*invoke(["ingest", *SMALL, "--overwrite", "--out", str(out)]))
        assert needle in line, (out, line)
        assert snapshot(tmp_path, store) == before, out


def test_an_unsigned_creating_file_is_never_wiped(tmp_path: Path) -> None:
    """Before: a directory holding an empty ``.creating`` was deleted even without --overwrite."""
    folder = tmp_path / "work"
    (folder / "data").mkdir(parents=True)
    (folder / CREATING).write_bytes(b"")
    (folder / "data" / "results.csv").write_text("a,b\n1,2\n")
    (tmp_path / "forged").mkdir()
    (tmp_path / "forged" / CREATING).write_text(json.dumps({"format": "actstore"}))  # no signature
    (tmp_path / "forged" / "weights").mkdir()
    for out in (folder, tmp_path / "forged"):
        for flags in ([], ["--overwrite"], ["--resume"]):
            before = snapshot(tmp_path)
            line = one_error(*invoke(["ingest", *SMALL, *flags, "--out", str(out)]))
            assert f"holds a {CREATING} file that actstore did not write" in line, (flags, line)
            assert snapshot(tmp_path) == before, flags


def test_signed_remains_are_cleared_but_not_through_a_link(store: Path, tmp_path: Path) -> None:
    """The remains of a creation killed before its manifest (signed ``.creating``) are deleted and
    the store is written; the same remains holding a link out are refused."""
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "data.bin").write_bytes(b"\x00" * 64)
    killed = tmp_path / "killed"
    (killed / "weights" / "embed").mkdir(parents=True)
    (killed / CREATING).write_bytes(creating_marker())
    (killed / "weights" / "embed" / "zarr.json").write_text("{}")
    linked = tmp_path / "killed-link"
    (linked / "weights").mkdir(parents=True)
    (linked / CREATING).write_bytes(creating_marker())
    os.symlink(outside, linked / "weights" / "embed")
    before = snapshot(tmp_path)
    line = one_error(*invoke(["ingest", *SMALL, "--out", str(linked)]))
    assert "'weights/embed'" in line and "nothing was deleted" in line, line
    assert snapshot(tmp_path) == before
    code, err = invoke(["ingest", *SMALL, "--resume", "--out", str(killed)])  # a resume of it starts afresh
    assert code == 0, err
    verify_ok(killed)
    assert sorted(p.name for p in killed.iterdir()) == [
        "commits",
        "manifest.json",
        "segments",
        "snapshot",
        "tables",
        "tokenizer",
        "weights.json",  # the weights themselves are in the shared cache (--weights shared, the default)
    ]
    assert snapshot(outside) == {k: v for k, v in before.items() if k.startswith(str(outside) + "/")}


def test_overwrite_replaces_a_valid_store(store: Path, tmp_path: Path) -> None:
    out = copy_store(store, tmp_path / "s")
    data = tmp_path / "other.jsonl"
    data.write_text("".join(json.dumps({"text": f"Number {i} is followed by"}) + "\n" for i in range(5)))
    code, err = invoke(
        ["ingest", *TINY, "--dataset", f"jsonl:{data}", "--quiet", "--overwrite", "--out", str(out)]
    )
    assert code == 0, err
    verify_ok(out)
    m = manifest_of(out)
    assert m["n_examples"] == 5 and m["ingest"]["dataset"] == f"jsonl:{data}"  # type: ignore[index]
    assert not (out / LOCK_NAME).exists() and not (out / CREATING).exists()


# --------------------------------------------------------------------------- item 4: one writer at a time


def test_overwrite_while_another_ingest_writes(tmp_path: Path) -> None:
    out = tmp_path / "store"
    first = start(["ingest", *BIG, "--quiet", "--out", str(out)])
    try:
        wait_until(lambda: commits(out) >= 2, first, "committing segments")
        pause(first)  # mid-ingest, holding the lock
        assert first.poll() is None and commits(out) < 45, (
            "the first writer finished before it could be paused"
        )
        before = snapshot(tmp_path)
        second = run(["ingest", *SMALL, "--overwrite", "--out", str(out)])
        line = one_error(second.returncode, second.stderr)
        assert (
            "is being written by another ingest" in line
            and f"pid {first.pid} on host {socket.gethostname()}" in line
        ), line
        assert snapshot(tmp_path) == before
    finally:
        first.send_signal(signal.SIGCONT)
    stdout, stderr = first.communicate(timeout=600)
    assert first.returncode == 0, stderr
    verify_ok(out)
    m = manifest_of(out)
    assert m["n_examples"] == 180 and m["ingest"]["dataset"] == "demo"  # type: ignore[index]
    assert m["ingest"]["limit_per_relation"] == 30  # type: ignore[index]
    assert not (out / LOCK_NAME).exists()


def test_two_fresh_ingests_of_different_data(tmp_path: Path) -> None:
    """Before: both wrote; the manifest named one data set and the rows came from the other."""
    import actstore
    from actstore.ingest.datasets.dispatch import load_dataset

    out = tmp_path / "store"
    other = tmp_path / "other.jsonl"
    other.write_text(
        "".join(json.dumps({"text": f"Item {i} of the other data set is"}) + "\n" for i in range(8))
    )
    first = start(["ingest", *BIG, "--quiet", "--out", str(out)])
    try:
        wait_until(held_by(out, first.pid), first, "taking the lock")
        pause(first)
        before = snapshot(tmp_path)
        second = run(["ingest", *TINY, "--dataset", f"jsonl:{other}", "--quiet", "--out", str(out)])
        line = one_error(second.returncode, second.stderr)
        assert "is being written by another ingest" in line and f"pid {first.pid} " in line, line
        assert snapshot(tmp_path) == before
    finally:
        first.send_signal(signal.SIGCONT)
    _, stderr = first.communicate(timeout=600)
    assert first.returncode == 0, stderr
    verify_ok(out)
    assert manifest_of(out)["ingest"]["dataset"] == "demo"  # type: ignore[index]
    texts = actstore.open(out).sql("SELECT text FROM examples ORDER BY example_id").column("text").to_pylist()
    assert texts == [
        r.text for r in load_dataset("demo", limit_per_relation=30).records
    ]  # the rows are demo's


def test_a_second_writer_after_the_manifest_names_the_holder(tmp_path: Path) -> None:
    """A plain ingest (no --overwrite) into a store being written: the holder is named, not just
    "already holds a store"; and a --procs launcher is refused the same way, before any rank starts."""
    out = tmp_path / "store"
    first = start(["ingest", *BIG, "--quiet", "--out", str(out)])
    try:
        wait_until(lambda: (out / "manifest.json").exists(), first, "writing its manifest")
        pause(first)
        before = snapshot(tmp_path)
        for extra in ([], ["--resume"], ["--procs", "2"]):
            second = run(["ingest", *SMALL, *extra, "--out", str(out)])
            line = one_error(second.returncode, second.stderr)
            assert "is being written by another ingest" in line and f"pid {first.pid} " in line, (extra, line)
            assert snapshot(tmp_path) == before, extra
    finally:
        first.send_signal(signal.SIGCONT)
    _, stderr = first.communicate(timeout=600)
    assert first.returncode == 0, stderr
    verify_ok(out)


def test_lock_released_on_sigterm_and_stale_lock_taken_over(tmp_path: Path) -> None:
    out = tmp_path / "store"
    # SIGTERM: the writer unwinds and lets the lock go
    first = start(["ingest", *BIG, "--quiet", "--out", str(out)])
    wait_until(held_by(out, first.pid), first, "taking the lock")
    first.send_signal(signal.SIGTERM)
    first.communicate(timeout=600)
    assert first.returncode == 128 + signal.SIGTERM
    assert not (out / LOCK_NAME).exists()
    # SIGKILL: the lock file stays, naming a dead process; the next writer takes over and says so
    again = ["--resume"] if (out / "manifest.json").exists() else []  # (SIGTERM may come before the manifest)
    second = start(["ingest", *BIG, *again, "--quiet", "--out", str(out)])
    wait_until(lambda: held_by(out, second.pid)() and commits(out) >= 1, second, "committing a segment")
    second.kill()
    second.communicate(timeout=600)
    assert lock_record(out) is not None and lock_record(out)["pid"] == second.pid  # type: ignore[index]
    third = run(["ingest", *BIG, "--resume", "--out", str(out)])
    assert third.returncode == 0, third.stderr
    takeover = [ln for ln in third.stderr.splitlines() if "taking over the writer lock" in ln]
    assert (
        len(takeover) == 1 and f"pid {second.pid} " in takeover[0] and "that process is gone" in takeover[0]
    )
    assert not (out / LOCK_NAME).exists()
    verify_ok(out)
    assert manifest_of(out)["segment_size"] == 4  # --segment-size as given


def test_lock_of_another_host_is_not_taken_over(store: Path, tmp_path: Path) -> None:
    out = copy_store(store, tmp_path / "s")
    record = Holder("gpu-node-7", 4242, 0, None, 1.7e9, "f" * 32, "actstore ingest").to_json()
    (out / LOCK_NAME).write_bytes(record)
    before = snapshot(tmp_path)
    line = one_error(*invoke(["ingest", *SMALL, "--overwrite", "--out", str(out)]))
    assert "pid 4242 on host gpu-node-7" in line and f"delete {out / LOCK_NAME}" in line, line
    assert snapshot(tmp_path) == before


def test_a_failed_ingest_leaves_no_lock_and_no_directory(tmp_path: Path) -> None:
    out = tmp_path / "deep" / "new"
    line = one_error(
        *invoke(["ingest", *SMALL[2:], "--model", str(tmp_path / "no-model"), "--out", str(out)])
    )
    assert "unknown model" in line, line  # failed under the lock (the model loads after it is taken)
    assert not (tmp_path / "deep").exists()


def test_lock_api_is_exclusive_reentrant_and_per_thread(tmp_path: Path) -> None:
    import threading

    from actstore.core.lock import active_writer, writer_lock

    out = tmp_path / "s"
    assert active_writer(out) is None
    with writer_lock(out, command="test") as lock:
        assert lock is not None and lock.holds()
        record = lock_record(out)
        assert record is not None and record["pid"] == os.getpid() and record["token"] == lock.token
        with writer_lock(out) as inner:  # nested in the same thread: the same lock, not a second one
            assert inner is None
        busy = active_writer(out)
        assert busy is not None and f"pid {os.getpid()} on host {socket.gethostname()}" in busy
        with pytest.raises(StoreLockedError):  # a second lock object in this process
            WriterLock(locate(out), "x", lambda m: None).acquire()
        errors: list[BaseException] = []

        def other_thread() -> None:
            try:
                with writer_lock(out):
                    pass
            except BaseException as e:
                errors.append(e)

        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        assert len(errors) == 1 and isinstance(errors[0], StoreLockedError), errors
        assert (out / LOCK_NAME).exists()
    assert not out.exists()  # the lock created the folder, and removed it with nothing else in it
    assert active_writer(out) is None


# --------------------------------------------------------------------------- item 5: --procs runs no code from the cwd

HOSTILE = """import os, pathlib
pathlib.Path(os.environ["HOSTILE_MARK"], "imported-" + __name__).write_text("pwned")
raise SystemExit("hostile module imported")
"""


def test_procs_ranks_do_not_import_code_from_the_working_directory(tmp_path: Path) -> None:
    cwd = tmp_path / "project"
    cwd.mkdir()
    marks = tmp_path / "marks"
    marks.mkdir()
    for name in ("ingest.py", "query.py", "torch.py", "actstore.py", "click.py", "numpy.py", "runpy.py"):
        (cwd / name).write_text(HOSTILE)
    (cwd / "ingest").mkdir()
    (cwd / "ingest" / "__init__.py").write_text(HOSTILE)
    user_files = snapshot(cwd)
    result = run(
        ["ingest", *SMALL, "--procs", "2", "--out", "store"], cwd=cwd, extra_env={"HOSTILE_MARK": str(marks)}
    )
    assert result.returncode == 0, result.stderr
    assert list(marks.iterdir()) == []  # nothing imported from the cwd, by torchrun or by a rank
    assert [line.split(":")[0] for line in result.stdout.splitlines()] == [
        f"wrote {cwd / 'store'}"
    ] * 2  # 2 ranks
    verify_ok(cwd / "store")
    assert {k: v for k, v in snapshot(cwd).items() if not k.startswith(str(cwd / "store"))} == user_files


# --------------------------------------------------------------------------- item 9: sizes and relations


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ["--segment-size", "8"],
            "--segment-size: 8 is not a multiple of the batch size 16",
        ),  # was silently 16
        (
            ["--segment-size", "10", "--batch-size", "4"],
            "--segment-size: 10 is not a multiple of the batch size 4 "
            "(a segment holds whole batches): use 8 or 12",
        ),
        (["--segment-size", "300"], "use 288 or 304"),
        (["--relations", ""], "--relations: no relation ids given"),  # was: every relation
        (["--relations", " , "], "--relations: no relation ids given"),
    ],
    ids=["segment-below-batch", "segment-not-multiple", "segment-300", "relations-empty", "relations-commas"],
)
def test_sizes_and_relations_are_checked(tmp_path: Path, args: list[str], needle: str) -> None:
    out = tmp_path / "new"
    base = ["--model", "tiny-llama", "--dataset", "demo", "--limit-per-relation", "2", "--quiet"]
    line = one_error(*invoke(["ingest", *base, *args, "--out", str(out)]))
    assert needle in line, line
    assert not out.exists()


# --------------------------------------------------------------------------- S3: conditional PUT


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, str]]:
    from s3server import moto_server, use_server_env

    with moto_server() as server, pytest.MonkeyPatch.context() as mp:
        use_server_env(mp, server)
        yield {"bucket": server.bucket, "endpoint": server.endpoint}


def s3_objects(info: dict[str, str]) -> dict[str, str]:
    import boto3

    client = boto3.client("s3", endpoint_url=info["endpoint"], region_name="us-east-1")
    out: dict[str, str] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=info["bucket"]):
        for obj in page.get("Contents", []):
            out[obj["Key"]] = obj["ETag"]
    return out


def test_s3_one_writer_and_overwrite_rules(s3: dict[str, str]) -> None:
    url = f"s3://{s3['bucket']}/stores/locked"
    code, err = invoke(["ingest", *SMALL, "--out", url])
    assert code == 0, err
    assert f"stores/locked/{LOCK_NAME}" not in s3_objects(s3)  # released (deleted) after the ingest
    # another writer holds the lock (taken here with a conditional PUT): every ingest is refused
    holder = WriterLock(locate(url), "actstore ingest (test)", lambda m: None)
    holder.acquire()
    try:
        with pytest.raises(StoreLockedError):  # the conditional PUT refuses a second lock object
            WriterLock(locate(url), "second", lambda m: None).acquire()
        before = s3_objects(s3)
        for flags in (["--overwrite"], ["--resume"]):
            line = one_error(*invoke(["ingest", *SMALL, *flags, "--out", url]))
            assert "is being written by another ingest" in line and f"pid {os.getpid()} " in line, line
            assert s3_objects(s3) == before
    finally:
        holder.release()
    # --overwrite of a prefix that is no store (its own manifest.json): refused, nothing deleted
    loc = locate(f"s3://{s3['bucket']}/site")
    loc.fs.pipe_file(loc.path("manifest.json"), b'{"name": "site", "start_url": "/"}')
    loc.fs.pipe_file(loc.path("index.html"), b"<html></html>")
    before = s3_objects(s3)
    line = one_error(*invoke(["ingest", *SMALL, "--overwrite", "--out", f"s3://{s3['bucket']}/site"]))
    assert "not an actstore store" in line, line
    assert s3_objects(s3) == before
    # a valid store is overwritten, and the lock object is gone afterwards
    code, err = invoke(["ingest", *SMALL, "--overwrite", "--out", url])
    assert code == 0, err
    assert not any(k.endswith(LOCK_NAME) for k in s3_objects(s3))
