"""``text_depth`` (the nesting check of every manifest, marker and snapshot actstore reads) gives the
depth ``json_depth`` counts on the parsed value, for any JSON (strings holding brackets, quotes and
backslashes included)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from actstore.core.manifest import json_depth, text_depth

NASTY = st.text(alphabet='[]{}"\\,: ab\n\u00e9', max_size=12)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | NASTY,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(NASTY, inner, max_size=4),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None)
@given(JSON, st.booleans())
def test_text_depth_is_the_parsed_depth(value: Any, compact: bool) -> None:
    text = json.dumps(value, separators=(",", ":") if compact else None, ensure_ascii=not compact)
    assert text_depth(text.encode()) == json_depth(value)


def test_deep_text_is_counted() -> None:
    assert text_depth(b'{"a": "[[[[", "b": ' + b"[" * 40 + b"]" * 40 + b"}") == 41
