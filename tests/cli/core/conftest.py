"""Fixtures of the store core's command-line tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's own shared weights cache (``ACTSTORE_WEIGHTS_DIR``), empty at first."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("ACTSTORE_WEIGHTS_DIR", str(folder))
    return folder
