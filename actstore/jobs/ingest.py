"""The ``actstore ingest`` job: load the data set, then the model, tokenize, capture, write.

Checks that cannot need the model (data set, output location, resume compatibility of the
settings) run before the model is loaded, so bad input fails in a second, not a minute.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace

import torch

from actstore.core.dependencies import transformers_logging
from actstore.core.errors import InvalidSetting, StoreExistsError, StoreLockedError
from actstore.core.lock import LOCK_ENV, active_writer
from actstore.core.ownership import check_root
from actstore.core.progress import say_nothing
from actstore.core.storage import locate
from actstore.core.storage.base import StoreLocation
from actstore.core.writer import creation_interrupted
from actstore.ingest.capture.architectures import architecture_for
from actstore.ingest.capture_store import IngestReport
from actstore.ingest.corpus import capture_positions, check_sources, kept_arrays
from actstore.ingest.corpus_windows import plan_corpus
from actstore.ingest.datasets.common import DatasetResult
from actstore.ingest.datasets.dispatch import load_dataset
from actstore.ingest.datasets.jsonl_stream import JsonlLines, stream_dataset
from actstore.ingest.datasets.text_corpus import Documents, is_corpus_spec, load_documents
from actstore.ingest.lazy_prompts import LazyPrompts
from actstore.ingest.models.base import LoadedModel
from actstore.ingest.models.registry import check_model_name, load_model
from actstore.ingest.pipeline import capture_prompts
from actstore.ingest.ranks import barrier, compact_after_ranks, join_process_group, ranks_writer_lock
from actstore.ingest.settings import CORPUS_KINDS, IngestRequest


def _model_record(loaded: LoadedModel, dtype: str) -> dict[str, str | None]:
    """The manifest's ``model`` record of a loaded model (the tokenizer's hash is added by the capture)."""
    return {
        "name": loaded.name,
        "source": loaded.source,
        "architecture": loaded.architecture,
        "weight_hash": loaded.weight_hash,
        "dtype": dtype,
    }


def _dataset_options(req: IngestRequest) -> dict[str, object]:
    """The data set's filters, as ``load_dataset`` takes them and the manifest records them."""
    keys = ("relations", "limit_per_relation", "template", "keep_object_first")
    return {k: getattr(req, k) for k in keys}


def run_ingest(req: IngestRequest, log: Callable[[str], None] = say_nothing) -> IngestReport:
    """Ingest ``req.dataset`` with ``req.model`` into ``req.out``; torch's thread count is restored after."""
    old = torch.get_num_threads()
    if req.threads > 0:
        torch.set_num_threads(req.threads)
    try:
        return _run_ingest(req, log)
    finally:
        torch.set_num_threads(old)


def _check_out(loc: StoreLocation, req: IngestRequest, grouped: bool) -> IngestRequest:
    """Whether ``req`` may write ``loc`` as asked; run before the writer lock (fail fast, touch
    nothing) and again under it.  A ``--resume`` of a creation killed before its manifest (signed
    remains, see :mod:`actstore.core.ownership`) becomes a fresh create."""
    if req.resume and not loc.exists("manifest.json"):
        if not creation_interrupted(loc):
            check_root(loc, overwrite=False)  # a foreign .creating or a non-empty directory: say so
            raise InvalidSetting("resume", f"no store at {loc.url} to resume")
        return replace(req, resume=False)  # killed while creating: nothing was committed, start afresh
    if not req.resume and (req.rank == 0 or grouped):  # every rank of a group refuses (none waits forever)
        check_root(loc, overwrite=req.overwrite)
    return req


def _load(req: IngestRequest, log: Callable[[str], None]) -> DatasetResult | Documents:
    """The prompts of a target-mode ingest, or the documents of a corpus one (``--positions all``)."""
    if req.positions == "all":
        docs = load_documents(req.dataset)
        log(f"dataset {req.dataset}: {len(docs)} documents")
        return docs
    if req.dataset.startswith(("text:", "hf:")) and is_corpus_spec(req.dataset):
        raise InvalidSetting("dataset", f"{req.dataset} is a text corpus: ingest it with --positions all")
    options = _dataset_options(req)
    # A JSON-lines file without filters streams (read and aligned a segment at a time); others load whole.
    data = stream_dataset(req.dataset, options) or load_dataset(req.dataset, **options)
    if not data.records:
        raise InvalidSetting("dataset", f"{req.dataset}: no records left after filtering")
    skipped = sum(sum(v.values()) for v in data.skipped.values())
    if isinstance(data.records, JsonlLines):
        log(f"dataset {req.dataset}: {len(data.records)} prompts, read and checked a segment at a time")
    else:
        log(
            f"dataset {req.dataset}: {len(data.records)} prompts in {len(data.kept)} relations ({skipped} skipped)"
        )
    return data


def _run_ingest(req: IngestRequest, log: Callable[[str], None]) -> IngestReport:
    check_model_name(req.model)  # a name that cannot load fails before the data set is read
    data = _load(req, log)
    loc = locate(req.out)
    loc.probe()  # a wrong S3 endpoint, credentials or bucket fails here, before the model loads
    grouped = join_process_group(req.rank, req.world_size)
    if not os.environ.get(LOCK_ENV):  # (ranks under a launcher run under its lock: no holder to name)
        try:
            _check_out(loc, req, grouped)
        except StoreExistsError:
            busy = active_writer(loc)  # a refusal while another ingest writes there names that ingest
            if busy is not None:
                raise StoreLockedError(busy) from None
            raise
    # One writer per store, for the whole ingest: a second one fails here with one line naming the holder.
    with ranks_writer_lock(loc, req.rank, req.world_size, grouped, log):
        req = _check_out(loc, req, grouped)
        if grouped:
            barrier()  # every rank has looked before rank 0 can create (or overwrite) the store
        if isinstance(data, Documents):
            report = _ingest_corpus_locked(req, loc, data, log)
        else:
            report = _ingest_locked(req, loc, data, log)
        if req.world_size > 1:  # one snapshot of every rank's segments, written by rank 0 alone
            compact_after_ranks(loc, req.rank, grouped)
        return report


def _ingest_locked(
    req: IngestRequest, loc: StoreLocation, data: DatasetResult, log: Callable[[str], None]
) -> IngestReport:

    if not req.progress:  # --quiet: no "Loading weights" bar from transformers either
        transformers_logging.disable_progress_bar()
    loaded = load_model(req.model, device=req.device, dtype=getattr(torch, req.model_dtype))
    max_len = getattr(loaded.model.config, "max_position_embeddings", None) or getattr(
        loaded.model.config, "n_positions", None
    )
    prompts = LazyPrompts(data.records, loaded.tokenizer, max_length=max_len)  # a segment's tokens at a time
    model_info = _model_record(loaded, req.model_dtype)
    cfg = req.capture_config(
        loc.url,
        {"dataset": req.dataset, **_dataset_options(req), "skipped": data.skipped},
    )
    return capture_prompts(loc, loaded.model, loaded.tokenizer, model_info, prompts, cfg)


def _ingest_corpus_locked(
    req: IngestRequest, loc: StoreLocation, docs: Documents, log: Callable[[str], None]
) -> IngestReport:
    """``--positions all``: windows and policy, what is kept, the size check, then the capture."""

    if not req.progress:
        transformers_logging.disable_progress_bar()
    loaded = load_model(req.model, device=req.device, dtype=getattr(torch, req.model_dtype))
    g = architecture_for(loaded.model).geometry(loaded.model)
    max_len = getattr(loaded.model.config, "max_position_embeddings", None) or getattr(
        loaded.model.config, "n_positions", None
    )
    context = req.context_length or int(max_len or 2048)
    if max_len and context > max_len:
        raise InvalidSetting("context_length", f"{context} is more than the model's {max_len} positions")
    if req.layers is not None and max(req.layers) > g.n_layers:
        raise InvalidSetting(
            "layers",
            f"layer {max(req.layers)} is past the model's {g.n_layers} layers (residual indices 0..{g.n_layers})",
        )
    plan = plan_corpus(
        docs,
        loaded.tokenizer,
        context_length=context,
        keep_special=req.keep_special,
        pack=req.pack,
        separator=req.pack_separator,
    )
    sources = 0 if req.sources is None else context if req.sources == "all" else int(req.sources)
    check_sources(sources, context, req.storage_dtype)
    kinds = req.kinds or CORPUS_KINDS
    kept = kept_arrays(g, kinds, req.layers)
    if sources and not kept["z"]:
        raise InvalidSetting(
            "sources", "needs attn or z among --kinds (the remainder is z minus the kept sources)"
        )
    if not any(kept.values()):
        raise InvalidSetting(
            "layers", f"keeps nothing of {', '.join(kinds)} (mlp, attn and z have layers 0..{g.n_layers - 1})"
        )
    log(
        f"corpus: {len(docs)} documents in {plan.policy['windows']} windows of at most {context} tokens, "
        f"{plan.n_rows} positions kept (special tokens {plan.policy['special']})"
    )
    model_info = _model_record(loaded, req.model_dtype)
    cfg = req.capture_config(loc.url, {"dataset": req.dataset, "kinds": list(kinds)})
    return capture_positions(
        loc, loaded.model, loaded.tokenizer, model_info, docs, plan, kept, cfg, log, sources=sources
    )
