"""A SIGKILLed ingest, resumed, yields the same store as an uninterrupted one; readers see only commits."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import actstore
from actstore.store import SEGMENT_ARRAYS
from ingest.run import IngestRequest, ingest_corpus

ARGS = dict(model="tiny-llama", dataset="demo", limit_per_relation=30, batch_size=4, segment_size=8,
            storage_dtype="float16", progress=False)


def ingest_in_process(out: Path, resume: bool = False) -> None:
    ingest_corpus(IngestRequest(out=str(out), resume=resume, **ARGS))  # type: ignore[arg-type]


def cli_args(out: Path) -> list[str]:
    return [sys.executable, "-m", "actstore.cli", "ingest", "--model", "tiny-llama", "--dataset", "demo",
            "--limit-per-relation", "30", "--batch-size", "4", "--segment-size", "8", "--dtype", "float16",
            "--out", str(out)]


def assert_same_store(a: Path, b: Path) -> None:
    sa, sb = actstore.open(a), actstore.open(b)
    assert sa.complete and sb.complete
    assert sa.commits == sb.commits  # same rows, sizes and table hashes per segment
    for seg in sa.commits:
        for name in SEGMENT_ARRAYS:
            x, y = sa.array(seg, name)[...], sb.array(seg, name)[...]
            assert x.dtype == y.dtype and np.array_equal(x.view(np.uint8), y.view(np.uint8)), (seg, name)
    for table in ("examples", "tokens", "targets", "heads"):
        assert sa.table(table).equals(sb.table(table)), table


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "store"
    ingest_in_process(out)
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sigkill_then_resume_equals_uninterrupted(seed: int, reference: Path, tmp_path: Path) -> None:
    out = tmp_path / "store"
    rng = random.Random(seed)
    proc = subprocess.Popen(cli_args(out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    seen = ""
    while "ingest:" not in seen and proc.poll() is None:  # the progress bar: capture has begun
        seen += proc.stderr.read(1)
    time.sleep(rng.uniform(0.0, 1.0))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    if (out / "manifest.json").exists():
        partial = actstore.open(out)
        assert partial.n_rows <= partial.manifest.n_examples
        assert partial.sql("SELECT count(*) AS n FROM targets").to_pylist()[0]["n"] == partial.n_rows
    ingest_in_process(out, resume=True)  # also covers a kill before the manifest existed
    assert_same_store(out, reference)


def test_reader_sees_only_committed_segments(reference: Path, tmp_path: Path) -> None:
    """A segment whose arrays and tables exist but whose marker does not is invisible."""
    import shutil

    out = tmp_path / "store"
    shutil.copytree(reference, out)
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

    from actstore.errors import StoreMismatchError

    out = tmp_path / "store"
    shutil.copytree(reference, out)
    before = sorted(p.name for p in (out / "commits").iterdir())
    with pytest.raises(StoreMismatchError):
        ingest_corpus(IngestRequest(out=str(out), resume=True, **{**ARGS, "limit_per_relation": 5}))  # type: ignore[arg-type]
    assert sorted(p.name for p in (out / "commits").iterdir()) == before
    assert_same_store(out, reference)
