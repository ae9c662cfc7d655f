"""Generic prompts: JSON lines, one JSON array, or Parquet, one prompt per row."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from actstore.core.errors import DatasetError
from actstore.core.manifest import json_depth
from actstore.ingest.datasets.common import Collector, DatasetResult, existing, find_span
from actstore.ingest.records import PromptRecord

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
        bad = e.object[e.start : e.end] if isinstance(e.object, str) else ""
        escaped = bad.encode("unicode_escape").decode()
        raise DatasetError(
            f"{where}: a string holds {escaped} (a lone surrogate), which is not valid Unicode text"
        ) from None
    return value


def _open_regular(path: Path) -> Any:
    """``path`` opened for binary reading if it is a regular file of at most :data:`MAX_JSONL_BYTES`; a
    named pipe, a device (``/dev/zero``) or a socket is refused before it is read (the type is checked
    on the descriptor, opened non-blocking so that a pipe cannot hang the open)."""

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
        raise DatasetError(
            f"{path}: {st.st_size} bytes, more than the {MAX_JSONL_BYTES >> 30} GiB a jsonl file may have"
        )
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
        subject_span = find_span(text, strings["subject"])
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
    path: str | Path, *, relations: Sequence[str] | None = None, limit_per_relation: int | None = None
) -> DatasetResult:
    """Generic prompts from JSON lines (``.jsonl``; ``.json`` may also be one array) or Parquet.

    Required: ``text``.  Optional: ``target`` ("last" or an int character offset in
    1..len(text)), ``subject_span``/``object_span`` ([start, end)), ``subject`` (located in
    the text when no span is given), ``object``, ``relation_id``, ``relation_name``,
    ``split``, ``source``; any other column goes to ``meta``.  Invalid rows raise
    :class:`DatasetError` naming the file and the 1-based line (or row).
    """
    p = existing(path, "jsonl")
    if p.is_dir():
        raise DatasetError(f"{p}: jsonl expects a .jsonl, .json or .parquet file, not a directory")
    wanted = None if relations is None else set([relations] if isinstance(relations, str) else relations)
    out = Collector(limit_per_relation)
    seen: set[str] = set()
    for where, row in _jsonl_rows(p):
        record = _jsonl_record(row, where)
        seen.add(record.relation_id)
        if wanted is None or record.relation_id in wanted:
            out.add(record)
    if wanted is not None and wanted - seen:
        raise DatasetError(
            f"{p}: unknown relation(s) {', '.join(sorted(wanted - seen))}; "
            f"available: {', '.join(sorted(seen))}"
        )
    return out.result()
