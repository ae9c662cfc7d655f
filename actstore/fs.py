"""Where a store's bytes live: a local directory or an fsspec URL (s3://, memory://, ...).

Everything above this module speaks in paths relative to the store root.  Local
directories get atomic writes through ``os.replace``; object stores get them for free,
since a PUT is atomic per object.
"""

from __future__ import annotations

import os
import posixpath
import uuid
from dataclasses import dataclass
from typing import Any

import fsspec
import pyarrow.fs as pafs


@dataclass(frozen=True)
class StoreLocation:
    """A store root: ``url`` as the user gave it, ``fs`` its fsspec filesystem, ``root`` the path in ``fs``."""

    url: str
    fs: Any
    root: str

    @property
    def is_local(self) -> bool:
        return "file" in _protocols(self.fs)

    def path(self, rel: str) -> str:
        return posixpath.join(self.root, rel) if rel else self.root

    def exists(self, rel: str) -> bool:
        return bool(self.fs.exists(self.path(rel)))

    def read_bytes(self, rel: str) -> bytes:
        data: bytes = self.fs.cat_file(self.path(rel))
        return data

    def write_bytes_atomic(self, rel: str, data: bytes) -> None:
        """Write ``data`` so that readers see either the old object or the whole new one."""
        target = self.path(rel)
        if self.is_local:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            tmp = f"{target}.tmp-{uuid.uuid4().hex}"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        else:
            self.fs.pipe_file(target, data)

    def listdir(self, rel: str) -> list[str]:
        """Names (not paths) directly under ``rel``; empty when it does not exist."""
        p = self.path(rel)
        if not self.fs.exists(p):
            return []
        return sorted(posixpath.basename(e.rstrip("/")) for e in self.fs.ls(p, detail=False))

    def remove_tree(self, rel: str) -> None:
        p = self.path(rel)
        if self.fs.exists(p):
            self.fs.rm(p, recursive=True)

    def makedirs(self, rel: str) -> None:
        if self.is_local:
            os.makedirs(self.path(rel), exist_ok=True)

    def zarr_store(self, rel: str, *, read_only: bool) -> Any:
        """A zarr v3 store object for the group at ``rel``."""
        import zarr.storage

        if self.is_local:
            return zarr.storage.LocalStore(self.path(rel), read_only=read_only)
        return zarr.storage.FsspecStore(self.fs, path=self.path(rel), read_only=read_only)

    def arrow_filesystem(self) -> pafs.FileSystem:
        if self.is_local:
            return pafs.LocalFileSystem()
        return pafs.PyFileSystem(pafs.FSSpecHandler(self.fs))


def _protocols(fs: Any) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


def locate(url: str | os.PathLike[str]) -> StoreLocation:
    """Resolve a store URL or path.  S3 settings come from the standard AWS environment variables."""
    text = os.fspath(url)
    if "://" not in text:
        text = os.path.abspath(text)
        fs = fsspec.filesystem("file")
        return StoreLocation(url=text, fs=fs, root=text)
    options: dict[str, Any] = {}
    if text.startswith("s3://"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3")
        if endpoint:
            options["client_kwargs"] = {"endpoint_url": endpoint}
        options["skip_instance_cache"] = True
    fs, root = fsspec.core.url_to_fs(text, **options)
    return StoreLocation(url=text, fs=fs, root=root.rstrip("/"))
