"""The relation index: which examples belong to a relation, without scanning ``examples``.

Compacted ``examples`` files are in store order (row groups pruned by ``example_id``), so a filter on
``relation_id`` cannot skip any of their row groups: the first 64 rows of one relation scanned every
``relation_id`` of the store (about 53 ms at 10^6 rows).  Compaction therefore writes, beside each
examples file ``tables/examples/cNNNNNN-KKK.parquet``, its index ``iNNNNNN-KKK.parquet``: the file's
``(relation_id, example_id)`` pairs sorted by relation, then example, in row groups of
:data:`~actstore.core.snapshot.INDEX_GROUP_ROWS` rows whose min/max statistics name the relations they
hold.  The snapshot lists the index files (path, SHA-256, rows, segments) with the others; they are
written before it, removed with it, hash-checked once per open store before first use, and ``actstore
verify`` checks that each one holds exactly its examples file's pairs, in that order.

A reader asks :func:`candidates` for the example ids of some relations: it reads only the row groups
whose statistics can hold them.  A query step uses the ids as bounds on ``example_id`` (which prune
the store-ordered files), never as its answer: the selection's own condition still decides every row.
The index covers the snapshot's segments; while segments beyond the snapshot exist (an ingest
running) there is no answer (None) and queries scan, as before.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from actstore.core.errors import CorruptStoreError
from actstore.core.snapshot import INDEX_GROUP_ROWS
from actstore.core.sql import where_tree

if TYPE_CHECKING:
    from actstore.core.store import StoreReader

INDEX_SCHEMA = pa.schema(
    [("relation_id", pa.string()), ("relation_name", pa.string()), ("example_id", pa.int64())]
)


def index_table(parts: Iterable[pa.Table]) -> pa.Table:
    """The index of the examples rows ``parts``: their ``(relation_id, relation_name, example_id)``,
    sorted by relation, then example (nulls last)."""
    pieces = [p.select(INDEX_SCHEMA.names).cast(INDEX_SCHEMA) for p in parts]
    whole = pa.concat_tables(pieces) if pieces else INDEX_SCHEMA.empty_table()
    return whole.sort_by([("relation_id", "ascending"), ("example_id", "ascending")])


def write_index(sink: Any, table: pa.Table) -> int:
    """Write index ``table`` to the binary file ``sink``; its rows."""
    writer = pq.ParquetWriter(  # (ids ascend within a relation: delta-packed, a few bits each)
        sink,
        INDEX_SCHEMA,
        compression="zstd",
        write_statistics=True,
        use_dictionary=["relation_id", "relation_name"],
        column_encoding={"example_id": "DELTA_BINARY_PACKED"},
    )
    writer.write_table(table, row_group_size=INDEX_GROUP_ROWS)
    writer.close()
    return table.num_rows


def _index_file(store: StoreReader, rel: str) -> pq.ParquetFile:
    """Index file ``rel``, hash-checked against the snapshot (once per open store), kept open."""
    cache: dict[str, pq.ParquetFile] = store.__dict__.setdefault("_relation_index_files", {})
    pf = cache.get(rel)
    if pf is None:
        data = store._table_bytes(rel)  # SHA-256 against the snapshot, or CorruptStoreError
        try:
            pf = pq.ParquetFile(pa.BufferReader(data))
        except Exception as e:
            raise CorruptStoreError(f"{store.url}/{rel}: unreadable Parquet ({type(e).__name__})") from None
        cache[rel] = pf
    return pf


def _groups_holding(pf: pq.ParquetFile, values: list[str]) -> list[int]:
    """Row groups of ``pf`` whose ``relation_id`` statistics may hold one of ``values`` (all of them
    when a row group has no statistics)."""
    md = pf.metadata
    col = pf.schema_arrow.get_field_index("relation_id")
    out = []
    for i in range(md.num_row_groups):
        st = md.row_group(i).column(col).statistics
        if st is None or not st.has_min_max:
            out.append(i)
        elif any(st.min <= v <= st.max for v in values):
            out.append(i)
    return out


def candidates(store: StoreReader, values: Iterable[str]) -> np.ndarray | None:
    """The sorted example ids whose ``relation_id`` is one of ``values``, from the relation index;
    None when the store has no index covering every committed segment (then the caller scans)."""
    snap = store.snapshot
    if snap is None or not snap.relation_index or len(snap.segments) != len(store.commits):
        return None
    wanted = sorted({str(v) for v in values})
    ids: list[np.ndarray] = []
    for f in snap.relation_index:
        pf = _index_file(store, f.path)
        groups = _groups_holding(pf, wanted)
        if not groups:
            continue
        part = pf.read_row_groups(groups, columns=["relation_id", "example_id"])
        keep = pc.is_in(part.column("relation_id"), value_set=pa.array(wanted, pa.string()))
        ids.append(part.column("example_id").filter(pc.fill_null(keep, False)).to_numpy())
    if not ids:
        return np.zeros(0, np.int64)
    return np.sort(np.concatenate(ids)).astype(np.int64)


def relation_counts(store: StoreReader) -> list[dict[str, Any]] | None:
    """Rows per relation, ``[{relation_id, relation_name, n}]`` ordered by ``relation_id`` (None last),
    from the relation index alone (``actstore info``: no scan of ``examples``, no DuckDB); the name is
    the smallest of the relation's names.  None when the index does not cover every committed segment."""
    snap = store.snapshot
    if snap is None or not snap.relation_index or len(snap.segments) != len(store.commits):
        return None
    files = [_index_file(store, f.path) for f in snap.relation_index]
    if any(pf.schema_arrow.names != INDEX_SCHEMA.names for pf in files):
        return None
    parts = [pf.read(columns=["relation_id", "relation_name"]) for pf in files]
    return count_relations(pa.concat_tables(parts))


def count_relations(table: pa.Table) -> list[dict[str, Any]]:
    """``[{relation_id, relation_name, n}]`` of a table of ``relation_id`` and ``relation_name`` columns:
    rows per relation id, ordered by id (None last), with the smallest of the relation's non-null names
    (None when it has none).  By dictionary codes and numpy: Arrow's ``group_by`` would import its
    Acero engine, which imports pandas (0.4 s of ``actstore info``)."""
    rid = table.column("relation_id").combine_chunks().dictionary_encode(null_encoding="encode")
    name = table.column("relation_name").combine_chunks().dictionary_encode(null_encoding="encode")
    r_idx, n_idx = _codes(rid.indices), _codes(name.indices)
    r_dict, n_dict = rid.dictionary.to_pylist(), name.dictionary.to_pylist()
    counts = np.bincount(r_idx, minlength=len(r_dict))
    name_order = sorted(range(len(n_dict)), key=lambda i: (n_dict[i] is None, n_dict[i] or ""))
    rank = np.empty(len(n_dict), dtype=np.int64)
    rank[name_order] = np.arange(len(n_dict))
    best = np.full(len(r_dict), len(n_dict), dtype=np.int64)
    np.minimum.at(best, r_idx, rank[n_idx])
    rows = [
        {
            "relation_id": r_dict[i],
            "relation_name": n_dict[name_order[b]] if b < len(n_dict) else None,
            "n": int(counts[i]),
        }
        for i, b in enumerate(best.tolist())
        if counts[i]
    ]
    return sorted(rows, key=lambda r: (r["relation_id"] is None, r["relation_id"] or ""))


def _codes(indices: pa.Array) -> np.ndarray:
    """Dictionary indices (no nulls: encoded with ``null_encoding="encode"``) as int64, read from the
    array's buffer (``to_numpy`` imports pandas)."""
    width = indices.type.bit_width // 8
    raw = np.frombuffer(
        indices.buffers()[1], dtype=f"<i{width}", count=len(indices), offset=indices.offset * width
    )
    return raw.astype(np.int64)


def relation_values(cond: str, params: Sequence[Any] | Mapping[str, Any] | None) -> frozenset[str] | None:
    """The relation ids a condition over ``examples`` restricts ``relation_id`` to, read from its parse
    tree: ``relation_id = v``, ``v = relation_id`` and ``relation_id IN (v, ...)`` with ``v`` a string
    literal or a bound parameter holding a string; of an ``AND``, the intersection of what its terms
    restrict (terms that restrict nothing ignored); of an ``OR``, the union when every branch restricts
    (a row that matches matches a branch, so its relation is in that branch's set), else nothing.  None
    when the condition restricts nothing (every row may match, as far as the index can tell)."""
    text = where_tree(cond)
    return None if text is None else _node_values(json.loads(text), params, 0)


_MAX_DEPTH = 64  # deeper AND/OR nesting restricts nothing here (the condition still decides every row)


def _node_values(
    node: Any, params: Sequence[Any] | Mapping[str, Any] | None, depth: int
) -> frozenset[str] | None:
    if not isinstance(node, dict) or depth > _MAX_DEPTH:
        return None
    kind = node.get("type")
    children = node.get("children")
    if kind in ("CONJUNCTION_AND", "CONJUNCTION_OR") and isinstance(children, list) and children:
        found: frozenset[str] | None = None
        for child in children:
            vals = _node_values(child, params, depth + 1)
            if vals is None and kind == "CONJUNCTION_OR":
                return None
            if vals is not None:
                found = (
                    vals if found is None else (found & vals if kind == "CONJUNCTION_AND" else found | vals)
                )
        return found
    return _restricts(node, params)


def _is_relation_column(node: Any, column: str = "relation_id") -> bool:
    """``column`` or ``examples.column`` (identifiers are case-insensitive)."""
    if not (isinstance(node, dict) and node.get("class") == "COLUMN_REF"):
        return False
    names = node.get("column_names")
    if not isinstance(names, list):
        return False
    return [str(n).lower() for n in names] in ([column], ["examples", column])


_FLIP = {
    "COMPARE_GREATERTHAN": "COMPARE_LESSTHAN",
    "COMPARE_GREATERTHANOREQUALTO": "COMPARE_LESSTHANOREQUALTO",
    "COMPARE_LESSTHAN": "COMPARE_GREATERTHAN",
    "COMPARE_LESSTHANOREQUALTO": "COMPARE_GREATERTHANOREQUALTO",
    "COMPARE_EQUAL": "COMPARE_EQUAL",
}


def id_bounds(cond: str, params: Sequence[Any] | Mapping[str, Any] | None) -> tuple[int | None, int | None]:
    """The smallest and largest ``example_id`` a condition allows, from its top-level conjuncts
    ``example_id <op> c`` (``c <op> example_id``; op one of = < <= > >=) and ``example_id BETWEEN a AND
    b`` with integer literals or bound integers; None where it says nothing (a limit's windows then
    start at the store's, or the relation's, first example)."""
    text = where_tree(cond)
    lo: int | None = None
    hi: int | None = None
    stack = [json.loads(text)] if text is not None else []
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        kind = node.get("type")
        if kind == "CONJUNCTION_AND":
            stack.extend(node.get("children", []))
            continue
        found: list[tuple[str, int | None]] = []
        if kind == "COMPARE_BETWEEN" and _is_relation_column(node.get("input"), "example_id"):
            found = [("COMPARE_GREATERTHANOREQUALTO", _int_value(node.get("lower"), params))]
            found.append(("COMPARE_LESSTHANOREQUALTO", _int_value(node.get("upper"), params)))
        elif kind in _FLIP:
            left, right, op = node.get("left"), node.get("right"), str(kind)
            if _is_relation_column(right, "example_id"):
                left, right, op = right, left, _FLIP[op]
            if _is_relation_column(left, "example_id"):
                found = [(op, _int_value(right, params))]
        for op, v in found:
            if v is None:
                continue
            if op in ("COMPARE_GREATERTHAN", "COMPARE_GREATERTHANOREQUALTO", "COMPARE_EQUAL"):
                b = v + (op == "COMPARE_GREATERTHAN")
                lo = b if lo is None else max(lo, b)
            if op in ("COMPARE_LESSTHAN", "COMPARE_LESSTHANOREQUALTO", "COMPARE_EQUAL"):
                b = v - (op == "COMPARE_LESSTHAN")
                hi = b if hi is None else min(hi, b)
    return lo, hi


def _bound(node: dict[str, Any], params: Sequence[Any] | Mapping[str, Any] | None) -> Any:
    """The value a parameter node (``$name``, ``$1``, ``?``) is bound to, None when unbound."""
    ident = str(node.get("identifier", ""))
    if isinstance(params, Mapping):
        return params.get(ident)
    if params is not None and ident.isdigit() and 1 <= int(ident) <= len(params):
        return params[int(ident) - 1]
    return None


def _int_value(node: Any, params: Sequence[Any] | Mapping[str, Any] | None) -> int | None:
    """An integer literal's value, or the integer a parameter is bound to (None for anything else)."""
    if not isinstance(node, dict):
        return None
    if node.get("class") == "CONSTANT":
        lit = node.get("literal")
        if isinstance(lit, dict) and lit.get("kind") == "INTEGER":
            try:
                return int(str(lit.get("text")))
            except ValueError:
                return None
        return None
    if node.get("class") == "PARAMETER":
        value = _bound(node, params)
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    return None


def _value(node: Any, params: Sequence[Any] | Mapping[str, Any] | None) -> str | None:
    """A string literal's text, or the string a parameter is bound to (None for anything else)."""
    if not isinstance(node, dict):
        return None
    if node.get("class") == "CONSTANT":
        lit = node.get("literal")
        if isinstance(lit, dict) and lit.get("kind") == "STRING" and isinstance(lit.get("text"), str):
            return str(lit["text"])
        return None
    if node.get("class") == "PARAMETER":
        value = _bound(node, params)
        return value if isinstance(value, str) else None
    return None


def _restricts(
    node: dict[str, Any], params: Sequence[Any] | Mapping[str, Any] | None
) -> frozenset[str] | None:
    kind = node.get("type")
    if kind == "COMPARE_EQUAL":
        left, right = node.get("left"), node.get("right")
        if _is_relation_column(right):
            left, right = right, left
        v = _value(right, params) if _is_relation_column(left) else None
        return None if v is None else frozenset([v])
    if kind == "COMPARE_IN":
        children = node.get("children", [])
        if not children or not _is_relation_column(children[0]):
            return None
        vals = [_value(c, params) for c in children[1:]]
        return None if any(v is None for v in vals) else frozenset(v for v in vals if v is not None)
    return None
