"""A JSON-lines corpus streams into the ingest: read, parsed and aligned a segment at a time.

Checked against the whole-file loader (``load_jsonl``, an independent reading of the same file):
the streamed records equal its records for any line layout and any read block size; a store
ingested from the stream equals, array for array and table for table, the store ingested from the
loaded records; a bad line late in the corpus stops the ingest with one line naming it, after the
segments before it are committed (a valid store); a resume tokenizes no committed segment.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import actstore
import actstore.ingest.datasets.jsonl_stream as jsonl_stream
from actstore.core.errors import DatasetError
from actstore.core.layout import SEGMENT_ARRAYS
from actstore.core.verify import verify_store
from actstore.ingest.datasets.jsonl import load_jsonl
from actstore.ingest.datasets.jsonl_stream import JsonlLines, stream_dataset
from actstore.ingest.lazy_prompts import LazyPrompts
from actstore.jobs.ingest import IngestRequest, run_ingest

RELATIONS = ("capital", "language", "currency")


def corpus_lines(n: int) -> list[str]:
    """``n`` JSON lines of invented facts over three relations (subjects located in the text)."""
    out = []
    for i in range(n):
        rel = RELATIONS[i % 3]
        subject = f"Land{i}"
        text = f"The {rel} of {subject} is" + " very" * (i % 5)
        out.append(json.dumps({"text": text, "subject": subject, "object": f"O{i % 7}", "relation_id": rel}))
    return out


def write_corpus(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def ingest(out: Path, dataset: Path, resume: bool = False, **options: object) -> None:
    run_ingest(
        IngestRequest(  # type: ignore[arg-type]
            out=str(out),
            model="tiny-llama",
            dataset=f"jsonl:{dataset}",
            batch_size=4,
            segment_size=8,
            storage_dtype="float32",
            progress=False,
            resume=resume,
            **options,
        )
    )


# -- the stream against the whole-file loader ---------------------------------------------------

LINE = st.one_of(
    st.sampled_from(["", " ", "\t", "\r", " \x1c ", "\u00a0", "\u2003 "]),  # blank lines of kinds
    st.builds(
        lambda t, s: json.dumps({"text": t, "relation_id": s}, ensure_ascii=s == "a"),
        st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12).filter(str.strip),
        st.sampled_from(["a", "b"]),
    ),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(LINE, max_size=30), block=st.integers(1, 64), newline=st.booleans())
def test_stream_equals_the_whole_file_loader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lines: list[str], block: int, newline: bool
) -> None:
    monkeypatch.setattr(jsonl_stream, "BLOCK", block)  # lines cut across blocks at every place
    path = tmp_path / "c.jsonl"
    path.write_bytes(("\n".join(lines) + ("\n" if newline else "")).encode("utf-8"))
    want = load_jsonl(path).records
    got = JsonlLines(path)
    assert len(got) == len(want)
    assert list(got) == want
    assert got[:] == want
    for lo in range(0, len(want), 3):
        assert got[lo : lo + 3] == want[lo : lo + 3]
    if want:
        assert got[-1] == want[-1]
    assert got.fingerprint == hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_bad_line_is_found_when_its_slice_is_read(tmp_path: Path) -> None:
    lines = corpus_lines(20)
    lines[13] = '{"text": "broken"'
    path = write_corpus(tmp_path / "c.jsonl", ["", *lines])  # a blank first line: line numbers shift by one
    got = JsonlLines(path)  # opening parses nothing
    assert len(got) == 20
    assert got[0:10] == load_jsonl(write_corpus(tmp_path / "ok.jsonl", lines[:10])).records
    with pytest.raises(DatasetError, match=r"c\.jsonl, line 15: malformed JSON"):
        got[10:20]


def test_stream_refusals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jsonl_stream, "MAX_JSONL_LINE", 50)
    path = write_corpus(tmp_path / "c.jsonl", ['{"text": "ok"}', '{"text": "' + "x" * 60 + '"}'])
    with pytest.raises(DatasetError, match=r"line 2: longer than"):
        JsonlLines(path)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
    with pytest.raises(DatasetError, match=r"bad\.jsonl, line 2: not UTF-8 text"):
        JsonlLines(bad)[0:2]
    with pytest.raises(DatasetError, match="not a regular file"):
        JsonlLines(Path("/dev/zero"))


def test_what_streams(tmp_path: Path) -> None:
    path = write_corpus(tmp_path / "c.jsonl", corpus_lines(5))
    assert isinstance(stream_dataset(f"jsonl:{path}", {"relations": None}).records, JsonlLines)  # type: ignore[union-attr]
    assert stream_dataset(f"jsonl:{path}", {"relations": ["capital"]}) is None  # a filter needs every record
    assert stream_dataset(f"jsonl:{path}", {"limit_per_relation": 2}) is None
    (tmp_path / "c.json").write_text(json.dumps([json.loads(x) for x in corpus_lines(2)]))
    assert stream_dataset(f"jsonl:{tmp_path / 'c.json'}", {}) is None
    assert stream_dataset("demo", {}) is None


# -- the ingest ------------------------------------------------------------------------------------


def test_streamed_ingest_equals_the_loaded_one(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.jsonl", corpus_lines(30))  # 4 segments of 8, the last of 6
    ingest(tmp_path / "streamed", corpus)
    ingest(tmp_path / "loaded", corpus, relations=list(RELATIONS))  # a filter: load_jsonl, whole
    a, b = actstore.open(tmp_path / "streamed"), actstore.open(tmp_path / "loaded")
    assert a.complete and b.complete and a.manifest.n_examples == b.manifest.n_examples == 30
    assert a.manifest.ingest["corpus_sha256"] == hashlib.sha256(corpus.read_bytes()).hexdigest()
    assert a.commits == b.commits
    for seg in a.commits:
        for name in SEGMENT_ARRAYS:
            x, y = a.array(seg, name)[...], b.array(seg, name)[...]
            assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), (seg, name)
    for table in ("examples", "tokens", "targets"):
        assert a.table(table).equals(b.table(table)), table
    texts = a.sql("SELECT text FROM examples ORDER BY example_id").column("text").to_pylist()
    assert texts == [r.text for r in load_jsonl(corpus).records]


def test_a_bad_line_late_stops_the_ingest_and_keeps_what_is_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = corpus_lines(40)  # 5 segments of 8
    lines[35] = "[1, 2"  # segment 4
    corpus = write_corpus(tmp_path / "c.jsonl", lines)
    parsed: list[int] = []
    real = jsonl_stream._jsonl_record
    monkeypatch.setattr(
        jsonl_stream, "_jsonl_record", lambda row, where: parsed.append(1) or real(row, where)
    )
    out = tmp_path / "s"
    with pytest.raises(DatasetError) as e:
        ingest(out, corpus)
    msg = str(e.value)
    assert "\n" not in msg and "c.jsonl, line 36: malformed JSON" in msg and "in segment 4" in msg
    assert "4 segment(s) written before it are committed" in msg
    assert len(parsed) == 32 + 3  # nothing was parsed ahead: segments 0-3, then segment 4 up to the bad line
    s = actstore.open(out)
    assert not s.complete and sorted(s.commits) == [0, 1, 2, 3]
    rep = verify_store(s)  # every committed byte intact; the one finding: the segment not written
    assert rep.segments_checked == 4 and rep.uncommitted == [4]
    assert len(rep.problems) == 1 and "segment 4 of 5 not committed and without data" in rep.problems[0]
    got = s.sql("SELECT text FROM examples ORDER BY example_id").column("text").to_pylist()
    assert got == [json.loads(x)["text"] for x in lines[:32]]

    # a resume reads and aligns only what is not committed: the tokenizer sees segment 4 alone
    seen: list[tuple[int, int]] = []
    tokenize = LazyPrompts._tokenize
    monkeypatch.setattr(
        LazyPrompts, "_tokenize", lambda self, lo, hi: seen.append((lo, hi)) or tokenize(self, lo, hi)
    )
    with pytest.raises(DatasetError, match="line 36"):
        ingest(out, corpus, resume=True)
    assert seen == [(32, 40)]
    assert sorted(actstore.open(out).commits) == [0, 1, 2, 3]


def test_a_bad_line_in_the_first_segment_writes_nothing(tmp_path: Path) -> None:
    lines = corpus_lines(20)
    lines[3] = '{"text": 7}'
    corpus = write_corpus(tmp_path / "c.jsonl", lines)
    out = tmp_path / "s"
    with pytest.raises(DatasetError, match=r"line 4: 'text' must be a string, got int$"):
        ingest(out, corpus)
    assert not out.exists() or not any(out.iterdir())


def test_resume_of_a_streamed_ingest_refuses_another_file(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.jsonl", corpus_lines(12))
    ingest(tmp_path / "s", corpus)
    write_corpus(corpus, corpus_lines(11) + ['{"text": "The capital of Elsewhere is"}'])
    with pytest.raises(Exception, match="corpus_sha256"):
        ingest(tmp_path / "s", corpus, resume=True)
