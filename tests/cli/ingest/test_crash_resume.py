"""A SIGKILLed ingest, resumed, yields the same store as an uninterrupted one; readers see only commits.

Kills land at chosen moments: the real ``actstore ingest`` runs in a subprocess whose
``StoreLocation.write_bytes_atomic`` pauses when it reaches a given object, after writing half
of it to a temporary file (a torn write), and tells the test so through a flag file; the test
checks that the process is still running and SIGKILLs it there.  Moments: before the manifest
exists (store creation), in the middle of a segment's commit (arrays written, a table shard
torn, no marker), on the commit marker itself, and a resumed ingest killed again.  Random kills
after capture has begun are kept as well.  Every resumed store is compared with an
uninterrupted run file by file (manifest, weights, segment arrays, table shards, commit
markers: every byte; only ``tables/runs/``, which records when each run happened, and the
remains of torn writes are left out) and through the reader (manifest fields, each weight,
each array, each table).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from helpers import uncompact

import actstore
from actstore.core.layout import SEGMENT_ARRAYS
from actstore.jobs.ingest import IngestRequest, run_ingest

ARGS = dict(
    model="tiny-llama",
    dataset="demo",
    limit_per_relation=30,
    batch_size=4,
    segment_size=8,
    storage_dtype="float16",
    progress=False,
    weights="copy",  # the store is compared file by file, its weights too
)
N_SEGMENTS = 23  # 6 relations x 30 prompts (a few relations have fewer templates x facts) in segments of 8

# Run by ``python -c``: the CLI, with a pause (after half a torn write) at one object of the store.
PAUSING_CLI = """
import os, sys, time, uuid
from actstore.core.storage.base import StoreLocation

trigger, flag = os.environ["ORACLE_PAUSE_AT"], os.environ["ORACLE_PAUSE_FLAG"]
real = StoreLocation.write_bytes_atomic

def write(self, rel, data):
    if rel == trigger:
        target = self.path(rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(f"{target}.tmp-{uuid.uuid4().hex}", "wb") as f:  # the temporary name the real write uses
            f.write(data[: len(data) // 2])
        open(flag, "w").close()
        time.sleep(600)
    return real(self, rel, data)

StoreLocation.write_bytes_atomic = write
from actstore.cli import main
main(args=sys.argv[1:], prog_name="actstore")
"""


def ingest_in_process(out: Path, resume: bool = False) -> None:
    run_ingest(IngestRequest(out=str(out), resume=resume, **ARGS))  # type: ignore[arg-type]


def cli_args(out: Path, resume: bool = False) -> list[str]:
    return [
        "ingest",
        "--model",
        "tiny-llama",
        "--dataset",
        "demo",
        "--limit-per-relation",
        "30",
        "--batch-size",
        "4",
        "--segment-size",
        "8",
        "--dtype",
        "float16",
        "--weights",
        "copy",
        "--out",
        str(out),
        *(["--resume"] if resume else []),
    ]


def env() -> dict[str, str]:
    # ACTSTORE_PROGRESS=1: the progress bar on a stderr that is a file, which the kill tests wait for
    return {**os.environ, "OMP_NUM_THREADS": "1", "ACTSTORE_PROGRESS": "1"}


def kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc``, which must still be running: a kill of a finished process proves nothing."""
    assert proc.poll() is None, f"the ingest had already exited ({proc.returncode}) before the kill"
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL


def kill_at(out: Path, trigger: str, tmp_path: Path, resume: bool = False) -> None:
    """Run the CLI until it is about to (atomically) write ``trigger`` in the store, then SIGKILL it."""
    flag = tmp_path / f"paused-{trigger.replace('/', '_')}"
    log = tmp_path / f"stderr-{trigger.replace('/', '_')}"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", PAUSING_CLI, *cli_args(out, resume)],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**env(), "ORACLE_PAUSE_AT": trigger, "ORACLE_PAUSE_FLAG": str(flag)},
        )
        try:
            deadline = time.monotonic() + 300
            while not flag.exists():
                assert proc.poll() is None, (
                    f"the ingest exited ({proc.returncode}) before writing {trigger}: "
                    f"{log.read_text()[-500:]}"
                )
                assert time.monotonic() < deadline, f"{trigger} not reached in 300 s"
                time.sleep(0.01)
            kill(proc)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    torn = list((out / trigger).parent.glob(f"{Path(trigger).name}.tmp-*"))
    assert len(torn) == 1 and not (out / trigger).exists()


def store_files(root: Path) -> dict[str, bytes]:
    """Every file of a store except the per-run records and the remains of killed writes."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and not rel.startswith("tables/runs/") and ".tmp-" not in p.name:
            out[rel] = p.read_bytes()
    return out


def assert_same_store(a: Path, b: Path) -> None:
    fa, fb = store_files(a), store_files(b)
    assert sorted(fa) == sorted(fb), sorted(set(fa) ^ set(fb))[:5]
    assert fa["manifest.json"] == fb["manifest.json"]
    differ = sorted(k for k in fa if fa[k] != fb[k])
    assert not differ, f"{len(differ)} files differ, e.g. {differ[:5]}"
    sa, sb = actstore.open(a), actstore.open(b)
    # the weights each reads: its own weights/ (compared file by file above) or the shared copy
    names = ("W_O", "b_O", "W_V", "b_V", "W_down", "b_down", "embed", "unembed", "final_norm_weight")
    weights = [name for name in names if sa.has_weight(name)]
    assert {"W_O", "W_V", "W_down", "embed"} <= set(weights) and weights == [
        n for n in names if sb.has_weight(n)
    ]
    assert sa.complete and sb.complete
    assert sa.manifest == sb.manifest
    for name in weights:
        assert np.array_equal(sa.weight(name), sb.weight(name)), name
    assert sa.weight_attrs == sb.weight_attrs
    assert sa.commits == sb.commits  # same rows, sizes and table hashes per segment
    for seg in sa.commits:
        for name in SEGMENT_ARRAYS:
            x, y = sa.array(seg, name)[...], sb.array(seg, name)[...]
            assert x.dtype == y.dtype and np.array_equal(x.view(np.uint8), y.view(np.uint8)), (seg, name)
    for table in ("examples", "tokens", "targets", "heads"):
        assert table_bytes(sa.table(table)) == table_bytes(sb.table(table)), table


def table_bytes(t: pa.Table) -> bytes:
    """``t`` as Arrow IPC bytes: equal tables give equal bytes, NaN included (``Table.equals`` says a
    table with a NaN differs from itself read again)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, t.schema) as w:
        w.write_table(t.combine_chunks())
    return sink.getvalue().to_pybytes()


def assert_readers_see_commits_only(out: Path, committed: set[int]) -> None:
    """A reader of a killed store sees exactly the whole committed segments, all intact."""
    from actstore.core.verify import verify_store

    s = actstore.open(out)
    # complete exactly when every segment is committed (a kill may land after the last commit)
    assert set(s.commits) == committed and s.complete == (len(committed) == s.manifest.n_segments)
    n = s.sql("SELECT (SELECT count(*) FROM targets) AS t, (SELECT count(*) FROM examples) AS e").to_pylist()[
        0
    ]
    assert n["t"] == n["e"] == s.n_rows == sum(c.n_rows for c in s.commits.values())
    assert set(s.sql("SELECT DISTINCT segment FROM targets").column("segment").to_pylist()) == committed
    report = verify_store(s)  # every committed byte intact; only the uncommitted segments are reported
    # (a kill after the last commit leaves a complete store, which verifies as ok)
    assert report.status == ("ok" if s.complete else "INCOMPLETE"), report.problems
    assert report.segments_checked == len(committed)
    assert set(report.uncommitted) == set(range(s.manifest.n_segments)) - committed


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "store"
    ingest_in_process(out)
    assert len(actstore.open(out).commits) == N_SEGMENTS
    return out


def test_kill_before_the_manifest_exists(reference: Path, tmp_path: Path) -> None:
    out = tmp_path / "store"
    kill_at(out, "manifest.json", tmp_path)
    assert (out / ".creating").exists() and not (out / "manifest.json").exists()
    assert any((out / "weights").iterdir())  # the weights were written: the kill came late in creation
    with pytest.raises(Exception):  # noqa: B017 - not a store yet, whatever a reader says about it
        actstore.open(out)
    ingest_in_process(out, resume=True)  # --resume after a killed creation starts afresh
    assert_same_store(out, reference)


@pytest.mark.parametrize("trigger", ["tables/tokens/000001.parquet", "commits/000002.json"])
def test_kill_during_a_commit(trigger: str, reference: Path, tmp_path: Path) -> None:
    """Killed with the segment's arrays written and a table shard (or the marker) torn."""
    out = tmp_path / "store"
    kill_at(out, trigger, tmp_path)
    killed = int(trigger.split("/")[-1].split(".")[0])
    assert (out / "segments" / f"{killed:06d}").is_dir()  # the arrays of the killed segment are there
    assert_readers_see_commits_only(out, set(range(killed)))
    ingest_in_process(out, resume=True)
    assert_same_store(out, reference)


def test_resumed_ingest_killed_again(reference: Path, tmp_path: Path) -> None:
    out = tmp_path / "store"
    kill_at(out, "commits/000001.json", tmp_path)
    assert_readers_see_commits_only(out, {0})
    kill_at(out, "tables/targets/000004.parquet", tmp_path, resume=True)
    assert_readers_see_commits_only(out, {0, 1, 2, 3})
    ingest_in_process(out, resume=True)
    assert_same_store(out, reference)


def test_killed_after_its_last_snapshot_then_resumed(reference: Path, tmp_path: Path) -> None:
    """Killed after the final compaction made its snapshot current (the process exiting: what a random
    kill meets when the ingest is fast), the resumed ingest has nothing to write and makes no second
    snapshot of the same files."""
    out = tmp_path / "store"
    kill_at(out, "snapshot/CURRENT", tmp_path)  # paused on CURRENT's write: let it finish, then resume
    (out / "snapshot" / "CURRENT").write_text((reference / "snapshot" / "CURRENT").read_text())
    for junk in (out / "snapshot").glob("CURRENT.tmp-*"):
        junk.unlink()
    whole = actstore.open(out)  # every segment committed, the final snapshot current
    assert len(whole.commits) == N_SEGMENTS and whole.snapshot is not None and whole.snapshot.number == 1
    ingest_in_process(out, resume=True)
    assert_same_store(out, reference)


@pytest.mark.parametrize("seed", [1, 2])
def test_sigkill_at_a_random_moment_then_resume(seed: int, reference: Path, tmp_path: Path) -> None:
    out = tmp_path / "store"
    rng = random.Random(seed)
    log = tmp_path / "stderr"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "actstore.cli", *cli_args(out)],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env(),
        )
        deadline = time.monotonic() + 300
        while b"ingest:" not in log.read_bytes():  # the progress bar: capture has begun
            assert proc.poll() is None, log.read_text()[-500:]
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.5))
        kill(proc)
    if (out / "manifest.json").exists():
        partial = actstore.open(out)  # may be complete: a fast machine can commit the last segment
        # before the random moment (the kill then lands while the process exits; kill_at's tests
        # are the ones that pin a kill mid-commit)
        assert_readers_see_commits_only(out, set(partial.commits))
    ingest_in_process(out, resume=True)
    assert_same_store(out, reference)


def test_reader_sees_only_committed_segments(reference: Path, tmp_path: Path) -> None:
    """A segment whose arrays and tables exist but whose marker does not is invisible."""
    import shutil

    out = tmp_path / "store"
    shutil.copytree(reference, out)
    uncompact(out)  # (mid-ingest: no snapshot covers the segment yet)
    (out / "commits" / "000002.json").unlink()
    s = actstore.open(out)
    assert 2 not in s.commits and not s.complete
    rows = s.sql("SELECT DISTINCT segment FROM targets").column("segment").to_pylist()
    assert 2 not in rows
    assert s.n_rows == s.sql("SELECT count(*) AS n FROM examples").to_pylist()[0]["n"]
    ingest_in_process(out, resume=True)
    assert_same_store(out, reference)


def test_resume_with_other_settings_is_refused(reference: Path, tmp_path: Path) -> None:
    import shutil

    from actstore.core.errors import StoreMismatchError

    out = tmp_path / "store"
    shutil.copytree(reference, out)
    before = sorted(p.name for p in (out / "commits").iterdir())
    with pytest.raises(StoreMismatchError):
        run_ingest(IngestRequest(out=str(out), resume=True, **{**ARGS, "limit_per_relation": 5}))  # type: ignore[arg-type]
    assert sorted(p.name for p in (out / "commits").iterdir()) == before
    assert_same_store(out, reference)
