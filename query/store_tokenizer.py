"""The tokenizer of a store's model, found without loading the model's weights.

Weight-only analyses (MAPS) turn words into token ids and token ids back into text, so they
need the tokenizer, but not the model.  :func:`tokenizer_for_store` resolves, in order:

1. an explicit ``name`` (the user's ``--tokenizer``: a local folder, ``tiny-<arch>``, a packaged
   alias or a hub name);
2. the manifest's model, only when it is one of actstore's own aliases: ``tiny-<arch>`` builds the
   deterministic tiny tokenizer; a packaged GGUF alias (``smollm2-135m``, ``gemma3-270m``) reads
   the converted cache folder whose recorded float32 weight hash equals the store's (any
   converted folder of that alias otherwise).  Any other name in a manifest (a folder, a hub
   repository, ``../../etc``) is data written by whoever made the store, not an instruction: it
   is neither read from disk nor fetched from the hub, and the user is asked for ``--tokenizer``.

Every failure is a :class:`~actstore.errors.QueryError` with one line naming what to pass.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from actstore.errors import QueryError
from actstore.store import Store


def tokenizer_for_store(store: Store, name: str | None = None) -> Any:
    """A fast tokenizer for ``store``'s model (or for ``name`` when given)."""
    from ingest.models import known_alias

    weight_hash = str(store.manifest.model.get("weight_hash") or "")
    if name is not None and name.strip():
        key = name.strip()
        tok = _resolve(key, weight_hash)
    else:
        key = str(store.manifest.model.get("name") or "").strip()
        if not key:
            raise QueryError(f"{store.url}: the manifest names no model; pass --tokenizer")
        alias = known_alias(key)
        if alias is None:
            raise QueryError(
                f"{store.url}: the store's model {key!r} is not one of actstore's aliases, and a name read from a "
                "store is never loaded from disk or the hub on its own; pass --tokenizer FOLDER_OR_NAME"
            )
        tok = _resolve_alias(alias, weight_hash)
    vocab = store.geometry.vocab_size
    if len(tok) > vocab:
        raise QueryError(
            f"tokenizer {key!r} has {len(tok)} tokens but the store's model has a vocabulary of {vocab}; "
            "pass the model's own tokenizer with --tokenizer"
        )
    return tok


def _resolve(key: str, weight_hash: str) -> Any:
    """A user-given tokenizer: a folder, an alias, or a name for ``AutoTokenizer``."""
    from ingest.models import known_alias

    path = Path(key).expanduser()
    if path.is_dir():
        return _auto(str(path))
    alias = known_alias(key)
    if alias is not None:
        return _resolve_alias(alias, weight_hash)
    return _auto(key)


def _resolve_alias(low: str, weight_hash: str) -> Any:
    """The tokenizer of one of actstore's aliases (see :func:`ingest.models.known_alias`)."""
    from ingest.models import GGUF_ALIASES, default_cache_dir, tiny_model

    if low.startswith("tiny-"):
        return tiny_model(low[5:]).tokenizer
    if low in GGUF_ALIASES:
        folder = _converted_folder(default_cache_dir(), low, weight_hash)
        if folder is None:
            raise QueryError(
                f"no converted copy of {low!r} in {default_cache_dir()} to read its tokenizer from; "
                f"load the model once (e.g. actstore ingest --model {low}) or pass --tokenizer FOLDER"
            )
        return _auto(str(folder))
    raise QueryError(f"{low!r} is not an actstore alias")


def _converted_folder(cache: Path, alias: str, weight_hash: str) -> Path | None:
    """The complete conversion folder of ``alias``, preferring the one with the store's weights."""
    candidates: list[Path] = []
    for folder in sorted(cache.glob(f"{alias}-*")):
        marker = folder / "actstore-conversion.json"
        if not marker.is_file() or not (folder / "tokenizer.json").is_file() and not (
            folder / "tokenizer_config.json"
        ).is_file():
            continue
        try:
            info = json.loads(marker.read_text())
        except (OSError, ValueError):
            continue
        if weight_hash and info.get("weight_hash_float32") == weight_hash:
            return folder
        candidates.append(folder)
    return candidates[0] if candidates else None


def _auto(name: str) -> Any:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(name)
    except Exception as e:  # transformers raises OSError, ValueError, HTTP errors, ...
        reason = " ".join(str(e).split())[:160]
        raise QueryError(f"cannot load a tokenizer from {name!r} ({reason}); pass --tokenizer") from None
    return tok
