"""Ingest: run the model once over a corpus with fused capture and write a store.

The corpus is tokenized up front, which fixes every example's row and segment before
the model runs.  Each segment is captured batch by batch; its host arrays go to a writer
thread that compresses, writes and commits them while the next segment runs.  At most
``max_pending`` segments wait for the writer, so memory is bounded by the segment size,
not the corpus size.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from actstore.core._version import __version__
from actstore.core.compact import compact_held
from actstore.core.errors import AlignmentError, DatasetError, RankError
from actstore.core.fs import StoreLocation, locate
from actstore.core.invalid import InvalidSetting
from actstore.core.layout import SEGMENT_ARRAYS, TOKENIZER_DIR
from actstore.core.lock import holding, writer_lock
from actstore.core.manifest import Manifest
from actstore.core.progress import progress_bar
from actstore.core.runs import new_run_id, write_run
from actstore.core.segments import tokenizer_file_name_ok
from actstore.core.tables import EXAMPLES, TARGETS, TOKENS, sha256
from actstore.core.writer import StoreWriter
from actstore.ingest.capture.architectures import Architecture, architecture_for
from actstore.ingest.capture.batches import pad_batch
from actstore.ingest.capture.fused import FusedCapture
from actstore.ingest.lazy_prompts import LazyPrompts
from actstore.ingest.ranks import rank_zero_first
from actstore.ingest.records import PromptRecord, TokenizedPrompt
from actstore.ingest.settings import IngestConfig

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


@dataclass
class IngestReport:
    store: str
    n_examples: int
    segments_written: int
    segments_skipped: int
    seconds: float
    forward_seconds: float


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


def build_manifest(
    model: torch.nn.Module,
    arch: Architecture,
    model_info: dict[str, Any],
    prompts: Sequence[TokenizedPrompt],
    cfg: IngestConfig,
) -> Manifest:
    settings = {
        "padding_side": cfg.padding_side,
        **({"length_batching": True} if cfg.length_batching else {}),
        "corpus_sha256": corpus_sha256(corpus_records(prompts)),
    }
    return store_manifest(model, arch, model_info, len(prompts), settings, cfg)


def store_manifest(
    model: torch.nn.Module,
    arch: Architecture,
    model_info: dict[str, Any],
    n_examples: int,
    ingest: dict[str, Any],
    cfg: IngestConfig,
) -> Manifest:
    """A new store's manifest: the capture settings of ``cfg``, the model's dtype and ``cfg.extra``
    recorded with the mode's own ``ingest`` settings (target prompts or a corpus plan)."""
    settings = {
        "batch_size": cfg.batch_size,
        **ingest,
        "model_dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        **cfg.extra,
    }
    return Manifest(
        geometry=arch.geometry(model),
        model=model_info,
        storage_dtype=cfg.storage_dtype,
        segment_size=cfg.segment_size,
        n_examples=n_examples,
        chunk_rows=cfg.chunk_rows,
        chunk_flat=cfg.chunk_flat,
        chunk_layers=cfg.chunk_layers,
        ingest=settings,
        architecture={"family": arch.name},
        code_version=__version__,
    )


def tokenizer_files(tokenizer: Any) -> dict[str, bytes]:
    """The files ``tokenizer.save_pretrained`` writes, by name ({} for an object that cannot save itself).

    The store keeps them under ``tokenizer/`` so that analyses that need only the tokenizer (MAPS)
    read it from the store (:mod:`actstore.query.select.store_tokenizer`) instead of loading the model package."""
    save = getattr(tokenizer, "save_pretrained", None)
    if save is None:
        return {}
    with tempfile.TemporaryDirectory(prefix="actstore-tokenizer-") as tmp:
        save(tmp)
        out: dict[str, bytes] = {}
        for path in sorted(Path(tmp).iterdir()):
            if not path.is_file() or not tokenizer_file_name_ok(path.name):
                raise ValueError(f"tokenizer.save_pretrained wrote {path.name!r}, which a store cannot hold")
            out[path.name] = path.read_bytes()
    return out


def _with_tokenizer(model_info: dict[str, Any], files: dict[str, bytes]) -> dict[str, Any]:
    """``model_info`` recording the tokenizer files' SHA-256 (``model.tokenizer``)."""
    if not files:
        return model_info
    return {**model_info, "tokenizer": {"files": {name: sha256(data) for name, data in files.items()}}}


def _host(t: torch.Tensor) -> np.ndarray:
    """One device-to-host copy; bfloat16 travels as its uint16 bits."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
        return _host(t).view(np.uint16)
    return t.cpu().numpy()


def to_host(tensors: dict[str, torch.Tensor], names: Sequence[str]) -> dict[str, np.ndarray]:
    """Copy a batch's captured arrays to host memory.

    On CUDA every array goes into a freshly pinned buffer with a non-blocking copy, and the
    stream is synchronised once for the whole batch; on the CPU the tensors already live in
    host memory and are only viewed as numpy.
    """
    if not any(tensors[n].is_cuda for n in names):
        return {n: _host(tensors[n]) for n in names}
    pinned: dict[str, torch.Tensor] = {}
    for n in names:
        src = tensors[n].view(torch.int16) if tensors[n].dtype == torch.bfloat16 else tensors[n]
        buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        buf.copy_(src, non_blocking=True)
        pinned[n] = buf
    torch.cuda.current_stream().synchronize()
    return {
        n: (b.numpy().view(np.uint16) if tensors[n].dtype == torch.bfloat16 else b.numpy())
        for n, b in pinned.items()
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
    ``actstore ingest`` job takes the lock itself and calls :func:`capture_corpus`."""
    loc = locate(cfg.out)
    if cfg.world_size > 1:
        raise RankError(
            "ranks run through the ingest job under one writer lock (actstore.jobs.ingest, ranks_writer_lock)"
        )
    with writer_lock(loc):
        return capture_corpus(loc, model, tokenizer, model_info, prompts, cfg, on_segment=on_segment)


def open_writer(
    loc: StoreLocation,
    manifest: Manifest,
    model: torch.nn.Module,
    arch: Architecture,
    files: dict[str, bytes],
    cfg: IngestConfig,
) -> tuple[StoreWriter, set[int], list[int], list[int]]:
    """The store's writer (resumed, or created by rank 0 with the weights and ``files`` while the other
    ranks wait: :mod:`actstore.ingest.ranks`), the committed segments, this rank's segments and those
    of them not yet committed."""
    if cfg.resume:
        writer = StoreWriter.resume(loc, manifest)
    else:

        def create() -> StoreWriter:
            weights, attrs = arch.weights(model)
            return StoreWriter.create(loc, manifest, weights, attrs, overwrite=cfg.overwrite, files=files)

        writer = rank_zero_first(
            create, lambda: StoreWriter.resume(loc, manifest), cfg.rank, cfg.world_size, loc
        )
    done = writer.committed()
    mine = [s for s in range(manifest.n_segments) if s % cfg.world_size == cfg.rank]
    return writer, done, mine, [s for s in mine if s not in done]


def capture_corpus(
    loc: StoreLocation,
    model: torch.nn.Module,
    tokenizer: Any,
    model_info: dict[str, Any],
    prompts: Sequence[TokenizedPrompt],
    cfg: IngestConfig,
    *,
    on_segment: Callable[[int], None] | None = None,
) -> IngestReport:
    """Capture ``prompts`` into the store at ``loc``, whose writer lock the caller holds (this
    process, or the launcher of its ranks: :func:`actstore.ingest.ranks.ranks_writer_lock`)."""
    if not holding(loc.url):
        raise RankError(
            f"the writer lock of {loc.url} is not held (take it with actstore.core.lock.writer_lock)"
        )
    if not prompts:
        raise InvalidSetting("dataset", "the corpus is empty: no prompts to ingest")
    arch = architecture_for(model)
    tok_files = tokenizer_files(tokenizer)
    model_info = _with_tokenizer(model_info, tok_files)
    manifest = build_manifest(model, arch, model_info, prompts, cfg)
    if not cfg.resume:  # the first segment is read and aligned before the store is touched
        _ = prompts[0 : cfg.segment_size]
    files = (
        {f"{TOKENIZER_DIR}/{name}": data for name, data in tok_files.items()}
        if "tokenizer" in model_info
        else {}
    )
    writer, done, mine, todo = open_writer(loc, manifest, model, arch, files, cfg)
    device = torch.device(cfg.device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    started = time.time()
    forward_s = 0.0
    pending: list[Future[Any]] = []
    written = 0
    n_todo = sum(min(cfg.segment_size, len(prompts) - s * cfg.segment_size) for s in todo)
    bar = _progress(n_todo, cfg.progress and cfg.rank == 0)
    with FusedCapture(model, arch, cfg.storage_dtype) as capture, ThreadPoolExecutor(max_workers=1) as pool:
        for seg in todo:
            lo = seg * cfg.segment_size
            seg_prompts = _segment_prompts(prompts, seg, lo, cfg.segment_size, len(done) + written)
            object_ids = _object_token_ids(tokenizer, seg_prompts)
            parts: dict[str, list[np.ndarray]] = {
                k: [] for k in (*SEGMENT_ARRAYS, "top", "obj_lp", "obj_rank")
            }
            order = forward_order(seg_prompts, cfg.length_batching)
            for b0 in range(0, len(seg_prompts), cfg.batch_size):
                members = order[b0 : b0 + cfg.batch_size]
                chunk = [seg_prompts[i] for i in members]
                batch = pad_batch(chunk, pad_id, cfg.padding_side, device)
                t0 = time.perf_counter()
                out = capture.run(batch.input_ids, batch.attention_mask, batch.index, batch.position_ids)
                for name, host in to_host(out, SEGMENT_ARRAYS).items():
                    parts[name].append(host)
                top, lp, rank = _predictions(out["logits"], object_ids[members])
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
            while len(pending) >= 2:  # backpressure: bounded host memory
                pending.pop(0).result()
            pending.append(pool.submit(_write, writer, seg, lo, arrays, tables, on_segment))
            written += 1
            if cfg.world_size == 1 and cfg.compact_every and written % cfg.compact_every == 0:
                # (the pool's one thread runs it after the writes before it: a snapshot of committed segments)
                pending.append(pool.submit(compact_held, loc, full=False, log=_quiet))
        for f in pending:
            f.result()
    bar.close()
    _write_run(writer, cfg, manifest, started, len(todo))
    if cfg.world_size == 1:  # ranks: rank 0 compacts once every rank is done (actstore.jobs.ingest)
        compact_held(loc, full=True, log=_quiet)
    return IngestReport(
        cfg.out, len(prompts), len(todo), len(mine) - len(todo), time.time() - started, forward_s
    )


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


def _quiet(message: str) -> None:
    pass


def _write(
    writer: StoreWriter,
    seg: int,
    lo: int,
    arrays: dict[str, np.ndarray],
    tables: dict[str, pa.Table],
    on_segment: Callable[[int], None] | None,
) -> None:
    writer.write_segment(seg, lo, arrays, tables)
    if on_segment is not None:
        on_segment(seg)


def _write_run(
    writer: StoreWriter, cfg: IngestConfig, manifest: Manifest, started: float, n_segments: int
) -> None:
    config = {k: v for k, v in asdict(cfg).items() if k != "extra"} | {"extra": cfg.extra}
    write_run(
        writer,
        new_run_id("ingest"),
        "ingest",
        started,
        config,
        segments_written=n_segments,
        rank=cfg.rank,
        world_size=cfg.world_size,
    )


def _object_token_ids(tokenizer: Any, prompts: Sequence[TokenizedPrompt]) -> np.ndarray:
    """First token id of " " + object for each prompt of a segment (-1 without an object)."""
    objects = [p.record.object for p in prompts]
    out = np.full(len(prompts), -1, dtype=np.int64)
    idx = [i for i, o in enumerate(objects) if o]
    if idx:
        enc = tokenizer([" " + objects[i] for i in idx], add_special_tokens=False)["input_ids"]
        for i, ids in zip(idx, enc):
            if ids:
                out[i] = ids[0]
    return out


def _predictions(logits: torch.Tensor, object_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = logp.argmax(-1).cpu().numpy().astype(np.int32)
    obj = torch.as_tensor(object_ids, device=logp.device)
    safe = obj.clamp(min=0)
    lp = logp.gather(1, safe[:, None])[:, 0]
    rank = (logp > lp[:, None]).sum(-1)
    has = obj >= 0
    lp_np = torch.where(has, lp, torch.full_like(lp, float("nan"))).cpu().numpy().astype(np.float32)
    rank_np = torch.where(has, rank, torch.full_like(rank, -1)).cpu().numpy().astype(np.int32)
    return top, lp_np, rank_np


def segment_tables(
    seg: int,
    lo: int,
    prompts: Sequence[TokenizedPrompt],
    tokenizer: Any,
    preds: tuple[np.ndarray, np.ndarray, np.ndarray],
    object_ids: np.ndarray,
) -> dict[str, pa.Table]:
    """The examples, tokens and targets shards of one segment."""
    n = len(prompts)
    n_tok = np.array([p.target_position + 1 for p in prompts], dtype=np.int64)
    tok_start = np.concatenate([[0], np.cumsum(n_tok)[:-1]]).astype(np.int64)
    ids = np.arange(lo, lo + n, dtype=np.int64)

    def span(s: tuple[int, int] | None, i: int) -> int:
        return -1 if s is None else int(s[i])

    recs = [p.record for p in prompts]
    examples = pa.table(
        {
            "example_id": ids,
            "text": [r.text for r in recs],
            "relation_id": [r.relation_id for r in recs],
            "relation_name": [r.relation_name for r in recs],
            "subject": [r.subject for r in recs],
            "object": [r.object for r in recs],
            "split": [r.split for r in recs],
            "source": [r.source for r in recs],
            "subject_start": [span(p.subject_tokens, 0) for p in prompts],
            "subject_end": [span(p.subject_tokens, 1) for p in prompts],
            "object_start": [span(p.object_tokens, 0) for p in prompts],
            "object_end": [span(p.object_tokens, 1) for p in prompts],
            "n_tokens": n_tok.astype(np.int32),
            "segment": np.full(n, seg, dtype=np.int32),
            "tok_start": tok_start,
            "meta": [json.dumps(r.meta, sort_keys=True, default=str) for r in recs],
        },
        schema=EXAMPLES,
    )
    tok_rows: dict[str, list[Any]] = {k: [] for k in TOKENS.names}
    for eid, p in zip(ids.tolist(), prompts):
        n_p = p.target_position + 1
        pieces = tokenizer.convert_ids_to_tokens(p.input_ids[:n_p])
        for pos in range(n_p):
            cs, ce = p.offsets[pos]
            role = "other"
            if p.subject_tokens and p.subject_tokens[0] <= pos < p.subject_tokens[1]:
                role = "subject"
            elif p.object_tokens and p.object_tokens[0] <= pos < p.object_tokens[1]:
                role = "object"
            tok_rows["example_id"].append(eid)
            tok_rows["position"].append(pos)
            tok_rows["token_id"].append(p.input_ids[pos])
            tok_rows["token"].append(p.record.text[cs:ce] if ce > cs else str(pieces[pos]))
            tok_rows["role"].append(role)
            tok_rows["char_start"].append(cs)
            tok_rows["char_end"].append(ce)
    tokens = pa.table(tok_rows, schema=TOKENS)
    top, lp, rank = preds
    targets = pa.table(
        {
            "example_id": ids,
            "position": (n_tok - 1).astype(np.int32),
            "row": ids,
            "segment": np.full(n, seg, dtype=np.int32),
            "seg_row": np.arange(n, dtype=np.int32),
            "src_start": tok_start,
            "n_src": n_tok.astype(np.int32),
            "top_token_id": top,
            "top_token": [str(t) for t in tokenizer.convert_ids_to_tokens(top.tolist())],
            "object_token_id": object_ids.astype(np.int32),
            "object_logprob": lp,
            "object_rank": rank,
        },
        schema=TARGETS,
    )
    return {"examples": examples, "tokens": tokens, "targets": targets}


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    return progress_bar(total=total, unit="prompt", desc="ingest")
