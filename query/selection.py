"""Selections: a SQL predicate (or query) over the tables picks target rows; features follow.

    sel = store.select("relation_id = 'P17' AND split = 'val'")
    sel = Selection.from_sql(store, "relation_id = $rel", params={"rel": "P17"})   # values bound, not pasted
    x = sel.features("attn_head", layers=[3, 4])            # numpy [n, 2, H, d_model]
    for ids, x in sel.iter_features("z", batch_rows=256):   # streaming, whole chunks per read
        ...
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa

from actstore.errors import QueryError
from actstore.sql import Params, predicate, run_sql, subquery
from actstore.store import Store
from query.features import FeatureSpec, RowBlock, compute_block

_ROWS_SQL = """
SELECT t.example_id, t.row, t.segment, t.seg_row, t.src_start, t.n_src, e.subject_start, e.subject_end
FROM targets t JOIN examples e USING (example_id)
WHERE {cond}
ORDER BY t.row
"""


@dataclass(frozen=True)
class Selection:
    """Target rows of a store, in store (row) order."""

    store: Store
    rows: pa.Table  # columns of _ROWS_SQL

    @classmethod
    def from_sql(cls, store: Store, where: str | None = None, *, query: str | None = None,
                 params: Params | None = None, memory_limit: str | None = None,
                 timeout: float | None = None) -> Selection:
        """``where``: one SQL expression over ``examples``; ``query``: one SELECT returning ``example_id``.

        Each is parsed on its own (:func:`actstore.sql.predicate`, :func:`actstore.sql.subquery`) before
        it is placed in the selection's query, so it cannot end that query or add a statement.
        ``params``: values for the placeholders of ``where`` / ``query`` (``?`` with a list, ``$name``
        with a dict), bound by DuckDB.
        ``memory_limit`` / ``timeout``: the SQL limits (default: those in force, see :mod:`actstore.sql`).
        """
        if where is not None and query is not None:
            raise QueryError("give a WHERE predicate or a query, not both")
        if query is not None:
            cond = f"t.example_id IN (SELECT example_id FROM {subquery(query)})"
        elif where is not None and where.strip():
            cond = f"t.example_id IN (SELECT example_id FROM examples WHERE {predicate(where)})"
        else:
            cond = "TRUE"
        return cls(store, run_sql(store, _ROWS_SQL.format(cond=cond), params=params, memory_limit=memory_limit,
                                  timeout=timeout))

    @classmethod
    def from_ids(cls, store: Store, example_ids: Sequence[int]) -> Selection:
        """The target rows of these examples (in store order; unknown ids select nothing)."""
        ids = [int(i) for i in example_ids]
        return cls.from_sql(store, query="SELECT unnest($ids::BIGINT[]) AS example_id", params={"ids": ids})

    def __len__(self) -> int:
        return self.rows.num_rows

    def __repr__(self) -> str:
        return f"<Selection of {len(self)} target rows from {self.store.url!r}>"

    def _repr_html_(self) -> str:
        """For notebooks: the row count, rows per relation and the first few prompts."""
        from html import escape

        n = len(self)
        ids = self.example_ids[:5].tolist()
        head = ""
        if ids:
            ex = self.store.sql("SELECT example_id, relation_id, text FROM examples "
                                "WHERE list_contains($ids::BIGINT[], example_id) ORDER BY example_id",
                                {"ids": [int(i) for i in ids]}).to_pylist()
            head = "".join(f"<tr><td>{r['example_id']}</td><td>{escape(str(r['relation_id']))}</td>"
                           f"<td style='text-align:left'>{escape(str(r['text']))}</td></tr>" for r in ex)
            head = f"<table><tr><th>example_id</th><th>relation</th><th>text</th></tr>{head}</table>"
        rel = ""
        if n:
            counts: dict[str, int] = {}
            ex_rel = self.store.table("examples", ["example_id", "relation_id"])
            id_rel = dict(zip(ex_rel.column(0).to_pylist(), ex_rel.column(1).to_pylist()))
            for e in self.example_ids.tolist():
                r = str(id_rel.get(e))
                counts[r] = counts.get(r, 0) + 1
            rel = ", ".join(f"{escape(k)} ({v})" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:12])
            rel = f"<p>per relation: {rel}{', ...' if len(counts) > 12 else ''}</p>"
        return (f"<div><b>Selection</b> of {n} target rows from <code>{escape(self.store.url)}</code>{rel}"
                f"{head}</div>")

    @property
    def example_ids(self) -> np.ndarray:
        return self.rows.column("example_id").to_numpy()

    def blocks(self, batch_rows: int | None = None) -> Iterator[tuple[np.ndarray, RowBlock]]:
        """(example ids, RowBlock) per segment, split into at most ``batch_rows`` rows each."""
        cols = {name: self.rows.column(name).to_numpy() for name in self.rows.column_names}
        segs = cols["segment"]
        if segs.size == 0:
            return
        bounds = np.flatnonzero(np.diff(segs)) + 1
        for part in np.split(np.arange(segs.size), bounds):
            step = batch_rows or part.size
            for i in range(0, part.size, step):
                p = part[i:i + step]
                yield cols["example_id"][p], RowBlock(
                    segment=int(segs[p[0]]),
                    seg_rows=cols["seg_row"][p].astype(np.int64),
                    src_start=cols["src_start"][p].astype(np.int64),
                    n_src=cols["n_src"][p].astype(np.int64),
                    subject_start=cols["subject_start"][p].astype(np.int64),
                    subject_end=cols["subject_end"][p].astype(np.int64),
                )

    def iter_features(
        self,
        kind: str,
        *,
        layers: Sequence[int] | None = None,
        heads: Sequence[int] | None = None,
        groups: int | None = None,
        batch_rows: int = 256,
        output: Literal["numpy", "torch"] = "numpy",
    ) -> Iterator[tuple[np.ndarray, Any]]:
        """Stream (example ids, features) in batches of at most ``batch_rows`` rows."""
        spec = FeatureSpec.parse(self.store, kind, layers, heads, groups)
        for ids, block in self.blocks(batch_rows):
            x = compute_block(self.store, spec, block)
            yield ids, _convert(x, output)

    def features(
        self,
        kind: str,
        *,
        layers: Sequence[int] | None = None,
        heads: Sequence[int] | None = None,
        groups: int | None = None,
        output: Literal["numpy", "torch"] = "numpy",
    ) -> Any:
        """All selected rows' features at once (see :mod:`query.features` for shapes)."""
        spec = FeatureSpec.parse(self.store, kind, layers, heads, groups)
        parts = [compute_block(self.store, spec, b) for _, b in self.blocks()]
        if not parts:
            raise QueryError("the selection is empty")
        if kind in ("attn_head_token", "attn_prob"):
            parts = _pad_sources(parts)
        return _convert(np.concatenate(parts, axis=0), output)


def _pad_sources(parts: list[np.ndarray]) -> list[np.ndarray]:
    S = max(p.shape[3] for p in parts)
    out = []
    for p in parts:
        pad = [(0, 0)] * p.ndim
        pad[3] = (0, S - p.shape[3])
        out.append(np.pad(p, pad))
    return out


def _convert(x: np.ndarray, output: str) -> Any:
    if output == "torch":
        import torch

        return torch.from_numpy(x)
    if output != "numpy":
        raise QueryError(f"unknown output {output!r} (numpy, torch)")
    return x
