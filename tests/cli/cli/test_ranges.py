"""Numbers out of range are usage errors: exit 2 and one ``error:`` line naming the option, before any
work (click's IntRange/FloatRange where the bound is known when the command is parsed, the settings'
``low``/``high`` otherwise, and ``trace --window`` against the model's layers)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from actstore.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

#: Numeric options with no bound: any integer is a meaning (random seeds, an example id, a layer
#: checked against the store's geometry, counts whose None or 0 means "the default").
UNBOUNDED = {
    ("probe", "--seed-start"),
    ("tokenscore", "--example"),
    ("tokenscore", "--seed"),
    ("tokenscore", "--episode"),
    ("correlate", "--workers"),
    ("maps-dynamic", "--workers"),
    ("trace", "--seed"),
    ("ablate", "--seed"),
    ("lens", "--seed"),
    ("corpus-lens", "--seed"),
    ("agree", "--seed"),
    ("study data", "--seed"),
    ("study run", "--seed"),
    ("study run", "--tuned-seed"),
    ("study chance", "--threshold"),
    ("topk", "--layer"),
    ("ingest", "--batch-size"),  # checked together with --segment-size: exit 2 (below)
    ("ingest", "--segment-size"),
    ("ingest", "--chunk-layers"),  # 0: all layers in one chunk; below 0 refused with exit 2
}


def _options(cmd: click.Command = main, path: tuple[str, ...] = ()) -> Iterator[tuple[str, click.Option]]:
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            yield from _options(sub, (*path, name))
        return
    for p in cmd.params:
        if isinstance(p, click.Option):
            yield " ".join(path), p


def test_every_numeric_option_with_a_known_bound_has_a_range() -> None:
    plain = {
        (name, p.opts[0])
        for name, p in _options()
        if isinstance(p.type, (click.types.IntParamType, click.types.FloatParamType))
        and not isinstance(p.type, (click.IntRange, click.FloatRange))
    }
    assert plain <= UNBOUNDED, sorted(plain - UNBOUNDED)


def _cases(store: str, out: str) -> list[tuple[list[str], str]]:
    trace = ["trace", store, "--all-facts", "--no-save"]
    return [
        ([*trace, "--window", "99"], "--window: a window of 99 layers is larger than the model (2 layers)"),
        ([*trace, "--window", "0"], "--window"),
        ([*trace, "--samples", "0"], "--samples"),
        ([*trace, "--noise", "-1"], "--noise"),
        ([*trace, "--noise-std", "-1"], "--noise-std"),
        ([*trace, "--batch-size", "0"], "--batch-size"),
        ([*trace, "--max-figures", "-1"], "--max-figures"),
        (["patch", store, "--batch-size", "0"], "--batch-size"),
        (["ablate", store, "--relation", "x", "--random-draws", "-1"], "--random-draws"),
        (["agree", store, "--probe-min-count", "0"], "--probe-min-count"),
        (["agree", store, "--probe-folds", "1"], "--probe-folds"),
        (["agree", store, "--tuned-steps", "0"], "--tuned-steps"),
        (["agree", store, "--tuned-batch", "0"], "--tuned-batch"),
        (["topk", store, "--layer", "0", "--k", "0"], "--k"),
        (["topk", store, "--layer", "0", "--k", "10001"], "--k"),
        (["features", store, "--kind", "mlp_group", "--groups", "0", "--out", out], "--groups"),
        (["demo", "--episodes", "0", "--out", out], "--episodes"),
        (["demo", "--limit-per-relation", "0", "--out", out], "--limit-per-relation"),
        (["ingest", "--batch-size", "0", "--out", out], "--batch-size"),
        (["ingest", "--chunk-layers", "-1", "--out", out], "--chunk-layers"),
        (["probe", store, "--seed-start", "-1"], "--seed"),
    ]


def test_out_of_range_numbers_exit_2_with_one_line(tiny_store: Path, tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    for args, words in _cases(str(tiny_store), out):
        r = CliRunner().invoke(main, args)
        lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert r.exit_code == 2 and len(lines) == 1 and words in lines[0], (
            args,
            r.exit_code,
            r.stderr[-800:],
        )
        assert not Path(out).exists(), args  # nothing written
