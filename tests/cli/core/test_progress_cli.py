"""Progress on the command line: the long commands show it on a terminal (a pseudo-terminal here), and
say nothing on stderr with ``--quiet`` or with ``--json`` piped; ``report`` prints each line once."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from actstore.cli import main

FIXTURES = Path(__file__).resolve().parents[2] / "data"
MAPS = ["--pairs", str(FIXTURES / "maps" / "datasets"), "--multi-token", "first", "--min-pairs", "1"]
MAPS += ["--no-first-mlp", "--no-save"]
ENV = {**os.environ, "ACTSTORE_PROGRESS": "", "COLUMNS": "", "PYTHONUNBUFFERED": "1"}
PROBE = [
    "--episodes",
    "20",
    "--n-way",
    "2",
    "--k-shot",
    "1",
    "--queries",
    "2",
    "--seeds",
    "1",
    "--threads",
    "1",
]
CLI = [sys.executable, "-m", "actstore.cli"]


def on_terminal(args: list[str], *, zero_width: bool = False) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``actstore ARGS`` with stderr on a pseudo-terminal (of 0 columns,
    as a fresh one reports, with ``zero_width``)."""
    master, slave = pty.openpty()
    if not zero_width:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    p = subprocess.Popen(CLI + args, stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL, env=ENV)
    os.close(slave)
    err = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        err += chunk
    out = p.stdout.read() if p.stdout else b""
    os.close(master)
    return p.wait(), out.decode(), err.decode(errors="replace")


def piped(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(CLI + args, capture_output=True, text=True, env=ENV, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def store(store_factory: Callable[..., Path]) -> str:
    path = str(store_factory("llama", segment_size=12))  # its own: a probe run is recorded in it
    r = CliRunner().invoke(main, ["probe", path, *PROBE, "--quiet"])  # so that the report has a section
    assert r.exit_code == 0, r.output
    return path


def long_commands(store: str, tmp: Path) -> dict[str, tuple[list[str], str]]:
    """command -> (its arguments, the words of its progress on a terminal, "|" between bars)."""
    return {
        "ingest": (
            ["ingest", "--model", "tiny-llama", "--limit-per-relation", "2", "--threads", "1"],
            "ingest",
        ),
        "probe": (
            ["probe", store, *PROBE, "--no-save"],
            "features attn_head|ep",  # the feature matrix's rows, then the episodes
        ),
        "maps": (["maps", store, *MAPS], "maps: scores"),
        "report": (["report", store, "--out", str(tmp / "r.html")], "report: "),
        "topk": (["topk", store, "--layer", "0", "--no-save"], "topk mlp layer 0:|100%"),
        "verify": (["verify", store], "verify:|segment"),
        "import": (
            ["import", vllm_folder(tmp), "--layer-ids", "0,2", "--model", "tiny-llama"],
            "import: 100%",
        ),
    }


def vllm_folder(tmp: Path) -> str:
    """Two files in vLLM's extract_hidden_states layout (tiny-llama's width)."""
    import torch
    from safetensors.torch import save_file

    folder = tmp / "hs"
    folder.mkdir(exist_ok=True)
    for k in range(2):
        ids = torch.arange(3, 10 + k)
        save_file(
            {"hidden_states": torch.randn(ids.numel(), 2, 64), "token_ids": ids},
            str(folder / f"r{k}.safetensors"),
        )
    return str(folder)


def test_long_commands_show_progress_on_a_terminal_and_none_when_quiet_or_piped_json(
    store: str, tmp_path: Path
) -> None:
    for name, (args, word) in long_commands(store, tmp_path).items():
        out_args = ["--out", str(tmp_path / f"{name}-t")] if name in ("ingest", "import") else []
        rc, _, err = on_terminal(args + out_args)
        assert rc == 0, (name, err)
        assert all(w in err for w in word.split("|")), (name, err)
        out_args = ["--out", str(tmp_path / f"{name}-j")] if name in ("ingest", "import") else []
        r = piped(args + out_args + ["--json"])
        assert r.returncode == 0 and r.stderr == "", (name, r.stderr)
        json.loads(r.stdout)
        rc, _, err = on_terminal(
            args
            + ["--quiet"]
            + (["--out", str(tmp_path / f"{name}-q")] if name in ("ingest", "import") else [])
        )
        assert rc == 0 and err.strip() == "", (name, err)


def test_a_terminal_of_no_width_still_gets_a_bar(store: str) -> None:
    rc, _, err = on_terminal(["maps", store, *MAPS], zero_width=True)
    assert rc == 0 and "maps: scores" in err and "100%" in err


def test_report_prints_each_progress_line_once(store: str, tmp_path: Path) -> None:
    rc, _, err = on_terminal(["report", store, "--out", str(tmp_path / "r.html")])
    lines = [line.strip() for line in err.splitlines() if "report: " in line]
    assert rc == 0 and lines, err
    assert len(lines) == len(set(lines)), err


def test_study_run_and_demo_show_progress_on_a_terminal_and_none_when_quiet(
    store: str, tmp_path: Path
) -> None:
    """``study run``: its trace runs' bars beside its time-stamped lines; ``demo``: the ingest's, the
    probe's and MAPS's bars beside its steps; ``--quiet``: nothing on stderr."""
    study = ["study", "run", store, "--all-facts", "--max-facts", "1", "--trace-only", "--samples", "1"]
    study += ["--window", "1"]
    rc, _, err = on_terminal([*study, "--state", str(tmp_path / "a.json")])
    assert rc == 0 and "trace: 100%" in err and "traced 1 facts" in err, err
    rc, _, err = on_terminal([*study, "--state", str(tmp_path / "b.json"), "--quiet"])
    assert rc == 0 and err.strip() == "", err
    demo = ["demo", "--model", "tiny-llama", "--limit-per-relation", "2", "--episodes", "4", "--threads", "1"]
    rc, out, err = on_terminal([*demo, "--out", str(tmp_path / "d1")])
    assert rc == 0 and "done in" in out, err
    for word in (
        "==> ingest",
        "ingest: 100%",
        "features attn_head: 100%",
        "MAPS static: 100%",
    ):  # 2 a relation: too few for the probe's episodes
        assert word in err, (word, err)
    rc, out, err = on_terminal([*demo, "--out", str(tmp_path / "d2"), "--quiet"])
    assert rc == 0 and "done in" in out and err.strip() == "", err
