"""Text corpora for ``actstore ingest --positions all``: documents, not prompts.

``text:FILE`` is one document a line (UTF-8); ``jsonl:FILE`` a JSON-lines file, a JSON array or a
Parquet file whose ``text`` column holds the documents; ``hf:NAME[:SPLIT]`` a Hugging Face data set
read through the ``datasets`` library (its ``text`` column) when a hub is reachable.  Every document
must have text: an empty document, a file that is not UTF-8 text (a NUL byte, an invalid byte
sequence) or a missing ``text`` column is refused with one line naming the file and the line, before
anything is written.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from actstore.core.errors import DatasetError

CORPUS_KINDS = ("text", "jsonl", "hf")
MAX_CORPUS_BYTES = 8 << 30  # a corpus file larger than this is refused unread


@dataclass(frozen=True)
class Documents:
    """The documents of a corpus, in corpus order, with where each came from (``where[i]``: a line
    or record number, for messages) and the SHA-256 of the whole corpus."""

    spec: str
    texts: Sequence[str]
    where: Sequence[str]
    sha256: str

    def __len__(self) -> int:
        return len(self.texts)


def is_corpus_spec(spec: str) -> bool:
    """True for a data set spec a corpus ingest reads (``text:``, ``jsonl:``, ``hf:``)."""
    return spec.partition(":")[0] in CORPUS_KINDS and ":" in spec


def load_documents(spec: str) -> Documents:
    """The documents of ``spec`` (see the module notes)."""
    kind, _, rest = spec.partition(":")
    if kind not in CORPUS_KINDS or not rest:
        raise DatasetError(
            f"--positions all reads a text corpus: text:FILE (one document a line), jsonl:FILE (a text "
            f"column; also .json and .parquet) or hf:NAME[:SPLIT], not {spec!r}"
        )
    if kind == "hf":
        return _hub_documents(spec, rest)
    path = Path(rest)
    if not path.is_file():
        raise DatasetError(f"{spec}: no such file")
    if path.stat().st_size > MAX_CORPUS_BYTES:
        raise DatasetError(f"{spec}: larger than {MAX_CORPUS_BYTES >> 30} GiB")
    if kind == "jsonl" and path.suffix == ".parquet":
        return _parquet_documents(spec, path)
    data = path.read_bytes()
    text = _decode(spec, data)
    if kind == "text":
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()  # the final newline ends the last document
        lines = [line[:-1] if line.endswith("\r") else line for line in lines]
        docs, where = lines, [f"line {i + 1}" for i in range(len(lines))]
    else:
        docs, where = _json_documents(spec, text)
    return _checked(spec, docs, where, hashlib.sha256(data).hexdigest())


def _decode(spec: str, data: bytes) -> str:
    if b"\x00" in data:
        at = data.index(b"\x00")
        raise DatasetError(f"{spec}: not a text file (a NUL byte at offset {at}); give UTF-8 text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(
            f"{spec}: not UTF-8 text (invalid byte at offset {e.start}); give UTF-8 text"
        ) from None


def _json_documents(spec: str, text: str) -> tuple[list[str], list[str]]:
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{spec}: not valid JSON ({e.msg} at line {e.lineno})") from None
        numbered = [(f"record {i}", item) for i, item in enumerate(items)]
    else:
        numbered = []
        for i, line in enumerate(text.split("\n")):
            if not line.strip():
                continue
            try:
                numbered.append((f"line {i + 1}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise DatasetError(f"{spec} line {i + 1}: not valid JSON ({e.msg})") from None
    docs: list[str] = []
    where: list[str] = []
    for at, item in numbered:
        value = item.get("text") if isinstance(item, dict) else None
        if not isinstance(value, str):
            raise DatasetError(f"{spec} {at}: no string field 'text' (a corpus record is {{\"text\": ...}})")
        docs.append(value)
        where.append(at)
    return docs, where


def _parquet_documents(spec: str, path: Path) -> Documents:
    try:
        table = pq.read_table(path)
    except Exception as e:
        raise DatasetError(f"{spec}: not a readable Parquet file ({type(e).__name__})") from None
    if "text" not in table.column_names:
        raise DatasetError(f"{spec}: no column 'text' (columns: {', '.join(table.column_names)})")
    docs = table.column("text").to_pylist()
    bad = next((i for i, d in enumerate(docs) if not isinstance(d, str)), None)
    if bad is not None:
        raise DatasetError(f"{spec} row {bad}: 'text' is not a string")
    return _checked(spec, docs, [f"row {i}" for i in range(len(docs))], _file_sha256(path))


def _hub_documents(spec: str, rest: str) -> Documents:
    name, _, split = rest.partition(":")
    try:
        import datasets
    except ImportError:
        raise DatasetError(
            f"{spec}: reading a hub data set needs the 'datasets' package (pip install 'actstore[hf]'), "
            "or use a local file: --dataset text:FILE or jsonl:FILE"
        ) from None
    try:
        ds = datasets.load_dataset(name, split=split or "train")
    except Exception as e:  # offline, unknown name, gated: one line naming the way out
        raise DatasetError(
            f"{spec}: cannot load the hub data set {name!r} ({type(e).__name__}); offline or without "
            "the hub, save its text to a local file and use --dataset text:FILE or jsonl:FILE"
        ) from None
    if "text" not in ds.column_names:
        raise DatasetError(f"{spec}: no column 'text' (columns: {', '.join(ds.column_names)})")
    docs = [str(t) for t in ds["text"]]
    h = hashlib.sha256()
    for d in docs:
        h.update(json.dumps(d).encode())
    return _checked(spec, docs, [f"row {i}" for i in range(len(docs))], h.hexdigest())


def _checked(spec: str, docs: Sequence[str], where: Sequence[str], digest: str) -> Documents:
    if not docs:
        raise DatasetError(f"{spec}: no documents")
    empty = next((i for i, d in enumerate(docs) if not d.strip()), None)
    if empty is not None:
        raise DatasetError(
            f"{spec} {where[empty]}: empty document (every document must have text; remove empty lines "
            "or records)"
        )
    return Documents(spec, docs, where, digest)


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()
