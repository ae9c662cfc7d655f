"""The built-in demo corpus (``ingest/data/demo.json``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from actstore.ingest.datasets.common import (
    Collector,
    DatasetResult,
    read_json,
    select_relations,
    string_list,
    string_pairs,
    template_records,
)

DEMO_PATH = Path(__file__).resolve().parents[1] / "data" / "demo.json"


def load_demo(
    *, relations: Sequence[str] | None = None, limit_per_relation: int | None = None
) -> DatasetResult:
    """The built-in demo corpus (``ingest/data/demo.json``): template x fact per relation."""
    data = read_json(DEMO_PATH)
    specs = {r["id"]: r for r in data["relations"]}
    out = Collector(limit_per_relation)
    for rid in select_relations(list(specs), relations, DEMO_PATH):
        spec = specs[rid]
        pairs = string_pairs(spec["facts"], DEMO_PATH)
        templates = string_list(spec["templates"], "'templates'", DEMO_PATH)
        template_records(out, rid, spec["name"], templates, pairs, source="demo", where=DEMO_PATH)
    return out.result()
