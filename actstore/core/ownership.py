"""What an ingest may delete: only what is provably an actstore store (or the remains of one).

``--overwrite`` empties a directory only when its ``manifest.json`` is a valid actstore manifest
(format name, version and checksum checked); the remains of a creation killed before its
manifest are deleted only when their ``.creating`` marker carries actstore's signature (written
atomically by the creating process).  Before deleting anything the whole tree is listed
without following links: a symbolic link, a named pipe, a socket or a device anywhere, or a
top-level entry a store never holds, and nothing is deleted.  The caller holds the writer lock
(:mod:`actstore.core.lock`), whose file is kept.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time

from actstore.core.errors import ActstoreError, NotOursError, StoreExistsError
from actstore.core.lock import LOCK_NAME
from actstore.core.manifest import FORMAT_NAME, FORMAT_VERSION, Manifest
from actstore.core.storage.base import StoreLocation

CREATING = ".creating"  # present while a store is being created, before its manifest exists
CREATING_SIGNATURE = "actstore store being created"
# Top-level entries a store holds (and the temporary files of their atomic writes).
STORE_ENTRIES = frozenset(
    {
        "manifest.json",
        CREATING,
        "commits",
        "segments",
        "snapshot",
        "tables",
        "weights",
        "weights.json",
        "tokenizer",
        LOCK_NAME,
    }
)
_TEMP = re.compile(r"^((manifest|weights)\.json|\.creating)\.tmp-[0-9a-f]{32}$|^\.tmp-weights-[0-9a-f]{32}$")
_MAX_SMALL_FILE = 16 * 1024 * 1024


def creating_marker() -> bytes:
    """The contents of ``.creating``: actstore's signature and who started the creation."""
    return json.dumps(
        {
            "format": FORMAT_NAME,
            "signature": CREATING_SIGNATURE,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.time(),
        },
        sort_keys=True,
    ).encode()


def signed_creating(loc: StoreLocation) -> bool:
    """True when ``.creating`` is actstore's marker (a regular file carrying its signature)."""
    data = loc.read_if_regular(CREATING, _MAX_SMALL_FILE)
    if data is None:
        return False
    try:
        d = json.loads(data)
    except (ValueError, RecursionError):
        return False
    return isinstance(d, dict) and d.get("format") == FORMAT_NAME and d.get("signature") == CREATING_SIGNATURE


def manifest_problem(loc: StoreLocation) -> str | None:
    """None when ``manifest.json`` is a valid actstore manifest this version reads, else why not."""
    data = loc.read_if_regular("manifest.json", _MAX_SMALL_FILE)
    if data is None:
        return "its manifest.json is not a regular file actstore can read"
    try:
        d = json.loads(data)
    except (ValueError, RecursionError):
        return "its manifest.json is not JSON"
    if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
        return "its manifest.json is not an actstore manifest"
    version = d.get("format_version")
    if type(version) is not int or not 1 <= version <= FORMAT_VERSION:
        return f"its manifest.json has format version {version!r}, not one this actstore writes (1..{FORMAT_VERSION})"
    try:
        Manifest.from_json(data, loc.url)
    except (ActstoreError, ValueError, TypeError, KeyError, RecursionError) as e:
        return f"its manifest.json is not valid ({' '.join(str(e).split())})"
    return None


def entries(loc: StoreLocation) -> list[str]:
    """Top-level names in the store root, the writer lock left out."""
    return [n for n in loc.listdir("") if n != LOCK_NAME]


def _foreign_entry(loc: StoreLocation, names: list[str]) -> str | None:
    """The first thing under the root actstore would not have written: a top-level name a store
    never holds, or (locally) a symbolic link, pipe, socket or device anywhere in the tree."""
    for name in names:
        if name not in STORE_ENTRIES and not _TEMP.match(name):
            return name
    return loc.first_special_entry(names)


def check_root(loc: StoreLocation, *, overwrite: bool) -> str | None:
    """Whether a new store may be created at ``loc``, without deleting anything: None when the root
    is missing or empty, the reason a wipe is allowed when it holds a store to overwrite or the
    signed remains of a killed creation; anything else raises :class:`StoreExistsError` (one line).
    Run before the lock so bad requests fail at once, and again under it by :func:`prepare_root`."""
    if loc.root_is_non_directory():
        raise StoreExistsError(f"{loc.url} exists and is not a directory; refusing to write there")
    if loc.root_is_link() and entries(loc):
        raise NotOursError(
            f"{loc.url} is a symbolic link; actstore does not delete through links (give the real path)"
        )
    names = entries(loc)
    if not names:
        return None
    if "manifest.json" in names:
        if not overwrite:
            raise StoreExistsError(
                f"{loc.url} already holds a store (use --resume to continue it, or --overwrite)"
            )
        problem = manifest_problem(loc)
        if problem is not None:
            raise NotOursError(
                f"--overwrite: {loc.url} is not an actstore store ({problem}); nothing was deleted"
            )
        why = "--overwrite replaces the store there"
    elif CREATING in names:
        if not signed_creating(loc):
            raise NotOursError(
                f"{loc.url} holds a {CREATING} file that actstore did not write; refusing to delete anything there"
            )
        why = "it holds the remains of an interrupted store creation"
    else:
        raise StoreExistsError(f"{loc.url} exists and is not an empty directory; refusing to write there")
    foreign = _foreign_entry(loc, names)
    if foreign is not None:
        raise NotOursError(
            f"{loc.url}: {why}, but it holds {foreign!r}, which actstore does not write there (a link, a special "
            f"file or a foreign name); nothing was deleted"
        )
    return why


def prepare_root(loc: StoreLocation, *, overwrite: bool) -> None:
    """Make ``loc`` an empty directory a new store may be created in, deleting only what
    :func:`check_root` proved to be actstore's.  The caller holds the writer lock.

    ``.creating`` is written first and ``manifest.json`` removed next, so a wipe killed half way
    leaves signed remains the next create may delete, never a half-deleted store that looks whole.
    """
    if check_root(loc, overwrite=overwrite) is None:
        return
    _wipe(loc)


def _wipe(loc: StoreLocation) -> None:
    """Everything under the root but the lock and ``.creating`` removed, ``.creating`` written first."""
    names = entries(loc)
    loc.write_bytes_atomic(CREATING, creating_marker())
    for name in ["manifest.json"] + sorted(n for n in names if n not in ("manifest.json", CREATING)):
        if name not in names:
            continue
        loc.remove_tree(name)  # does not follow symbolic links (and none were found)


def discard_created(loc: StoreLocation) -> None:
    """Remove the store this process created at ``loc`` (the root was missing or empty before; the
    caller holds the writer lock), leaving the root as empty as it found it: a write that failed half
    way on bad input.  The same order as :func:`prepare_root`: killed half way, it leaves signed
    remains the next create may delete; nothing when the root holds what :func:`check_root` would
    not delete."""
    try:
        if check_root(loc, overwrite=True) is None:
            return
    except (StoreExistsError, NotOursError):
        return
    _wipe(loc)
    loc.remove_tree(CREATING)
