"""Where a store's bytes live: one interface (:class:`~actstore.core.storage.base.StoreLocation`, in
:mod:`.base`), one implementation per kind of storage, and :func:`locate`, which picks one for a
URL or path:

============================  =====================================================================
a path, ``file://``           :class:`~actstore.core.storage.local.LocalLocation` (:mod:`.local`)
``s3://bucket/prefix``        :class:`~actstore.core.storage.s3.S3Location` (:mod:`.s3`)
``memory://name``             :class:`~actstore.core.storage.memory.MemoryLocation` (:mod:`.memory`)
any other fsspec URL          :class:`~actstore.core.storage.objects.ObjectLocation` (:mod:`.objects`:
                              reads and writes, no writer lock)
============================  =====================================================================
"""

from __future__ import annotations

import os
from typing import Any

import fsspec

from actstore.core.errors import StorageError
from actstore.core.storage.base import StoreLocation
from actstore.core.storage.local import LocalLocation
from actstore.core.storage.memory import MemoryLocation
from actstore.core.storage.objects import ObjectLocation
from actstore.core.storage.s3 import S3Location, s3_options


def locate(url: str | os.PathLike[str]) -> StoreLocation:
    """Resolve a store URL or path.  S3 settings come from the standard AWS environment variables."""
    text = os.fspath(url)
    if "://" not in text:
        text = os.path.abspath(text)
        return LocalLocation(url=text, fs=fsspec.filesystem("file"), root=text)
    options = s3_options() if text.startswith("s3://") else {}
    try:
        fs, root = fsspec.core.url_to_fs(text, **options)
    except ImportError as e:
        raise StorageError(f"{text}: no filesystem for this URL scheme ({e})") from None
    except ValueError as e:
        raise StorageError(f"{text}: not a store URL ({e})") from None
    return _backend(fs)(url=text, fs=fs, root=root.rstrip("/"), options=options)


def _backend(fs: Any) -> type[StoreLocation]:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if "file" in protocols:
        return LocalLocation
    if type(fs).__name__ == "S3FileSystem":
        return S3Location
    if "memory" in protocols:
        return MemoryLocation
    return ObjectLocation
