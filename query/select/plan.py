"""The steps of a selection's plan.  Each maps its parent's rows (a table with the columns of
:data:`ROWS_SQL`, in store order) to a subset of them, in the same order; a split's parts share
their parent's rows (its SQL runs once)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from actstore.core.errors import EmptySelectionWarning, QueryError
from actstore.core.relation_index import candidates, id_bounds, relation_values
from actstore.core.snapshot import ROW_GROUP_ROWS
from actstore.core.sql import predicate, run_sql
from actstore.core.store import StoreReader

# The examples' condition filters a derived table, so that DuckDB carries a condition on example_id
# across the join into the targets scan (a point lookup prunes both tables' row groups); a semi-join
# (``t.example_id IN (SELECT ... WHERE ...)``) scanned every target row of the store.
ROWS_SQL = """
SELECT t.example_id, t.row, t.segment, t.seg_row, t.src_start, t.n_src, e.subject_start, e.subject_end,
       e.relation_id
FROM targets t JOIN (
    SELECT example_id, subject_start, subject_end, relation_id FROM examples WHERE {examples_cond}
) e USING (example_id)
WHERE {cond}
ORDER BY t.row
"""

# How many of the first ``limit`` examples matching a condition there are (at most ``limit``), and the
# last of them, in store order (a limit's first step, over a window of example ids).
FIRST_EXAMPLES_SQL = """
SELECT count(*), max(example_id) FROM (
    SELECT example_id FROM examples WHERE {examples_cond} ORDER BY example_id LIMIT {limit}
)
"""


@dataclass(frozen=True)
class QueryStep:
    """The first step: the target rows whose example matches ``where`` or whose id ``query`` returns."""

    cond: str  # over the targets (t)
    params: list[Any] | dict[str, Any] | None
    memory_limit: str | None
    timeout: float | None
    text: str
    examples_cond: str = "TRUE"  # over the examples (their columns unqualified)

    def apply(self, store: StoreReader, rows: pa.Table | None, limit: int | None = None) -> pa.Table:
        """The rows; ``limit``: only the first ``limit`` (a limit on a large selection costs about the
        rows it returns, not the rows it selects).

        A condition that restricts ``relation_id`` to some relations (``relation_id = 'P17'``, ``IN``,
        bound parameters) asks the relation index (:mod:`actstore.core.relation_index`) for those
        relations' example ids; their smallest and largest bound ``example_id``, which prunes the
        store-ordered files' row groups.  The condition itself still decides every row."""
        run = lambda text: run_sql(  # noqa: E731
            store, text, params=self.params, memory_limit=self.memory_limit, timeout=self.timeout
        )
        cond = self.examples_cond
        ids = None
        if cond != "TRUE":
            values = relation_values(cond, self.params)
            ids = None if values is None else candidates(store, values)
        n_examples = store.manifest.n_examples
        if ids is not None:
            if ids.size == 0:
                return run(ROWS_SQL.format(cond="TRUE", examples_cond=f"({cond}) AND FALSE"))
        if limit is not None and self.cond == "TRUE":
            bounds = id_bounds(cond, self.params) if cond != "TRUE" else (None, None)
            first = _first_rows(run, cond, ids, limit, n_examples, bounds)
            if first is not None:
                return first
        if ids is not None and int(ids[-1]) - int(ids[0]) < n_examples // 2:
            # (a bound over most of the store prunes nothing and costs DuckDB a filter on every row)
            cond = f"({cond}) AND example_id BETWEEN {int(ids[0])} AND {int(ids[-1])}"
        sql = ROWS_SQL.format(cond=self.cond, examples_cond=cond)
        return run(sql + ("" if limit is None else f"LIMIT {int(limit)}\n"))


def _first_rows(
    run: Callable[[str], pa.Table],
    cond: str,
    ids: np.ndarray | None,
    limit: int,
    n_examples: int,
    bounds: tuple[int | None, int | None] = (None, None),
) -> pa.Table | None:
    """The first ``limit`` rows of the examples matching ``cond``, in two steps: the first ``limit``
    matching examples, looked for in growing windows of example ids (from the first candidate of the
    relation index, or 0, or the condition's own lower bound on ``example_id``: at least the first
    ``limit`` candidates and a row group's ids, then 4x as many ids, ...), each a scan of the examples'
    row groups in that window alone; then the rows of examples up to the last of them, whose targets'
    row groups that bound prunes.  Rows follow examples in store order,
    one or more per example, so those examples hold the first ``limit`` rows unless some have no row:
    then None (the caller runs the plain plan)."""
    lo, hi = (int(ids[0]), int(ids[-1])) if ids is not None else (0, n_examples - 1)
    first_end = int(ids[min(limit, ids.size) - 1]) if ids is not None else lo
    low, high = bounds  # the condition's own bounds on example_id (kept within the store's ids)
    low = None if low is None else min(low, n_examples)
    high = None if high is None else max(high, -1)
    if low is not None and low > lo:
        lo = low
        if ids is not None:
            k = int(np.searchsorted(ids, low))
            first_end = int(ids[min(k + limit, ids.size) - 1]) if k < ids.size else lo
    hi = hi if high is None else min(hi, high)
    first_end = max(first_end, lo)
    span = max(first_end - lo + 1, ROW_GROUP_ROWS)  # (a window costs the row groups it spans)
    n = last = 0
    while True:
        end = min(lo + span - 1, hi)
        window = f"({cond}) AND example_id BETWEEN {lo} AND {end}"
        first = run(FIRST_EXAMPLES_SQL.format(examples_cond=window, limit=limit))
        n, last = first.column(0)[0].as_py() or 0, first.column(1)[0].as_py()
        if n >= limit or end >= hi:
            break
        span *= 4
    if n == 0 or last is None:
        return run(ROWS_SQL.format(cond="TRUE", examples_cond=f"({cond}) AND FALSE"))
    rows = run(
        ROWS_SQL.format(cond="TRUE", examples_cond=f"({cond}) AND example_id BETWEEN {lo} AND {int(last)}")
        + f"LIMIT {int(limit)}\n"
    )
    # (fewer than ``limit`` matching examples in the whole last window: these are all the rows)
    return rows if rows.num_rows == limit or n < limit else None


@dataclass(frozen=True)
class FilterStep:
    where: str
    params: list[Any] | dict[str, Any] | None

    @property
    def text(self) -> str:
        return f"filter({self.where})"

    def apply(self, store: StoreReader, rows: pa.Table | None) -> pa.Table:
        assert rows is not None
        ids = run_sql(
            store,
            f"SELECT DISTINCT example_id FROM examples WHERE {predicate(self.where)}",
            params=self.params,
        ).column(0)
        return rows.filter(pc.is_in(rows.column("example_id"), value_set=ids.combine_chunks()))


@dataclass(frozen=True)
class RelationsStep:
    names: tuple[str, ...]

    @property
    def text(self) -> str:
        return f"relations({', '.join(self.names)})"

    def apply(self, store: StoreReader, rows: pa.Table | None) -> pa.Table:
        assert rows is not None
        keep = pc.is_in(rows.column("relation_id"), value_set=pa.array(self.names, pa.string()))
        out = rows.filter(pc.fill_null(keep, False))
        present = set(pc.unique(out.column("relation_id")).to_pylist())
        missing = [r for r in self.names if r not in present]
        if missing:
            there = sorted(str(r) for r in pc.unique(rows.column("relation_id")).to_pylist() if r is not None)
            shown = ", ".join(there[:20]) + (f", ... ({len(there)} in all)" if len(there) > 20 else "")
            warnings.warn(
                f"relations(): no rows for {', '.join(missing)} in this selection "
                f"(its relations: {shown or 'none'})",
                EmptySelectionWarning,
                stacklevel=2,
            )
        return out


@dataclass(frozen=True)
class IdsStep:
    """Keeps its parent's rows (a ``from_ids`` query); warns about the ids that have none."""

    ids: tuple[int, ...]

    @property
    def text(self) -> str:
        return f"{len(self.ids)} ids"

    def apply(self, store: StoreReader, rows: pa.Table | None) -> pa.Table:
        assert rows is not None
        present = set(pc.unique(rows.column("example_id")).to_pylist())
        missing = [i for i in self.ids if i not in present]
        if missing:
            shown = ", ".join(map(str, missing[:10])) + (
                f", ... ({len(missing)} in all)" if len(missing) > 10 else ""
            )
            warnings.warn(f"from_ids(): no rows for example ids {shown}", EmptySelectionWarning, stacklevel=2)
        return rows


@dataclass(frozen=True)
class LimitStep:
    n: int

    @property
    def text(self) -> str:
        return f"limit({self.n})"

    def apply(self, store: StoreReader, rows: pa.Table | None) -> pa.Table:
        assert rows is not None
        return rows.slice(0, self.n)


@dataclass(frozen=True)
class SampleStep:
    n: int
    seed: int | None

    @property
    def text(self) -> str:
        return f"sample({self.n}, seed={self.seed})"

    def apply(self, store: StoreReader, rows: pa.Table | None) -> pa.Table:
        assert rows is not None
        return rows.take(sample_indices(rows.num_rows, self.n, self.seed))


@dataclass(frozen=True)
class PartStep:
    index: int
    fractions: tuple[float, ...]
    seed: int | None
    by: str | None
    stratify: bool

    @property
    def text(self) -> str:
        how = f", by={self.by}" if self.by else ", stratified" if self.stratify else ""
        return f"split({', '.join(f'{f:g}' for f in self.fractions)}, seed={self.seed}{how})[{self.index}]"

    def apply(self, store: StoreReader, rows: pa.Table | None) -> pa.Table:
        assert rows is not None
        groups = None
        if self.by is not None or self.stratify:
            groups = np.array([str(r) for r in rows.column("relation_id").to_pylist()], dtype=object)
        parts = split_indices(
            rows.num_rows, self.fractions, self.seed, groups=groups, whole_groups=self.by is not None
        )
        return rows.take(parts[self.index])


def sample_indices(n_rows: int, n: int, seed: int | None) -> np.ndarray:
    """``min(n, n_rows)`` distinct positions out of ``n_rows``, drawn uniformly with ``seed``, sorted."""
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(n_rows, size=min(n, n_rows), replace=False)).astype(np.int64)


def _cut(n: int, fractions: Sequence[float]) -> np.ndarray:
    """Boundaries of consecutive parts of ``n`` items with these fractions (the last one exact at ``n``
    when the fractions sum to one)."""
    cum = np.cumsum(np.asarray(fractions, dtype=np.float64))
    bounds = np.floor(cum * n + 0.5).astype(np.int64)
    if abs(cum[-1] - 1.0) < 1e-9:
        bounds[-1] = n
    return np.concatenate([[0], np.minimum(bounds, n)])


def split_indices(
    n_rows: int,
    fractions: Sequence[float],
    seed: int | None,
    *,
    groups: np.ndarray | None = None,
    whole_groups: bool = False,
) -> list[np.ndarray]:
    """Disjoint sorted positions of ``n_rows`` rows for each part, in a random order drawn with ``seed``.

    Without ``groups``: a permutation of the rows cut at the fractions.  With ``groups`` [n_rows]
    and ``whole_groups``: the distinct groups are permuted and cut (each part gets whole groups;
    the fractions are of the groups, not of the rows).  With ``groups`` alone: each group's rows are
    permuted and cut on their own (stratified: every group in every part, in proportion).
    """
    rng = np.random.default_rng(seed)
    out: list[list[np.ndarray]] = [[] for _ in fractions]
    if groups is None:
        perm = rng.permutation(n_rows)
        b = _cut(n_rows, fractions)
        for k in range(len(fractions)):
            out[k].append(perm[b[k] : b[k + 1]])
    else:
        names = sorted(set(groups.tolist()))
        if whole_groups:
            order = [names[i] for i in rng.permutation(len(names))]
            b = _cut(len(order), fractions)
            part_of = {g: k for k in range(len(fractions)) for g in order[b[k] : b[k + 1]]}
            for k in range(len(fractions)):
                out[k].append(np.flatnonzero([part_of.get(g) == k for g in groups.tolist()]))
        else:
            for g in names:
                members = np.flatnonzero(groups == g)
                perm = members[rng.permutation(members.size)]
                b = _cut(members.size, fractions)
                for k in range(len(fractions)):
                    out[k].append(perm[b[k] : b[k + 1]])
    return [np.sort(np.concatenate(p)).astype(np.int64) if p else np.zeros(0, np.int64) for p in out]


def split_fractions(parts: float | int | Sequence[float]) -> tuple[float, ...]:
    if isinstance(parts, (bool, np.bool_)):
        raise QueryError(f"split takes fractions or a number of parts, not {parts!r}")
    if isinstance(parts, (int, np.integer)):
        if parts < 2:
            raise QueryError(f"split into at least 2 parts (got {parts})")
        return (1.0 / int(parts),) * int(parts)
    if isinstance(parts, (float, np.floating)):
        parts = (float(parts), 1.0 - float(parts))
    fr = tuple(float(f) for f in parts)
    if len(fr) < 1 or any(not np.isfinite(f) or f <= 0 for f in fr) or sum(fr) > 1 + 1e-9:
        raise QueryError(f"split fractions must be positive and sum to at most 1 (got {list(fr)})")
    return fr


def check_count(n: int, what: str) -> int:
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 0:
        raise QueryError(f"{what} takes a number of rows >= 0 (got {n!r})")
    return int(n)
