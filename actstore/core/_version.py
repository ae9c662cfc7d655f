"""The package version, in the store core so that ingest and the core can record it without importing
the facade (:mod:`actstore`, which re-exports it as ``actstore.__version__``)."""

__version__ = "0.1.0"
