"""One rule for exit codes, over every command: 2 a usage error (an unknown option, a missing
argument, a value the command refuses before any work: a feature kind, a layer out of range or an
empty range, a model name that is no alias, folder or hub name), 1 a runtime error (the work failed:
no store, bad data, ...), 3 damage (``verify``), each with one ``error:`` line (docs/commands.md,
"Errors and exit codes")."""

from __future__ import annotations

import time
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from actstore.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def _leaves(
    cmd: click.Command = main, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], click.Command]]:
    if isinstance(cmd, click.Group):
        return [leaf for name, sub in sorted(cmd.commands.items()) for leaf in _leaves(sub, (*path, name))]
    return [(path, cmd)]


LEAVES = _leaves()
IDS = [" ".join(p) for p, _ in LEAVES]


def _options(cmd: click.Command) -> set[str]:
    return {o for p in cmd.params if isinstance(p, click.Option) for o in p.opts}


def _store_arg(cmd: click.Command) -> bool:
    args = [p for p in cmd.params if isinstance(p, click.Argument)]
    return bool(args) and args[0].name == "store"


def _run(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(main, list(args))
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, (args, r.exit_code, r.stderr[-2000:])
    return r.exit_code, lines[0]


@pytest.mark.parametrize("leaf", LEAVES, ids=IDS)
def test_an_unknown_option_is_a_usage_error(leaf: tuple[tuple[str, ...], click.Command]) -> None:
    path, _ = leaf
    assert _run(*path, "--no-such-option")[0] == 2


@pytest.mark.parametrize(
    "leaf", [x for x in LEAVES if _store_arg(x[1])], ids=[i for i, x in zip(IDS, LEAVES) if _store_arg(x[1])]
)
def test_bad_values_are_usage_errors_on_every_store_command(
    leaf: tuple[tuple[str, ...], click.Command], tiny_store: Path, tmp_path: Path
) -> None:
    path, cmd = leaf
    opts = _options(cmd)
    store = str(tiny_store)
    out = ["--out", str(tmp_path / "x.npy")] if "--out" in opts and path == ("features",) else []
    cases: list[list[str]] = []
    if "--kind" in opts and path != ("ablate",):
        cases.append(["--kind", "bogus"])
    if "--layers" in opts:
        cases += [["--layers", "40"], ["--layers", "5-3"]]
    if "--layer" in opts:
        cases.append(["--layer", "40", *(["--kind", "mlp"] if path == ("topk",) else [])])
    if "--model" in opts:  # with the other settings a model run needs on this store
        extra = {("trace",): ["--all-facts", "--window", "1"], ("patch",): ["--pair", "0:2"]}.get(path, [])
        cases.append(["--model", "nosuchmodel", *extra])
    for case in cases:
        code, line = _run(*path, store, *case, *out)
        assert code == 2, (path, case, line)


@pytest.mark.parametrize(
    "leaf", [x for x in LEAVES if _store_arg(x[1])], ids=[i for i, x in zip(IDS, LEAVES) if _store_arg(x[1])]
)
def test_a_missing_store_is_a_runtime_error(
    leaf: tuple[tuple[str, ...], click.Command], tmp_path: Path
) -> None:
    path, cmd = leaf
    required = [p for p in cmd.params[1:] if p.required]
    if required:  # a missing required option is a usage error first
        pytest.skip(f"needs {required[0].opts[0]}")  # the other tests cover these commands' usage errors
    code, line = _run(*path, str(tmp_path / "nothing"))
    assert code == 1, (path, line)


def test_specific_messages(tiny_store: Path, tmp_path: Path) -> None:
    s = str(tiny_store)
    assert (
        "'5-3' is an empty range (write 3-5)"
        in _run("features", s, "--kind", "z", "--layers", "5-3", "--out", "x.npy")[1]
    )
    assert (
        "--layers: layer 40 out of range for attn_head: valid 0..1" in _run("probe", s, "--layers", "40")[1]
    )
    assert _run("features", s, "--kind", "bogus", "--out", "x.npy")[1].startswith(
        "error: --kind: unknown feature kind"
    )
    t0 = time.perf_counter()
    code, line = _run("ingest", "--model", "nosuchmodel", "--dataset", "demo", "--out", str(tmp_path / "s"))
    assert code == 2 and "tiny-llama" in line and "local transformers folder" in line
    assert time.perf_counter() - t0 < 20  # no hub retries
