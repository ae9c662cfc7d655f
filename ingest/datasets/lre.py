"""LRE relations (``data/<category>/<relation>.json``): each sample through each prompt template."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from actstore.core.errors import DatasetError
from actstore.ingest.datasets.common import (
    Collector,
    DatasetResult,
    clean_name,
    existing,
    json_files,
    read_json,
    select_relations,
    string_list,
    template_records,
)


def load_lre(
    path: str | Path,
    *,
    relations: Sequence[str] | None = None,
    limit_per_relation: int | None = None,
    templates: Literal["all", "first"] = "all",
) -> DatasetResult:
    """LRE relation files (evandez/relations): one record per sample x prompt template.

    ``path`` is one relation JSON file or a directory searched recursively for ``*.json``.
    The relation id is the file stem, the category (factual, linguistic, ...) its folder.
    Subjects and objects are cleaned by :func:`clean_name`.
    """
    if templates not in ("all", "first"):
        raise DatasetError(f"templates must be 'all' or 'first', got {templates!r}")
    p = existing(path, "lre")
    files = json_files(p)
    out = Collector(limit_per_relation)
    for stem in select_relations(list(files), relations, p):
        f = files[stem]
        data = read_json(f)
        if not isinstance(data, dict) or not isinstance(data.get("samples"), list):
            raise DatasetError(
                f"{f}: expected an LRE relation object with 'name', 'prompt_templates', 'samples'"
            )
        prompts = string_list(data.get("prompt_templates"), "'prompt_templates'", f)
        samples = data["samples"]
        if not all(
            isinstance(s, dict) and isinstance(s.get("subject"), str) and isinstance(s.get("object"), str)
            for s in samples
        ):
            raise DatasetError(f"{f}: every sample needs string 'subject' and 'object'")
        pairs = [(clean_name(s["subject"]), clean_name(s["object"])) for s in samples]
        template_records(
            out,
            stem,
            str(data.get("name", stem)),
            prompts[:1] if templates == "first" else prompts,
            pairs,
            source="lre",
            where=f,
            meta={"category": f.parent.name},
        )
    return out.result()
