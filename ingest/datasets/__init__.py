"""Data set loaders: public relation data sets turned into :class:`PromptRecord` lists.

One module per format (:mod:`.fewrel`, :mod:`.lre`, :mod:`.known1000`, :mod:`.maps`,
:mod:`.jsonl` for JSON lines / JSON arrays / Parquet, :mod:`.demo`, and :mod:`.codex` for the
CoDEx knowledge graph's triple files), what they share in :mod:`.common`, the public data sets by
name in :mod:`.registry` (fetched into a cache and checked against the SHA-256 pinned in
:mod:`.pins`), and ``load_dataset`` in :mod:`.dispatch`; import each name from its module.

Every loader takes a path (so users point it at their own copy), returns a
:class:`DatasetResult` and is deterministic: records come out in file order (directories
are walked in sorted path order).  ``limit_per_relation`` keeps the first N records of
each relation after skipping; every instance a loader reads is either kept or counted
under a skip reason (``over_limit`` included), so ``kept + skipped`` is the file total.

Spans are half-open character ranges into ``text`` and always valid for it.
``load_dataset("KIND:PATH", **options)`` dispatches on the kind; ``load_dataset("fewrel")``
reads the public data set by name.
"""
