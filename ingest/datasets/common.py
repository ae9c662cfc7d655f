"""What every data set loader shares: the error, the result and its bookkeeping, the helpers that
read JSON and turn (subject, object) pairs into prompts, and the ``KIND[:PATH]`` spec parser.

Spans are half-open character ranges into ``text`` and always valid for it.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, overload

from actstore.core.errors import DatasetError
from actstore.ingest.records import PromptRecord

T = TypeVar("T")

# The prompt data set kinds ``load_dataset`` dispatches on (``KIND:PATH``, or ``demo``).
KINDS = ("fewrel", "lre", "known1000", "maps", "jsonl", "demo", "methods2k")


@dataclass
class DatasetResult:
    """What a loader returns: the records plus per-relation bookkeeping.

    ``skipped[relation][reason]`` counts instances left out, ``kept[relation]`` the
    records kept; relations filtered out by ``relations=`` appear in neither.
    """

    records: Sequence[PromptRecord]  # a list, or a streamed source (.jsonl_stream.JsonlLines)
    skipped: dict[str, dict[str, int]] = field(default_factory=dict)
    kept: dict[str, int] = field(default_factory=dict)

    @property
    def n_kept(self) -> int:
        return len(self.records)

    @property
    def n_skipped(self) -> int:
        return sum(sum(reasons.values()) for reasons in self.skipped.values())


class Collector:
    """Accumulates records per relation, applying the per-relation limit and counting skips."""

    def __init__(self, limit_per_relation: int | None) -> None:
        self.limit = check_limit(limit_per_relation, "limit_per_relation")
        self.records: list[PromptRecord] = []
        self.kept: dict[str, int] = {}
        self.skipped: dict[str, dict[str, int]] = {}

    def start(self, relation: str) -> None:
        """Register a relation so it is reported even when nothing of it is kept."""
        self.kept.setdefault(relation, 0)
        self.skipped.setdefault(relation, {})

    def skip(self, relation: str, reason: str) -> None:
        self.start(relation)
        reasons = self.skipped[relation]
        reasons[reason] = reasons.get(reason, 0) + 1

    def add(self, record: PromptRecord) -> None:
        relation = record.relation_id
        self.start(relation)
        if self.limit is not None and self.kept[relation] >= self.limit:
            self.skip(relation, "over_limit")
            return
        self.kept[relation] += 1
        self.records.append(record)

    def result(self) -> DatasetResult:
        return DatasetResult(self.records, self.skipped, self.kept)


def check_limit(limit: int | None, name: str) -> int | None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise DatasetError(f"{name} must be a positive integer, got {limit!r}")
    return limit


def existing(path: str | Path, kind: str) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise DatasetError(f"{kind} data set {p} not found")
    return p


def read_json(path: Path) -> Any:
    try:
        with path.open(encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}: malformed JSON ({e.msg}, line {e.lineno} column {e.colno})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(f"{path}: cannot read: {e}") from None


def json_files(path: Path) -> dict[str, Path]:
    """One JSON file, or every ``*.json`` under a directory, keyed by file stem (the relation id)."""
    files = sorted(path.rglob("*.json")) if path.is_dir() else [path]
    by_stem: dict[str, Path] = {}
    for f in files:
        if f.stem in by_stem:
            raise DatasetError(f"{path}: relation id {f.stem!r} is used by both {by_stem[f.stem]} and {f}")
        by_stem[f.stem] = f
    if not by_stem:
        raise DatasetError(f"{path}: no .json files found")
    return by_stem


def select_relations(available: Sequence[str], relations: Sequence[str] | None, where: Path) -> list[str]:
    """The relations to load, in file order; unknown requested ids are an error."""
    if relations is None:
        return list(available)
    if isinstance(relations, str):
        relations = [relations]
    unknown = sorted(set(relations) - set(available))
    if unknown:
        raise DatasetError(
            f"{where}: unknown relation(s) {', '.join(unknown)}; available: {', '.join(available)}"
        )
    wanted = set(relations)
    return [r for r in available if r in wanted]


def fill_template(template: str, subject: str) -> tuple[str, tuple[int, int]]:
    """``template.format(subject)`` and the character span where the subject landed.

    The template must hold exactly one ``{}`` field (``{{``/``}}`` escapes are fine).
    Raises ``ValueError`` otherwise.
    """
    parts = list(string.Formatter().parse(template))
    fields = [p for p in parts if p[1] is not None]
    if len(fields) != 1 or fields[0][1] not in ("", "0") or fields[0][2] or fields[0][3]:
        raise ValueError(f"template {template!r} must contain exactly one plain {{}} field")
    start = 0
    for literal, name, _, _ in parts:
        start += len(literal)
        if name is not None:
            break
    return template.format(subject), (start, start + len(subject))


def strip_span(text: str, start: int, end: int) -> tuple[int, int]:
    """Shrink ``[start, end)`` so it neither starts nor ends with whitespace."""
    piece = text[start:end]
    return start + len(piece) - len(piece.lstrip()), start + len(piece.rstrip())


def find_span(text: str, needle: str) -> tuple[int, int] | None:
    start = text.find(needle) if needle else -1
    return None if start < 0 else (start, start + len(needle))


_ESCAPE = re.compile(r"\\u([0-9a-fA-F]{4})")


def clean_name(value: str) -> str:
    r"""Strip surrounding blanks and decode literal ``\uXXXX`` escapes.

    The LRE files contain a few double-escaped names (``Bras\u00edlia``) and subjects
    with a trailing space (``"Jimmy Carter "``) that would put two spaces in the prompt.
    """
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), value).strip()


def template_records(
    out: Collector,
    relation_id: str,
    relation_name: str,
    templates: Sequence[str],
    pairs: Sequence[tuple[str, str]],
    *,
    source: str,
    where: Path,
    meta: Mapping[str, Any] | None = None,
) -> None:
    """One record per (pair, template), pair-major so a limit keeps whole facts."""
    out.start(relation_id)
    for index, (subject, obj) in enumerate(pairs):
        if not subject:
            out.skip(relation_id, "empty_subject")
            continue
        for template in templates:
            try:
                text, span = fill_template(template, subject)
            except ValueError as e:
                raise DatasetError(f"{where}: relation {relation_id}: {e}") from None
            record_meta = {"template": template, "pair_index": index, **(meta or {})}
            out.add(
                PromptRecord(
                    text=text,
                    relation_id=relation_id,
                    relation_name=relation_name,
                    subject=subject,
                    object=obj,
                    subject_span=span,
                    source=source,
                    meta=record_meta,
                )
            )


def string_pairs(value: Any, where: Path) -> list[tuple[str, str]]:
    if not isinstance(value, list) or not all(
        isinstance(p, list | tuple) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in value
    ):
        raise DatasetError(f"{where}: expected a list of [subject, object] string pairs")
    return [(p[0], p[1]) for p in value]


def string_list(value: Any, what: str, where: Path) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(x, str) for x in value):
        raise DatasetError(f"{where}: {what} must be a non-empty list of strings")
    return list(value)


def parse_spec(spec: str) -> tuple[str, str | None]:
    """Split a data set spec into its lower-cased kind and its location.

    ``"fewrel:/data/val_wiki.json"`` -> ``("fewrel", "/data/val_wiki.json")``; a spec without a
    colon (``"fewrel"``) names a data set and gives no location (``None``); ``"fewrel:"`` gives an
    empty location, which the caller refuses.  Only the first colon splits, so a location may hold
    colons.
    """
    kind, colon, location = spec.partition(":")
    return kind.strip().lower(), location.strip() if colon else None


class SliceReader(Sequence[T]):
    """A sequence read a slice at a time (:meth:`_read`: items ``lo`` to ``hi - 1``): an item is a slice of
    one, iteration reads :attr:`chunk` items at a time, a slice takes no step."""

    chunk = 4096

    def _read(self, lo: int, hi: int) -> list[T]:
        raise NotImplementedError

    def _read_slice(self, lo: int, hi: int) -> list[T]:
        """What ``self[lo:hi]`` returns (a subclass may keep it)."""
        return self._read(lo, hi)

    @overload
    def __getitem__(self, i: int) -> T: ...

    @overload
    def __getitem__(self, i: slice) -> list[T]: ...

    def __getitem__(self, i: int | slice) -> T | list[T]:
        if isinstance(i, slice):
            lo, hi, step = i.indices(len(self))
            if step != 1:
                raise ValueError(f"{type(self).__name__} slices take no step")
            return self._read_slice(lo, hi)
        n = len(self)
        if not -n <= i < n:
            raise IndexError(i)
        i %= n
        return self._read(i, i + 1)[0]

    def __iter__(self) -> Iterator[T]:
        for lo in range(0, len(self), self.chunk):
            yield from self._read(lo, min(lo + self.chunk, len(self)))
