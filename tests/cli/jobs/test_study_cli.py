"""``actstore study`` as a command group: its help cites the paper it runs, its data set command writes
what the library's builder writes, and bad input is one line with the documented exit status (2 for a
usage error, 1 when the command cannot do what was asked).  The study's runs, checkpoints and re-reads
are tested in tests/unit/jobs/test_study_checkpoint.py and tests/integration/methods/test_method_metrics.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import click
from click.testing import CliRunner, Result
from helpers import FIXTURES

from actstore.cli import main
from actstore.ingest.datasets.methods2k import build_methods2k

M2K = FIXTURES / "methods2k"
PAPER = "An Empirical Study of Mechanistic Interpretability Approaches for Factual Recall (ACL 2025)"


def study(*args: object) -> Result:
    return CliRunner().invoke(main, ["study", *map(str, args)])


def _one_line(r: Result, code: int, words: str) -> None:
    err = r.stderr.strip()
    assert r.exit_code == code and err.startswith("error: ") and "\n" not in err and words in err, r.output


def test_help_cites_the_paper_and_no_seed_or_issue() -> None:
    group = main.commands["study"]
    assert isinstance(group, click.Group)
    names = sorted(group.commands)
    assert names == ["chance", "checkpoint", "data", "merge", "restore", "run", "summary", "tables"]
    top = study("--help")
    assert top.exit_code == 0 and PAPER in " ".join(top.stdout.split())
    assert "arXiv 2202.05262" in " ".join(top.stdout.split())  # ROME's causal tracing
    for name in ["", *names]:
        r = study(*([name] if name else []), "--help")
        text = " ".join(r.stdout.split())
        assert r.exit_code == 0 and "Example" in text, name
        assert "the seed" not in text.lower() and not re.search(r"issue \d", text, re.I), name
    assert "arXiv 2303.08112" in " ".join(study("run", "--help").stdout.split())  # the tuned lens


def test_data_writes_what_the_builder_writes(tmp_path: Path) -> None:
    r = study(
        "data",
        "--out",
        tmp_path / "cli",
        "--lre",
        M2K / "lre" / "factual",
        "--known",
        M2K / "known_1000.json",
        "--frequency",
        M2K / "zipf.json",
        "--size",
        "18",
    )
    assert r.exit_code == 0 and "methods2k.json" in r.stdout, r.output
    want = build_methods2k(
        M2K / "lre" / "factual",
        M2K / "known_1000.json",
        tmp_path / "lib",
        size=18,
        frequency=json.loads((M2K / "zipf.json").read_text()),
    )
    assert (tmp_path / "cli" / "methods2k.json").read_bytes() == want.read_bytes()
    _one_line(
        study("data", "--out", tmp_path / "x", "--known", M2K / "known_1000.json", "--frequency", M2K),
        1,
        "not a JSON table of subject frequencies",
    )


def test_bad_input_is_one_line_with_its_exit_status(tmp_path: Path) -> None:
    _one_line(study("run", tmp_path), 2, "Missing option '--state'")
    _one_line(study("run", tmp_path, "--state", "s.json", "--methods", "trace,bogus"), 2, "--methods")
    _one_line(study("run", tmp_path, "--state", "s.json", "--chunk", "0"), 2, "--chunk")
    _one_line(study("chance", tmp_path, "--state", "s.json", "--methods", "patch"), 2, "trace and any of")
    _one_line(study("chance", tmp_path, "--state", "s.json", "--tuned", "bogus"), 2, "--tuned")
    _one_line(study("merge", tmp_path, "--state", "s.json"), 2, "Missing option '--add'")
    _one_line(study("summary", "no-label.json"), 2, "LABEL=FILE")
    _one_line(study("summary"), 2, "Missing argument")
    _one_line(study("tables", tmp_path / "none.json"), 1, "not a study summary")
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    _one_line(study("tables", bad), 1, "not a JSON object")
    _one_line(
        study("merge", tmp_path / "nowhere", "--state", "s.json", "--add", "t.json"), 1, "no actstore store"
    )
