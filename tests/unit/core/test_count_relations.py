"""``count_relations`` (``actstore info``'s rows per relation from the relation index) against a plain
Python count: ids and names with nulls, repeats and non-ASCII text, several chunks."""

from __future__ import annotations

from collections import Counter

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from actstore.core.relation_index import count_relations

TEXT = st.one_of(st.none(), st.sampled_from(["P17", "P177", "p17", "Ä", "R\u00e9", "", "z", "\U0001f600"]))


def plain(pairs: list[tuple[str | None, str | None]]) -> list[dict[str, object]]:
    counts = Counter(r for r, _ in pairs)
    out = []
    for r in sorted(counts, key=lambda r: (r is None, r or "")):
        names = [n for q, n in pairs if q == r and n is not None]
        out.append({"relation_id": r, "relation_name": min(names) if names else None, "n": counts[r]})
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(TEXT, TEXT), min_size=1, max_size=60), st.integers(1, 4))
def test_counts_equal_a_plain_count(pairs: list[tuple[str | None, str | None]], n_chunks: int) -> None:
    step = -(-len(pairs) // n_chunks)
    chunks = [pairs[i : i + step] for i in range(0, len(pairs), step)]
    table = pa.Table.from_batches(
        [
            pa.record_batch(
                [pa.array([r for r, _ in c], pa.string()), pa.array([n for _, n in c], pa.string())],
                names=["relation_id", "relation_name"],
            )
            for c in chunks
        ]
    )
    assert count_relations(table) == plain(pairs)


def test_an_empty_table_has_no_relations() -> None:
    empty = pa.table({"relation_id": pa.array([], pa.string()), "relation_name": pa.array([], pa.string())})
    assert count_relations(empty) == []
