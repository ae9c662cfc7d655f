"""Every ``actstore ...`` line in README.md, docs/*.md's code blocks and each command's ``--help``
example parses as written (click's own parser and the options' checks: no unknown option, no value
out of range, no missing required option), and the cheap ones run as written on a store of the test
fixtures standing at the path they name."""

from __future__ import annotations

import re
import shlex
import shutil
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from actstore.cli import main

REPO = Path(__file__).resolve().parents[3]
EXAMPLE_LINE = re.compile(r"^(?:\$ )?(?:[A-Z_]+=\S+ )*(actstore .*)$")


def _lines(text: str) -> Iterator[str]:
    """The ``actstore`` command lines of ``text`` (continuations joined, comments and env assignments cut)."""
    for line in text.replace("\\\n", " ").split("\n"):
        m = EXAMPLE_LINE.match(line.strip())
        if m:
            yield m.group(1)


def example_lines() -> list[tuple[str, str]]:
    """(where, line) of every example: README's and docs' fenced blocks, every --help epilog."""
    out: list[tuple[str, str]] = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for block in re.findall(r"```[\w-]*\n(.*?)```", doc.read_text(), re.S):
            out += [(doc.name, line) for line in _lines(block)]

    def walk(cmd: click.Command, path: list[str]) -> None:
        if cmd.epilog:
            out.extend((f"--help {' '.join(path) or 'actstore'}", line) for line in _lines(cmd.epilog))
        if isinstance(cmd, click.Group):
            for name, sub in cmd.commands.items():
                walk(sub, [*path, name])

    walk(main, [])
    return out


def argv(line: str) -> list[str]:
    words = shlex.split(line, comments=True)
    assert words[0] == "actstore", line
    return words[1:]


def parse(args: list[str]) -> click.Context:
    """The leaf command's context of ``actstore ARGS``, parsed by click as the command line would be
    (nothing runs): a UsageError (BadParameter, NoSuchOption, MissingParameter) when it does not parse."""
    ctx = main.make_context("actstore", list(args))
    cmd: click.Command = main
    while isinstance(cmd, click.Group):
        rest = [*getattr(ctx, "_protected_args", ()), *ctx.args]  # click 8.2: the subcommand and its args
        name, sub, rest = cmd.resolve_command(ctx, rest)
        assert sub is not None and name is not None
        ctx, cmd = sub.make_context(name, rest, parent=ctx), sub
    return ctx


EXAMPLES = example_lines()


def test_there_are_examples_everywhere() -> None:
    wheres = {w for w, _ in EXAMPLES}
    assert {"README.md", "commands.md", "getting-started.md", "--help probe", "--help study run"} <= wheres
    assert len(EXAMPLES) > 120


@pytest.mark.parametrize("where,line", EXAMPLES, ids=[f"{w}: {x[:60]}" for w, x in EXAMPLES])
def test_every_example_line_parses_as_written(where: str, line: str) -> None:
    try:
        parse(argv(line))
    except click.UsageError as e:
        pytest.fail(f"{where}: {line!r} does not parse: {e.format_message()}")


def test_the_parse_refuses_what_the_command_line_refuses() -> None:
    """The check above can fail: an unknown option, a value out of range, a missing option."""
    for bad in (
        "actstore probe S --no-such",
        "actstore trace S --window 0",
        "actstore maps S",
        "actstore nosuch S",
    ):
        with pytest.raises(click.UsageError):
            parse(argv(bad))
    assert parse(argv("actstore study run S --state x.json")).info_name == "run"


#: Commands cheap enough to run on the tiny fixture store (seconds), given the path they name.
CHEAP = {"info", "sql", "verify", "compact", "features", "topk", "report"}


def test_the_cheap_examples_run_as_written(
    tiny_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lines whose command is cheap, naming the store /tmp/s and no FewRel relation: run with the tiny
    store copied there (under a temporary folder standing for /tmp), in a temporary working directory;
    the one substitution: ``--layer N`` past the tiny model's 2 layers reads layer 1."""
    store = tmp_path / "s"
    shutil.copytree(tiny_store, store)
    monkeypatch.chdir(tmp_path)
    ran = []
    for where, line in EXAMPLES:
        args = argv(line)
        if args[0] not in CHEAP or "/tmp/s" not in args or re.search(r"\bP\d+\b", line):
            continue
        args = [str(store) if a == "/tmp/s" else a for a in args]
        for i, a in enumerate(args[:-1]):  # the fixture's model has 2 layers: a later layer stands as 1
            if a == "--layer" and args[i + 1].isdigit() and int(args[i + 1]) > 1:
                args[i + 1] = "1"
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 0, (where, line, r.output[-1500:])
        ran.append(args[0])
    assert {"info", "sql", "verify", "topk", "report"} <= set(ran), ran
