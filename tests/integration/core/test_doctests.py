"""The examples in the package's docstrings run and print what they say (on the tiny demo store)."""

from __future__ import annotations

import doctest
import types
from pathlib import Path

import pytest

import actstore
from actstore.core import sql_limits

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def run_examples(module: types.ModuleType, **globs: object) -> doctest.TestResults:
    return doctest.testmod(
        module, extraglobs={"actstore": actstore, **globs}, optionflags=FLAGS, verbose=False
    )


def test_the_facade_example_runs() -> None:
    result = run_examples(actstore)
    assert result.attempted >= 9
    assert result.failed == 0


@pytest.mark.parametrize("module", [sql_limits])
def test_examples_that_take_a_store_run(module: types.ModuleType, tmp_path: Path) -> None:
    store = actstore.ingest_corpus(tmp_path / "s", model="tiny-llama", dataset="demo")
    result = run_examples(module, store=store)
    assert result.attempted >= 1
    assert result.failed == 0
