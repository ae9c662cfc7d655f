"""MAPS defaults: the authors' k per relation, the minimum number of pairs, the score threshold.

``k`` and the pairs follow the authors' released code by default (github.com/amitelhelo/MAPS,
``src/utils.py`` ``get_k`` and ``src/maps.py`` ``preprocess_dataset`` / ``is_valid_dataset_for_model``):

* ``k`` per relation (:func:`paper_k`): 1 for the copying relations (name containing "copying"),
  10 for every other; for Llama-3 models 3 and 25.  A given ``k`` applies to every relation instead.
* a relation with fewer than :data:`MIN_PAIRS` = 30 usable pairs (the authors'
  ``min_filtered_dataset_size``) is excluded (:func:`actstore.query.maps.pairs.split_by_min_pairs`).
* head h *implements* R when phi_R(h) >= 0.15 (:data:`IMPLEMENTS_THRESHOLD`), and *suppresses* R
  when its suppression score is.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from actstore.core.errors import MapsError

DEFAULT_K = 10  # the paper's k for every relation but the copying ones, on every model but Llama-3
COPYING_K = 1  # the paper's k for the copying relations
MIN_PAIRS = 30  # the authors' min_filtered_dataset_size: fewer usable pairs and a relation is excluded
IMPLEMENTS_THRESHOLD = 0.15
# a multi-token word of a pair file: its pair left out (the authors' filter), or its first token (ours)
MULTI_TOKEN = ("skip", "first")
ROW_CHUNK = 256  # source rows per [rows, |V|] block


def paper_k(relation: str, model_name: str = "") -> int:
    """The authors' k for ``relation`` (``get_k`` in their ``src/utils.py``): 1 for a copying relation
    (its name contains "copying") and 10 otherwise; for Llama-3 models 3 and 25."""
    copying = "copying" in relation
    if re.search(r"llama-?3", model_name, re.IGNORECASE):
        return 3 if copying else 25
    return COPYING_K if copying else DEFAULT_K


def paper_first_mlp(model_name: str = "") -> bool:
    """Whether the authors read sources through the first MLP for this model (every model but
    Llama-3.1-70B: ``apply_first_mlp`` in their ``src/experiment1_correlative.py``)."""
    return re.search(r"llama-?3\.1-70b", model_name, re.IGNORECASE) is None


def relation_ks(relations: Iterable[str], k: int | None, model_name: str = "") -> dict[str, int]:
    """k per relation: the given ``k`` for all, or (``None``) the authors' :func:`paper_k`."""
    return {r: (int(k) if k is not None else paper_k(r, model_name)) for r in relations}


def k_of(k: int | Mapping[str, int], relation: str) -> int:
    return int(k) if isinstance(k, int) else int(k[relation])


def check_k(k: int, k_max: int) -> None:
    if not 1 <= k <= k_max:
        raise MapsError(f"k={k} is outside 1..{k_max}, the ranks computed (ranks are kept up to k_max)")
