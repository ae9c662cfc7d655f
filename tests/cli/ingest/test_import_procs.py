"""``actstore import --procs 2`` (torchrun, gloo on the CPU, real processes) writes the store a
single-process import writes; a bad value in a file is one line and leaves no store, or the store it
would have overwritten as it was; a resume of ranks finishes what they left."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import uncompact
from safetensors.torch import load_file, save_file
from test_crash_resume import assert_same_store, store_files
from test_import_cli import vllm_files
from test_multiprocess import env

import actstore
from actstore.cli import main

ARGS = ["--layer-ids", "0,2", "--model", "tiny-llama", "--segment-size", "16"]


def run(*argv: str, torchrun: bool = False) -> subprocess.CompletedProcess[str]:
    """``actstore import ...`` in a process of its own; ``torchrun``: as two ranks of a bare torchrun."""
    head = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m"]
        if torchrun
        else [sys.executable, "-m"]
    )
    return subprocess.run(
        [*head, "actstore.cli", "import", *argv], env=env(), capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 requests of 5..44 tokens (980 positions: 62 segments of 16), and a copy with a NaN in the
    file of request 37, whose rows fall in segments of both ranks."""
    root = tmp_path_factory.mktemp("import-procs")
    vllm_files(root / "hs", n=40)
    shutil.copytree(root / "hs", root / "bad")
    d = load_file(str(root / "bad" / "r37.safetensors"))
    h = d["hidden_states"].clone()
    h[3, 1, 5] = float("nan")
    save_file({"hidden_states": h, "token_ids": d["token_ids"]}, str(root / "bad" / "r37.safetensors"))
    single = CliRunner().invoke(main, ["import", str(root / "hs"), *ARGS, "--out", str(root / "single")])
    assert single.exit_code == 0, single.output
    return root


def bad_line(files: Path) -> str:
    """The error naming request 37's window (the files are taken in name order) and residual 2 (the
    file's layer 1 under --layer-ids 0,2)."""
    k = sorted(p.name for p in (files / "bad").glob("*.safetensors")).index("r37.safetensors")
    return f"error: --source: window {k}, residual 2: not finite"


def test_procs_2_equals_one_process_and_resumes(files: Path, tmp_path: Path) -> None:
    out = tmp_path / "two"
    r = run(str(files / "hs"), *ARGS, "--out", str(out), "--procs", "2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"{out}: 980 positions, 31 segments written"] * 2  # one line a rank
    assert_same_store(out, files / "single")  # arrays bitwise, markers, tables (NaN-free in bytes)
    s = actstore.open(out)
    runs = s.sql("SELECT rank, world_size, segments_written FROM runs ORDER BY rank").to_pylist()
    assert runs == [
        {"rank": 0, "world_size": 2, "segments_written": 31},
        {"rank": 1, "world_size": 2, "segments_written": 31},
    ]
    assert CliRunner().invoke(main, ["verify", str(out)]).exit_code == 0

    # ranks killed before their last segments: those segments' files and markers gone, then --resume
    uncompact(out)
    for seg in ("000059", "000060", "000061"):
        shutil.rmtree(out / "segments" / seg)
        (out / "commits" / f"{seg}.json").unlink()
        for t in (out / "tables").glob(f"*/{seg}.parquet"):
            t.unlink()
    r = run(str(files / "hs"), *ARGS, "--out", str(out), "--procs", "2", "--resume")
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == [
        f"{out}: 980 positions, 1 segments written",  # rank 0: segment 60; rank 1: 59 and 61
        f"{out}: 980 positions, 2 segments written",
    ]
    assert_same_store(out, files / "single")


def test_a_bad_value_under_procs_is_one_line_and_changes_nothing(files: Path, tmp_path: Path) -> None:
    # a new store: each rank checks its segments as it casts them; the launcher removes what they made
    out = tmp_path / "new"
    r = run(str(files / "bad"), *ARGS, "--out", str(out), "--procs", "2")
    assert r.returncode == 1
    assert r.stderr.splitlines() == [bad_line(files)], r.stderr
    assert not out.exists()
    # a store to overwrite: the values are checked (each rank its own windows) before rank 0 touches it
    kept = tmp_path / "kept"
    shutil.copytree(files / "single", kept)
    before = store_files(kept)
    r = run(str(files / "bad"), *ARGS, "--out", str(kept), "--procs", "2", "--overwrite")
    assert r.returncode == 1
    assert r.stderr.splitlines() == [bad_line(files)], r.stderr
    assert store_files(kept) == before


def test_bare_torchrun_ranks(files: Path, tmp_path: Path) -> None:
    """Ranks of a torchrun started by hand: rank 0 takes the lock for all; the values are checked before
    the store is made (no launcher to remove it)."""
    out = tmp_path / "bare"
    r = run(*ARGS, "--out", str(out), "--", str(files / "hs"), torchrun=True)
    assert r.returncode == 0, r.stderr
    assert_same_store(out, files / "single")
    r = run(*ARGS, "--out", str(tmp_path / "b"), "--", str(files / "bad"), torchrun=True)
    assert r.returncode != 0 and bad_line(files) in r.stderr
    assert not (tmp_path / "b").exists()


def test_rank_windows_against_a_plain_loop() -> None:
    """Each window belongs to the ranks whose segments hold any of its rows (a brute-force loop over
    every row)."""
    import numpy as np

    from actstore.ingest.external import ExternalWindow
    from actstore.jobs.import_acts import rank_windows

    rng = np.random.default_rng(0)
    for _ in range(50):
        sizes = rng.integers(1, 40, size=int(rng.integers(1, 12)))
        ws = [ExternalWindow(np.zeros(n, np.int64), {}) for n in sizes]
        seg, world = int(rng.integers(1, 20)), int(rng.integers(1, 4))
        starts = np.concatenate([[0], np.cumsum(sizes)])
        for rank in range(world):
            want = {
                k
                for k in range(len(ws))
                for row in range(starts[k], starts[k + 1])
                if (row // seg) % world == rank
            }
            assert rank_windows(ws, seg, rank, world) == want


@pytest.mark.parametrize(
    "argv",
    [
        ["a", "b", "--out", "s", "--procs", "2"],
        ["--no-predict", "--resume", "--out", "-odd name", "--procs", "3", "--", "-first", "second"],
        ["x", "--predict", "--layer-ids", "0,2", "--procs", "2", "--weights", "copy", "--out", "s"],
    ],
)
def test_rank_args_give_each_rank_the_same_command(argv: list[str]) -> None:
    """What each rank of ``--procs`` parses is what the launcher parsed, ``--procs`` aside (a flag pair
    set either way, a positional that looks like an option, a value with a space)."""
    from actstore.cli._options import rank_args
    from actstore.cli.importing import import_

    ctx = import_.make_context("import", list(argv))
    again = import_.make_context("import", rank_args(ctx))
    assert "--procs" not in rank_args(ctx)
    want = {k: v for k, v in ctx.params.items() if k != "procs"}
    assert {k: v for k, v in again.params.items() if k != "procs"} == want and again.params["procs"] is None
