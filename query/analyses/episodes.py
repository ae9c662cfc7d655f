"""n-way k-shot episodes over the relations of a selection ("Tracing Relational Knowledge Recall", ACL 2026 Findings).

An episode draws ``n_way`` distinct relations and, for each, ``k_shot + queries`` distinct
instances (target rows) without replacement: the first ``k_shot`` are the support set, the
rest the queries.  Everything is indexed by *positions* into the label array the sampler was
given (one label per selected row, in selection order), class-major:

    support[e]  = [c0 s0 .. c0 s(k-1), c1 s0, ..., c(n-1) s(k-1)]      (n*k positions)
    query[e]    = [c0 q0 .. c0 q(q-1), ...]                              (n*q positions)
    classes[e]  = relation indices (into ``relations``) in class order

Sampling depends only on ``seed``, the sorted relation ids and the members of each relation
in selection order, so the same store, predicate and settings give the same episodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from actstore.core.errors import InvalidSetting, QueryError


@dataclass(frozen=True)
class EpisodeSet:
    """Episodes as stacked arrays (several seeds may be concatenated)."""

    relations: tuple[str, ...]  # sorted relation ids; classes index into this
    n_way: int
    k_shot: int
    queries: int
    seed: np.ndarray  # [E] seed that drew each episode
    index: np.ndarray  # [E] episode number within its seed
    classes: np.ndarray  # [E, n] relation indices
    support: np.ndarray  # [E, n*k] positions
    query: np.ndarray  # [E, n*q] positions

    def __len__(self) -> int:
        return int(self.seed.shape[0])

    @property
    def support_labels(self) -> np.ndarray:
        """[n*k] class index of each support position (the same for every episode)."""
        return np.repeat(np.arange(self.n_way), self.k_shot)

    @property
    def query_labels(self) -> np.ndarray:
        return np.repeat(np.arange(self.n_way), self.queries)

    def take(self, idx: np.ndarray | slice) -> EpisodeSet:
        return EpisodeSet(
            self.relations,
            self.n_way,
            self.k_shot,
            self.queries,
            self.seed[idx],
            self.index[idx],
            self.classes[idx],
            self.support[idx],
            self.query[idx],
        )

    def find(self, seed: int, index: int) -> int:
        hit = np.flatnonzero((self.seed == seed) & (self.index == index))
        if hit.size == 0:
            raise QueryError(f"no episode {index} for seed {seed}")
        return int(hit[0])


def check_relations(labels: Sequence[str], n_way: int, per_class: int) -> dict[str, np.ndarray]:
    """Members (positions) of each relation; one clear error when the episodes cannot be drawn."""
    if n_way < 2:
        raise InvalidSetting("n_way", f"must be at least 2 (got {n_way})")
    if per_class < 2:
        raise QueryError("k-shot and queries must each be at least 1")
    arr = np.asarray(labels, dtype=object)
    if arr.size == 0:
        raise QueryError("the selection is empty: no rows to draw episodes from")
    if any(x is None for x in arr):
        raise InvalidSetting("where", "some selected rows have no relation_id; restrict the selection")
    relations = sorted(set(arr.tolist()))
    if n_way > len(relations):
        raise InvalidSetting(
            "n_way", f"{n_way} is larger than the number of relations in the selection ({len(relations)})"
        )
    members = {r: np.flatnonzero(arr == r) for r in relations}
    short = [f"{r} ({m.size})" for r, m in members.items() if m.size < per_class]
    if short:
        raise QueryError(
            f"relations with fewer than k-shot + queries = {per_class} instances: {', '.join(short)}; "
            "lower k-shot or queries, or exclude them from the selection"
        )
    return members


def sample_episodes(
    labels: Sequence[str], *, n_way: int, k_shot: int, queries: int, episodes: int, seed: int
) -> EpisodeSet:
    """``episodes`` episodes drawn with ``numpy.random.default_rng(seed)``."""
    if episodes < 1:
        raise InvalidSetting("episodes", f"must be at least 1 (got {episodes})")
    per = k_shot + queries
    members = check_relations(labels, n_way, per)
    relations = tuple(members)
    rng = np.random.default_rng(seed)
    classes = np.empty((episodes, n_way), dtype=np.int64)
    support = np.empty((episodes, n_way * k_shot), dtype=np.int64)
    query = np.empty((episodes, n_way * queries), dtype=np.int64)
    for e in range(episodes):
        cls = rng.choice(len(relations), size=n_way, replace=False)
        classes[e] = cls
        for i, c in enumerate(cls):
            pick = rng.choice(members[relations[c]], size=per, replace=False)
            support[e, i * k_shot : (i + 1) * k_shot] = pick[:k_shot]
            query[e, i * queries : (i + 1) * queries] = pick[k_shot:]
    return EpisodeSet(
        relations,
        n_way,
        k_shot,
        queries,
        np.full(episodes, seed, dtype=np.int64),
        np.arange(episodes, dtype=np.int64),
        classes,
        support,
        query,
    )


def sample_seeds(
    labels: Sequence[str], *, n_way: int, k_shot: int, queries: int, episodes: int, seeds: Sequence[int]
) -> EpisodeSet:
    """Episodes of several seeds, concatenated in seed order."""
    parts = [
        sample_episodes(labels, n_way=n_way, k_shot=k_shot, queries=queries, episodes=episodes, seed=s)
        for s in seeds
    ]
    if not parts:
        raise QueryError("at least one seed is needed")
    first = parts[0]
    return EpisodeSet(
        first.relations,
        n_way,
        k_shot,
        queries,
        *(
            np.concatenate([getattr(p, f) for p in parts])
            for f in ("seed", "index", "classes", "support", "query")
        ),
    )
