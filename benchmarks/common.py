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
