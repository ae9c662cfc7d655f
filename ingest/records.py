"""The unit of ingest: one prompt with its spans, before and after tokenization."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PromptRecord:
    """One prompt as a dataset loader yields it, in characters (no tokenizer yet).

    ``target`` is either ``"last"`` (the last token of ``text``) or a character offset:
    the target token is the token that contains character ``target - 1``, i.e. the last
    token ending at or before that offset.  Spans are half-open ``(start, end)`` character
    ranges into ``text``; ``None`` when the record has no such span (the object of a
    FewRel prompt lies after the prompt, so its span is ``None``).
    """

    text: str
    relation_id: str = ""
    relation_name: str = ""
    subject: str = ""
    object: str = ""
    subject_span: tuple[int, int] | None = None
    object_span: tuple[int, int] | None = None
    target: int | str = "last"
    source: str = ""
    split: str = ""
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TokenizedPrompt:
    """A record aligned to a tokenizer: token ids, per-token character offsets and token spans.

    ``target_position`` indexes ``input_ids``; token spans are half-open ``(start, end)``
    token ranges, ``None`` when the record has no such span or it lies outside the tokens.
    Only ``input_ids[: target_position + 1]`` are fed to the model.
    """

    record: PromptRecord
    input_ids: list[int]
    offsets: list[tuple[int, int]]
    target_position: int
    subject_tokens: tuple[int, int] | None
    object_tokens: tuple[int, int] | None
