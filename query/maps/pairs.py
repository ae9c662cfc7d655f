"""MAPS pairs: pair files, their tokenization, the single-token rule, the minimum-pairs exclusion,
and the (source, object) token pairs of a store's prompts.

Words to tokens (:func:`tokenize_pairs`): each word gets a leading space (the paper's
``add_leading_space``).  Pairs whose source or target has no token, or only the tokenizer's
unknown token, are dropped and counted.  Only pairs whose source and target are each one token
are scored (``multi_token="skip"``, the authors' filter); ``multi_token="first"`` (ours, a named
variant) lets a multi-token word stand as its first token, and the number of such pairs is
reported.  A relation with fewer than :data:`~actstore.query.maps.defaults.MIN_PAIRS` usable pairs is
excluded: :func:`split_by_min_pairs` reports it with its counts, and it enters no score table,
summary or figure.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa

from actstore.core.errors import MapsError
from actstore.core.store import StoreReader
from actstore.query.maps.defaults import MIN_PAIRS
from actstore.query.select.rows import Rows, rows_condition


@dataclass(frozen=True)
class RelationPairs:
    """The (source, target) word pairs of one relation, as read from its file."""

    relation: str
    pairs: tuple[tuple[str, str], ...]
    path: str


def load_pair_files(
    paths: Sequence[str | Path], relations: Sequence[str] | None = None
) -> list[RelationPairs]:
    """MAPS pair files (``[["France", "Paris"], ...]``): files, or directories searched for ``*.json``.

    The relation is the file's stem.  ``relations`` keeps only those (unknown ones are an error).
    """
    if not paths:
        raise MapsError("no pair files given")
    files: dict[str, Path] = {}
    for raw in paths:
        p = Path(raw).expanduser()
        if not p.exists():
            raise MapsError(f"pair file or directory {p} not found")
        found = sorted(p.rglob("*.json")) if p.is_dir() else [p]
        if not found:
            raise MapsError(f"{p}: no .json pair files found")
        for f in found:
            if f.stem in files and files[f.stem] != f:
                raise MapsError(f"relation {f.stem!r} is given twice: {files[f.stem]} and {f}")
            files[f.stem] = f
    names = list(files)
    if relations is not None:
        unknown = sorted(set(relations) - set(names))
        if unknown:
            raise MapsError(
                f"unknown relation(s) {', '.join(unknown)}; the pair files hold {', '.join(names)}"
            )
        names = [n for n in names if n in set(relations)]
    return [RelationPairs(n, _read_pairs(files[n]), str(files[n])) for n in names]


def stored_relations(names: list[str], relations: Sequence[str] | None, url: str) -> list[str]:
    """``names`` (the relations the store at ``url`` has prompts of) or, when ``relations`` is given,
    those of them it names (one the store has no prompts of is refused with one line)."""
    if relations is None:
        return names
    missing = sorted(set(relations) - set(names))
    if missing:
        raise MapsError(
            f"relation(s) {', '.join(missing)} have no prompts in {url}; it holds {', '.join(names)}"
        )
    return [n for n in names if n in set(relations)]


def _read_pairs(path: Path) -> tuple[tuple[str, str], ...]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise MapsError(f"{path}: cannot read: {e}") from None
    except json.JSONDecodeError as e:
        raise MapsError(f"{path}: malformed JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(data, list):
        raise MapsError(
            f"{path}: expected a JSON list of [source, target] string pairs, got {type(data).__name__}"
        )
    if not data:
        raise MapsError(f"{path}: the list of pairs is empty")
    for i, p in enumerate(data):
        if not (isinstance(p, list | tuple) and len(p) == 2 and all(isinstance(x, str) for x in p)):
            raise MapsError(
                f"{path}: item {i} is {json.dumps(p)[:60]}, not a [source, target] pair of strings"
            )
    return tuple((str(a), str(b)) for a, b in data)


@dataclass(frozen=True)
class TokenPairs:
    """A relation's pairs as (source, target) token ids, with what tokenization did to them."""

    relation: str
    src: np.ndarray  # [n] int64
    dst: np.ndarray  # [n] int64
    n_pairs: int  # pairs in the file
    n_multi_token: int  # used pairs whose source or target is several tokens (first token used)
    n_unknown: int  # dropped: a word with no token, or only the unknown token
    n_skipped_multi_token: int = 0  # dropped because multi_token="skip"

    @property
    def n_used(self) -> int:
        return int(self.src.size)


MultiToken = Literal["skip", "first"]


def tokenize_pairs(
    rel: RelationPairs,
    tokenizer: Any,
    *,
    vocab_size: int | None = None,
    leading_space: bool = True,
    multi_token: MultiToken = "skip",
    allow_empty: bool = False,
) -> TokenPairs:
    """Token ids of a relation's words (see the module docstring for the policy).

    ``multi_token="skip"`` (default, the authors' filter) keeps only pairs whose source and target
    are one token each; ``"first"`` keeps every pair, a multi-token word standing as its first
    token.  A relation left with no pair is an error unless ``allow_empty`` (then it comes back
    with ``n_used == 0``, to be reported as excluded).
    """
    if multi_token not in ("first", "skip"):
        raise MapsError(f"multi_token must be 'first' or 'skip', not {multi_token!r}")
    words = [w for pair in rel.pairs for w in pair]
    prefix = " " if leading_space else ""
    enc = tokenizer([prefix + w.strip() if w.strip() else "" for w in words], add_special_tokens=False)[
        "input_ids"
    ]
    unk = getattr(tokenizer, "unk_token_id", None)
    src: list[int] = []
    dst: list[int] = []
    multi = unknown = skipped = 0
    for i in range(len(rel.pairs)):
        a, b = list(enc[2 * i]), list(enc[2 * i + 1])
        if (
            not a
            or not b
            or a[0] == unk
            or b[0] == unk
            or (vocab_size is not None and max(a[0], b[0]) >= vocab_size)
        ):
            unknown += 1
            continue
        if len(a) > 1 or len(b) > 1:
            if multi_token == "skip":
                skipped += 1
                continue
            multi += 1
        src.append(int(a[0]))
        dst.append(int(b[0]))
    if not src and not allow_empty:
        why = (
            "has a source and a target the tokenizer knows"
            if unknown == len(rel.pairs)
            else ("is left after dropping multi-token words")
        )
        raise MapsError(f"relation {rel.relation}: none of its {len(rel.pairs)} pairs {why}")
    return TokenPairs(
        rel.relation,
        np.asarray(src, np.int64),
        np.asarray(dst, np.int64),
        len(rel.pairs),
        multi,
        unknown,
        skipped,
    )


def single_token_pairs(
    pairs: Sequence[tuple[str, str]],
    tokenizer: Any,
    *,
    vocab_size: int | None = None,
    leading_space: bool = True,
) -> np.ndarray:
    """[n] bool: whether source and target are each one known token (the rule of
    ``tokenize_pairs(..., multi_token="skip")``, pair by pair)."""
    if not pairs:
        return np.zeros(0, bool)
    prefix = " " if leading_space else ""
    words = [w for pair in pairs for w in pair]
    enc = tokenizer([prefix + w.strip() if w.strip() else "" for w in words], add_special_tokens=False)[
        "input_ids"
    ]
    unk = getattr(tokenizer, "unk_token_id", None)
    out = np.zeros(len(pairs), bool)
    for i in range(len(pairs)):
        a, b = list(enc[2 * i]), list(enc[2 * i + 1])
        out[i] = (
            len(a) == 1
            and len(b) == 1
            and unk not in (a[0], b[0])
            and (vocab_size is None or max(a[0], b[0]) < vocab_size)
        )
    return out


def split_by_min_pairs(
    pairs: Sequence[TokenPairs], min_pairs: int = MIN_PAIRS
) -> tuple[list[TokenPairs], list[dict[str, Any]]]:
    """(relations with at least ``min_pairs`` usable pairs, the others as report rows).

    An excluded relation enters no score, summary or figure; its row says why (pairs in the file,
    usable, multi-token dropped or kept, unknown)."""
    if min_pairs < 0:
        raise MapsError(f"the minimum number of pairs must not be negative, not {min_pairs}")
    kept = [p for p in pairs if p.n_used >= max(min_pairs, 1)]
    excluded = [
        {
            "relation": p.relation,
            "n_pairs": p.n_pairs,
            "n_used": p.n_used,
            "n_skipped_multi_token": p.n_skipped_multi_token,
            "n_multi_token": p.n_multi_token,
            "n_unknown": p.n_unknown,
            "min_pairs": int(min_pairs),
        }
        for p in pairs
        if p.n_used < max(min_pairs, 1)
    ]
    return kept, excluded


def excluded_line(rows: Sequence[Mapping[str, Any]]) -> str:
    """``year_to_following 0/700, english_to_spanish 6/82`` (usable / pairs in the file)."""
    return ", ".join(f"{r['relation']} {r['n_used']}/{r['n_pairs']}" for r in rows)


def store_pairs(
    store: StoreReader,
    rows: Rows | None = None,
    *,
    source_token: Literal["first", "last"] = "first",
    relations: Sequence[str] | None = None,
) -> pa.Table:
    """Per example with a subject and an object: (example_id, relation_id, template, src_id, dst_id).

    ``src_id`` is the prompt's token at the subject's first (or last) position, ``dst_id`` the
    first token of " " + object (``targets.object_token_id``), ``template`` the dataset's
    template when its loader recorded one (``meta.template``), else ''.  ``rows``: only these prompts;
    ``relations``: only these relation ids (both bound, not pasted).
    """
    if source_token not in ("first", "last"):
        raise MapsError(f"source token must be 'first' or 'last', not {source_token!r}")
    pos = "e.subject_start" if source_token == "first" else "e.subject_end - 1"
    rows_cond, params = rows_condition(rows, "e.example_id")
    cond = f"AND {rows_cond}"
    if relations is not None:
        cond += " AND list_contains($relations, e.relation_id)"
        params["relations"] = list(relations)
    return store.sql(
        f"""
        SELECT e.example_id, e.relation_id, coalesce(json_extract_string(e.meta, '$.template'), '') AS template,
               tk.token_id::BIGINT AS src_id, t.object_token_id::BIGINT AS dst_id, {pos} AS src_position
        FROM examples e JOIN targets t USING (example_id)
        JOIN tokens tk ON tk.example_id = e.example_id AND tk.position = {pos}
        WHERE e.subject_start >= 0 AND t.object_token_id >= 0 {cond}
        ORDER BY e.example_id""",
        params or None,
    )
