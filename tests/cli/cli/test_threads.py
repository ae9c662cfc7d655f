"""``--threads``: one option with one meaning and one default on every command that computes (torch's
intra-op threads and numpy's BLAS/OpenMP pools while the command runs; 0, the default, leaves them as
they are), checked where the command's work starts: as it opens its store, or calls its job."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
import torch
from click.testing import CliRunner
from threadpoolctl import threadpool_info

from actstore.cli import main
from actstore.core.settings import DEFAULT_THREADS, THREADS_HELP

#: Every command that computes, with the required settings it needs to reach its work (values the
#: command only reads once it runs).
COMPUTING: dict[str, list[str]] = {
    "features": ["--kind", "attn_head", "--out", "x.npy"],
    "ingest": ["--out", "s"],
    "probe": [],
    "tokenscore": ["--run", "r", "--example", "0"],
    "correlate": ["--run", "r"],
    "shortcuts": ["--run", "r"],
    "maps": ["--pairs", "p"],
    "maps-dynamic": [],
    "trace": [],
    "patch": [],
    "ablate": ["--relation", "r"],
    "lens": [],
    "corpus-lens": [],
    "agree": [],
    "study run": ["--state", "x.json"],
    "study chance": ["--state", "x.json"],
    "report": [],
    "demo": [],
    "topk": ["--layer", "0", "--kind", "mlp"],
    "dfa": ["--direction", "token:1"],
    "import": ["--out", "s"],
}
NO_STORE = {"ingest": "actstore.jobs.ingest.run_ingest", "demo": "actstore.jobs.demo.run_demo"}
NO_STORE["import"] = "actstore.jobs.import_acts.read_source"


class Reached(Exception):
    """Raised where the command's work starts, after the thread counts were read."""


def _commands(cmd: click.Command = main, path: tuple[str, ...] = ()) -> Iterator[tuple[str, click.Command]]:
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            yield from _commands(sub, (*path, name))
    else:
        yield " ".join(path), cmd


def test_every_computing_command_has_the_one_threads_option() -> None:
    with_threads = {name for name, cmd in _commands() if any(p.name == "threads" for p in cmd.params)}
    assert with_threads == set(COMPUTING)
    for name, cmd in _commands():
        for p in cmd.params:
            if p.name == "threads":
                assert isinstance(p, click.Option) and p.opts == ["--threads"], name
                assert p.default == DEFAULT_THREADS and THREADS_HELP in str(p.help), name
                assert isinstance(p.type, click.IntRange) and p.type.min == 0, name


def _blas_threads() -> set[int]:
    return {int(i["num_threads"]) for i in threadpool_info() if i["user_api"] == "blas"}


@pytest.mark.parametrize("name", sorted(COMPUTING))
def test_threads_reach_torch_and_numpy_where_the_work_starts(
    name: str, tiny_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import actstore

    seen: list[tuple[int, set[int]]] = []

    def reached(*args: Any, **kwargs: Any) -> Any:
        seen.append((torch.get_num_threads(), _blas_threads()))
        raise Reached("reached")

    if name in NO_STORE:
        module, attr = NO_STORE[name].rsplit(".", 1)
        monkeypatch.setattr(module + "." + attr, reached)
        args = [*name.split(), *(["/nowhere"] if name == "import" else [])]
    else:
        monkeypatch.setattr(actstore, "open", reached)
        args = [*name.split(), str(tiny_store)]
    monkeypatch.chdir(tmp_path)
    before = torch.get_num_threads()
    want = 3 if before != 3 else 2
    r = CliRunner().invoke(main, [*args, *COMPUTING[name], "--threads", str(want)])
    assert "reached" in r.output and r.exit_code == 1, r.output
    assert seen[-1][0] == want and seen[-1][1] <= {want}, seen
    assert torch.get_num_threads() == before  # restored after the command
    r = CliRunner().invoke(main, [*args, *COMPUTING[name]])  # the default: torch's threads as they were
    assert "reached" in r.output and seen[-1][0] == before, (r.output, seen)


def test_threads_run_through_a_whole_command(tiny_store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """topk to its end with --threads 2: the job's stream of blocks runs on two torch threads."""
    from actstore.query.analyses import topk

    real, seen = topk.top_activations, []

    def counting(*args: Any, **kwargs: Any) -> Any:
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(topk, "top_activations", counting)
    monkeypatch.setattr("actstore.jobs.topk.top_activations", counting)
    want = 2 if torch.get_num_threads() != 2 else 3
    r = CliRunner().invoke(
        main, ["topk", str(tiny_store), "--kind", "mlp", "--layer", "0", "--no-save", "--threads", str(want)]
    )
    assert r.exit_code == 0, r.output
    assert seen == [want] and "mlp layer 0: top" in r.stdout
    r = CliRunner().invoke(
        main, ["topk", str(tiny_store), "--kind", "mlp", "--layer", "0", "--threads", "-1"]
    )
    assert r.exit_code == 2 and "--threads" in r.stderr


def test_threads_reach_duckdb(tiny_store: Path) -> None:
    """A store's SQL connection opened while ``--threads N`` is in force runs DuckDB on N threads (read
    back with DuckDB's own current_setting); outside it, the connection's default."""
    import actstore
    from actstore.cli._options import compute_threads
    from actstore.core.sql_connect import THREADS

    def duckdb_threads() -> int:
        table = actstore.open(tiny_store).sql("SELECT current_setting('threads') AS t")
        return int(table.column("t")[0].as_py())

    assert duckdb_threads() == THREADS
    for want in (1, 3):
        with compute_threads(want):
            assert duckdb_threads() == want
    assert duckdb_threads() == THREADS
