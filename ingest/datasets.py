"""Dataset loaders: public relation data sets turned into :class:`PromptRecord` lists.

Every loader takes a path (so users point it at their own copy), returns a
:class:`DatasetResult` and is deterministic: records come out in file order (directories
are walked in sorted path order).  ``limit_per_relation`` keeps the first N records of
each relation after skipping; every instance a loader reads is either kept or counted
under a skip reason (``over_limit`` included), so ``kept + skipped`` is the file total.

Spans are half-open character ranges into ``text`` and always valid for it.
``load_dataset("KIND:PATH", **options)`` dispatches on the kind.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from actstore.errors import ActstoreError
from actstore.manifest import json_depth
from ingest.records import PromptRecord

DEMO_PATH = Path(__file__).parent / "data" / "demo.json"
KINDS = ("fewrel", "lre", "known1000", "maps", "jsonl", "demo")


class DatasetError(ActstoreError, ValueError):
    """A data set is missing or malformed, or a loader option is invalid (one-line message)."""


@dataclass
class DatasetResult:
    """What a loader returns: the records plus per-relation bookkeeping.

    ``skipped[relation][reason]`` counts instances left out, ``kept[relation]`` the
    records kept; relations filtered out by ``relations=`` appear in neither.
    """

    records: list[PromptRecord]
    skipped: dict[str, dict[str, int]] = field(default_factory=dict)
    kept: dict[str, int] = field(default_factory=dict)

    @property
    def n_kept(self) -> int:
        return len(self.records)

    @property
    def n_skipped(self) -> int:
        return sum(sum(reasons.values()) for reasons in self.skipped.values())


class _Collector:
    """Accumulates records per relation, applying the per-relation limit and counting skips."""

    def __init__(self, limit_per_relation: int | None) -> None:
        self.limit = _check_limit(limit_per_relation, "limit_per_relation")
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


# --------------------------------------------------------------------------- helpers


def _check_limit(limit: int | None, name: str) -> int | None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise DatasetError(f"{name} must be a positive integer, got {limit!r}")
    return limit


def _existing(path: str | Path, kind: str) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise DatasetError(f"{kind} data set {p} not found")
    return p


def _read_json(path: Path) -> Any:
    try:
        with path.open(encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}: malformed JSON ({e.msg}, line {e.lineno} column {e.colno})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(f"{path}: cannot read: {e}") from None


def _json_files(path: Path) -> dict[str, Path]:
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


def _select(available: Sequence[str], relations: Sequence[str] | None, where: Path) -> list[str]:
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


def _strip_span(text: str, start: int, end: int) -> tuple[int, int]:
    """Shrink ``[start, end)`` so it neither starts nor ends with whitespace."""
    piece = text[start:end]
    return start + len(piece) - len(piece.lstrip()), start + len(piece.rstrip())


def _find_span(text: str, needle: str) -> tuple[int, int] | None:
    start = text.find(needle) if needle else -1
    return None if start < 0 else (start, start + len(needle))


_ESCAPE = re.compile(r"\\u([0-9a-fA-F]{4})")


def _clean_name(value: str) -> str:
    r"""Strip surrounding blanks and decode literal ``\uXXXX`` escapes.

    The LRE files contain a few double-escaped names (``Bras\u00edlia``) and subjects
    with a trailing space (``"Jimmy Carter "``) that would put two spaces in the prompt.
    """
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), value).strip()


def _template_records(
    out: _Collector,
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


def _string_pairs(value: Any, where: Path) -> list[tuple[str, str]]:
    if not isinstance(value, list) or not all(
        isinstance(p, list | tuple) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in value
    ):
        raise DatasetError(f"{where}: expected a list of [subject, object] string pairs")
    return [(p[0], p[1]) for p in value]


def _string_list(value: Any, what: str, where: Path) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(x, str) for x in value):
        raise DatasetError(f"{where}: {what} must be a non-empty list of strings")
    return list(value)


# --------------------------------------------------------------------------- FewRel


def join_tokens(tokens: Sequence[str]) -> tuple[str, list[int], list[int]]:
    """Join FewRel tokens with single spaces; return the text and each token's char start/end.

    Whitespace-only tokens (about 2% of FewRel sentences hold ``"\\xa0"``, ``"\\n"`` or
    ``" "`` tokens) are left out of the text, so prompts carry no runs of blanks; such a
    token gets the empty span at the end of the text before it.
    """
    text = ""
    starts: list[int] = []
    ends: list[int] = []
    for tok in tokens:
        if tok.strip():
            text += " " + tok if text else tok
            starts.append(len(text) - len(tok))
        else:
            starts.append(len(text))
        ends.append(len(text))
    return text, starts, ends


def _fewrel_names(path: Path) -> dict[str, str]:
    """Relation names from ``pid2name.json`` (``{"P177": ["crosses", "description"]}``), if present."""
    if not path.is_file():
        return {}
    data = _read_json(path)
    if not isinstance(data, dict):
        raise DatasetError(f"{path}: expected an object of relation id -> [name, description]")
    return {pid: v[0] for pid, v in data.items() if isinstance(v, list) and v and isinstance(v[0], str)}


def _fewrel_entity(value: Any) -> tuple[str, str, list[int]] | None:
    """``[name, qid, [[idx, ...], ...]]`` -> (name, qid, first occurrence), or None if malformed."""
    if not (isinstance(value, list) and len(value) >= 3 and isinstance(value[0], str)):
        return None
    occurrences = value[2]
    if not (isinstance(occurrences, list) and occurrences and isinstance(occurrences[0], list)):
        return None
    first = occurrences[0]
    if not first or not all(isinstance(i, int) for i in first):
        return None
    return value[0], str(value[1]), first


def _fewrel_record(
    instance: Any, pid: str, name: str, index: int, keep_object_first: bool
) -> PromptRecord | str:
    """One FewRel instance as a record, or the reason it is skipped.

    The prompt is the sentence (see :func:`join_tokens`) up to the first tail occurrence,
    without the separating space, so the target -- the last token of the prompt -- is the
    last real token before the object.  The head span is its first occurrence.

    Skip reasons: ``malformed``, ``invalid_span`` (indices out of range), ``overlap``
    (head and tail share tokens), ``object_first`` (tail before head, unless
    ``keep_object_first``), ``empty_prompt`` (nothing before the tail), and
    ``subject_not_in_prompt`` (head tokens are all blank).  Under ``keep_object_first`` an
    object-first instance is kept with ``subject_span=None``: the prompt ends before the
    object, so it cannot contain the head (no FewRel validation instance repeats the head
    earlier).
    """
    if not isinstance(instance, dict) or not isinstance(instance.get("tokens"), list):
        return "malformed"
    tokens = [str(t) for t in instance["tokens"]]
    head, tail = _fewrel_entity(instance.get("h")), _fewrel_entity(instance.get("t"))
    if head is None or tail is None:
        return "malformed"
    h0, h1 = min(head[2]), max(head[2]) + 1
    t0, t1 = min(tail[2]), max(tail[2]) + 1
    if min(h0, t0) < 0 or max(h1, t1) > len(tokens):
        return "invalid_span"
    if h0 < t1 and t0 < h1:
        return "overlap"
    object_first = t0 < h0
    if object_first and not keep_object_first:
        return "object_first"
    sentence, starts, ends = join_tokens(tokens)
    text = sentence[: starts[t0]].rstrip()
    if not text:
        return "empty_prompt"
    subject_span = None
    if not object_first:
        s, e = _strip_span(sentence, starts[h0], ends[h1 - 1])
        if e <= s or e > len(text):
            return "subject_not_in_prompt"
        subject_span = (s, e)
    return PromptRecord(
        text=text,
        relation_id=pid,
        relation_name=name,
        subject=head[0],
        object=tail[0],
        subject_span=subject_span,
        object_span=None,
        source="fewrel",
        split="val",
        meta={
            "subject_qid": head[1],
            "object_qid": tail[1],
            "fewrel_index": index,
            "object_first": object_first,
        },
    )


def load_fewrel(
    path: str | Path,
    *,
    relations: Sequence[str] | None = None,
    limit_per_relation: int | None = None,
    keep_object_first: bool = False,
) -> DatasetResult:
    """FewRel (``{"P177": [{"tokens", "h", "t"}, ...]}``): the sentence up to the object.

    Instances whose object precedes the subject are skipped (``object_first``) unless
    ``keep_object_first``; they are then kept without a subject span.  On the FewRel 1.0
    validation split the default keeps 6,128 of 11,200 instances.  See
    :func:`_fewrel_record` for the prompt rule and all skip reasons.
    """
    p = _existing(path, "fewrel")
    data = _read_json(p)
    if not isinstance(data, dict) or not all(isinstance(v, list) for v in data.values()):
        raise DatasetError(f"{p}: expected an object of relation id -> list of instances (FewRel format)")
    names = _fewrel_names(p.parent / "pid2name.json")
    out = _Collector(limit_per_relation)
    for pid in _select(list(data), relations, p):
        out.start(pid)
        for index, instance in enumerate(data[pid]):
            outcome = _fewrel_record(instance, pid, names.get(pid, pid), index, keep_object_first)
            if isinstance(outcome, str):
                out.skip(pid, outcome)
            else:
                out.add(outcome)
    return out.result()


# --------------------------------------------------------------------------- LRE


def load_lre(
    path: str | Path,
    *,
    relations: Sequence[str] | None = None,
    limit_per_relation: int | None = None,
    templates: Literal["all", "first"] = "all",
) -> DatasetResult:
    """LRE relation files (evandez/relations): one record per sample x prompt template.

    ``path`` is one relation JSON file or a directory searched recursively for ``*.json``.
    The relation id is the file stem, the category (factual, linguistic, ...) its folder.
    Subjects and objects are cleaned by :func:`_clean_name`.
    """
    if templates not in ("all", "first"):
        raise DatasetError(f"templates must be 'all' or 'first', got {templates!r}")
    p = _existing(path, "lre")
    files = _json_files(p)
    out = _Collector(limit_per_relation)
    for stem in _select(list(files), relations, p):
        f = files[stem]
        data = _read_json(f)
        if not isinstance(data, dict) or not isinstance(data.get("samples"), list):
            raise DatasetError(
                f"{f}: expected an LRE relation object with 'name', 'prompt_templates', 'samples'"
            )
        prompts = _string_list(data.get("prompt_templates"), "'prompt_templates'", f)
        samples = data["samples"]
        if not all(
            isinstance(s, dict) and isinstance(s.get("subject"), str) and isinstance(s.get("object"), str)
            for s in samples
        ):
            raise DatasetError(f"{f}: every sample needs string 'subject' and 'object'")
        pairs = [(_clean_name(s["subject"]), _clean_name(s["object"])) for s in samples]
        _template_records(
            out,
            stem,
            str(data.get("name", stem)),
            prompts[:1] if templates == "first" else prompts,
            pairs,
            source="lre",
            where=f,
            meta={"category": f.parent.name},
        )
    return out.result()


# --------------------------------------------------------------------------- known_1000


def load_known1000(
    path: str | Path,
    *,
    limit: int | None = None,
    relations: Sequence[str] | None = None,
    limit_per_relation: int | None = None,
) -> DatasetResult:
    """ROME's known_1000: the given ``prompt`` with the subject located in it.

    ``limit`` keeps the first N records overall (after ``relations`` and the per-relation
    limit); instances whose subject is not in the prompt are skipped.
    """
    _check_limit(limit, "limit")
    p = _existing(path, "known1000")
    data = _read_json(p)
    keys = ("subject", "attribute", "prompt", "relation_id")
    if not isinstance(data, list) or not all(
        isinstance(x, dict) and all(isinstance(x.get(k), str) for k in keys) for x in data
    ):
        raise DatasetError(
            f"{p}: expected a list of objects with string {', '.join(keys)} (known_1000 format)"
        )
    available = list(dict.fromkeys(x["relation_id"] for x in data))
    wanted = set(_select(available, relations, p))
    out = _Collector(limit_per_relation)
    for x in data:
        relation = x["relation_id"]
        if relation not in wanted:
            continue
        span = _find_span(x["prompt"], x["subject"])
        if span is None:
            out.skip(relation, "subject_not_in_prompt")
            continue
        if limit is not None and len(out.records) >= limit:
            out.skip(relation, "over_limit")
            continue
        meta = {"known_id": x.get("known_id"), "template": x.get("template", "")}
        out.add(
            PromptRecord(
                text=x["prompt"],
                relation_id=relation,
                relation_name=relation,
                subject=x["subject"],
                object=x["attribute"],
                subject_span=span,
                source="known1000",
                meta=meta,
            )
        )
    return out.result()


# --------------------------------------------------------------------------- MAPS


def load_maps(
    path: str | Path,
    *,
    template: str = "{}",
    relations: Sequence[str] | None = None,
    limit_per_relation: int | None = None,
) -> DatasetResult:
    """MAPS pair files (``[["cat", "chat"], ...]``): ``template.format(source)`` -> target.

    ``path`` is one pair file or a directory such as ``maps/datasets`` (one folder per
    relation holding ``<relation>.json``); the relation id is the file stem.
    """
    try:
        fill_template(template, "x")
    except ValueError as e:
        raise DatasetError(f"maps: {e}") from None
    p = _existing(path, "maps")
    files = _json_files(p)
    out = _Collector(limit_per_relation)
    for stem in _select(list(files), relations, p):
        f = files[stem]
        pairs = _string_pairs(_read_json(f), f)
        _template_records(out, stem, stem.replace("_", " "), [template], pairs, source="maps", where=f)
    return out.result()


# --------------------------------------------------------------------------- demo


def load_demo(
    *, relations: Sequence[str] | None = None, limit_per_relation: int | None = None
) -> DatasetResult:
    """The built-in demo corpus (``ingest/data/demo.json``): template x fact per relation."""
    data = _read_json(DEMO_PATH)
    specs = {r["id"]: r for r in data["relations"]}
    out = _Collector(limit_per_relation)
    for rid in _select(list(specs), relations, DEMO_PATH):
        spec = specs[rid]
        pairs = _string_pairs(spec["facts"], DEMO_PATH)
        templates = _string_list(spec["templates"], "'templates'", DEMO_PATH)
        _template_records(out, rid, spec["name"], templates, pairs, source="demo", where=DEMO_PATH)
    return out.result()


# --------------------------------------------------------------------------- JSONL / Parquet

_JSONL_STRINGS = ("subject", "object", "relation_id", "relation_name", "split", "source")
_JSONL_FIELDS = frozenset({"text", "target", "subject_span", "object_span", "meta", *_JSONL_STRINGS})


# Bounds on what a JSONL data set may hold: a file is read whole into records, so its size is
# bounded; a line is parsed at once, so its length is; nesting beyond a few levels is no prompt.
MAX_JSONL_BYTES = 4 << 30
MAX_JSONL_LINE = 16 << 20
MAX_JSONL_DEPTH = 64


def _parse_json_value(text: str, where: str) -> Any:
    """One JSON value, as one clear :class:`DatasetError` for malformed text, deep nesting (which would
    exhaust the parser's recursion) and strings that are not valid Unicode (lone surrogates such as
    ``"\\ud800"``, which no tokenizer or Parquet file can take)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        at = f"column {e.colno}" if e.lineno == 1 else f"line {e.lineno} column {e.colno}"
        raise DatasetError(f"{where}: malformed JSON ({e.msg} at {at})") from None
    except RecursionError:
        raise DatasetError(f"{where}: JSON nests deeper than {MAX_JSONL_DEPTH} levels") from None
    if json_depth(value, MAX_JSONL_DEPTH) > MAX_JSONL_DEPTH:
        raise DatasetError(f"{where}: JSON nests deeper than {MAX_JSONL_DEPTH} levels")
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        bad = e.object[e.start:e.end] if isinstance(e.object, str) else ""
        raise DatasetError(f"{where}: a string holds {bad.encode('unicode_escape').decode()!s} (a lone surrogate), "
                           "which is not valid Unicode text") from None
    return value


def _open_regular(path: Path) -> Any:
    """``path`` opened for binary reading if it is a regular file of at most :data:`MAX_JSONL_BYTES`; a
    named pipe, a device (``/dev/zero``) or a socket is refused before it is read (the type is checked
    on the descriptor, opened non-blocking so that a pipe cannot hang the open)."""
    import os
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise DatasetError(f"{path}: cannot read: {e.strerror or e}") from None
    f = os.fdopen(fd, "rb")
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        f.close()
        raise DatasetError(f"{path}: not a regular file (a device, pipe or socket); jsonl reads files only")
    if st.st_size > MAX_JSONL_BYTES:
        f.close()
        raise DatasetError(f"{path}: {st.st_size} bytes, more than the {MAX_JSONL_BYTES >> 30} GiB a jsonl file may have")
    return f


def _text_lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(number, line)`` of a regular UTF-8 file, each line at most :data:`MAX_JSONL_LINE` bytes."""
    total = 0
    with _open_regular(path) as f:
        number = 0
        while True:
            raw = f.readline(MAX_JSONL_LINE + 1)
            if not raw:
                return
            number += 1
            total += len(raw)
            if len(raw) > MAX_JSONL_LINE:
                raise DatasetError(f"{path}, line {number}: longer than {MAX_JSONL_LINE >> 20} MiB")
            if total > MAX_JSONL_BYTES:
                raise DatasetError(f"{path}: more than {MAX_JSONL_BYTES >> 30} GiB")
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(f"{path}, line {number}: not UTF-8 text ({e.reason})") from None


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` pairs; ``where`` names the file and the 1-based line or row."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        _open_regular(path).close()
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several unrelated types for bad files
            raise DatasetError(f"{path}: cannot read Parquet: {e}") from None
        for number, row in enumerate(rows, 1):
            yield f"{path}, row {number}", row
        return
    if path.suffix == ".json":
        with _open_regular(path) as f:
            head = f.read(4096).decode("utf-8", "replace").lstrip()
        if head.startswith("["):
            with _open_regular(path) as f:
                try:
                    content = f.read().decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DatasetError(f"{path}: not UTF-8 text ({e.reason})") from None
            data = _parse_json_value(content, str(path))
            for number, row in enumerate(data, 1):
                yield f"{path}, record {number}", row
            return
    for number, line in _text_lines(path):
        if not line.strip():
            continue
        yield f"{path}, line {number}", _parse_json_value(line, f"{path}, line {number}")


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _jsonl_span(row: Mapping[str, Any], key: str, n: int, where: str) -> tuple[int, int] | None:
    value = row.get(key)
    if value is None:
        return None
    ok = isinstance(value, list | tuple) and len(value) == 2
    if not ok or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise DatasetError(f"{where}: {key!r} must be [start, end] character offsets, got {value!r}")
    start, end = value
    if start >= end:
        raise DatasetError(f"{where}: {key!r} {[start, end]} has start >= end")
    if start < 0 or end > n:
        raise DatasetError(f"{where}: {key!r} {[start, end]} is out of range for a text of {n} characters")
    return (start, end)


def _jsonl_target(value: Any, n: int, where: str) -> int | str:
    if value is None or value == "last":
        return "last"
    if isinstance(value, bool) or not isinstance(value, int):
        raise DatasetError(f"{where}: 'target' must be \"last\" or a character offset, got {value!r}")
    if not 1 <= value <= n:
        raise DatasetError(f"{where}: 'target' offset {value} is out of range 1..{n}")
    return value


def _jsonl_record(row: Any, where: str) -> PromptRecord:
    """Validate one JSONL/Parquet row; see :func:`load_jsonl` for the fields."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {_type_name(row)}")
    text = row.get("text")
    if text is None:
        raise DatasetError(f"{where}: missing 'text'")
    if not isinstance(text, str):
        raise DatasetError(f"{where}: 'text' must be a string, got {_type_name(text)}")
    if not text.strip():
        raise DatasetError(f"{where}: 'text' is empty")
    strings: dict[str, str] = {}
    for key in _JSONL_STRINGS:
        value = row.get(key)
        if value is not None and not isinstance(value, str):
            raise DatasetError(f"{where}: {key!r} must be a string, got {_type_name(value)}")
        strings[key] = value or ""
    subject_span = _jsonl_span(row, "subject_span", len(text), where)
    if subject_span is None and strings["subject"]:
        subject_span = _find_span(text, strings["subject"])
        if subject_span is None:
            raise DatasetError(f"{where}: subject {strings['subject']!r} not found in text")
    # null means "not given" (a Parquet file has every column in every row)
    meta = {k: v for k, v in row.items() if k not in _JSONL_FIELDS and v is not None}
    if isinstance(row.get("meta"), dict):
        meta = {**row["meta"], **meta}
    elif row.get("meta") is not None:
        meta["meta"] = row["meta"]
    return PromptRecord(
        text=text,
        relation_id=strings["relation_id"],
        relation_name=strings["relation_name"] or strings["relation_id"],
        subject=strings["subject"],
        object=strings["object"],
        subject_span=subject_span,
        object_span=_jsonl_span(row, "object_span", len(text), where),
        target=_jsonl_target(row.get("target"), len(text), where),
        source=strings["source"] or "jsonl",
        split=strings["split"],
        meta=meta,
    )


def load_jsonl(
    path: str | Path,
    *,
    relations: Sequence[str] | None = None,
    limit_per_relation: int | None = None,
) -> DatasetResult:
    """Generic prompts from JSON lines (``.jsonl``; ``.json`` may also be one array) or Parquet.

    Required: ``text``.  Optional: ``target`` ("last" or an int character offset in
    1..len(text)), ``subject_span``/``object_span`` ([start, end)), ``subject`` (located in
    the text when no span is given), ``object``, ``relation_id``, ``relation_name``,
    ``split``, ``source``; any other column goes to ``meta``.  Invalid rows raise
    :class:`DatasetError` naming the file and the 1-based line (or row).
    """
    p = _existing(path, "jsonl")
    if p.is_dir():
        raise DatasetError(f"{p}: jsonl expects a .jsonl, .json or .parquet file, not a directory")
    wanted = None if relations is None else set([relations] if isinstance(relations, str) else relations)
    out = _Collector(limit_per_relation)
    seen: set[str] = set()
    for where, row in _jsonl_rows(p):
        record = _jsonl_record(row, where)
        seen.add(record.relation_id)
        if wanted is None or record.relation_id in wanted:
            out.add(record)
    if wanted is not None and wanted - seen:
        raise DatasetError(
            f"{p}: unknown relation(s) {', '.join(sorted(wanted - seen))}; available: {', '.join(sorted(seen))}"
        )
    return out.result()


# --------------------------------------------------------------------------- dispatch

_OPTIONS: dict[str, frozenset[str]] = {
    "fewrel": frozenset({"relations", "limit_per_relation", "keep_object_first"}),
    "lre": frozenset({"relations", "limit_per_relation", "templates"}),
    "known1000": frozenset({"relations", "limit_per_relation", "limit"}),
    "maps": frozenset({"relations", "limit_per_relation", "template"}),
    "jsonl": frozenset({"relations", "limit_per_relation"}),
    "demo": frozenset({"relations", "limit_per_relation"}),
}
_ALL_OPTIONS = frozenset().union(*_OPTIONS.values())


def _applicable(kind: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """Options for ``kind``; others must be unset (None, or False for a flag)."""
    unknown = sorted(set(options) - _ALL_OPTIONS)
    if unknown:
        raise DatasetError(
            f"unknown dataset option(s) {', '.join(unknown)}; known: {', '.join(sorted(_ALL_OPTIONS))}"
        )
    kept = {k: v for k, v in options.items() if k in _OPTIONS[kind]}
    stray = sorted(
        k for k, v in options.items() if k not in _OPTIONS[kind] and v is not None and v is not False
    )
    if stray:
        raise DatasetError(f"option(s) {', '.join(stray)} do not apply to {kind} data sets")
    return {k: v for k, v in kept.items() if v is not None}


def load_dataset(spec: str, **options: Any) -> DatasetResult:
    """Load ``"KIND:PATH"`` (KIND in fewrel, lre, known1000, maps, jsonl) or ``"demo"``.

    Options: ``relations``, ``limit_per_relation``, ``template`` (maps), ``templates``
    (lre), ``limit`` (known1000), ``keep_object_first`` (fewrel).  An option that does not
    apply to the kind is an error unless it is None (or False for a flag).
    """
    kind, _, location = spec.partition(":")
    kind = kind.strip().lower()
    if kind not in KINDS:
        raise DatasetError(
            f"unknown dataset kind {kind!r} in {spec!r}; expected one of {', '.join(KINDS)} (as KIND:PATH, or demo)"
        )
    opts = _applicable(kind, options)
    if kind == "demo":
        if location.strip():
            raise DatasetError(f"the demo data set takes no path, got {spec!r}")
        return load_demo(**opts)
    if not location.strip():
        raise DatasetError(f"{spec!r}: no path given; write {kind}:PATH")
    path = _existing(location.strip(), kind)
    loaders: dict[str, Callable[..., DatasetResult]] = {
        "fewrel": load_fewrel,
        "lre": load_lre,
        "known1000": load_known1000,
        "maps": load_maps,
        "jsonl": load_jsonl,
    }
    return loaders[kind](path, **opts)
