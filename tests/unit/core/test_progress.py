"""actstore.core.progress: the one way progress bars are made (tqdm on stderr, off when not enabled)."""

from __future__ import annotations

import pytest

from actstore.core.progress import progress_bar


def test_enabled_bar_counts_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    bar = progress_bar(total=3, desc="ingest", unit="prompt")
    for _ in range(3):
        bar.update(1)
    bar.close()
    out, err = capsys.readouterr()
    assert out == "" and "ingest" in err and "3/3" in err and "prompt" in err


def test_disabled_bar_writes_nothing_but_still_iterates(capsys: pytest.CaptureFixture[str]) -> None:
    seen = list(progress_bar(range(4), desc="MAPS static", unit="layer", enabled=False))
    bar = progress_bar(total=2, enabled=False)
    bar.update(2)
    bar.close()
    assert seen == [0, 1, 2, 3]
    assert capsys.readouterr() == ("", "")
