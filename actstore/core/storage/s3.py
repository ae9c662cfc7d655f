"""A store on S3 (or an S3-compatible server), through s3fs.

Settings come from the standard AWS environment variables (``AWS_ENDPOINT_URL`` or
``AWS_ENDPOINT_URL_S3`` for another server).  Reads and writes are :class:`ObjectLocation`'s.

The writer lock is the object ``.actstore-writer.lock``, written with a conditional PUT
(``If-None-Match: *``): the first writer creates it, every later one gets 412 and reads who holds
it.  A record its policy lets this writer replace is replaced with ``If-Match: <its ETag>``, and
release deletes only the ETag this writer wrote.  A server that ignores the conditions is caught by
reading the record back; the limits are in docs/security.md ("Writers").
"""

from __future__ import annotations

import os
from typing import Any

from fsspec.asyn import sync

from actstore.core.errors import ActstoreError, StorageError
from actstore.core.storage.base import LockPolicy, LockSlot, LockState
from actstore.core.storage.objects import ObjectLocation


def s3_options() -> dict[str, Any]:
    """The s3fs options of every S3 store: the endpoint from the environment, no cached listings."""
    options: dict[str, Any] = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        options["client_kwargs"] = {"endpoint_url": endpoint}
    # Other writers (ranks, a running ingest) add objects: never answer from a stale listing.
    options["use_listings_cache"] = False
    options["skip_instance_cache"] = True
    # One GET per object read: with s3fs's default (10), every whole-object read first asks the
    # object's size (a HEAD) to decide whether to fetch its parts concurrently.
    options["max_concurrency"] = 1
    return options


class S3Location(ObjectLocation):
    """A store root on S3 (``fs`` is an s3fs ``S3FileSystem``)."""

    def lock_slot(self, name: str, policy: LockPolicy, max_record: int) -> LockSlot:
        return S3LockSlot(self, name, policy, max_record)


class _Conflict(ActstoreError):
    """An S3 condition (If-None-Match, If-Match) failed: someone else's record is there."""


class S3LockSlot(LockSlot):
    """The lock object, taken and let go of with conditional requests."""

    def __init__(self, loc: S3Location, name: str, policy: LockPolicy, max_record: int) -> None:
        super().__init__(loc, name, policy, max_record)
        self._etag: str | None = None  # the ETag of the record this writer put

    def held(self) -> bool:
        return self._etag is not None

    def _call(self, op: str, **kwargs: Any) -> dict[str, Any]:
        """One S3 call on the lock object; a failed condition (412) raises :class:`_Conflict`."""
        bucket, key, _ = self.loc.fs.split_path(self.key)
        with self.loc.io():
            try:
                result: dict[str, Any] = self.loc.fs.call_s3(op, Bucket=bucket, Key=key, **kwargs)
            except Exception as e:
                if isinstance(e, FileExistsError) or _precondition_failed(e):
                    raise _Conflict(op) from None
                raise
        return result

    def _get(self) -> tuple[bytes | None, str | None]:
        """(record, ETag) of the lock object in one GET; (None, None) when there is none."""
        bucket, key, _ = self.loc.fs.split_path(self.key)
        fs, limit = self.loc.fs, self.max_record

        async def get() -> tuple[bytes, str | None]:
            resp = await fs._call_s3("get_object", Bucket=bucket, Key=key)
            try:
                data: bytes = await resp["Body"].read(limit)
            finally:
                resp["Body"].close()
            return data, resp.get("ETag")

        try:
            with self.loc.io():
                return sync(fs.loop, get)  # type: ignore[no-any-return]
        except FileNotFoundError:
            return None, None

    def read(self) -> bytes | None:
        return self._get()[0]

    def state(self) -> tuple[LockState, bytes | None]:
        return "unknown", self.read()  # only the record can tell whether its writer still runs

    def acquire(self, record: bytes) -> None:
        for _ in range(20):
            try:
                put: dict[str, Any] | None = self._call("put_object", Body=record, IfNoneMatch="*")
            except _Conflict:
                put = None
            if put is None:  # a record exists: may this writer replace it?
                previous, etag = self._get()
                if etag is None or previous is None:
                    continue  # released in between: try again
                self.policy.judge(previous, free=False)
                try:
                    put = self._call("put_object", Body=record, IfMatch=etag)
                except _Conflict:
                    continue  # another writer replaced it first
            self._etag = put.get("ETag")
            mine = self.read()  # a server that ignored the condition overwrote the record
            if not self.policy.mine(mine):
                self._etag = None
                self.policy.refuse_held(mine)
            return
        self.policy.refuse_held(None)

    def release(self) -> None:
        etag, self._etag = self._etag, None
        if etag is None:
            return
        try:
            self._call("delete_object", IfMatch=etag)
        except _Conflict:
            return  # no longer ours: leave it
        except FileNotFoundError:
            return
        except StorageError:  # a server without conditional deletes: delete it if the record is still ours
            if self.policy.mine(self.read()):
                self._call("delete_object")


def _precondition_failed(e: BaseException) -> bool:
    cur: BaseException | None = e
    while cur is not None:
        response = getattr(cur, "response", None)
        if isinstance(response, dict):
            err = response.get("Error", {})
            code = str(err.get("Code", ""))
            if code in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                return True
        cur = cur.__cause__ or cur.__context__
    return False
