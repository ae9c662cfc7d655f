"""Data set loaders: public relation data sets turned into :class:`PromptRecord` lists.

One module per format (:mod:`.fewrel`, :mod:`.lre`, :mod:`.known1000`, :mod:`.maps`,
:mod:`.jsonl` for JSON lines / JSON arrays / Parquet, :mod:`.demo`, and :mod:`.codex` for the
CoDEx knowledge graph's triple files), what they share in :mod:`.common`, the public data sets by
name in :mod:`.registry` (fetched into a cache and checked against the SHA-256 pinned in
:mod:`.pins`), and ``load_dataset`` in :mod:`.dispatch`.

Every loader takes a path (so users point it at their own copy), returns a
:class:`DatasetResult` and is deterministic: records come out in file order (directories
are walked in sorted path order).  ``limit_per_relation`` keeps the first N records of
each relation after skipping; every instance a loader reads is either kept or counted
under a skip reason (``over_limit`` included), so ``kept + skipped`` is the file total.

Spans are half-open character ranges into ``text`` and always valid for it.
``load_dataset("KIND:PATH", **options)`` dispatches on the kind; ``load_dataset("fewrel")``
reads the public data set by name.
"""

from __future__ import annotations

from actstore.core.errors import DatasetError
from actstore.ingest.datasets.codex import triple_files
from actstore.ingest.datasets.common import KINDS, DatasetResult, fill_template, parse_spec
from actstore.ingest.datasets.demo import DEMO_PATH, load_demo
from actstore.ingest.datasets.dispatch import load_dataset
from actstore.ingest.datasets.fewrel import join_tokens, load_fewrel
from actstore.ingest.datasets.jsonl import MAX_JSONL_BYTES, MAX_JSONL_DEPTH, MAX_JSONL_LINE, load_jsonl
from actstore.ingest.datasets.known1000 import load_known1000
from actstore.ingest.datasets.lre import load_lre
from actstore.ingest.datasets.maps import load_maps
from actstore.ingest.datasets.registry import DATASETS, NamedDataset, fetch
from actstore.ingest.records import PromptRecord

__all__ = [
    "DATASETS",
    "DEMO_PATH",
    "KINDS",
    "MAX_JSONL_BYTES",
    "MAX_JSONL_DEPTH",
    "MAX_JSONL_LINE",
    "DatasetError",
    "DatasetResult",
    "NamedDataset",
    "PromptRecord",
    "fetch",
    "fill_template",
    "join_tokens",
    "load_dataset",
    "load_demo",
    "load_fewrel",
    "load_jsonl",
    "load_known1000",
    "load_lre",
    "load_maps",
    "parse_spec",
    "triple_files",
]
