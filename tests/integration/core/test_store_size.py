"""One size everywhere: ``info`` (text and --json), the report's summary and the explorer's store page
say the same bytes, from :func:`actstore.core.sizes.store_size`, with the weights on a line of their own."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from click.testing import CliRunner

import actstore
from actstore.cli import main
from actstore.core.sizes import human_size, store_size
from actstore.serve.views import store_summary


def _du(root: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


def test_info_report_and_explorer_say_the_same_size(store_factory: Callable[..., Path]) -> None:
    path = store_factory("llama")
    s = actstore.open(str(path))
    size = store_size(s)
    assert size.total == _du(path) and size.weights == _du(path / "weights") and 0 < size.weights < size.total

    r = CliRunner().invoke(main, ["info", str(path), "--json"])
    d = json.loads(r.stdout)
    assert (d["bytes"], d["weights_bytes"]) == (size.total, size.weights)
    text = CliRunner().invoke(main, ["info", str(path)]).stdout
    assert (
        f"size      {human_size(size.total)} on disk" in text
        and f"weights   {human_size(size.weights)}" in text
    )

    page = store_summary(s)
    assert (page["size_bytes"], page["weights_bytes"]) == (size.total, size.weights)
    assert (page["size"], page["weights_size"]) == (human_size(size.total), human_size(size.weights))

    html = Path(path.parent / "size-report.html")
    r = CliRunner().invoke(main, ["report", str(path), "--out", str(html), "--quiet"])
    assert r.exit_code == 0, r.output
    page_text = html.read_text()
    assert human_size(size.total) in page_text and human_size(size.weights) in page_text
