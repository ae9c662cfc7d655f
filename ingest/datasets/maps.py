"""MAPS pair files (``[["cat", "chat"], ...]``): a template filled with each source word."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from actstore.core.errors import DatasetError
from actstore.ingest.datasets.common import (
    Collector,
    DatasetResult,
    existing,
    fill_template,
    json_files,
    read_json,
    select_relations,
    string_pairs,
    template_records,
)


def load_maps(
    path: str | Path,
    *,
    template: str = "{}",
    relations: Sequence[str] | None = None,
    limit_per_relation: int | None = None,
) -> DatasetResult:
    """MAPS pair files (``[["cat", "chat"], ...]``): ``template.format(source)`` -> target.

    ``path`` is one pair file or a directory such as ``maps/datasets`` (one folder per
    relation holding ``<relation>.json``); the relation id is the file stem.
    """
    try:
        fill_template(template, "x")
    except ValueError as e:
        raise DatasetError(f"maps: {e}") from None
    p = existing(path, "maps")
    files = json_files(p)
    out = Collector(limit_per_relation)
    for stem in select_relations(list(files), relations, p):
        f = files[stem]
        pairs = string_pairs(read_json(f), f)
        template_records(out, stem, stem.replace("_", " "), [template], pairs, source="maps", where=f)
    return out.result()
