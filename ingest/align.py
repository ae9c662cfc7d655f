"""Align character-level records to a tokenizer: token ids, target position, token spans.

Works with any fast (Rust-backed) tokenizer, which reports each token's character
offsets.  Special tokens (BOS, CLS, SEP, ...) carry no characters (offset ``(0, 0)``):
they are never the target and never part of a span.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from actstore.core.errors import AlignmentError
from actstore.ingest.records import PromptRecord, TokenizedPrompt


def tokenize_record(
    record: PromptRecord,
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_length: int | None = None,
    add_special_tokens: bool = True,
) -> TokenizedPrompt:
    """Tokenize one record and locate its target and spans in tokens.

    The target is the last content token for ``target="last"``; for an int offset it
    is the last content token with ``start < target`` and ``end <= target``.  A char span
    maps to the tokens that overlap it (``None`` if none do).  Tokens after the target
    are dropped.  Raises :class:`AlignmentError` if the text has no tokens, the target
    cannot be located, or the prompt is longer than ``max_length`` tokens.
    """
    aligned = tokenize_records(
        [record], tokenizer, max_length=max_length, add_special_tokens=add_special_tokens
    )
    return aligned[0]


def tokenize_records(
    records: Sequence[PromptRecord],
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_length: int | None = None,
    add_special_tokens: bool = True,
) -> list[TokenizedPrompt]:
    """:func:`tokenize_record` for many records with one batched tokenizer call.

    Errors name the record's index in ``records`` and the start of its text.
    """
    if not records:
        return []
    if not getattr(tokenizer, "is_fast", False):
        raise AlignmentError(
            f"{type(tokenizer).__name__} is not a fast tokenizer; character offsets need one"
        )
    encoding: Any = tokenizer(
        [r.text for r in records],
        add_special_tokens=add_special_tokens,
        return_offsets_mapping=True,
        return_special_tokens_mask=True,
        return_attention_mask=False,
    )
    out = []
    for i, record in enumerate(records):
        try:
            out.append(
                _align(
                    record,
                    list(encoding["input_ids"][i]),
                    [(int(s), int(e)) for s, e in encoding["offset_mapping"][i]],
                    list(encoding["special_tokens_mask"][i]),
                    max_length,
                )
            )
        except AlignmentError as e:
            where = f"record {i} " if len(records) > 1 else ""
            raise AlignmentError(f"{where}{_describe(record)}: {e}") from None
    return out


def _describe(record: PromptRecord) -> str:
    text = record.text if len(record.text) <= 60 else record.text[:57] + "..."
    return f"{record.relation_id} {text!r}" if record.relation_id else repr(text)


def _align(
    record: PromptRecord,
    input_ids: list[int],
    offsets: list[tuple[int, int]],
    special: list[int],
    max_length: int | None,
) -> TokenizedPrompt:
    # A content token covers at least one character of the text and is not special.
    content = [i for i, ((s, e), sp) in enumerate(zip(offsets, special)) if not sp and e > s]
    if not content:
        raise AlignmentError("text tokenizes to no tokens")
    target = _target_position(record.target, len(record.text), offsets, content)
    n = target + 1
    if max_length is not None and n > max_length:
        raise AlignmentError(f"prompt has {n} tokens, model context is {max_length}")
    kept = [i for i in content if i < n]
    return TokenizedPrompt(
        record=record,
        input_ids=input_ids[:n],
        offsets=offsets[:n],
        target_position=target,
        subject_tokens=_token_span(record.subject_span, offsets, kept),
        object_tokens=_token_span(record.object_span, offsets, kept),
    )


def _target_position(
    target: int | str, n_chars: int, offsets: list[tuple[int, int]], content: list[int]
) -> int:
    if target == "last":
        return content[-1]
    if isinstance(target, bool) or not isinstance(target, int):
        raise AlignmentError(f"target must be 'last' or a character offset, got {target!r}")
    if not 1 <= target <= n_chars:
        raise AlignmentError(f"target offset {target} is out of range 1..{n_chars}")
    before = [i for i in content if offsets[i][0] < target and offsets[i][1] <= target]
    if not before:
        raise AlignmentError(f"no token ends at or before target offset {target}")
    return before[-1]


def _token_span(
    span: tuple[int, int] | None, offsets: list[tuple[int, int]], content: list[int]
) -> tuple[int, int] | None:
    """Half-open token range of the content tokens overlapping the char span ``[a, b)``."""
    if span is None:
        return None
    a, b = span
    hits = [i for i in content if offsets[i][0] < b and offsets[i][1] > a]
    return (hits[0], hits[-1] + 1) if hits else None
