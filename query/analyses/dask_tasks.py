"""Corpus-wide feature statistics, computed block by block, optionally on a Dask cluster.

A selection's target rows are split into blocks (one segment, or ``rows_per_task`` rows of it,
so every task reads whole zarr chunks).  Each task opens the store by URL in its own process,
computes the block's features (:func:`actstore.query.select.features.compute_block`) and reduces them to
per-group moments: count, mean and the sum of squared deviations (float64).  The driver merges
the blocks' moments in block order (Chan et al.'s pairwise update), so the result does not
depend on which worker ran what: with a ``dask.distributed.Client`` it is bitwise the result
of ``client=None``, which runs the same tasks in this process.

    from dask.distributed import Client, LocalCluster
    client = Client(LocalCluster(n_workers=8, threads_per_worker=1))
    m = feature_moments("s3://bucket/store", "attn_head", layers=[10], client=client)
    d = relation_scores("s3://bucket/store", "attn_head", layers=[10], client=client)

Workers read the store themselves: a local path must be visible to every worker (a shared
filesystem), an ``s3://`` store needs the AWS variables in the workers' environment.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from actstore.core.dependencies import dask_distributed
from actstore.core.errors import InvalidSetting, QueryError
from actstore.core.store import StoreReader, open_reader
from actstore.query.analyses.relspec import POOLED_EPS
from actstore.query.select.features import FeatureSpec, RowBlock, compute_block
from actstore.query.select.selection import Selection


@dataclass(frozen=True)
class Moments:
    """Per-feature count, mean and sum of squared deviations (``m2``) over a set of rows."""

    count: int
    mean: np.ndarray  # float64, the shape of one row's features
    m2: np.ndarray  # float64, sum over rows of (x - mean)^2

    @property
    def var(self) -> np.ndarray:
        """Population variance (divide by n); ``m2 / (count - 1)`` gives the sample variance."""
        return self.m2 / self.count if self.count else np.full_like(self.m2, np.nan)

    @property
    def std(self) -> np.ndarray:
        return np.sqrt(self.var)

    @classmethod
    def of(cls, x: np.ndarray) -> Moments:
        """Moments of the rows of ``x`` [n, ...]."""
        x64 = x.astype(np.float64, copy=False)
        mean = x64.mean(0) if len(x64) else np.zeros(x.shape[1:])
        return cls(len(x), mean, np.square(x64 - mean).sum(0))

    def merge(self, other: Moments) -> Moments:
        """The moments of the union of both row sets (Chan, Golub and LeVeque's update)."""
        if other.count == 0:
            return self
        if self.count == 0:
            return other
        n = self.count + other.count
        delta = other.mean - self.mean
        mean = self.mean + delta * (other.count / n)
        m2 = self.m2 + other.m2 + np.square(delta) * (self.count * other.count / n)
        return Moments(n, mean, m2)


# Stores opened by this process (a Dask worker keeps them between tasks).
_OPEN: dict[str, StoreReader] = {}


def _store(url: str) -> StoreReader:
    if url not in _OPEN:
        _OPEN[url] = open_reader(url)
    return _OPEN[url]


def store_of(store: str | StoreReader) -> StoreReader:
    """A task's store: the caller's :class:`StoreReader` in process, else opened by URL once per process."""
    return store if isinstance(store, StoreReader) else _store(store)


def run_tasks(
    client: Any,
    fn: Callable[..., Any],
    args: Sequence[tuple[Any, ...]],
    *,
    shared: dict[str, Any] | None = None,
    on_done: Callable[[int, int], None] | None = None,
) -> list[Any]:
    """``[fn(*a, **shared) for a in args]``, in that order, here (``client=None``) or on a Dask cluster.

    ``shared``: keyword arguments common to every task; on a cluster they are scattered to every
    worker once instead of being sent with each task.  ``on_done(done, total)`` is called on
    this process as tasks finish (for progress lines).  Results come back in task order, so the
    caller merges them in a fixed order whichever worker ran what.
    """
    shared = dict(shared or {})
    if client is None:
        out = []
        for i, a in enumerate(args):
            out.append(fn(*a, **shared))
            if on_done is not None:
                on_done(i + 1, len(args))
        return out
    if shared:
        shared = dict(zip(shared, client.scatter(list(shared.values()), broadcast=True)))
    futures = [client.submit(fn, *a, **shared, pure=False) for a in args]
    if on_done is not None:
        for i, _ in enumerate(dask_distributed.as_completed(futures)):
            on_done(i + 1, len(futures))
    return list(client.gather(futures))


def client_threads(client: Any) -> int:
    """Worker threads of a Dask cluster (1 without one)."""
    if client is None:
        return 1
    return max(1, sum(int(n) for n in client.nthreads().values()))


@contextmanager
def dask_client(address: str | None = None, workers: int | None = None) -> Iterator[Any]:
    """The client for ``--dask ADDRESS`` (a running scheduler) or ``--workers N`` (a local cluster
    of N single-threaded worker processes, closed on exit); ``None`` when neither is given."""
    if address and workers is not None:
        raise InvalidSetting("workers", "give a Dask scheduler address or a number of workers, not both")
    if not address and workers is None:
        yield None
        return
    if workers is not None and workers < 1:
        raise InvalidSetting("workers", f"must be at least 1, not {workers}")
    Client, LocalCluster = dask_distributed.Client, dask_distributed.LocalCluster  # one line if missing
    if workers is not None:
        with warnings.catch_warnings():  # "Port 8787 is already in use": its HTTP server moves elsewhere
            warnings.simplefilter("ignore", UserWarning)
            cluster = LocalCluster(
                n_workers=workers,
                threads_per_worker=1,
                processes=True,
                dashboard_address=None,
                silence_logs=logging.ERROR,
            )
        try:
            with Client(cluster) as client:
                yield client
        finally:
            cluster.close()
        return
    try:
        client = Client(address, timeout="10s")
    except (OSError, TimeoutError) as e:
        raise QueryError(
            f"cannot reach the Dask scheduler at {address}: {' '.join(str(e).split())}"
        ) from None
    try:
        yield client
    finally:
        client.close()


def block_moments(
    url: str,
    kind: str,
    layers: tuple[int, ...] | None,
    heads: tuple[int, ...] | None,
    groups: int | None,
    block: RowBlock,
    labels: np.ndarray,
) -> dict[str, Moments]:
    """One task: the features of ``block`` reduced to moments per label (``labels`` [n] str)."""
    store = _store(url)
    spec = FeatureSpec.parse(store, kind, layers, heads, groups)
    x = compute_block(store, spec, block)  # [n, ...] float32
    return {str(g): Moments.of(x[labels == g]) for g in np.unique(labels)}


def feature_moments(
    store: str | StoreReader,
    kind: str,
    *,
    rows: Selection | None = None,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    groups: int | None = None,
    by: str | None = None,
    client: Any = None,
    rows_per_task: int | None = None,
) -> Any:
    """Per-feature moments of ``kind`` over ``rows`` (every row of the store when None).

    ``by``: a column (or expression) of ``examples`` to group by, e.g. ``"relation_id"``; the
    result is then a dict ``{group: Moments}`` (groups as strings, sorted), else one
    :class:`Moments`.  ``client``: a ``dask.distributed.Client``; ``None`` computes here.
    ``rows_per_task``: split segments into tasks of at most this many rows (rounded to whole
    chunks); default one task per segment.
    """
    st = store if isinstance(store, StoreReader) else open_reader(store)
    FeatureSpec.parse(st, kind, layers, heads, groups)  # fail on the driver, not in every task
    sel = rows if rows is not None else Selection.from_sql(st)
    if len(sel) == 0:
        raise QueryError("the selection is empty")
    label_of = _labels(st, sel, by)
    step = None
    if rows_per_task:
        chunk = st.manifest.chunk_rows
        step = max(chunk, rows_per_task // chunk * chunk)
    tasks = [(block, label_of[ids]) for ids, block in sel.blocks(step)]
    args = (st.url, kind, _tuple(layers), _tuple(heads), groups)
    if client is None:
        parts = [block_moments(*args, block, labels) for block, labels in tasks]
    else:
        futures = client.map(block_moments, *zip(*[(*args, b, lab) for b, lab in tasks]), pure=False)
        parts = client.gather(futures)
    merged: dict[str, Moments] = {}
    for part in parts:  # block order: the same float operations whoever computed the blocks
        for g, m in part.items():
            merged[g] = merged[g].merge(m) if g in merged else m
    if by is None:
        return merged["all"]
    return dict(sorted(merged.items()))


def relation_scores(
    store: str | StoreReader,
    kind: str,
    *,
    rows: Selection | None = None,
    by: str = "relation_id",
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    groups: int | None = None,
    client: Any = None,
    rows_per_task: int | None = None,
) -> tuple[list[str], np.ndarray]:
    """RelSpec scores over whole relations: Cohen's d of each group against all other rows.

    The definition of :mod:`actstore.query.analyses.relspec` (pooled within-group variance over ``N - 2``
    degrees of freedom, floored at ``POOLED_EPS`` times the feature's variance), applied to
    every selected row instead of an episode's support set.  Returns the groups and ``d``
    [n_groups, *feature shape].
    """

    by_group: dict[str, Moments] = feature_moments(
        store,
        kind,
        rows=rows,
        layers=layers,
        heads=heads,
        groups=groups,
        by=by,
        client=client,
        rows_per_task=rows_per_task,
    )
    names = list(by_group)
    if len(names) < 2:
        raise QueryError(f"relation scores need at least two groups of {by}, got {len(names)}")
    total = Moments(0, np.zeros(()), np.zeros(()))
    for g in names:
        total = total.merge(by_group[g])
    scores = []
    for g in names:
        c = by_group[g]
        rest_n = total.count - c.count
        rest_mean = (total.mean * total.count - c.mean * c.count) / rest_n
        # m2 of the rest: remove c from the total (the inverse of Moments.merge).
        rest_m2 = total.m2 - c.m2 - np.square(c.mean - rest_mean) * (c.count * rest_n / total.count)
        pooled = np.maximum(c.m2 + np.maximum(rest_m2, 0), 0) / max(total.count - 2, 1)
        floor = POOLED_EPS * total.var + 1e-30  # relative to each feature's own variance, as in relspec
        scores.append((c.mean - rest_mean) / np.sqrt(pooled + floor))
    return names, np.stack(scores)


def _tuple(xs: Sequence[int] | None) -> tuple[int, ...] | None:
    return None if xs is None else tuple(int(x) for x in xs)


def _labels(store: StoreReader, sel: Selection, by: str | None) -> Any:
    """An array mapping each selected row (in selection order) to its group label."""
    if by is None:
        return _Const("all")
    table = store.sql(f"SELECT example_id, CAST(({by}) AS VARCHAR) AS g FROM examples")
    lookup = dict(zip(table.column("example_id").to_pylist(), table.column("g").to_pylist()))
    return _Lookup({int(i): str(lookup.get(int(i))) for i in sel.example_ids})


class _Const:
    def __init__(self, value: str) -> None:
        self.value = value

    def __getitem__(self, ids: np.ndarray) -> np.ndarray:
        return np.full(len(ids), self.value, dtype=object)


class _Lookup:
    def __init__(self, mapping: dict[int, str]) -> None:
        self.mapping = mapping

    def __getitem__(self, ids: np.ndarray) -> np.ndarray:
        return np.array([self.mapping[int(i)] for i in ids], dtype=object)
