"""ROME's known_1000 (a list of ``{subject, attribute, prompt, relation_id}``): the given prompts."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from actstore.core.errors import DatasetError
from actstore.ingest.datasets.common import (
    Collector,
    DatasetResult,
    check_limit,
    existing,
    find_span,
    read_json,
    select_relations,
)
from actstore.ingest.records import PromptRecord


def load_known1000(
    path: str | Path,
    *,
    limit: int | None = None,
    relations: Sequence[str] | None = None,
    limit_per_relation: int | None = None,
) -> DatasetResult:
    """ROME's known_1000: the given ``prompt`` with the subject located in it.

    ``limit`` keeps the first N records overall (after ``relations`` and the per-relation
    limit); instances whose subject is not in the prompt are skipped.
    """
    check_limit(limit, "limit")
    p, data = read_known1000(path)
    available = list(dict.fromkeys(x["relation_id"] for x in data))
    wanted = set(select_relations(available, relations, p))
    out = Collector(limit_per_relation)
    for x in data:
        relation = x["relation_id"]
        if relation not in wanted:
            continue
        span = find_span(x["prompt"], x["subject"])
        if span is None:
            out.skip(relation, "subject_not_in_prompt")
            continue
        if limit is not None and len(out.records) >= limit:
            out.skip(relation, "over_limit")
            continue
        meta = {"known_id": x.get("known_id"), "template": x.get("template", "")}
        out.add(
            PromptRecord(
                text=x["prompt"],
                relation_id=relation,
                relation_name=relation,
                subject=x["subject"],
                object=x["attribute"],
                subject_span=span,
                source="known1000",
                meta=meta,
            )
        )
    return out.result()


def read_known1000(path: str | Path) -> tuple[Path, list[dict[str, Any]]]:
    """The file ``path`` and its records, each with string ``subject``, ``attribute``, ``prompt`` and
    ``relation_id`` (refused with one line otherwise)."""
    p = existing(path, "known1000")
    data = read_json(p)
    keys = ("subject", "attribute", "prompt", "relation_id")
    if not isinstance(data, list) or not all(
        isinstance(x, dict) and all(isinstance(x.get(k), str) for k in keys) for x in data
    ):
        raise DatasetError(
            f"{p}: expected a list of objects with string {', '.join(keys)} (known_1000 format)"
        )
    return p, data
