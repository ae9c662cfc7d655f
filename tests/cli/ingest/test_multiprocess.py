"""``torchrun --nproc_per_node 2`` ingest (gloo on CPU, real processes) equals a single-process ingest.

Both runs use one intra-op thread per process (``OMP_NUM_THREADS=1``, torchrun's own default),
so the CPU kernels sum in the same order and the stored bytes can be compared exactly.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from test_crash_resume import assert_same_store

import actstore

ARGS = [
    "--model",
    "tiny-llama",
    "--dataset",
    "demo",
    "--limit-per-relation",
    "4",
    "--batch-size",
    "4",
    "--segment-size",
    "8",
    "--dtype",
    "float16",
    "--quiet",
]


def env() -> dict[str, str]:
    e = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    e["OMP_NUM_THREADS"] = "1"
    return e


def torchrun(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "actstore.cli",
        "ingest",
        *ARGS,
        "--out",
        str(out),
        *extra,
    ]
    return subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=300)


def test_two_ranks_equal_one_process(tmp_path: Path) -> None:
    single, multi = tmp_path / "single", tmp_path / "multi"
    one = subprocess.run(
        [sys.executable, "-m", "actstore.cli", "ingest", *ARGS, "--out", str(single)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr
    two = torchrun(multi)
    assert two.returncode == 0, two.stderr
    s = actstore.open(multi)
    assert s.manifest.n_segments >= 3  # both ranks had segments to write
    assert_same_store(multi, single)  # arrays bitwise, commit markers (table hashes) and tables equal
    runs = s.sql("SELECT rank, world_size, segments_written FROM runs ORDER BY rank").to_pylist()
    assert [(r["rank"], r["world_size"]) for r in runs] == [(0, 2), (1, 2)]
    assert sum(r["segments_written"] for r in runs) == s.manifest.n_segments

    # Every rank refuses an existing store (no rank waits forever for rank 0); nothing changes.
    before = {p: p.read_bytes() for p in multi.rglob("*") if p.is_file()}
    again = torchrun(multi)
    assert again.returncode != 0
    assert "already holds a store" in again.stderr
    assert {p: p.read_bytes() for p in multi.rglob("*") if p.is_file()} == before
