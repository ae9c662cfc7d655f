"""``load_dataset("KIND:PATH")`` / ``load_dataset("NAME")``: the one entry point the ingest job uses."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import actstore.ingest.datasets.registry as registry
from actstore.core.errors import DatasetError
from actstore.ingest.datasets.common import KINDS, DatasetResult, existing, parse_spec
from actstore.ingest.datasets.demo import load_demo
from actstore.ingest.datasets.fewrel import load_fewrel
from actstore.ingest.datasets.jsonl import load_jsonl
from actstore.ingest.datasets.known1000 import load_known1000
from actstore.ingest.datasets.lre import load_lre
from actstore.ingest.datasets.maps import load_maps
from actstore.ingest.datasets.methods2k import load_methods2k

_OPTIONS: dict[str, frozenset[str]] = {
    "fewrel": frozenset({"relations", "limit_per_relation", "keep_object_first"}),
    "lre": frozenset({"relations", "limit_per_relation", "templates"}),
    "known1000": frozenset({"relations", "limit_per_relation", "limit"}),
    "maps": frozenset({"relations", "limit_per_relation", "template"}),
    "jsonl": frozenset({"relations", "limit_per_relation"}),
    "demo": frozenset({"relations", "limit_per_relation"}),
    "methods2k": frozenset({"relations", "limit_per_relation"}),
}
_ALL_OPTIONS = frozenset().union(*_OPTIONS.values())


def _applicable(kind: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """Options for ``kind``; others must be unset (None, or False for a flag)."""
    unknown = sorted(set(options) - _ALL_OPTIONS)
    if unknown:
        raise DatasetError(
            f"unknown dataset option(s) {', '.join(unknown)}; known: {', '.join(sorted(_ALL_OPTIONS))}"
        )
    kept = {k: v for k, v in options.items() if k in _OPTIONS[kind]}
    stray = sorted(
        k for k, v in options.items() if k not in _OPTIONS[kind] and v is not None and v is not False
    )
    if stray:
        raise DatasetError(f"option(s) {', '.join(stray)} do not apply to {kind} data sets")
    return {k: v for k, v in kept.items() if v is not None}


_LOADERS: dict[str, Callable[..., DatasetResult]] = {
    "fewrel": load_fewrel,
    "lre": load_lre,
    "known1000": load_known1000,
    "maps": load_maps,
    "jsonl": load_jsonl,
    "methods2k": load_methods2k,
}


def load_dataset(spec: str, **options: Any) -> DatasetResult:
    """Load ``"KIND:PATH"`` (KIND in fewrel, lre, known1000, maps, jsonl), ``"demo"``, or a public
    data set by name (``"fewrel"``, ``"lre"``, ``"known1000"``, ``"maps"``: see
    :func:`actstore.ingest.datasets.registry.fetch` for where it is read from).

    Options: ``relations``, ``limit_per_relation``, ``template`` (maps), ``templates``
    (lre), ``limit`` (known1000), ``keep_object_first`` (fewrel).  An option that does not
    apply to the kind is an error unless it is None (or False for a flag).
    """
    kind, location = parse_spec(spec)
    if kind not in KINDS:
        named = registry.DATASETS.get(kind)
        if named is not None and named.kind is None:
            raise DatasetError(
                f"{named.name} is a knowledge graph of Wikidata triples, not a prompt data set; fetch it "
                f"with actstore.ingest.datasets.registry.fetch({named.name!r}) and read its triple files as a knowledge graph"
            )
        raise DatasetError(
            f"unknown dataset kind {kind!r} in {spec!r}; expected one of {', '.join(KINDS)} "
            f"(as KIND:PATH, a public data set by name: {', '.join(_named_prompt_sets())}, or demo)"
        )
    opts = _applicable(kind, options)
    if kind == "demo":
        if location:
            raise DatasetError(f"the demo data set takes no path, got {spec!r}")
        return load_demo(**opts)
    if location is None:
        if kind == "methods2k":  # by name: built from the public LRE and known_1000
            return load_methods2k(None, **opts)
        if kind not in _named_prompt_sets():
            raise DatasetError(f"{spec!r}: no path given; write {kind}:PATH")
        return _LOADERS[kind](registry.fetch(kind), **opts)
    if not location:
        by_name = f", or {kind} alone for the public data set" if kind in _named_prompt_sets() else ""
        raise DatasetError(f"{spec!r}: no path given; write {kind}:PATH{by_name}")
    return _LOADERS[kind](existing(location, kind), **opts)


def _named_prompt_sets() -> list[str]:
    return [name for name, ds in registry.DATASETS.items() if ds.kind is not None]
