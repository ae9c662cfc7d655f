"""docs/interop.md's TransformerLens, nnsight and vLLM snippets run as written, printing what the page says."""

from __future__ import annotations

import contextlib
import io
import re
import warnings
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[3] / "docs" / "interop.md"
SECTIONS = ("TransformerLens", "nnsight", "vLLM")


def snippets(section: str) -> list[tuple[str, list[str]]]:
    """The ```python blocks of ``section`` with the lines their ``# `` comments say they print."""
    text = DOC.read_text()
    body = re.split(r"^## ", text, flags=re.M)
    part = next(b for b in body if b.startswith(section + "\n"))
    out = []
    for block in re.findall(r"```python\n(.*?)```", part, flags=re.S):
        expected = [line[2:] for line in block.splitlines() if line.startswith("# ")]
        out.append((block, expected))
    return out


@pytest.mark.parametrize("section", SECTIONS)
def test_snippets_run(section: str, tmp_path: Path) -> None:
    import runpy

    blocks = snippets(section)
    assert blocks
    for k, (code, expected) in enumerate(blocks):
        script = tmp_path / f"snippet_{k}.py"  # a file on disk: nnsight reads a trace's source back
        script.write_text(code)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), warnings.catch_warnings():
            warnings.simplefilter(
                "ignore", DeprecationWarning
            )  # HookedTransformer: deprecated for 4.0's bridge
            runpy.run_path(str(script), run_name="__main__")
        printed = buf.getvalue().splitlines()
        for line in expected:
            assert line in printed, (line, printed)
