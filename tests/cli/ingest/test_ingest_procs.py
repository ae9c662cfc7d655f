"""``actstore ingest --procs 2`` (torchrun, gloo on the CPU, real processes) equals a single-process ingest."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from test_crash_resume import assert_same_store
from test_multiprocess import ARGS, env

import actstore
from actstore.ingest.ranks import safe_python, torchrun_command


def ingest(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "actstore.cli", "ingest", *ARGS, "--out", str(out), *extra],
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_procs_2_equals_one_process(tmp_path: Path) -> None:
    single, multi = tmp_path / "single", tmp_path / "multi"
    one = ingest(single)
    assert one.returncode == 0, one.stderr
    two = ingest(multi, "--procs", "2")
    assert two.returncode == 0, two.stderr
    assert two.stderr == ""  # --quiet: nothing from the ranks, nothing from torchrun
    assert (
        sorted(line.split(":")[0] for line in two.stdout.splitlines()) == [f"wrote {multi}"] * 2
    )  # one per rank
    s = actstore.open(multi)
    assert s.manifest.n_segments >= 3
    assert_same_store(multi, single)  # arrays bitwise, commit markers (table hashes) and tables equal
    runs = s.sql("SELECT rank, world_size, segments_written FROM runs ORDER BY rank").to_pylist()
    assert [(r["rank"], r["world_size"]) for r in runs] == [(0, 2), (1, 2)]
    assert sum(r["segments_written"] for r in runs) == s.manifest.n_segments

    # A failing --procs run is one error line (not one per rank, not torchrun's traceback); nothing changes.
    before = {p: p.read_bytes() for p in multi.rglob("*") if p.is_file()}
    again = ingest(multi, "--procs", "2")
    assert again.returncode == 1
    lines = again.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "already holds a store" in lines[0], (
        again.stderr
    )
    assert {p: p.read_bytes() for p in multi.rglob("*") if p.is_file()} == before


def test_procs_command_line_and_bad_values(tmp_path: Path) -> None:
    cmd = torchrun_command(3, ["--out", "x"])  # both Pythons without the cwd on sys.path (test_writer_safety)
    assert cmd == [
        *safe_python("torch.distributed.run"),
        "--standalone",
        "--nproc_per_node",
        "3",
        "--no-python",
        *safe_python("actstore.cli", unbuffered=True),
        "ingest",
        "--out",
        "x",
    ]
    assert "-m" not in cmd
    bad = ingest(tmp_path / "s", "--procs", "0")
    assert bad.returncode == 2 and bad.stderr.startswith("error: Invalid value for '--procs'")
    under = subprocess.run(
        [sys.executable, "-m", "actstore.cli", "ingest", *ARGS, "--out", str(tmp_path / "t"), "--procs", "2"],
        env={**env(), "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert under.returncode == 1 and under.stderr.startswith("error: --procs starts the ranks itself"), (
        under.stderr
    )
    assert not (tmp_path / "s").exists() and not (tmp_path / "t").exists()


def test_threads_option_is_applied_and_restored(tmp_path: Path) -> None:
    import numpy as np
    import torch

    from actstore.jobs.ingest import IngestRequest, run_ingest

    # In process: the thread count holds while the ingest runs (seen from its log callback) and is put back.
    original = torch.get_num_threads()
    torch.set_num_threads(1)
    seen: list[int] = []
    req = IngestRequest(
        model="tiny-llama",
        dataset="demo",
        limit_per_relation=4,
        batch_size=4,
        segment_size=8,
        out=str(tmp_path / "two"),
        progress=False,
        threads=2,
    )
    try:
        run_ingest(req, log=lambda _: seen.append(torch.get_num_threads()))
        assert seen and set(seen) == {2}
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(original)
    # From the command line, with one thread: the same store up to float summation order.
    one = ingest(tmp_path / "one", "--threads", "1")
    assert one.returncode == 0, one.stderr
    a = actstore.open(tmp_path / "one").select().features("attn_head")
    b = actstore.open(tmp_path / "two").select().features("attn_head")
    assert a.shape == b.shape and np.abs(a).max() > 0
    np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-3)
    bad = ingest(tmp_path / "bad", "--threads", "-1")
    assert bad.returncode == 2 and bad.stderr.startswith("error: Invalid value for '--threads'"), bad.stderr
    assert not (tmp_path / "bad").exists()
