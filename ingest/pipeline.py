"""Target mode's ingest: each prompt's last token is its target, every token before it a source.

The prompts are tokenized up front (or lazily, :class:`~actstore.ingest.lazy_prompts.LazyPrompts`),
which fixes every example's row and segment before the model runs.  A segment's prompts go through the
model batch by batch (``length_batching``: sorted by length, put back in corpus order after); the
segment loop and the writer thread are :func:`actstore.ingest.capture_store.capture_segments`.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from actstore.core.errors import AlignmentError, DatasetError, InvalidSetting, RankError
from actstore.core.layout import SEGMENT_ARRAYS
from actstore.core.lock import writer_lock
from actstore.core.storage import locate
from actstore.core.storage.base import StoreLocation
from actstore.ingest.capture.batches import pad_batch
from actstore.ingest.capture.fused import FusedCapture
from actstore.ingest.capture.host import predictions, to_host
from actstore.ingest.capture_store import (
    CapturedSegment,
    CaptureMode,
    IngestReport,
    capture_segments,
    require_lock,
)
from actstore.ingest.lazy_prompts import LazyPrompts
from actstore.ingest.prompt_tables import object_token_ids, segment_tables
from actstore.ingest.records import PromptRecord, TokenizedPrompt
from actstore.ingest.settings import IngestConfig, prompt_layout

FLAT_ARRAYS = ("attn", "v")  # one entry per stored token of each example, examples concatenated


def forward_order(prompts: Sequence[TokenizedPrompt], by_length: bool) -> np.ndarray:
    """The order in which a segment's prompts go through the model: [n] indices into ``prompts``.

    Corpus order, or (``by_length``) sorted by stored token count, ties in corpus order, so that
    each batch is padded only to the longest of prompts of similar length."""
    n = len(prompts)
    if not by_length:
        return np.arange(n, dtype=np.int64)
    lengths = np.array([p.target_position + 1 for p in prompts], dtype=np.int64)
    return np.argsort(lengths, kind="stable").astype(np.int64)


def corpus_order(data: np.ndarray, order: np.ndarray, lengths: np.ndarray | None = None) -> np.ndarray:
    """Rows captured in ``order`` (see :func:`forward_order`) put back in corpus order.

    ``data``: [n, ...] one row per prompt, or (``lengths`` [n] given, in corpus order) the flat
    [sum(lengths), ...] concatenation of each prompt's ``lengths[i]`` entries in capture order.
    Returns ``data`` itself when ``order`` is the identity."""
    if np.array_equal(order, np.arange(order.size)):
        return data
    if lengths is None:
        out = np.empty_like(data)
        out[order] = data
        return out
    captured_len = lengths[order]  # entries per captured row, in capture order
    captured_start = np.cumsum(captured_len) - captured_len
    start = np.empty_like(captured_start)
    start[order] = captured_start  # where corpus row i's entries begin in ``data``
    # Gather index: for corpus row i, start[i] .. start[i] + lengths[i] - 1, rows concatenated.
    base = np.repeat(start - (np.cumsum(lengths) - lengths), lengths)
    return data[base + np.arange(int(lengths.sum()), dtype=np.int64)]


def corpus_records(prompts: Sequence[TokenizedPrompt]) -> Sequence[PromptRecord]:
    """The records behind ``prompts`` (a :class:`LazyPrompts`'s own, without tokenizing any)."""
    return prompts.records if isinstance(prompts, LazyPrompts) else [p.record for p in prompts]


def corpus_sha256(records: Sequence[PromptRecord]) -> str:
    """The corpus fingerprint the manifest records (``--resume`` refuses another corpus): the SHA-256
    of a streamed file's bytes (its ``fingerprint``, digested once when it was indexed), else of the
    records' fields.  Tokens are not hashed: the tokenizer's identity is the manifest's
    ``model.tokenizer`` (its files' hashes), so nothing is tokenized for the fingerprint."""
    fingerprint = getattr(records, "fingerprint", None)
    if isinstance(fingerprint, str):
        return fingerprint
    h = hashlib.sha256()
    for r in records:
        fields: list[object] = [r.text, r.relation_id, r.relation_name, r.subject, r.object, r.subject_span]
        fields += [r.object_span, r.target, r.source, r.split]
        h.update(json.dumps(fields).encode())
        h.update(json.dumps(r.meta, sort_keys=True, default=str).encode())
    return h.hexdigest()


def prompt_settings(prompts: Sequence[TokenizedPrompt], cfg: IngestConfig) -> dict[str, Any]:
    """Target mode's own ``ingest`` settings in the manifest (with the corpus fingerprint)."""
    return {
        "padding_side": cfg.padding_side,
        **({"length_batching": True} if cfg.length_batching else {}),
        "corpus_sha256": corpus_sha256(corpus_records(prompts)),
    }


def ingest_prompts(
    model: torch.nn.Module,
    tokenizer: Any,
    model_info: dict[str, Any],
    prompts: Sequence[TokenizedPrompt],
    cfg: IngestConfig,
    *,
    on_segment: Callable[[int], None] | None = None,
) -> IngestReport:
    """Capture ``prompts`` into the store ``cfg.out`` (create, or resume an interrupted ingest),
    holding its writer lock (:mod:`actstore.core.lock`) throughout: the library's way in.  The
    ``actstore ingest`` job takes the lock itself and calls :func:`capture_prompts`."""
    loc = locate(cfg.out)
    if cfg.world_size > 1:
        raise RankError(
            "ranks run through the ingest job under one writer lock (actstore.jobs.ingest, ranks_writer_lock)"
        )
    with writer_lock(loc):
        return capture_prompts(loc, model, tokenizer, model_info, prompts, cfg, on_segment=on_segment)


def capture_prompts(
    loc: StoreLocation,
    model: torch.nn.Module,
    tokenizer: Any,
    model_info: dict[str, Any],
    prompts: Sequence[TokenizedPrompt],
    cfg: IngestConfig,
    *,
    on_segment: Callable[[int], None] | None = None,
) -> IngestReport:
    """Capture ``prompts`` (target mode: each prompt's last token is its target) into the store at
    ``loc``, whose writer lock the caller holds (this process, or the launcher of its ranks:
    :func:`actstore.ingest.ranks.ranks_writer_lock`).  Corpus mode is
    :func:`actstore.ingest.corpus.capture_positions`."""
    require_lock(loc)
    if not prompts:
        raise InvalidSetting("dataset", "the corpus is empty: no prompts to ingest")
    cfg = prompt_layout(cfg)
    device = torch.device(cfg.device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    S = cfg.segment_size

    def first_segment() -> None:
        if not cfg.resume:  # the first segment is read and aligned before the store is touched
            _ = prompts[0:S]

    def capture_segment(capture: FusedCapture, seg: int, n_before: int, bar: Any) -> CapturedSegment:
        lo = seg * S
        seg_prompts = _segment_prompts(prompts, seg, lo, S, n_before)
        object_ids = object_token_ids(tokenizer, seg_prompts)
        parts: dict[str, list[np.ndarray]] = {k: [] for k in (*SEGMENT_ARRAYS, "top", "obj_lp", "obj_rank")}
        order = forward_order(seg_prompts, cfg.length_batching)
        forward_s = 0.0
        for b0 in range(0, len(seg_prompts), cfg.batch_size):
            members = order[b0 : b0 + cfg.batch_size]
            chunk = [seg_prompts[i] for i in members]
            batch = pad_batch(chunk, pad_id, cfg.padding_side, device)
            t0 = time.perf_counter()
            out = capture.run(batch.input_ids, batch.attention_mask, batch.index, batch.position_ids)
            for name, host in to_host(out, SEGMENT_ARRAYS).items():
                parts[name].append(host)
            top, lp, rank = predictions(out["logits"], object_ids[members])
            parts["top"].append(top)
            parts["obj_lp"].append(lp)
            parts["obj_rank"].append(rank)
            forward_s += time.perf_counter() - t0
            bar.update(len(chunk))
        n_tok = np.array([p.target_position + 1 for p in seg_prompts], dtype=np.int64)
        arrays = {
            k: corpus_order(np.concatenate(parts[k]), order, n_tok if k in FLAT_ARRAYS else None)
            for k in SEGMENT_ARRAYS
        }
        preds = (
            corpus_order(np.concatenate(parts["top"]), order),
            corpus_order(np.concatenate(parts["obj_lp"]), order),
            corpus_order(np.concatenate(parts["obj_rank"]), order),
        )
        tables = segment_tables(seg, lo, seg_prompts, tokenizer, preds, object_ids)
        return CapturedSegment(arrays, tables, forward_s)

    settings = prompt_settings(prompts, cfg)
    mode = CaptureMode(len(prompts), settings, "prompt", capture_segment, check=first_segment)
    return capture_segments(loc, model, tokenizer, model_info, cfg, mode, on_segment=on_segment)


def _segment_prompts(
    prompts: Sequence[TokenizedPrompt], seg: int, lo: int, size: int, n_committed: int
) -> Sequence[TokenizedPrompt]:
    """Segment ``seg``'s prompts, read and aligned now; a record that cannot be stops the ingest with
    its own one-line error, saying what the store holds (the segments committed before stay valid)."""
    try:
        return prompts[lo : lo + size]
    except (DatasetError, AlignmentError) as e:
        if not n_committed:
            raise
        raise type(e)(
            f"{e} (in segment {seg}; the ingest stopped there: the {n_committed} segment(s) written "
            "before it are committed and valid, the store is incomplete)"
        ) from None
