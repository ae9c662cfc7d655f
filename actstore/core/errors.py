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


class WeightsUnavailableError(QueryError):
    """The store's weights are neither in the store nor in this machine's shared weights cache, or it
    was ingested without them (``--weights none``); the message says what to do."""


class NotFoundError(QueryError, LookupError):
    """A relation, prompt, run or table that a request names is not in the store (the explorer's 404)."""


class ReadOnlySQLError(QueryError, PermissionError):
    """A SQL statement tried to write, attach, install, or reach outside the store."""


class StorageError(ActstoreError, OSError):
    """The storage backend (an object store) cannot be reached or refuses access (credentials, network)."""


class StoreLockedError(ActstoreError, RuntimeError):
    """Another writer holds the store's lock (or its record cannot be proven stale)."""


class NotOursError(StoreExistsError):
    """The directory holds something actstore did not write: it is left untouched."""


class MissingChunkError(CorruptStoreError):
    """A chunk that the store's writer wrote is not there."""


class AlignmentError(ActstoreError, ValueError):
    """A record cannot be aligned to the tokenizer (one-line message)."""


class DatasetError(ActstoreError, ValueError):
    """A data set is missing or malformed, or a loader option is invalid (one-line message)."""


class ModelError(ActstoreError, ValueError):
    """A model could not be resolved or loaded; the message is one line meant for the user."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))  # one line: every run of whitespace one space


class AblationError(ActstoreError, ValueError):
    """The ablation cannot run as asked (one line)."""


class PatchError(ActstoreError, ValueError):
    """Patching cannot run as asked (one line)."""


class InterventionError(ActstoreError, ValueError):
    """An intervention that cannot apply to this model or prompt (one line)."""


class TraceError(ActstoreError, ValueError):
    """Tracing cannot run as asked (one line)."""


class RankError(ActstoreError, RuntimeError):
    """Another rank failed, or the ranks' settings are inconsistent."""


class StatsError(QueryError):
    """A statistic asked for with impossible settings (one line)."""


class LensError(QueryError):
    """A lens cannot be computed as asked (one line)."""


class MethodsError(QueryError):
    """A method comparison cannot run as asked (one line)."""


class MapsError(QueryError):
    """Bad MAPS input (pair files, relations, heads); one line for the command line."""


class InvalidSetting(ActstoreError, ValueError):
    """A setting's value is invalid or missing; ``setting`` names the parameter.  Library code never
    names command-line flags: it raises this with the name of the parameter at fault
    (``setting="model"``), and the command line shows it under the name of its own option (``--model``)."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(f"{setting}: {message}")
        self.setting = setting
        self.detail = message


class InvalidQuerySetting(InvalidSetting, QueryError):
    """A query's setting is invalid (a feature kind, a layer out of range): both an
    :class:`InvalidSetting` (the command line exits 2, a usage error) and a :class:`QueryError`."""


class UnknownModelName(ModelError, InvalidSetting):
    """A model name that is no alias, no local folder or file, and no hub name (``owner/name``):
    refused at once, before any network access (the command line exits 2, a usage error)."""

    def __init__(self, message: str) -> None:
        InvalidSetting.__init__(self, "model", " ".join(str(message).split()))
        self.args = (self.detail,)


class EmptySelectionWarning(UserWarning):
    """A selection names relations or example ids that have no rows (a typo, or another data set's
    names).  A warning by default; ``warnings.simplefilter("error", EmptySelectionWarning)`` (or
    ``-W error::actstore.EmptySelectionWarning``) makes it an error."""


class MissingDependency(QueryError, ImportError):
    """An optional package a function needs is not installed (the message says what to install)."""
