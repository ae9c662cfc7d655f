"""Public data sets by name: ``fewrel``, ``lre``, ``known1000``, ``maps`` and ``codex-m``.

:func:`fetch` returns a local path a loader can read, looked up in this order:

1. ``$ACTSTORE_DATA/<entry>`` when ``ACTSTORE_DATA`` is set and holds the data set (the user's
   own copy, read as it is; nothing is requested);
2. the cache (``$ACTSTORE_DATA_CACHE``, else the platform's user cache folder
   ``actstore/datasets``), where every file is checked against its pinned SHA-256
   (:mod:`actstore.ingest.datasets.pins`);
3. a download of each missing or damaged file from its public source (a fixed commit of the
   authors' repository, or the mirror ``$ACTSTORE_DATA_URL`` serving the ``$ACTSTORE_DATA``
   layout), kept only when its SHA-256 matches the pin.

Both the data folder and the cache use one layout (``fewrel/val_wiki.json``,
``lre_relations/data/<category>/<relation>.json``, ``known_1000/known_1000.json``,
``maps/datasets/<relation>/<relation>.json``, ``codex_m/{train,valid,test}.txt``), so a cache
folder is also a valid ``$ACTSTORE_DATA``.  See docs/datasets.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import platformdirs
import pooch
import requests

from actstore.core.errors import DatasetError
from actstore.ingest.datasets.pins import SHA256

DATA_ENV = "ACTSTORE_DATA"
CACHE_ENV = "ACTSTORE_DATA_CACHE"
MIRROR_ENV = "ACTSTORE_DATA_URL"
GITHUB_RAW = "https://raw.githubusercontent.com"
TIMEOUT_S = 60.0

log = logging.getLogger(__name__)


def _pinned(folder: str) -> dict[str, str]:
    return {path: sha for path, sha in SHA256.items() if path.startswith(folder + "/")}


@dataclass(frozen=True)
class NamedDataset:
    """A public data set: where its files live in the layout, and where each is published.

    ``files`` maps each file's path in the layout (``fewrel/val_wiki.json``) to its SHA-256;
    the file is published at ``{GITHUB_RAW}/{repository}/{commit}/{upstream}/{rest}``, where
    ``rest`` is the path below ``folder``.  ``kind`` is the loader that reads ``entry`` (None for
    a data set that holds no prompts, such as a knowledge graph).
    """

    name: str
    kind: str | None
    folder: str
    entry: str
    repository: str
    commit: str
    upstream: str
    files: Mapping[str, str] = field(default_factory=dict)

    def url(self, layout_path: str, mirror: str | None = None) -> str:
        """The URL of one of :attr:`files`: on the mirror (same layout) or at its public source."""
        if mirror:
            return f"{mirror.rstrip('/')}/{layout_path}"
        rest = layout_path[len(self.folder) + 1 :]
        where = f"{self.upstream}/{rest}" if self.upstream else rest
        return f"{GITHUB_RAW}/{self.repository}/{self.commit}/{where}"


# Provenance: ../shared/data/README.md (repository, folder and commit of each data set).
DATASETS: dict[str, NamedDataset] = {
    ds.name: ds
    for ds in (
        NamedDataset(
            "fewrel",
            "fewrel",
            "fewrel",
            "fewrel/val_wiki.json",
            "thunlp/FewRel",
            "278a2315d2138810a379cd8d5718914dc56e2582",
            "data",
            _pinned("fewrel"),
        ),
        NamedDataset(
            "lre",
            "lre",
            "lre_relations",
            "lre_relations/data",
            "evandez/relations",
            "1b9ec3cf2b8368e42bde7e80fcef384312a6ec07",
            "",
            _pinned("lre_relations"),
        ),
        NamedDataset(
            "known1000",
            "known1000",
            "known_1000",
            "known_1000/known_1000.json",
            "khnhenriette/ProjectADL",
            "6f1637bbf55cc8506e565513f31e24dda55b9858",
            "dsets",
            _pinned("known_1000"),
        ),
        NamedDataset(
            "maps",
            "maps",
            "maps",
            "maps/datasets",
            "amitelhelo/MAPS",
            "b320fcd972bab3e05f4a0b7d5d266641a0f1bcfe",
            "",
            _pinned("maps"),
        ),
        NamedDataset(
            "codex-m",
            None,
            "codex_m",
            "codex_m",
            "tsafavi/codex",
            "3132e426c2a6b643b70bad679905a3a6270be440",
            "data/triples/codex-m",
            _pinned("codex_m"),
        ),
    )
}


def lookup(name: str) -> NamedDataset:
    """The data set called ``name`` (case-insensitive); :class:`DatasetError` for an unknown name."""
    ds = DATASETS.get(name.strip().lower())
    if ds is None:
        raise DatasetError(f"no public data set is called {name!r}; known names: {', '.join(DATASETS)}")
    return ds


def dataset_cache_dir() -> Path:
    """``$ACTSTORE_DATA_CACHE`` if set, else the user cache folder's ``actstore/datasets``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()

    return platformdirs.user_cache_path("actstore") / "datasets"


def local_copy(name: str, data_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """``<data_dir>/<entry>`` (``data_dir`` defaults to ``$ACTSTORE_DATA``) if it exists, else None."""
    root = data_dir if data_dir is not None else os.environ.get(DATA_ENV) or None
    if root is None:
        return None
    path = Path(root).expanduser() / lookup(name).entry
    return path if path.exists() else None


def fetch(
    name: str,
    *,
    data_dir: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    mirror: str | None = None,
) -> Path:
    """A local path to the data set called ``name``, downloading what the cache lacks.

    ``data_dir``, ``cache_dir`` and ``mirror`` default to ``$ACTSTORE_DATA``,
    :func:`dataset_cache_dir` and ``$ACTSTORE_DATA_URL`` (no mirror: the public source).
    Raises :class:`DatasetError` (one line) when a file cannot be downloaded, naming its URL and
    ``ACTSTORE_DATA``, or when a download does not match its pinned SHA-256 (nothing is kept).
    """
    ds = lookup(name)
    local = local_copy(ds.name, data_dir)
    if local is not None:
        return local
    cache = Path(cache_dir).expanduser() if cache_dir is not None else dataset_cache_dir()
    base = mirror if mirror is not None else os.environ.get(MIRROR_ENV) or None
    if not ds.files:
        raise DatasetError(f"the {ds.name} data set pins no files")
    for layout_path, sha256 in sorted(ds.files.items()):
        _retrieve(ds, ds.url(layout_path, base), sha256, cache / layout_path)
    return cache / ds.entry


@contextmanager
def _quiet_pooch() -> Iterator[None]:
    """pooch logs each download at INFO on its own stderr handler; the library does not print."""

    logger = pooch.get_logger()
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def _retrieve(ds: NamedDataset, url: str, sha256: str, target: Path) -> None:
    """``target``, downloaded from ``url`` unless it is there with the pinned hash."""

    downloader = pooch.HTTPDownloader(progressbar=False, timeout=TIMEOUT_S)
    try:
        with _quiet_pooch():
            log.debug("%s: checking the cache, else downloading %s", target, url)
            pooch.retrieve(
                url,
                known_hash=f"sha256:{sha256}",
                fname=target.name,
                path=target.parent,
                downloader=downloader,
                progressbar=False,
            )
    except requests.exceptions.RequestException as e:
        raise DatasetError(
            f"cannot download the {ds.name} data set: {url} failed ({_reason(e)}); set {DATA_ENV} to a "
            f"folder holding {ds.entry} (see docs/datasets.md), or connect to {urlsplit(url).netloc}"
        ) from None
    except ValueError as e:  # pooch: the downloaded file's hash differs from the pin
        if "hash" not in str(e).lower():
            raise
        raise DatasetError(
            f"{url}: the downloaded file's SHA-256 is not the pinned {sha256}; it was not kept (a changed or "
            f"damaged file: set {DATA_ENV} to a folder holding a copy you trust)"
        ) from None
    except OSError as e:
        raise DatasetError(f"cannot write {target}: {e.strerror or e}") from None


def _reason(error: Exception) -> str:
    """A short reason for a failed request (requests' own messages run to several hundred characters)."""

    if isinstance(error, requests.exceptions.HTTPError) and error.response is not None:
        return f"HTTP {error.response.status_code}"
    if isinstance(error, requests.exceptions.Timeout):
        return f"no answer within {TIMEOUT_S:.0f} s"
    if isinstance(error, requests.exceptions.ConnectionError):
        return "no connection"
    return type(error).__name__
