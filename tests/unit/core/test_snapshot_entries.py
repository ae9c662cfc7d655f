"""The snapshot's segment entries and file coverage, checked by numpy (``_segments``, ``_cover_once``),
against the per-entry loop they replace: the same accepted snapshots, the same segments, and a refusal
(one ``CorruptStoreError``) for every entry the loop refused (floats, booleans, short entries,
duplicates, out of range)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actstore.core.errors import CorruptStoreError
from actstore.core.manifest import MAX_COUNT
from actstore.core.snapshot import TableFile, _cover_once, _segments

N_SEGMENTS = 12


def loop(raw: list[Any]) -> dict[int, tuple[int, int]] | None:
    """The per-entry check (None: refused)."""
    out: dict[int, tuple[int, int]] = {}
    for entry in raw:
        if not (
            isinstance(entry, list)
            and len(entry) == 3
            and all(isinstance(v, int) and not isinstance(v, bool) for v in entry)
        ):
            return None
        seg, a, b = entry
        if not 0 <= seg < N_SEGMENTS or seg in out or not (0 <= a <= MAX_COUNT and 0 <= b <= MAX_COUNT):
            return None
        out[seg] = (a, b)
    return dict(sorted(out.items()))


value = st.one_of(
    st.integers(-2, N_SEGMENTS + 2),
    st.integers(0, 5),
    st.just(MAX_COUNT + 1),
    st.just(1 << 70),
    st.just(True),
    st.just(1.0),
    st.none(),
)
entry = st.one_of(
    st.lists(st.integers(0, N_SEGMENTS - 1), min_size=1, max_size=1).map(lambda s: [s[0], 3, 4]),
    st.lists(value, min_size=3, max_size=3),
    st.lists(value, min_size=0, max_size=4),
    st.just("x"),
)


@settings(max_examples=500, deadline=None)
@given(st.lists(entry, max_size=8))
def test_entries_as_the_loop_checks_them(raw: list[Any]) -> None:
    want = loop(raw)
    if want is None:
        with pytest.raises(CorruptStoreError):
            _segments(raw, "s", N_SEGMENTS)
    else:
        got = _segments(raw, "s", N_SEGMENTS)
        assert got == want and list(got) == sorted(got)


def file(first: int, last: int) -> TableFile:
    return TableFile("tables/examples/c000001-000.parquet", "0" * 64, 0, 0, first, last, -1, -1)


@settings(max_examples=500, deadline=None)
@given(
    st.sets(st.integers(0, 20), max_size=10),
    st.lists(st.tuples(st.integers(0, 20), st.integers(0, 6)), max_size=5),
)
def test_cover_once_as_a_count_per_segment(segs: set[int], ranges: list[tuple[int, int]]) -> None:
    files = tuple(file(a, a + w) for a, w in ranges)
    covered = [s for f in files for s in segs if f.first <= s <= f.last]
    want = sorted(covered) == sorted(segs)
    assert _cover_once(files, np.array(sorted(segs), dtype=np.int64)) == want
