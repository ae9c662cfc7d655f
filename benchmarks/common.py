"""Small pieces every benchmark script shares."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(result: dict[str, Any], json_out: str | None) -> str:
    """Print ``result`` as indented JSON and, with ``json_out``, write the same text there."""
    text = json.dumps(result, indent=2)
    print(text)
    if json_out:
        Path(json_out).write_text(text)
    return text
