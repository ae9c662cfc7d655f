"""``actstore ingest --positions all`` on the command line: the size estimate is printed before the
first batch, and each hostile input gives one ``error:`` line, a non-zero exit and no store."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from actstore.cli import main

BASE = ["ingest", "--model", "tiny-llama", "--batch-size", "2", "--segment-size", "8", "--threads", "1"]


def write(root: Path, name: str, data: bytes) -> Path:
    p = root / name
    p.write_bytes(data)
    return p


GOOD = b"The cat sat on the mat.\nParis is the capital of France.\n"


def corpus(kind: str, name: str, data: bytes, *extra: str) -> Callable[[Path], list[str]]:
    """The arguments of a corpus ingest of ``data`` written to ``name`` in the test's folder."""
    return lambda r: ["--dataset", f"{kind}:{write(r, name, data)}", "--positions", "all", *extra]


# name -> (the arguments after BASE given the data folder, a word the error line must contain)
CASES: dict[str, tuple[Callable[[Path], list[str]], str]] = {
    "empty document": (corpus("text", "e.txt", b"one\n\nthree\n"), "empty document"),
    "whitespace document": (corpus("text", "w.txt", b"one\n   \n"), "line 2"),
    "binary file as text": (corpus("text", "b.txt", bytes(range(256)) * 4), "not a text file"),
    "invalid utf-8": (corpus("text", "u.txt", b"caf\xe9 au lait\n"), "not utf-8"),
    "jsonl without text": (corpus("jsonl", "j.jsonl", b'{"body": "x"}\n'), "text"),
    "empty jsonl text": (corpus("jsonl", "k.jsonl", b'{"text": "a"}\n{"text": ""}\n'), "line 2"),
    "empty file": (corpus("text", "z.txt", b""), "no documents"),
    "a per-source kind": (corpus("text", "g.txt", GOOD, "--kinds", "attn_prob"), "per-source"),
    "an unknown kind": (corpus("text", "g.txt", GOOD, "--kinds", "resid,foo"), "--kinds"),
    "no kind": (corpus("text", "g.txt", GOOD, "--kinds", ","), "--kinds"),
    "kinds in target mode": (lambda r: ["--dataset", "demo", "--kinds", "resid"], "--positions all"),
    "a layer past the model": (corpus("text", "g.txt", GOOD, "--layers", "9"), "--layers"),
    "a context past the model": (
        corpus("text", "g.txt", GOOD, "--context-length", "100000"),
        "--context-length",
    ),
    "a text corpus in target mode": (
        lambda r: ["--dataset", f"text:{write(r, 'g.txt', GOOD)}"],
        "--positions all",
    ),
    "a prompt data set in corpus mode": (lambda r: ["--dataset", "demo", "--positions", "all"], "text:FILE"),
    "a hub data set offline": (
        lambda r: ["--dataset", "hf:no-such-user/no-such-corpus", "--positions", "all"],
        "text:FILE",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_corpus_input(name: str, tmp_path: Path) -> None:
    args, needle = CASES[name]
    out = tmp_path / "store"
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    result = CliRunner().invoke(main, [*BASE, *args(tmp_path), "--out", str(out), "--quiet"], env=env)
    assert result.exit_code != 0, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert needle.lower() in lines[0].lower(), lines[0]
    assert not out.exists()


def test_estimate_comes_before_the_first_batch(tmp_path: Path) -> None:
    docs = write(tmp_path, "g.txt", GOOD)
    out = tmp_path / "store"
    args = [
        *BASE,
        "--dataset",
        f"text:{docs}",
        "--positions",
        "all",
        "--kinds",
        "resid,mlp",
        "--layers",
        "0,1",
    ]
    result = CliRunner().invoke(main, [*args, "--out", str(out)], env={"ACTSTORE_PROGRESS": "1"})
    assert result.exit_code == 0, result.stderr
    err = result.stderr
    assert "size estimate:" in err and err.index("size estimate:") < err.index("ingest:")
    # tiny Llama: (64 (d_model) x 2 residual indices + 128 (d_mlp) x 2 layers) x 2 bytes (float16)
    assert " x 768 bytes" in err
    assert (out / "manifest.json").exists()
    info = CliRunner().invoke(main, ["info", str(out)])
    assert info.exit_code == 0, info.stderr
    assert "corpus    every kept token of 2 documents" in info.stdout
    assert "kept mlp 0,1; resid 0,1" in info.stdout and "positions (1 files)" in info.stdout
