"""Corpus mode (``--positions all``): documents cut into context windows, and which positions are kept.

Each document is tokenized without special tokens (its *content*: ``position`` counts these tokens,
special-token literals in the text included); each window the model sees is the tokens the tokenizer
adds before a text (Llama's and Gemma's BOS; nothing for SmolLM2), at most ``content_per_window``
content tokens, then the tokens it adds after one.  A document longer than that is cut into windows
at fixed content offsets (the cut is recorded: ``window_index`` and ``position`` in the positions table).
With ``pack``, documents are joined by a separator token into one stream first, cut the same way.

The position policy: every position of a window is kept except special tokens (BOS, EOS, padding and
every other id in ``tokenizer.all_special_ids``), unless ``keep_special``; padding is never stored.
Kept positions, in corpus order, are the store's rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from actstore.core.errors import DatasetError, InvalidSetting
from actstore.core.tables import EXAMPLES, POSITIONS, TARGETS, TOKENS
from actstore.ingest.datasets.text_corpus import Documents

TOKENIZE_DOCS = 1024  # documents tokenized at once by plan_corpus


@dataclass(frozen=True)
class Window:
    """One model input: ``ids`` [n] with, per position, its document, its position in that
    document (-1 for added special tokens and separators), its characters and whether it is kept."""

    number: int  # the document's window number (packed: the stream's)
    ids: np.ndarray  # int64 [n]
    document: np.ndarray  # int64 [n]
    position: np.ndarray  # int32 [n]
    char_start: np.ndarray  # int32 [n], -1 for added tokens
    char_end: np.ndarray
    kept: np.ndarray  # bool [n]


@dataclass(frozen=True)
class CorpusPlan:
    """Every window of a corpus and the global row of each kept position."""

    windows: list[Window]
    row_start: np.ndarray  # int64 [n_windows + 1]: first row of each window (cumulative kept counts)
    policy: dict[str, Any]

    @property
    def n_rows(self) -> int:
        return int(self.row_start[-1])

    def windows_of(self, lo: int, hi: int) -> range:
        """The windows holding rows ``lo..hi-1``."""
        first = int(np.searchsorted(self.row_start, lo, side="right")) - 1
        last = int(np.searchsorted(self.row_start, hi, side="left"))
        return range(max(first, 0), min(last, len(self.windows)))


def added_tokens(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids the tokenizer adds before and after a text (found by encoding one with and without)."""
    probe = "a"
    plain = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
    full = list(tokenizer(probe)["input_ids"])
    for k in range(len(full) - len(plain) + 1):
        if full[k : k + len(plain)] == plain:
            return full[:k], full[k + len(plain) :]
    return [], []


def plan_corpus(
    docs: Documents,
    tokenizer: Any,
    *,
    context_length: int,
    keep_special: bool,
    pack: bool,
    separator: str | None,
) -> CorpusPlan:
    """Tokenize ``docs`` and cut them into windows of ``context_length`` tokens (see the module notes)."""
    prefix, suffix = added_tokens(tokenizer)
    per_window = context_length - len(prefix) - len(suffix)
    if per_window < 1:
        raise InvalidSetting(
            "context_length",
            f"{context_length} leaves no room beside the {len(prefix) + len(suffix)} added tokens",
        )
    special = set(int(i) for i in tokenizer.all_special_ids)
    sep_ids: list[int] = []
    if pack:
        text = separator if separator is not None else (tokenizer.eos_token or "")
        sep_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
        if not sep_ids:
            raise InvalidSetting(
                "pack_separator", "the separator is no token (the tokenizer has no EOS: give one)"
            )
    streams: list[
        tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
    ] = []  # ids, document, position, chars
    # tokenized TOKENIZE_DOCS documents at a time, each turned into arrays at once: the tokenizer's
    # Python lists (ids and offset pairs, about 300 bytes a token) never exist for the whole corpus
    for first in range(0, len(docs.texts), TOKENIZE_DOCS):
        part = list(docs.texts[first : first + TOKENIZE_DOCS])
        enc = tokenizer(part, add_special_tokens=False, return_offsets_mapping=True)
        for d, (ids, offs) in enumerate(zip(enc["input_ids"], enc["offset_mapping"]), start=first):
            if not ids:
                raise DatasetError(f"{docs.spec} {docs.where[d]}: the document has no tokens")
            n = len(ids)
            streams.append(
                (
                    np.asarray(ids, np.int64),
                    np.full(n, d, np.int64),
                    np.arange(n, dtype=np.int32),
                    np.asarray(offs, np.int32).reshape(n, 2),
                )
            )
    if pack:
        joined: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        for i, s in enumerate(streams):
            if i:
                k = len(sep_ids)
                sep = (np.asarray(sep_ids, np.int64), np.full(k, -1, np.int64), np.full(k, -1, np.int32))
                joined.append((*sep, np.full((k, 2), -1, np.int32)))
            joined.append(s)
        ids_, doc_, pos_, chars_ = (np.concatenate([p[j] for p in joined]) for j in range(4))
        streams = [(ids_, doc_, pos_, chars_)]
    windows: list[Window] = []
    for ids, doc, pos, chars in streams:
        for w, a in enumerate(range(0, ids.size, per_window)):
            b = min(a + per_window, ids.size)
            windows.append(
                _window(w, ids[a:b], doc[a:b], pos[a:b], chars[a:b], prefix, suffix, special, keep_special)
            )
    counts = np.array([int(w.kept.sum()) for w in windows], dtype=np.int64)
    row_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    if row_start[-1] == 0:
        raise DatasetError(f"{docs.spec}: no position to keep (every token is a special token)")
    policy = {
        "positions": "all",
        "context_length": context_length,
        "special": "kept" if keep_special else "excluded",
        "special_ids": sorted(special),
        "added_before": prefix,
        "added_after": suffix,
        "pack": pack,
        **({"separator_ids": sep_ids} if pack else {}),
        "documents": len(docs),
        "windows": len(windows),
        "cut_documents": 0 if pack else sum(1 for w in windows if w.number == 1),
    }
    return CorpusPlan(windows, row_start, policy)


def _window(
    number: int,
    ids: np.ndarray,
    doc: np.ndarray,
    pos: np.ndarray,
    chars: np.ndarray,
    prefix: list[int],
    suffix: list[int],
    special: set[int],
    keep_special: bool,
) -> Window:
    def added(k: int, fill_doc: int) -> tuple[np.ndarray, ...]:
        return (np.full(k, fill_doc, np.int64), np.full(k, -1, np.int32), np.full((k, 2), -1, np.int32))

    real = doc[doc >= 0]  # (a packed separator's document is -1)
    d0, d1 = (int(real[0]), int(real[-1])) if real.size else (-1, -1)
    pre, post = added(len(prefix), d0), added(len(suffix), d1)  # added tokens: the nearest document's
    all_ids = np.concatenate([np.asarray(prefix, np.int64), ids, np.asarray(suffix, np.int64)])
    all_doc = np.concatenate([pre[0], doc, post[0]])
    all_pos = np.concatenate([pre[1], pos, post[1]])
    all_chars = np.concatenate([pre[2], chars, post[2]])
    if keep_special:
        kept = np.ones(all_ids.size, dtype=bool)
    else:
        kept = ~np.isin(all_ids, np.fromiter(special, np.int64, len(special)))
    return Window(number, all_ids, all_doc, all_pos, all_chars[:, 0], all_chars[:, 1], kept)


def segment_corpus_tables(
    seg: int,
    lo: int,
    rows: dict[str, np.ndarray],
    texts: Sequence[str],
    tokenizer: Any,
    preds: tuple[np.ndarray, np.ndarray, np.ndarray],
    next_ids: np.ndarray,
    source: str,
) -> dict[str, pa.Table]:
    """The examples, tokens, targets and positions shards of one corpus segment.  ``rows``: per
    row, ``document``, ``window_index``, ``position``, ``window_position``, ``token_id``, ``char_start``,
    ``char_end``; every row is an example of its own (``example_id = row``)."""
    n = rows["token_id"].size
    ids = np.arange(lo, lo + n, dtype=np.int64)
    pieces = [str(p) for p in tokenizer.convert_ids_to_tokens(rows["token_id"].tolist())]
    token_text = [
        texts[int(d)][int(a) : int(b)] if b > a else pieces[i]
        for i, (d, a, b) in enumerate(zip(rows["document"], rows["char_start"], rows["char_end"]))
    ]
    none = [""] * n
    minus = np.full(n, -1, np.int32)
    seg_col = np.full(n, seg, np.int32)
    examples = pa.table(
        {
            "example_id": ids,
            "text": token_text,
            "relation_id": none,
            "relation_name": none,
            "subject": none,
            "object": none,
            "split": none,
            "source": [source] * n,
            "subject_start": minus,
            "subject_end": minus,
            "object_start": minus,
            "object_end": minus,
            "n_tokens": np.zeros(n, np.int32),  # no per-token factors: the flat axes are empty
            "segment": seg_col,
            "tok_start": np.zeros(n, np.int64),
            "meta": ["{}"] * n,
        },
        schema=EXAMPLES,
    )
    top, lp, rank = preds
    targets = pa.table(
        {
            "example_id": ids,
            "position": rows["window_position"].astype(np.int32),
            "row": ids,
            "segment": seg_col,
            "seg_row": np.arange(n, dtype=np.int32),
            "src_start": np.zeros(n, np.int64),
            "n_src": np.zeros(n, np.int32),
            "top_token_id": top,
            "top_token": [str(t) for t in tokenizer.convert_ids_to_tokens(top.tolist())],
            "object_token_id": next_ids.astype(np.int32),  # corpus mode: the next token of the window
            "object_logprob": lp,
            "object_rank": rank,
        },
        schema=TARGETS,
    )
    positions = pa.table(
        {
            "example_id": ids,
            "row": ids,
            "document": rows["document"].astype(np.int64),
            "window_index": rows["window_index"].astype(np.int32),
            "position": rows["position"].astype(np.int32),
            "window_position": rows["window_position"].astype(np.int32),
            "token_id": rows["token_id"].astype(np.int32),
            "token": token_text,
            "char_start": rows["char_start"].astype(np.int32),
            "char_end": rows["char_end"].astype(np.int32),
        },
        schema=POSITIONS,
    )
    return {"examples": examples, "tokens": TOKENS.empty_table(), "targets": targets, "positions": positions}
