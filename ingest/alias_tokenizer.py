"""The tokenizer of one of actstore's model aliases, without loading the model's weights.

Stores hold their model's tokenizer since it was ingested; this is for a tokenizer named by alias
(``tiny-llama``, ``smollm2-135m``).  It lives
in ``ingest`` because it needs the model registry (:mod:`actstore.ingest.models`); ``query`` never imports
it, the facade does (:func:`actstore.api.tokenizer_for_store`).

Only actstore's own aliases are resolved: ``tiny-<arch>`` builds the deterministic tiny tokenizer;
a packaged GGUF alias reads the converted cache folder whose recorded float32 weight hash equals
the store's (any converted folder of that alias otherwise).  Any other name, folders and hub
repositories included, is not resolved here (None).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from actstore.core.dependencies import transformers
from actstore.core.errors import QueryError
from actstore.ingest.models.cache import model_cache_dir
from actstore.ingest.models.gguf import GGUF_ALIASES
from actstore.ingest.models.registry import known_alias
from actstore.ingest.models.tiny import tiny_model


def alias_tokenizer(name: str, weight_hash: str = "") -> Any | None:
    """The tokenizer of alias ``name`` (preferring the converted copy with ``weight_hash``), or None
    when ``name`` is not one of actstore's aliases."""

    low = known_alias(name)
    if low is None:
        return None
    if low.startswith("tiny-"):
        return tiny_model(low[5:]).tokenizer
    if low in GGUF_ALIASES:
        folder = converted_folder(model_cache_dir(), low, weight_hash)
        if folder is None:
            raise QueryError(
                f"no converted copy of {low!r} in {model_cache_dir()} to read its tokenizer from; "
                f"load the model once (e.g. actstore ingest --model {low}) or name a tokenizer folder"
            )
        return load_folder(folder)
    return None


def converted_folder(cache: Path, alias: str, weight_hash: str) -> Path | None:
    """The complete conversion folder of ``alias``, preferring the one with the store's weights."""
    candidates: list[Path] = []
    for folder in sorted(cache.glob(f"{alias}-*")):
        marker = folder / "actstore-conversion.json"
        has_tokenizer = (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()
        if not marker.is_file() or not has_tokenizer:
            continue
        try:
            info = json.loads(marker.read_text())
        except (OSError, ValueError):
            continue
        if weight_hash and info.get("weight_hash_float32") == weight_hash:
            return folder
        candidates.append(folder)
    return candidates[0] if candidates else None


def load_folder(folder: Path) -> Any:
    """A tokenizer from a local folder (nothing fetched, no code run)."""
    try:
        return transformers.AutoTokenizer.from_pretrained(
            str(folder), local_files_only=True, trust_remote_code=False
        )
    except Exception as e:  # transformers raises OSError, ValueError, ...
        raise QueryError(
            f"cannot load a tokenizer from {str(folder)!r} ({' '.join(str(e).split())[:160]})"
        ) from None
