"""Selections: lazy plans over a store's target rows; features follow.

A :class:`Selection` records what to pick (a SQL predicate or query over the tables, then any chain of
``filter``, ``relations``, ``limit``, ``sample`` and ``split``) and reads nothing until something asks
for its rows (``len``, ``example_ids``, ``rows``, ``table()``, ``features()``, ...)::

    sel = store.select("split = 'val'").relations(["P177", "P361"]).sample(500, seed=0)
    train, test = sel.split((0.8, 0.2), seed=1)            # still nothing read
    x = train.features("attn_head", layers=[3, 4])          # numpy [n, 2, H, d_model]
    da = test.to_xarray("attn_head_token", layers=[3])      # labelled: row, layer, head, source, d_model
    for ids, x in sel.iter_features("z", batch_rows=256):   # streaming, whole chunks per read
        ...

Values always reach SQL as DuckDB parameters (``params=``), never pasted into the text.  Each step
keeps the store's row order; a selection's rows are computed once and shared by the selections made
from it (the parts of a ``split`` run their parent's SQL once).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from actstore.core.errors import QueryError
from actstore.core.sql import Params, check_params, predicate, run_sql, subquery
from actstore.core.store import StoreReader
from actstore.query.select.corpus_sources import corpus_sources
from actstore.query.select.features import FeatureSpec, RowBlock, compute_block, row_shape
from actstore.query.select.labelled import SOURCE_KINDS, dask_features, to_dataarray
from actstore.query.select.plan import (
    FilterStep,
    IdsStep,
    LimitStep,
    PartStep,
    QueryStep,
    RelationsStep,
    SampleStep,
    check_count,
    split_fractions,
)

if TYPE_CHECKING:
    import dask.array
    import xarray
    from typing_extensions import Unpack

    from actstore.query.select.hf_export import ExportOptions
    from actstore.query.select.loader import ActivationLoader
    from actstore.query.select.loader_args import LoaderOptions


Output = Literal["numpy", "torch", "xarray"]


# The steps of a plan.  Each maps its parent's rows (a table with the columns of ROWS_SQL, in
# store order) to a subset of them, in the same order.


Step = QueryStep | FilterStep | IdsStep | RelationsStep | LimitStep | SampleStep | PartStep


class Selection:
    """Target rows of a store, in store (row) order: a plan read on first use.

    ``Selection(store, rows)`` wraps rows already read (a table with the columns of the selection
    query); :meth:`from_sql`, :meth:`from_ids` and ``store.select(...)`` make plans.
    """

    def __init__(
        self,
        store: StoreReader,
        rows: pa.Table | None = None,
        *,
        parent: Selection | None = None,
        step: Step | None = None,
    ) -> None:
        self.store = store
        self._parent = parent
        self._step = step
        if rows is not None:
            self.__dict__["rows"] = rows
        elif step is None:
            raise QueryError("a Selection needs rows or a plan step")

    # -- making plans -------------------------------------------------------------------------

    @classmethod
    def from_sql(
        cls,
        store: StoreReader,
        where: str | None = None,
        *,
        query: str | None = None,
        params: Params | None = None,
        memory_limit: str | None = None,
        timeout: float | None = None,
    ) -> Selection:
        """``where``: one SQL expression over ``examples``; ``query``: one SELECT returning ``example_id``.

        Each is parsed now (:func:`actstore.core.sql.predicate`, :func:`actstore.core.sql.subquery`), before it is
        placed in the selection's query, so it cannot end that query or add a statement; it runs when
        the rows are first needed, under ``memory_limit`` / ``timeout`` or else the SQL limits in force
        then (see :mod:`actstore.core.sql`).  ``params``: values for the placeholders of ``where`` / ``query``
        (``?`` with a list, ``$name`` with a dict), bound by DuckDB.
        """
        if where is not None and query is not None:
            raise QueryError("give a WHERE predicate or a query, not both")
        examples_cond = "TRUE"
        if query is not None:
            cond, text = (
                f"t.example_id IN (SELECT example_id FROM {subquery(query)})",
                f"query({query.strip()})",
            )
        elif where is not None and where.strip():
            cond, text, examples_cond = "TRUE", where.strip(), predicate(where)
        else:
            cond, text = "TRUE", "all rows"
        step = QueryStep(cond, check_params(params), memory_limit, timeout, text, examples_cond)
        return cls(store, step=step)

    @classmethod
    def from_ids(cls, store: StoreReader, example_ids: Sequence[int]) -> Selection:
        """The target rows of these examples (in store order; unknown ids select nothing, with an
        :class:`~actstore.core.errors.EmptySelectionWarning` when the rows are read)."""
        ids = [int(i) for i in example_ids]
        sel = cls.from_sql(store, query="SELECT unnest($ids::BIGINT[]) AS example_id", params={"ids": ids})
        return sel._then(IdsStep(tuple(ids)))

    def _then(self, step: Step) -> Selection:
        return Selection(self.store, parent=self, step=step)

    def filter(self, where: str, params: Params | None = None) -> Selection:
        """The rows whose example also matches ``where``: one SQL expression over the columns of
        ``examples``, with ``params`` bound by DuckDB (``sel.filter("split = $s", {"s": "val"})``).
        Conditions on other tables: ``where="example_id IN (SELECT example_id FROM targets WHERE ...)"``."""
        predicate(where)
        return self._then(FilterStep(where, check_params(params)))

    def relations(self, relation_ids: Sequence[str]) -> Selection:
        """The rows whose example's ``relation_id`` is one of ``relation_ids``.  A relation with no
        rows in this selection gives an :class:`~actstore.core.errors.EmptySelectionWarning` when the
        rows are read (an error under ``warnings.simplefilter("error", EmptySelectionWarning)``)."""
        if isinstance(relation_ids, str):
            relation_ids = [relation_ids]
        names = tuple(str(r) for r in relation_ids)
        if not names:
            raise QueryError("relations() needs at least one relation id")
        return self._then(RelationsStep(names))

    def limit(self, n: int) -> Selection:
        """The first ``n`` rows (in store order)."""
        return self._then(LimitStep(check_count(n, "limit")))

    def sample(self, n: int, seed: int | None = 0) -> Selection:
        """``n`` rows drawn uniformly without replacement with ``seed`` (all of them when there are
        fewer), kept in store order."""
        return self._then(SampleStep(check_count(n, "sample"), seed))

    def split(
        self,
        parts: float | int | Sequence[float] = (0.8, 0.2),
        seed: int | None = 0,
        *,
        by: Literal["relation"] | None = None,
        stratify: bool = False,
    ) -> tuple[Selection, ...]:
        """Disjoint random parts of the rows: ``parts`` is a sequence of fractions (summing to at most
        1; rows left over belong to no part), one fraction ``f`` for ``(f, 1 - f)``, or a number of
        equal parts.  Each part keeps store order.

        ``by="relation"``: whole relations go to one part (the fractions are of the relations: a
        probe tested on relations it never saw).  ``stratify=True``: every relation is split on its
        own, so each part holds the same share of every relation.
        """
        fr = split_fractions(parts)
        if by not in (None, "relation"):
            raise QueryError(f"split by {by!r}: only by='relation' (or None for rows)")
        if by is not None and stratify:
            raise QueryError("split: by='relation' puts whole relations in one part; it cannot also stratify")
        return tuple(self._then(PartStep(k, fr, seed, by, stratify)) for k in range(len(fr)))

    # -- reading ------------------------------------------------------------------------------

    @cached_property
    def rows(self) -> pa.Table:
        """The selected target rows (example_id, row, segment, seg_row, src_start, n_src,
        subject_start, subject_end, relation_id), in store order; read on first use, then kept."""
        assert self._step is not None
        up = self._parent
        if (  # a limit right after the query, whose rows were never read: the limit goes into the SQL
            isinstance(self._step, LimitStep)
            and up is not None
            and isinstance(up._step, QueryStep)
            and "rows" not in up.__dict__
        ):
            return up._step.apply(self.store, None, limit=self._step.n)
        parent = up.rows if up is not None else None
        return self._step.apply(self.store, parent)

    @property
    def plan(self) -> list[str]:
        """The steps of this selection, first to last (for reading; nothing runs)."""
        steps: list[str] = []
        node: Selection | None = self
        while node is not None:
            steps.append(node._step.text if node._step is not None else "given rows")
            node = node._parent
        return steps[::-1]

    def __len__(self) -> int:
        return self.rows.num_rows

    def __repr__(self) -> str:
        return f"<Selection of {len(self)} target rows from {self.store.url!r}: {' | '.join(self.plan)}>"

    def _repr_html_(self) -> str:
        """For notebooks: the row count, rows per relation and the first few prompts."""
        from html import escape

        n = len(self)
        head = ""
        if n:
            ex = self.table(["example_id", "relation_id", "text"]).slice(0, 5).to_pylist()
            head = "".join(
                f"<tr><td>{r['example_id']}</td><td>{escape(str(r['relation_id']))}</td>"
                f"<td style='text-align:left'>{escape(str(r['text']))}</td></tr>"
                for r in ex
            )
            head = f"<table><tr><th>example_id</th><th>relation</th><th>text</th></tr>{head}</table>"
        rel = ""
        if n:
            counts: dict[str, int] = {}
            for r in self.rows.column("relation_id").to_pylist():
                counts[str(r)] = counts.get(str(r), 0) + 1
            rel = ", ".join(
                f"{escape(k)} ({v})" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:12]
            )
            rel = f"<p>per relation: {rel}{', ...' if len(counts) > 12 else ''}</p>"
        return (
            f"<div><b>Selection</b> of {n} target rows from <code>{escape(self.store.url)}</code>{rel}"
            f"{head}</div>"
        )

    @property
    def example_ids(self) -> np.ndarray:
        """[n] int64: the example of each selected row, in selection order."""
        return self.rows.column("example_id").to_numpy()

    def table(self, columns: Sequence[str] | None = None) -> pa.Table:
        """The ``examples`` rows of the selection, one per selected target row and in its order, with the
        target's store ``row`` first; ``columns``: only these (``row`` may be one of them)."""
        rows = self.rows.column("row").combine_chunks()
        got = run_sql(
            self.store,
            "SELECT t.row, e.* FROM targets t JOIN examples e USING (example_id) "
            "WHERE t.row IN (SELECT unnest($rows::BIGINT[]))",
            params={"rows": rows.to_pylist()},
        )
        got = got.take(pc.index_in(rows, value_set=got.column("row").combine_chunks()))
        if columns is not None:
            missing = [c for c in columns if c not in got.column_names]
            if missing:
                raise QueryError(
                    f"no column {missing[0]!r} in examples (columns: {', '.join(got.column_names)})"
                )
            got = got.select(list(columns))
        return got

    def blocks(self, batch_rows: int | None = None) -> Iterator[tuple[np.ndarray, RowBlock]]:
        """(example ids, RowBlock) per segment, split into at most ``batch_rows`` rows each."""
        cols = {
            name: self.rows.column(name).to_numpy()
            for name in self.rows.column_names
            if name != "relation_id"
        }
        segs = cols["segment"]
        if segs.size == 0:
            return
        bounds = [0, *(np.flatnonzero(segs[1:] != segs[:-1]) + 1).tolist(), segs.size]
        for lo, hi in zip(bounds[:-1], bounds[1:]):  # each segment's run of rows, cut by slices
            step = batch_rows or hi - lo
            for i in range(lo, hi, step):
                p = slice(i, min(i + step, hi))
                yield (
                    cols["example_id"][p].copy(),  # (a slice of the column: a copy, as a gather gave)
                    RowBlock(
                        segment=int(segs[i]),
                        seg_rows=cols["seg_row"][p].astype(np.int64),
                        src_start=cols["src_start"][p].astype(np.int64),
                        n_src=cols["n_src"][p].astype(np.int64),
                        subject_start=cols["subject_start"][p].astype(np.int64),
                        subject_end=cols["subject_end"][p].astype(np.int64),
                    ),
                )

    def n_sources(self) -> int:
        """S, the longest source axis of the selected rows (the padded size of ``attn_head_token`` and
        ``attn_prob``); 0 for an empty selection."""
        n = self.rows.column("n_src")
        K = corpus_sources(self.store)  # a corpus store with sources: K a row
        if K:
            return K if len(n) else 0
        return int(pc.max(n).as_py() or 0) if len(n) else 0

    def source_mask(self) -> np.ndarray:
        """[n, S] bool: True where source ``j`` exists for the row (False on the zero padding)."""
        n_src = self.rows.column("n_src").to_numpy().astype(np.int64)
        if corpus_sources(self.store):
            n_src = np.full(n_src.size, self.n_sources(), np.int64)
        return np.arange(self.n_sources())[None, :] < n_src[:, None]

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
        """Stream (example ids [b], features [b, ...]) in batches of at most ``batch_rows`` rows of one
        segment each (source kinds padded to the batch's own longest source)."""
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
        output: Output = "numpy",
    ) -> Any:
        """All selected rows' features at once: numpy (default), a torch tensor sharing its memory, or a
        labelled ``xarray.DataArray`` (:meth:`to_xarray`).  Shapes (see :mod:`actstore.query.select.features`), for n
        rows, l layers, h heads (or groups) and S the longest source: ``z`` [n, l, h, d_head];
        ``attn_head``, ``attn_entity``, ``mlp_group`` [n, l, h, d_model]; ``attn``, ``mlp`` [n, l,
        d_model]; ``resid`` [n, l, d_model]; ``attn_head_token`` [n, l, h, S, d_model] and
        ``attn_prob`` [n, l, h, S], zero beyond each row's sources (:meth:`source_mask`).

        A selection within one segment returns the computed block itself; for several segments each
        block is computed straight into its rows of the result (no intermediate copy).
        """
        if output == "xarray":
            return self.to_xarray(kind, layers=layers, heads=heads, groups=groups)
        spec = FeatureSpec.parse(self.store, kind, layers, heads, groups)
        if output not in ("numpy", "torch"):
            raise QueryError(f"unknown output {output!r} (numpy, torch, xarray)")
        blocks = [b for _, b in self.blocks()]
        if not blocks:
            raise QueryError("the selection is empty")
        if len(blocks) == 1:
            return _convert(compute_block(self.store, spec, blocks[0]), output)
        # Several segments: each block's matmuls write straight into its rows of one result (no
        # per-block array, no second copy); compute_block zero-fills a source axis beyond a block's rows.
        S = self.n_sources() if kind in SOURCE_KINDS else 0
        zeroed = (
            kind in SOURCE_KINDS
        )  # a fresh np.zeros: the padding beyond each row's sources is never written
        out = (np.zeros if zeroed else np.empty)(
            (sum(len(b.seg_rows) for b in blocks), *row_shape(self.store, spec, S)), np.float32
        )
        at = 0
        for b in blocks:
            compute_block(self.store, spec, b, out=out[at : at + len(b.seg_rows)], zeroed=zeroed)
            at += len(b.seg_rows)
        return _convert(out, output)

    def to_xarray(
        self,
        kind: str,
        *,
        layers: Sequence[int] | None = None,
        heads: Sequence[int] | None = None,
        groups: int | None = None,
        chunked: bool = False,
    ) -> xarray.DataArray:
        """The features as an ``xarray.DataArray`` with named dimensions (``row``, ``layer``, ``head``
        or ``group``, ``source``, ``d_model`` / ``d_head``) and coordinates: ``example_id`` and
        ``relation_id`` on ``row``, the layer and head (group) numbers, and for the source kinds the
        boolean ``mask`` [row, source] (False on padding).  See :mod:`actstore.query.select.labelled`.
        ``chunked=True``: the data is :meth:`to_dask`'s lazy array (one chunk per segment)."""
        spec = FeatureSpec.parse(self.store, kind, layers, heads, groups)
        if chunked:
            x = self.to_dask(kind, layers=layers, heads=heads, groups=groups)
        else:
            x = self.features(kind, layers=layers, heads=heads, groups=groups)
        return to_dataarray(
            self.store,
            spec,
            x,
            self.example_ids,
            self.rows.column("relation_id").to_pylist(),
            self.source_mask() if kind in SOURCE_KINDS else None,
        )

    def to_dask(
        self,
        kind: str,
        *,
        layers: Sequence[int] | None = None,
        heads: Sequence[int] | None = None,
        groups: int | None = None,
        batch_rows: int | None = None,
        chunk_rows: int | None = None,
    ) -> dask.array.Array:
        """The features as a lazy dask array (:meth:`features`'s shape), one chunk per segment (or ``batch_rows``
        rows of one; ``chunk_rows``: consecutive ones joined up to that many rows), larger than memory."""
        spec = FeatureSpec.parse(self.store, kind, layers, heads, groups)
        blocks = [(len(ids), b) for ids, b in self.blocks(batch_rows)]
        return dask_features(self.store, spec, blocks, self.n_sources(), chunk_rows)

    def loader(self, kind: str, **options: Unpack[LoaderOptions]) -> ActivationLoader:
        """A training feed: an iterable of torch tensors ``[batch_size, *row]`` (one row of
        :meth:`features`; ``flatten=True``: ``[batch_size, F]``), or ``(row_ids, x)`` with ``with_ids``.
        Each epoch gives every selected row once (this rank's share of them), in an order made of a
        seeded permutation of the storage chunks and an in-memory shuffle of windows of
        ``buffer_rows`` rows; ``state_dict()`` / ``load_state_dict()`` resume mid-epoch; ``rank`` /
        ``world_size`` split the rows disjointly (contiguous shares of the permuted chunk sequence);
        a background thread builds the next window (``workers=0``: none; ``workers >= 2``: that many
        reader threads, ``prefetch`` units of ``unit_rows`` rows of whole chunks ahead).
        The options and their defaults are those of :class:`actstore.query.select.loader.ActivationLoader`."""
        from actstore.query.select.loader import ActivationLoader

        return ActivationLoader(self, kind, **options)

    def to_hf_dataset(self, path: str | os.PathLike[str], kind: str, **options: Unpack[ExportOptions]) -> Any:
        """Export the features to ``path`` as a Hugging Face ``datasets`` dataset in SAELens's
        cached-activations layout (one ``Array2D(shape=(1, d_in))`` column per layer, named by its
        TransformerLens hook, e.g. ``blocks.3.hook_mlp_out``; plus ``row`` and ``example_id``) and
        return it, memory-mapped.  Needs the ``hf`` extra.  The options (``layers``, ``heads``,
        ``groups``, ``dtype``, ``batch_rows``, ``overwrite``) and their defaults are those of
        :func:`actstore.query.select.hf_export.to_hf_dataset`."""
        from actstore.query.select.hf_export import to_hf_dataset

        return to_hf_dataset(self, path, kind, **options)

    def to_activation_cache(
        self,
        kinds: Sequence[str] = ("resid", "attn_head", "attn", "mlp", "z"),
        layers: Sequence[int] | None = None,
    ) -> Any:
        """The rows as the cache TransformerLens's ``run_with_cache`` returns: hook name -> ``[rows, 1, ...]``
        (``blocks.3.hook_resid_pre``, ``blocks.3.attn.hook_result``, ...), a ``transformer_lens.ActivationCache``
        whose ``stack_head_results``, ``accumulated_resid``, ``decompose_resid`` and ``logit_attrs`` run on the
        stored weights without the model (``tlens`` extra); a dict without transformer-lens.
        See :mod:`actstore.query.select.tl_cache`."""
        from actstore.query.select.tl_cache import activation_cache

        return activation_cache(self, kinds, layers)


def _convert(x: np.ndarray, output: str) -> Any:
    if output == "torch":
        import torch

        return torch.from_numpy(x)
    if output != "numpy":
        raise QueryError(f"unknown output {output!r} (numpy, torch)")
    return x
