"""Small pieces every benchmark script shares."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# The public data sets: $ACTSTORE_DATA, or ../shared/data beside the repository (as the tests read them).
DATA = Path(os.environ.get("ACTSTORE_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data")


def emit(result: dict[str, Any], json_out: str | None) -> str:
    """Print ``result`` as indented JSON and, with ``json_out``, write the same text there."""
    text = json.dumps(result, indent=2)
    print(text)
    if json_out:
        Path(json_out).write_text(text)
    return text


def evict(paths: list[str] | list[Path]) -> None:
    """Drop these files' pages from the page cache (each fsynced first: dirty pages are not dropped),
    with ``posix_fadvise(POSIX_FADV_DONTNEED)``, which needs no root."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
