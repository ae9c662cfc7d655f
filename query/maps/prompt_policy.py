"""The published pair policy applied to a store's prompts: which prompts a dynamic MAPS run reads
(single-token subject and object, relations with enough usable pairs)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from actstore.core.errors import MapsError
from actstore.core.store import StoreReader
from actstore.query.maps.defaults import MIN_PAIRS
from actstore.query.maps.pairs import single_token_pairs, stored_relations
from actstore.query.select.rows import Rows, rows_condition


@dataclass(frozen=True)
class PromptSelection:
    """Which stored prompts a dynamic run uses, per relation, and which relations it excludes."""

    example_ids: np.ndarray  # prompts kept (all relations)
    relations: list[str]  # relations kept
    excluded: list[dict[str, Any]]  # one report row per excluded relation
    counts: dict[str, dict[str, Any]]  # per relation: prompts, prompts kept, distinct pairs, usable pairs


def usable_prompts(
    store: StoreReader,
    *,
    tokenizer: Any = None,
    rows: Rows | None = None,
    relations: Sequence[str] | None = None,
    multi_token: str = "skip",
    min_pairs: int = MIN_PAIRS,
    pair_counts: dict[str, tuple[int, int]] | None = None,
) -> PromptSelection:
    """The published pair policy applied to a store's prompts.

    ``multi_token="skip"`` (the authors' filter) keeps a prompt only when its subject and its object
    are each one token with a leading space (:func:`actstore.query.maps.pairs.single_token_pairs`, needs ``tokenizer``);
    ``"first"`` keeps every prompt.  A relation is excluded when it has fewer than ``min_pairs``
    usable pairs: counted in its pair file when ``pair_counts`` holds it (relation -> (usable, pairs in
    the file), the authors' criterion), else as distinct usable (subject, object) pairs among the
    store's prompts (which undercounts when the prompts are a sample of the file).
    """
    if multi_token not in ("skip", "first"):
        raise MapsError(f"multi_token must be 'skip' or 'first', not {multi_token!r}")
    if multi_token == "skip" and tokenizer is None:
        raise MapsError("single-token prompts need the tokenizer")
    cond, params = rows_condition(rows, "e.example_id")
    t = store.sql(
        f"""SELECT e.example_id, e.relation_id, e.subject, e.object FROM examples e
            JOIN targets t USING (example_id)
            WHERE e.subject_start >= 0 AND t.object_token_id >= 0 AND {cond} ORDER BY e.example_id""",
        params or None,
    )
    ids = t.column("example_id").to_numpy()
    rel = np.asarray(t.column("relation_id").to_pylist(), dtype=object)
    subj = [str(x or "") for x in t.column("subject").to_pylist()]
    obj = [str(x or "") for x in t.column("object").to_pylist()]
    names = stored_relations(sorted(set(rel.tolist())), relations, store.url)
    uniq = sorted(set(zip(subj, obj)))
    ok = dict(
        zip(uniq, single_token_pairs(uniq, tokenizer, vocab_size=store.geometry.vocab_size).tolist())
        if multi_token == "skip"
        else ((p, True) for p in uniq)
    )
    usable = np.asarray([ok[(a, b)] for a, b in zip(subj, obj)], bool)
    counts: dict[str, dict[str, Any]] = {}
    kept: list[str] = []
    excluded: list[dict[str, Any]] = []
    for name in names:
        m = rel == name
        pairs = {(subj[i], obj[i]) for i in np.flatnonzero(m)}
        good = {(subj[i], obj[i]) for i in np.flatnonzero(m & usable)}
        if pair_counts is not None and name in pair_counts:
            n_used, n_pairs, source = pair_counts[name][0], pair_counts[name][1], "pair file"
        else:
            n_used, n_pairs, source = len(good), len(pairs), "store prompts"
        c = {
            "relation": name,
            "n_prompts": int(m.sum()),
            "n_prompts_used": int((m & usable).sum()),
            "n_pairs": int(n_pairs),
            "n_used": int(n_used),
            "counted_from": source,
            "min_pairs": int(min_pairs),
        }
        counts[name] = c
        if n_used < max(min_pairs, 1) or c["n_prompts_used"] == 0:
            excluded.append(c)
        else:
            kept.append(name)
    keep = np.isin(rel, kept) & usable
    return PromptSelection(ids[keep], kept, excluded, counts)
