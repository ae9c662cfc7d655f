"""A commit marker's object list checked in two regular-expression matches (``_objects_ok``) accepts
exactly what the per-entry checks accept (hostile keys and values: newlines, ``..``, long, non-hex,
not strings), for either hash a marker may list: SHA-256 (64 hex digits) or XXH3-128 (32, format 4)."""

from __future__ import annotations

import re
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from actstore.core.manifest import _objects_ok

KEY = re.compile(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*")
HEX = {"sha256": re.compile(r"[0-9a-f]{64}"), "xxh3": re.compile(r"[0-9a-f]{32}")}
GOOD = "0123456789abcdef" * 4
SHORT = GOOD[:32]


def per_entry(objects: dict[str, Any], algorithm: str) -> bool:
    return all(
        KEY.fullmatch(k) is not None
        and ".." not in k.split("/")
        and len(k) <= 512
        and isinstance(v, str)
        and HEX[algorithm].fullmatch(v) is not None
        for k, v in objects.items()
    )


keys = st.one_of(
    st.sampled_from(
        ["zarr.json", "z/c/0/0/0/0", "resid/zarr.json", "a/../b", "..", "a/..", "../a", "a..b/c"]
    ),
    st.text(alphabet="ab./_-\n0", min_size=0, max_size=12),
    st.just("k" * 513),
    st.just("k" * 512),
)
values = st.one_of(
    st.just(GOOD),
    st.just(GOOD.upper()),
    st.just(GOOD + "\n" + GOOD),
    st.just(GOOD[:-1]),
    st.just(SHORT),
    st.just(SHORT + "0"),
    st.just(SHORT + "\n"),
    st.just(GOOD + "\n"),
    st.text(alphabet="0123456789abcdefg\n", min_size=63, max_size=65),
    st.text(alphabet="0123456789abcdefg\n", min_size=31, max_size=33),
    st.integers(),
    st.none(),
)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(keys, values, max_size=6), st.sampled_from(["sha256", "xxh3"]))
def test_batched_check_accepts_only_what_each_entry_passes(objects: dict[str, Any], algorithm: str) -> None:
    assert _objects_ok(objects, algorithm) == per_entry(objects, algorithm)


def test_a_joined_newline_cannot_pass_for_two_entries() -> None:
    for algorithm, good in (("sha256", GOOD), ("xxh3", SHORT)):
        assert _objects_ok({"a": good, "b": good}, algorithm)
        assert not _objects_ok({"a\nb": good}, algorithm)
        assert not _objects_ok({"a": good + "\n" + good}, algorithm)
        assert not _objects_ok({"a": good, "b/../c": good}, algorithm)


def test_a_digest_of_the_other_hash_is_refused() -> None:
    assert not _objects_ok({"a": SHORT}, "sha256")
    assert not _objects_ok({"a": GOOD}, "xxh3")
