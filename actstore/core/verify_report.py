"""``actstore verify``'s report, and reading a file against the SHA-256 recorded for it."""

from __future__ import annotations

from dataclasses import dataclass, field

from actstore.core.errors import ActstoreError
from actstore.core.store import StoreReader
from actstore.core.tables import sha256


@dataclass
class VerifyReport:
    store: str
    segments_checked: int = 0
    chunks_checked: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # limits of what could be checked (older stores)
    uncommitted: list[int] = field(default_factory=list)  # segments the manifest promises, not committed
    values_checked: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def status(self) -> str:
        """``ok``, ``INCOMPLETE`` (only uncommitted segments are wrong) or ``CORRUPT``."""
        if self.ok:
            return "ok"
        n_uncommitted = sum(
            1 for p in self.problems if p.startswith(("segment ", "segments ")) and "not committed" in p
        )
        return "INCOMPLETE" if n_uncommitted == len(self.problems) else "CORRUPT"


def read_hashed(
    store: StoreReader,
    report: VerifyReport,
    rel: str,
    max_bytes: int,
    want: str | None,
    missing: str,
    recorded_in: str,
) -> bytes | None:
    """The bytes of ``rel`` when it exists, can be read and has the SHA-256 ``want``; else None, with the
    problem reported (``missing``: why it should be there; ``recorded_in``: what records its hash)."""
    try:
        data = store.location.read_bytes(rel, max_bytes)
    except FileNotFoundError:
        report.problems.append(f"{rel}: missing ({missing})")
        return None
    except (ActstoreError, OSError) as e:
        report.problems.append(f"{rel}: cannot be read: {e}")
        return None
    if sha256(data) != want:
        report.problems.append(f"{rel}: SHA-256 does not match {recorded_in}")
        return None
    return data
