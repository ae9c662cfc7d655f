"""The public facade: the store as researchers use it, on top of the core, ``query`` and ``ingest``.

:class:`Store` is the core :class:`actstore.core.store.StoreReader` (manifest, arrays, weights, tables, SQL)
plus the methods that need the query layer.  ``actstore.open`` returns one.  The layers below
never import this module (docs/architecture.md; enforced by import-linter, ``make lint``).

The query layer is imported when a method needs it, not when this module is: ``import actstore``
(and the command line's ``--help``) does not load torch.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from actstore.core.errors import ActstoreError
from actstore.core.storage import locate
from actstore.core.store import StoreReader

if TYPE_CHECKING:
    from actstore.query.select.selection import Selection


class Store(StoreReader):
    """A read-only view of a store (see :class:`actstore.core.store.StoreReader`), with selections of its rows."""

    def select(
        self,
        where: str | None = None,
        *,
        query: str | None = None,
        params: dict[str, Any] | list[Any] | None = None,
    ) -> Selection:
        """The target rows whose example matches ``where`` (one SQL expression over ``examples``) or
        whose ``example_id`` the SELECT ``query`` returns; all rows when both are None.
        ``params``: values for the placeholders of ``where`` / ``query`` (bound by DuckDB)::

            store.select("relation_id = $rel AND split = 'val'", params={"rel": "P177"})
        """
        from actstore.query.select.selection import Selection

        return Selection.from_sql(self, where=where, query=query, params=params)

    def hook_names(self) -> dict[str, list[dict[str, str]]]:
        """Each kind's TransformerLens hook name and transformers module path, per layer
        (``{"resid": [{"hook": "blocks.0.hook_resid_pre", "module": "model.embed_tokens", "side": "output"}, ...]}``;
        :func:`actstore.query.select.tl_cache.kind_names` for one kind and layer)."""
        from actstore.query.select.tl_cache import hook_names

        return hook_names(self)


def open_store(url: str | os.PathLike[str]) -> Store:
    """Open an existing store (local path or URL) for reading."""
    return Store(locate(url))


def ingest_corpus(out: str | os.PathLike[str], *, progress: bool | None = None, **settings: Any) -> Store:
    """Run a model once over a data set and write a store at ``out`` (a path or URL); returns it, open.

    ``settings``: any field of :class:`actstore.ingest.settings.IngestRequest`, with its defaults
    (``model``: an alias such as ``tiny-llama`` or ``smollm2-135m``, a hub name or a folder;
    ``dataset``: a name such as ``demo`` or ``fewrel``, or ``kind:PATH``; ``limit_per_relation``,
    ``storage_dtype``, ``batch_size``, ...).  ``progress``: a bar on stderr (default: when stderr is a
    terminal, as on the command line).  The same as ``actstore ingest`` on the command line::

        store = actstore.ingest_corpus("/tmp/s", model="tiny-llama", dataset="demo", limit_per_relation=4)
    """
    from dataclasses import fields

    from actstore.ingest.settings import IngestRequest
    from actstore.jobs.ingest import run_ingest

    known = {f.name for f in fields(IngestRequest)} - {"out", "progress", "extra"}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ActstoreError(
            f"ingest_corpus() got unknown setting(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})"
        )
    if settings.get("relations") is not None:
        settings["relations"] = tuple(settings["relations"])
    from actstore.core.progress import progress_wanted

    wanted = progress_wanted() if progress is None else progress
    req = IngestRequest(out=os.fspath(out), progress=wanted, **settings)
    run_ingest(req)
    return open_store(out)


def tokenizer_for_store(store: StoreReader, name: str | None = None) -> Any:
    """The tokenizer of ``store``'s model, or ``name``'s (a folder, a hub name, or one of actstore's
    model aliases such as ``tiny-llama`` or ``smollm2-135m``).

    A store holds its model's tokenizer (:func:`actstore.query.select.store_tokenizer.stored_tokenizer`
    reads it).  An alias given as ``name`` is resolved through the model registry of ``ingest``, which
    is why this lives in the facade and not in ``query``.
    """
    from actstore.ingest.alias_tokenizer import alias_tokenizer
    from actstore.query.select.store_tokenizer import check_vocabulary, stored_tokenizer

    weight_hash = str(store.manifest.model.get("weight_hash") or "")
    key = name.strip() if name is not None and name.strip() else None
    if key is not None and not os.path.isdir(os.path.expanduser(key)):
        tok = alias_tokenizer(key, weight_hash)
        if tok is not None:
            return check_vocabulary(store, tok, key)
    return stored_tokenizer(store, key)


def write_corpus(out: str | os.PathLike[str], source: Any, **settings: Any) -> Store:
    """Write activations captured elsewhere into a corpus store at ``out``; returns it, open (docs/interop.md).

    ``source``: a TransformerLens ``run_with_cache`` cache or nnsight saves (a mapping of ``[batch, pos,
    d_model]`` residual-stream tensors; with ``tokens=``, the ids they were run on), a list of them (with a
    list of ``tokens``), or a folder / list of the safetensors files vLLM's ``extract_hidden_states`` writes
    (with ``layer_ids=``, its ``eagle_aux_hidden_state_layer_ids``).  ``settings``: ``model`` (the model they
    came from, as ``ingest_corpus`` names it), ``storage_dtype``, ``segment_size``, ``overwrite``, ``resume``::

        logits, cache = model.run_with_cache(tokens)
        store = actstore.write_corpus("/tmp/s", cache, tokens=tokens, model="tiny-llama")
    """
    from actstore.jobs.import_acts import write_corpus as write

    write(out, source, **settings)
    return open_store(out)
