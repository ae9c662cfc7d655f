"""FewRel 1.0 (``{"P177": [{"tokens", "h", "t"}, ...]}``): each sentence up to its object."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from actstore.core.errors import DatasetError
from actstore.ingest.datasets.common import (
    Collector,
    DatasetResult,
    existing,
    read_json,
    select_relations,
    strip_span,
)
from actstore.ingest.records import PromptRecord


def join_tokens(tokens: Sequence[str]) -> tuple[str, list[int], list[int]]:
    """Join FewRel tokens with single spaces; return the text and each token's char start/end.

    Whitespace-only tokens (about 2% of FewRel sentences hold ``"\\xa0"``, ``"\\n"`` or
    ``" "`` tokens) are left out of the text, so prompts carry no runs of blanks; such a
    token gets the empty span at the end of the text before it.
    """
    text = ""
    starts: list[int] = []
    ends: list[int] = []
    for tok in tokens:
        if tok.strip():
            text += " " + tok if text else tok
            starts.append(len(text) - len(tok))
        else:
            starts.append(len(text))
        ends.append(len(text))
    return text, starts, ends


def _fewrel_names(path: Path) -> dict[str, str]:
    """Relation names from ``pid2name.json`` (``{"P177": ["crosses", "description"]}``), if present."""
    if not path.is_file():
        return {}
    data = read_json(path)
    if not isinstance(data, dict):
        raise DatasetError(f"{path}: expected an object of relation id -> [name, description]")
    return {pid: v[0] for pid, v in data.items() if isinstance(v, list) and v and isinstance(v[0], str)}


def _fewrel_entity(value: Any) -> tuple[str, str, list[int]] | None:
    """``[name, qid, [[idx, ...], ...]]`` -> (name, qid, first occurrence), or None if malformed."""
    if not (isinstance(value, list) and len(value) >= 3 and isinstance(value[0], str)):
        return None
    occurrences = value[2]
    if not (isinstance(occurrences, list) and occurrences and isinstance(occurrences[0], list)):
        return None
    first = occurrences[0]
    if not first or not all(isinstance(i, int) for i in first):
        return None
    return value[0], str(value[1]), first


def _fewrel_record(
    instance: Any, pid: str, name: str, index: int, keep_object_first: bool
) -> PromptRecord | str:
    """One FewRel instance as a record, or the reason it is skipped.

    The prompt is the sentence (see :func:`join_tokens`) up to the first tail occurrence,
    without the separating space, so the target -- the last token of the prompt -- is the
    last real token before the object.  The head span is its first occurrence.

    Skip reasons: ``malformed``, ``invalid_span`` (indices out of range), ``overlap``
    (head and tail share tokens), ``object_first`` (tail before head, unless
    ``keep_object_first``), ``empty_prompt`` (nothing before the tail), and
    ``subject_not_in_prompt`` (head tokens are all blank).  Under ``keep_object_first`` an
    object-first instance is kept with ``subject_span=None``: the prompt ends before the
    object, so it cannot contain the head (no FewRel validation instance repeats the head
    earlier).
    """
    if not isinstance(instance, dict) or not isinstance(instance.get("tokens"), list):
        return "malformed"
    tokens = [str(t) for t in instance["tokens"]]
    head, tail = _fewrel_entity(instance.get("h")), _fewrel_entity(instance.get("t"))
    if head is None or tail is None:
        return "malformed"
    h0, h1 = min(head[2]), max(head[2]) + 1
    t0, t1 = min(tail[2]), max(tail[2]) + 1
    if min(h0, t0) < 0 or max(h1, t1) > len(tokens):
        return "invalid_span"
    if h0 < t1 and t0 < h1:
        return "overlap"
    object_first = t0 < h0
    if object_first and not keep_object_first:
        return "object_first"
    sentence, starts, ends = join_tokens(tokens)
    text = sentence[: starts[t0]].rstrip()
    if not text:
        return "empty_prompt"
    subject_span = None
    if not object_first:
        s, e = strip_span(sentence, starts[h0], ends[h1 - 1])
        if e <= s or e > len(text):
            return "subject_not_in_prompt"
        subject_span = (s, e)
    return PromptRecord(
        text=text,
        relation_id=pid,
        relation_name=name,
        subject=head[0],
        object=tail[0],
        subject_span=subject_span,
        object_span=None,
        source="fewrel",
        split="val",
        meta={
            "subject_qid": head[1],
            "object_qid": tail[1],
            "fewrel_index": index,
            "object_first": object_first,
        },
    )


def load_fewrel(
    path: str | Path,
    *,
    relations: Sequence[str] | None = None,
    limit_per_relation: int | None = None,
    keep_object_first: bool = False,
) -> DatasetResult:
    """FewRel (``{"P177": [{"tokens", "h", "t"}, ...]}``): the sentence up to the object.

    Instances whose object precedes the subject are skipped (``object_first``) unless
    ``keep_object_first``; they are then kept without a subject span.  On the FewRel 1.0
    validation split the default keeps 6,128 of 11,200 instances.  See
    :func:`_fewrel_record` for the prompt rule and all skip reasons.
    """
    p = existing(path, "fewrel")
    data = read_json(p)
    if not isinstance(data, dict) or not all(isinstance(v, list) for v in data.values()):
        raise DatasetError(f"{p}: expected an object of relation id -> list of instances (FewRel format)")
    names = _fewrel_names(p.parent / "pid2name.json")
    out = Collector(limit_per_relation)
    for pid in select_relations(list(data), relations, p):
        out.start(pid)
        for index, instance in enumerate(data[pid]):
            outcome = _fewrel_record(instance, pid, names.get(pid, pid), index, keep_object_first)
            if isinstance(outcome, str):
                out.skip(pid, outcome)
            else:
                out.add(outcome)
    return out.result()
