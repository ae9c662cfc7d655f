"""The converted-model cache: where it lives, who may write a folder in it, and the GGUF hash index.

Location: ``$ACTSTORE_CACHE`` when set, else ``models/`` under the platform's user cache folder
for actstore (``platformdirs.user_cache_dir("actstore")``: ``~/.cache/actstore`` on Linux, or
``$XDG_CACHE_HOME/actstore``; ``~/Library/Caches/actstore`` on macOS).

Writers hold a ``filelock.FileLock`` per cache folder (``.locks/<folder>.lock``) while they
build it, so two processes never convert the same model at once: the second waits, then finds
the folder complete and reuses it.  The operating system releases the lock of a process that
dies, so a killed conversion never blocks later ones; its temporary folder is removed by the
next writer that takes the lock.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import platformdirs
from filelock import FileLock, Timeout

from .base import ModelError

__all__ = ["CACHE_ENV", "LOCK_TIMEOUT_S", "conversion_lock", "model_cache_dir", "file_sha256"]

logger = logging.getLogger(__name__)

CACHE_ENV = "ACTSTORE_CACHE"
"""Environment variable that overrides the cache folder."""
LOCK_TIMEOUT_S = 3600.0
"""How long a process waits for another one's conversion (a real one takes a minute or two)."""

HASH_INDEX = "gguf-sha256.json"
LOCK_DIR = ".locks"
_CHUNK = 1 << 20


def model_cache_dir() -> Path:
    """``$ACTSTORE_CACHE`` if set, else ``<platformdirs.user_cache_dir("actstore")>/models``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path(platformdirs.user_cache_dir("actstore", appauthor=False)) / "models"


def _lock(cache: Path, name: str, timeout: float) -> FileLock:
    folder = cache / LOCK_DIR
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelError(f"cannot create the model cache folder {folder}: {exc.strerror or exc}") from exc
    return FileLock(str(folder / f"{name}.lock"), timeout=timeout)


@contextlib.contextmanager
def conversion_lock(cache: Path, name: str, timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold the lock of cache folder ``name`` (waiting up to ``timeout`` seconds for another process).

    Raises ModelError when the lock is not free within ``timeout``.
    """
    lock = _lock(cache, name, timeout)
    try:
        lock.acquire(blocking=False)
    except Timeout:
        logger.info("waiting for another process that is converting %s (lock %s)", name, lock.lock_file)
        try:
            lock.acquire(timeout=timeout)
        except Timeout:
            raise ModelError(
                f"another process has held the lock {lock.lock_file} for over {timeout:g} s while converting "
                f"{name}; wait for it to finish (the lock is released when that process ends), or set "
                f"{CACHE_ENV} to another folder"
            ) from None
    try:
        yield
    finally:
        lock.release()


def is_complete(folder: Path, marker: str, version: int) -> bool:
    """Whether ``folder`` holds the completion ``marker`` (JSON) of format ``version``."""
    path = folder / marker
    if not path.is_file():
        return False
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("format") == version


def temp_prefix(name: str, kind: str) -> str:
    """Prefix of a temporary entry (``kind``: ``convert``, ``gguf``, ``broken``) for folder ``name``."""
    return f".tmp-{name}-{kind}-"


def remove_temps(cache: Path, name: str) -> None:
    """Remove the temporary entries left for cache folder ``name`` by killed writers.

    Call it holding ``conversion_lock(cache, name)``: then no live process owns any of them.
    """
    if not cache.is_dir():
        return
    pattern = re.compile(rf"^\.tmp-{re.escape(name)}-(convert|gguf|broken)-")
    for entry in cache.iterdir():
        if not pattern.match(entry.name):
            continue
        logger.debug("removing the leftover %s", entry)
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                entry.unlink()


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path`` and rename it into place."""
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _read_index(path: Path) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        loaded = json.loads(path.read_text())
        if isinstance(loaded, dict):
            return loaded
    return {}


def file_sha256(path: Path, cache: Path) -> str:
    """sha256 of a file (read in 1 MB chunks), remembered in ``cache/gguf-sha256.json`` by path,
    size and modification time, so an unchanged file is hashed once."""
    stat = path.stat()
    key = str(path.resolve())
    index_path = cache / HASH_INDEX
    entry = _read_index(index_path).get(key)
    if (
        isinstance(entry, dict)
        and entry.get("size") == stat.st_size
        and entry.get("mtime_ns") == stat.st_mtime_ns
        and isinstance(entry.get("sha256"), str)
    ):
        return str(entry["sha256"])
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(_CHUNK):
            digest.update(block)
    sha = digest.hexdigest()
    # The index is only a shortcut: when it cannot be written, the file is hashed again next time.
    with contextlib.suppress(OSError, ModelError, Timeout), _lock(cache, HASH_INDEX, 60.0):
        index = _read_index(index_path)  # re-read under the lock: keep other processes' entries
        index[key] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha}
        write_atomic(index_path, json.dumps(index, indent=1, sort_keys=True))
    return sha
