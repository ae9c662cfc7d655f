"""Links from the static report to a running explorer's views of the same store
(``actstore report --explorer URL``)."""

from __future__ import annotations

import json
import os
import urllib.parse
import urllib.request
from typing import Any

from actstore.core.store import StoreReader
from actstore.serve.common import relations_index


def served_name(base: str, store_url: str, timeout: float = 2.0) -> str | None:
    """The name under which the explorer at ``base`` serves the store at ``store_url`` (None when it
    does not answer, or serves other stores)."""
    if urllib.parse.urlsplit(base).scheme not in ("http", "https"):
        return None
    try:
        with urllib.request.urlopen(base.rstrip("/") + "/api/stores", timeout=timeout) as r:  # noqa: S310
            stores: Any = json.loads(r.read(1_000_000))
    except (OSError, ValueError):
        return None
    want = os.path.realpath(store_url) if "://" not in store_url else store_url
    for s in stores if isinstance(stores, list) else []:
        url = str(s.get("url", "")) if isinstance(s, dict) else ""
        if url and (os.path.realpath(url) if "://" not in url else url) == want:
            return str(s.get("name"))
    return None


def explorer_links(store: StoreReader, base: str, name: str) -> list[tuple[str, str]]:
    """(text, href) of the explorer's views of ``store`` served as ``name`` at ``base``: the store,
    the HeadScore heatmap, the method comparison, the SQL console, the features, and each relation."""
    root = f"{base.rstrip('/')}/s/{urllib.parse.quote(name, safe='')}"
    links = [
        ("store", root),
        ("HeadScore heatmap", root + "/heads"),
        ("method comparison", root + "/methods"),
        ("SQL console", root + "/sql"),
        ("features", root + "/features"),
    ]
    for rel, info in sorted(relations_index(store).items()):
        label = f"{rel} {info.get('relation_name') or ''}".strip()
        links.append((label, f"{root}/relation/{urllib.parse.quote(rel, safe='')}"))
    return links
