"""MAPS (Elhelo & Geva, 2025): what each attention head does to the vocabulary.

The package, by responsibility:

* :mod:`actstore.query.maps.defaults`    the authors' settings (k per relation, minimum pairs, threshold) and
                                :class:`MapsError`;
* :mod:`actstore.query.maps.pairs`       pair files, tokenization, the single-token rule, the minimum-pairs
                                exclusion, and the (source, object) pairs of a store's prompts;
* :mod:`actstore.query.maps.projection`  the store's weights arranged to read a head's vocabulary map row by
                                row, and the ranks of targets in those rows;
* :mod:`actstore.query.maps.static`      static scores from the weights alone, salient operations, their tables,
                                and the scores an earlier run stored;
* :mod:`actstore.query.maps.dynamic`     what the heads wrote on the stored prompts, and its correlation with
                                the static scores (imported on its own: it needs Dask helpers).

The names below are re-exported so that ``from actstore.query.maps import ...`` keeps working.
"""

from __future__ import annotations

from actstore.query.maps.defaults import (
    COPYING_K,
    DEFAULT_K,
    IMPLEMENTS_THRESHOLD,
    MIN_PAIRS,
    ROW_CHUNK,
    MapsError,
    check_k,
    k_of,
    paper_first_mlp,
    paper_k,
    relation_ks,
)
from actstore.query.maps.pairs import (
    MultiToken,
    RelationPairs,
    TokenPairs,
    excluded_line,
    load_pair_files,
    single_token_pairs,
    split_by_min_pairs,
    store_pairs,
    tokenize_pairs,
)
from actstore.query.maps.projection import (
    HeadMap,
    SourceTransform,
    VocabProjection,
    check_head,
    head_list,
    parse_heads,
    projected_ranks,
    target_ranks,
)
from actstore.query.maps.static import (
    SalientOps,
    StaticScores,
    StoredScores,
    implementing_heads,
    pair_ranks,
    relation_summary,
    salient_operations,
    salient_table,
    scores_table,
    static_scores,
    stored_static_scores,
    token_decoder,
    top_heads,
)

__all__ = [
    "COPYING_K", "DEFAULT_K", "IMPLEMENTS_THRESHOLD", "MIN_PAIRS", "ROW_CHUNK", "HeadMap", "MapsError",
    "MultiToken", "RelationPairs", "SalientOps", "SourceTransform", "StaticScores", "StoredScores", "TokenPairs",
    "VocabProjection", "check_head", "check_k", "excluded_line", "head_list", "implementing_heads", "k_of",
    "load_pair_files", "pair_ranks", "paper_first_mlp", "paper_k", "parse_heads", "projected_ranks",
    "relation_ks", "relation_summary", "salient_operations", "salient_table", "scores_table",
    "single_token_pairs", "split_by_min_pairs", "static_scores", "store_pairs", "stored_static_scores",
    "target_ranks", "token_decoder", "tokenize_pairs", "top_heads",
]
