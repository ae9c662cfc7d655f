"""The tokenizer of a store's model, read from the store itself.

Weight-only analyses (MAPS) turn words into token ids and token ids back into text, so they need
the tokenizer, but not the model.  The ingest saves the model's tokenizer into the store
(``tokenizer/``, each file's SHA-256 in the manifest's ``model.tokenizer``), so the query layer needs
no model package.  :func:`stored_tokenizer` loads, in order:

1. an explicit ``name`` (a local folder, or a hub name given by the user);
2. the store's own ``tokenizer/`` files, checked against the manifest's hashes.

A name written in a store's manifest is never loaded from disk or the hub.  Actstore's model
aliases (``tiny-llama``, ``smollm2-135m``) are resolved by the facade (:func:`actstore.api.tokenizer_for_store`), which may use ``ingest``.

Every failure is a :class:`~actstore.core.errors.QueryError` with one line naming what to pass.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from actstore.core.dependencies import transformers
from actstore.core.errors import QueryError
from actstore.core.model_names import hub_offline
from actstore.core.store import StoreReader


def stored_tokenizer(store: StoreReader, name: str | None = None) -> Any:
    """A fast tokenizer for ``store``'s model (or for ``name``, a folder or hub name, when given)."""
    if name is not None and name.strip():
        key = name.strip()
        path = Path(key).expanduser()
        tok = _auto(str(path)) if path.is_dir() else _auto(key)
    else:
        key = f"{store.url}/tokenizer"
        if not store.has_tokenizer():
            raise QueryError(
                f"{store.url} holds no tokenizer; name the model's tokenizer (a folder, a hub name or an "
                "alias) explicitly"
            )
        files = store.tokenizer_files()
        with tempfile.TemporaryDirectory(prefix="actstore-tokenizer-") as tmp:
            for fname, data in files.items():
                (Path(tmp) / fname).write_bytes(data)
            tok = _auto(tmp, local=True)
    return check_vocabulary(store, tok, key)


def check_vocabulary(store: StoreReader, tok: Any, key: str) -> Any:
    """``tok`` if it fits the store's vocabulary, else one QueryError."""
    vocab = store.geometry.vocab_size
    if len(tok) > vocab:
        raise QueryError(
            f"tokenizer {key!r} has {len(tok)} tokens but the store's model has a vocabulary of {vocab}; "
            "name the model's own tokenizer"
        )
    return tok


def _auto(name: str, *, local: bool = False) -> Any:
    try:
        try:  # the local hub cache first: no network
            tok = transformers.AutoTokenizer.from_pretrained(
                name, local_files_only=True, trust_remote_code=False
            )
        except Exception:
            if local:
                raise
            offline = hub_offline()
            if offline:  # one line at once, not the hub client's retries
                raise OSError(f"not in the local hub cache and {offline}") from None
            tok = transformers.AutoTokenizer.from_pretrained(
                name, local_files_only=False, trust_remote_code=False
            )
    except Exception as e:  # transformers raises OSError, ValueError, HTTP errors, ...
        reason = " ".join(str(e).split())[:160]
        where = "the store's tokenizer files" if local else repr(name)
        raise QueryError(
            f"cannot load a tokenizer from {where} ({reason}); name the model's tokenizer"
        ) from None
    return tok
