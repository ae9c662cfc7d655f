"""Typed errors. Each also inherits the matching built-in so callers can catch either.

The CLI prints ``str(error)`` as one line and exits non-zero; messages are written to
stand alone (they name the store, array or argument at fault).
"""

from __future__ import annotations


class ActstoreError(Exception):
    """Base class of every error actstore raises on purpose."""


class StoreNotFoundError(ActstoreError, FileNotFoundError):
    """The path or URL holds no actstore store."""


class FormatVersionError(ActstoreError, ValueError):
    """The store was written by an incompatible (usually newer) format version."""


class StoreExistsError(ActstoreError, FileExistsError):
    """Refusing to overwrite an existing store."""


class StoreMismatchError(ActstoreError, ValueError):
    """A resume or append does not match what the store already holds (model, corpus, settings)."""


class CorruptStoreError(ActstoreError, OSError):
    """A checksum, offset or manifest check failed: the store's bytes are not what was written."""


class QueryError(ActstoreError, ValueError):
    """A selection, feature request or SQL statement is invalid."""


class ReadOnlySQLError(QueryError, PermissionError):
    """A SQL statement tried to write, attach, install, or reach outside the store."""


class StorageError(ActstoreError, OSError):
    """The storage backend (an object store) cannot be reached or refuses access (credentials, network)."""
