"""Corpus-mode capture (``--positions all``): ``z``, ``mlp`` and ``resid`` at every kept position.

Rows are the kept positions of :class:`~actstore.ingest.corpus_windows.CorpusPlan`, in corpus order;
segment ``s`` holds rows ``s * segment_size ..`` (``--segment-size`` counts positions here).  The
windows go through the model in fixed global batches (windows ``k * batch_size ..``), every kept
position a target of the fused capture; a segment takes its rows from the batches holding them, and
the last one, when it holds rows of the next segment too, is kept for that segment, so a window runs
once in an uninterrupted ingest.  Since a batch is the same whichever segment asks for it, a resumed
ingest, or a rank that recomputes a batch its neighbour also ran, writes the same bytes.  The per-source factors (``attn``, ``v``) are not captured:
their flat axes are empty.  Kinds and layers that ``--kinds`` / ``--layers`` do not keep are written
as zero chunks (a few bytes each after compression) and refused on read
(:func:`actstore.query.select.features.check_corpus_kind`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from actstore.core.errors import InvalidSetting, StorageError
from actstore.core.layout import SEGMENT_ARRAYS
from actstore.core.manifest import Geometry, Manifest, read_manifest
from actstore.core.storage.base import StoreLocation
from actstore.ingest.capture.architectures import architecture_for
from actstore.ingest.capture.fused import BatchIndex, FusedCapture
from actstore.ingest.capture.host import predictions, to_host
from actstore.ingest.capture_store import (
    CapturedSegment,
    CaptureMode,
    IngestReport,
    capture_segments,
    quiet,
    require_lock,
)
from actstore.ingest.corpus_windows import CorpusPlan, segment_corpus_tables
from actstore.ingest.datasets.text_corpus import Documents
from actstore.ingest.settings import IngestConfig

BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
FLAT = ("attn", "v")  # empty in corpus mode: no sources are stored
ROW_FIELDS = ("document", "window_index", "position", "window_position", "token_id", "char_start", "char_end")


def kept_arrays(g: Geometry, kinds: Sequence[str], layers: Sequence[int] | None) -> dict[str, list[int]]:
    """The layers kept of each stored array: ``z`` for ``attn`` and ``z``, ``mlp``, ``resid``
    (residual indices 0..L: a layer number ``L`` keeps the last residual only)."""
    every = list(range(g.n_layers + 1))
    chosen = every if layers is None else sorted(set(layers))
    out = {"z": [], "mlp": [], "resid": []}  # type: dict[str, list[int]]
    if "attn" in kinds or "z" in kinds:
        out["z"] = [x for x in chosen if x < g.n_layers]
    if "mlp" in kinds:
        out["mlp"] = [x for x in chosen if x < g.n_layers]
    if "resid" in kinds:
        out["resid"] = list(chosen)
    return out


EXACT_OFFSETS = {"float32": 1 << 24, "float16": 2048, "bfloat16": 256}  # integers a dtype holds exactly


def check_sources(sources: int, context: int, storage_dtype: str) -> None:
    """``--sources K``: K at most the window (``context`` tokens), and every row offset (< context)
    exact in the storage dtype, or one line before anything is written."""
    if sources > context:
        raise InvalidSetting(
            "sources", f"{sources} sources is more than the window's {context} tokens (--context-length)"
        )
    if sources and context > EXACT_OFFSETS[storage_dtype]:
        raise InvalidSetting(
            "sources",
            f"source offsets up to {context - 1} are not exact in {storage_dtype} (at most "
            f"{EXACT_OFFSETS[storage_dtype]} tokens a window; use a shorter --context-length or --storage-dtype float32)",
        )


def bytes_per_row(g: Geometry, kept: dict[str, list[int]], storage_dtype: str) -> int:
    """Uncompressed bytes one position costs: per kept layer, ``H * d_head`` values of ``z``, ``d_mlp``
    of ``mlp``, ``d_model`` of ``resid``."""
    per_layer = {"z": g.n_heads * g.d_head, "mlp": g.d_mlp, "resid": g.d_model}
    return BYTES[storage_dtype] * sum(per_layer[k] * len(v) for k, v in kept.items())


def stored_bytes_per_row(g: Geometry, kept: dict[str, list[int]], storage_dtype: str, sources: int) -> int:
    """Uncompressed bytes one position costs with ``--sources K``: :func:`bytes_per_row`, plus per kept
    attention layer ``2K`` values a head (weights, offsets) and the value vectors."""
    per_row = bytes_per_row(g, kept, storage_dtype)
    if sources:
        per_row += BYTES[storage_dtype] * len(kept["z"]) * (2 * sources * g.n_heads + g.n_kv_heads * g.d_head)
    return per_row


SEGMENT_BYTES = 16 << 20  # stored bytes a corpus segment, about (one commit: marker, tables, digests)
CHUNK_BYTES = 256 << 10  # bytes a chunk of the widest kept array, about (Zarr's advice: 100s of KB to 1 MB)
MIN_CHUNK_ROWS = 32  # (the prompt stores' chunk)


def corpus_segment_rows(row_bytes: int, batch_size: int) -> int:
    """Positions a corpus segment holds by default: about :data:`SEGMENT_BYTES` of stored activations
    (``row_bytes`` a position), a multiple of 256 from 256 to 16,384, rounded up to whole batches."""
    rows = min(16384, max(256, SEGMENT_BYTES // max(1, row_bytes) // 256 * 256))
    return -(-rows // batch_size) * batch_size


def corpus_chunk_rows(
    g: Geometry, kept: dict[str, list[int]], storage_dtype: str, chunk_layers: int, segment: int
) -> int:
    """Rows a chunk of a corpus store's ``z`` / ``mlp`` / ``resid`` by default: a chunk (``chunk_layers``
    layers of one array; 0: all of them) of the widest kept array about :data:`CHUNK_BYTES`, the power
    of two at or below it, at least 32 and at most the segment.  A corpus is read by the thousand
    positions (the loader, exports, scans); 32-row chunks made a tiny model's chunk 4 KB, one file each."""
    per_layer = {"z": g.n_heads * g.d_head, "mlp": g.d_mlp, "resid": g.d_model}
    depth = {"z": g.n_layers, "mlp": g.n_layers, "resid": g.n_layers + 1}
    widest = (
        max((per_layer[k] * (chunk_layers or depth[k]) for k, v in kept.items() if v), default=g.d_model)
        * BYTES[storage_dtype]
    )
    rows = 1 << max(0, (CHUNK_BYTES // widest).bit_length() - 1)
    return max(1, min(segment, max(MIN_CHUNK_ROWS, rows)))


def corpus_layout(
    cfg: IngestConfig, g: Geometry, kept: dict[str, list[int]], sources: int, stored: Manifest | None
) -> IngestConfig:
    """``cfg`` with its automatic (0) ``segment_size`` and ``chunk_rows`` decided for a corpus store:
    a resumed store's own (``stored``: its manifest; a store written before these defaults keeps its
    256-position segments and 32-row chunks), else :func:`corpus_segment_rows` and :func:`corpus_chunk_rows`.
    A function of the settings and the model alone, so every rank and every resume decides the same."""
    if stored is not None:
        seg, chunk = cfg.segment_size or stored.segment_size, cfg.chunk_rows or stored.chunk_rows
    else:
        row = stored_bytes_per_row(g, kept, cfg.storage_dtype, sources)
        seg = cfg.segment_size or corpus_segment_rows(row, cfg.batch_size)
        chunk = cfg.chunk_rows or corpus_chunk_rows(g, kept, cfg.storage_dtype, cfg.chunk_layers, seg)
    return replace(cfg, segment_size=seg, chunk_rows=chunk)


def free_bytes(loc: StoreLocation) -> int | None:
    """Free bytes where a local store would be written (None for object storage)."""
    return loc.free_bytes()


def capture_positions(
    loc: StoreLocation,
    model: torch.nn.Module,
    tokenizer: Any,
    model_info: dict[str, Any],
    docs: Documents,
    plan: CorpusPlan,
    kept: dict[str, list[int]],
    cfg: IngestConfig,
    log: Any = quiet,
    sources: int = 0,
) -> IngestReport:
    """Capture every kept position of ``plan`` into the store at ``loc`` (writer lock held).

    ``sources`` > 0 (``--sources K``): at the layers of ``kept["z"]``, each position's top-K sources
    per head (weights and row offsets in ``attn``, ``2K`` entries a row) and its value vectors (``v``,
    one entry a row); see docs/format.md, Corpus stores with sources."""
    require_lock(loc)
    g = architecture_for(model).geometry(model)
    stored = read_manifest(loc) if cfg.resume and loc.exists("manifest.json") else None
    cfg = corpus_layout(cfg, g, kept, sources, stored)
    device = torch.device(cfg.device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    S, B = cfg.segment_size, cfg.batch_size

    def check_space() -> None:
        per_row = stored_bytes_per_row(g, kept, cfg.storage_dtype, sources)
        estimate = per_row * plan.n_rows
        log(
            f"size estimate: {plan.n_rows} positions x {per_row} bytes ({', '.join(f'{k} {len(v)} layers' for k, v in kept.items() if v)}, "
            f"{cfg.storage_dtype}) = {estimate / 1e9:.3f} GB before compression"
        )
        free = free_bytes(loc)
        if not cfg.resume and free is not None and estimate > free:
            raise StorageError(
                f"{loc.url}: the store needs about {estimate / 1e9:.2f} GB and only {free / 1e9:.2f} GB are free; "
                "keep fewer --kinds or --layers, or a smaller corpus"
            )

    carry: _Captured | None = None  # the last global batch, when it holds rows of the next segment

    def run_batch(capture: FusedCapture, number: int) -> _Captured:
        wins = range(number * B, min((number + 1) * B, len(plan.windows)))
        t0 = time.perf_counter()
        meta: dict[str, list[np.ndarray]] = {n: [] for n in ROW_FIELDS}
        ids, mask, index, next_ids = _batch(plan, wins, pad_id, device, meta, sources, kept.get("z", []))
        out = capture.run(ids, mask, index, position_ids(mask))
        host = to_host(out, SEGMENT_ARRAYS)
        arrays = {n: (a[:, kept[n]] if n in kept else a) for n, a in host.items()}  # kept layers only
        top, lp, rank = predictions(out["logits"], next_ids)
        cols = {n: np.concatenate(v) for n, v in meta.items()} | {
            "top": top,
            "lp": lp,
            "rank": rank,
            "next": next_ids,
        }
        return _Captured(
            number, int(plan.row_start[wins.start]), arrays, cols, time.perf_counter() - t0, sources
        )

    def capture_segment(capture: FusedCapture, seg: int, n_before: int, bar: Any) -> CapturedSegment:
        nonlocal carry
        lo, hi = seg * S, min((seg + 1) * S, plan.n_rows)
        wins = plan.windows_of(lo, hi)
        pieces: list[_Captured] = []
        forward_s = 0.0
        for number in range(wins.start // B, (wins.stop - 1) // B + 1):
            if carry is not None and carry.number == number:
                cap = carry
            else:
                cap = run_batch(capture, number)
                forward_s += cap.seconds
            pieces.append(cap.rows(lo, hi))
            carry = cap if cap.end > hi else None
        bar.update(hi - lo)
        arrays = {n: np.concatenate([p.arrays[n] for p in pieces]) for n in SEGMENT_ARRAYS}
        cols = {n: np.concatenate([p.cols[n] for p in pieces]) for n in pieces[0].cols}
        rows = {n: cols[n] for n in ROW_FIELDS}
        preds = (cols["top"], cols["lp"], cols["rank"])
        tables = segment_corpus_tables(seg, lo, rows, docs.texts, tokenizer, preds, cols["next"], docs.spec)
        return CapturedSegment(arrays, tables, forward_s)

    settings = {"padding_side": "right", "corpus_sha256": docs.sha256, **plan.policy, "kept": kept}
    if sources:
        settings["sources"] = sources
    mode = CaptureMode(
        plan.n_rows,
        settings,
        "position",
        capture_segment,
        check=check_space,  # (the arrays go to the writer with their kept layers only)
    )
    return capture_segments(loc, model, tokenizer, model_info, cfg, mode)


@dataclass(frozen=True)
class _Captured:
    """Global batch ``number`` (windows ``number * batch_size ..``) captured: its kept positions are
    rows ``start ..`` in order; ``arrays`` holds the kept layers, ``cols`` the per-row columns."""

    number: int
    start: int
    arrays: dict[str, np.ndarray]
    cols: dict[str, np.ndarray]
    seconds: float  # its forward pass (capture, host copy and predictions)
    sources: int = 0  # K of --sources: ``attn`` holds 2K entries a row, ``v`` one

    @property
    def end(self) -> int:
        return self.start + int(self.cols["token_id"].size)

    def rows(self, lo: int, hi: int) -> _Captured:
        """Its rows in ``lo .. hi-1`` (the flat ``attn`` and ``v`` are empty in corpus mode without
        sources; with them, ``2K`` and one entries a row)."""
        a, b = max(lo, self.start) - self.start, max(min(hi, self.end), lo) - self.start
        per = {"attn": 2 * self.sources, "v": 1 if self.sources else 0}
        arrays = {
            n: (v[a:b] if n not in FLAT else v[a * per[n] : b * per[n]]) for n, v in self.arrays.items()
        }
        cols = {n: v[a:b] for n, v in self.cols.items()}
        return _Captured(self.number, self.start + a, arrays, cols, self.seconds, self.sources)


def _batch(
    plan: CorpusPlan,
    wins: Sequence[int],
    pad_id: int,
    device: torch.device,
    meta: dict[str, list[np.ndarray]],
    sources: int = 0,
    source_layers: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor, BatchIndex, np.ndarray]:
    """One right-padded batch of windows, its targets their kept positions (in row order), and the next
    token id of each target (-1 at a window's end); with ``sources``, each kept position's rank in its
    window (-1 elsewhere) and the value vectors of every target row."""
    T = max(plan.windows[w].ids.size for w in wins)
    ids = torch.full((len(wins), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(wins), T), dtype=torch.long)
    rank = torch.full((len(wins), T), -1, dtype=torch.long)
    tb: list[np.ndarray] = []
    tp: list[np.ndarray] = []
    nxt: list[np.ndarray] = []
    for b, w in enumerate(wins):
        win = plan.windows[w]
        n = win.ids.size
        ids[b, :n] = torch.from_numpy(win.ids)
        mask[b, :n] = 1
        pos = np.flatnonzero(win.kept)
        rank[b, torch.from_numpy(pos)] = torch.arange(pos.size)
        tb.append(np.full(pos.size, b, np.int64))
        tp.append(pos)
        following = np.append(win.ids, -1)
        nxt.append(following[pos + 1])
        for name, values in (
            ("document", win.document[pos]),
            ("window_index", np.full(pos.size, win.number, np.int32)),
            ("position", win.position[pos]),
            ("window_position", pos.astype(np.int32)),
            ("token_id", win.ids[pos]),
            ("char_start", win.char_start[pos]),
            ("char_end", win.char_end[pos]),
        ):
            meta[name].append(values)
    empty = torch.zeros(0, dtype=torch.long, device=device)
    target_b = torch.from_numpy(np.concatenate(tb)).to(device)
    target_pos = torch.from_numpy(np.concatenate(tp)).to(device)
    index = BatchIndex(
        target_b=target_b,
        target_pos=target_pos,
        src_t=empty,
        src_pos=empty,
        tok_b=target_b if sources else empty,
        tok_pos=target_pos if sources else empty,
        sources=sources,
        src_rank=rank.to(device) if sources else None,
        source_layers=tuple(source_layers) if sources else (),
    )
    return ids.to(device), mask.to(device), index, np.concatenate(nxt).astype(np.int64)


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Each window's own positions 0.. (right padding: padded slots get the last one)."""
    return (torch.cumsum(mask, 1) - 1).clamp(min=0)
