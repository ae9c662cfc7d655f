"""Dataset loaders on the project's own fixtures (tests/data: invented content in each public
format), the same generic checks on the real public sets (``real_data``), their exact figures,
and synthetic edge cases."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import FIXTURES, real_data

from actstore.core.errors import DatasetError
from actstore.ingest.datasets.common import DatasetResult, fill_template
from actstore.ingest.datasets.demo import load_demo
from actstore.ingest.datasets.dispatch import load_dataset
from actstore.ingest.datasets.fewrel import load_fewrel
from actstore.ingest.datasets.jsonl import load_jsonl
from actstore.ingest.datasets.known1000 import load_known1000
from actstore.ingest.datasets.lre import load_lre
from actstore.ingest.datasets.maps import load_maps
from actstore.ingest.records import PromptRecord

FEWREL = FIXTURES / "fewrel" / "val_wiki.json"
LRE = FIXTURES / "lre_relations" / "data"
KNOWN = FIXTURES / "known_1000" / "known_1000.json"
MAPS = FIXTURES / "maps" / "datasets"
# Where each format lives, relative to the fixtures folder and to $ACTSTORE_DATA (same layout).
RELATIVE = {
    "fewrel": "fewrel/val_wiki.json",
    "lre": "lre_relations/data",
    "known1000": "known_1000/known_1000.json",
    "maps": "maps/datasets",
}
SOURCES = ["fixture", pytest.param("real", marks=pytest.mark.real_data)]


def data_path(kind: str, source: str) -> Path:
    """The fixture, or the real data set (skips, or fails in CI, when it is absent)."""
    return FIXTURES / RELATIVE[kind] if source == "fixture" else real_data(RELATIVE[kind])


def assert_valid(records: list[PromptRecord]) -> None:
    """Spans lie inside the text, targets are valid, texts are non-empty."""
    for r in records:
        assert r.text.strip(), r
        for span in (r.subject_span, r.object_span):
            if span is not None:
                assert 0 <= span[0] < span[1] <= len(r.text), r
        assert r.target == "last" or (isinstance(r.target, int) and 1 <= r.target <= len(r.text)), r


def total(result: DatasetResult, relation: str) -> int:
    return result.kept[relation] + sum(result.skipped[relation].values())


def nonblank(tokens: list[str]) -> list[str]:
    return [t for t in tokens if t.strip()]


# --------------------------------------------------------------------------- FewRel


def fewrel_outcome(inst: Any, keep_object_first: bool = False) -> str:
    """What the loader must do with one raw FewRel instance, worked out from the format alone:
    ``"kept"`` or the skip reason, checked in the documented order (malformed, invalid_span,
    overlap, object_first, empty_prompt, subject_not_in_prompt)."""

    def first_occurrence(entity: Any) -> list[int] | None:
        ok = isinstance(entity, list) and len(entity) >= 3 and isinstance(entity[0], str)
        occurrences = entity[2] if ok else None
        if not (isinstance(occurrences, list) and occurrences and isinstance(occurrences[0], list)):
            return None
        first = occurrences[0]
        return first if first and all(isinstance(i, int) for i in first) else None

    if not isinstance(inst, dict) or not isinstance(inst.get("tokens"), list):
        return "malformed"
    head, tail = first_occurrence(inst.get("h")), first_occurrence(inst.get("t"))
    if head is None or tail is None:
        return "malformed"
    tokens = [str(t) for t in inst["tokens"]]
    if min(head + tail) < 0 or max(head + tail) >= len(tokens):
        return "invalid_span"
    head_tokens, tail_tokens = set(range(min(head), max(head) + 1)), set(range(min(tail), max(tail) + 1))
    if head_tokens & tail_tokens:
        return "overlap"
    object_first = min(tail) < min(head)
    if object_first and not keep_object_first:
        return "object_first"
    if not nonblank(tokens[: min(tail)]):
        return "empty_prompt"
    if not object_first and not nonblank(tokens[min(head) : max(head) + 1]):
        return "subject_not_in_prompt"
    return "kept"


@pytest.fixture(scope="module", params=SOURCES)
def fewrel_path(request: pytest.FixtureRequest) -> Path:
    return data_path("fewrel", request.param)


@pytest.fixture(scope="module")
def fewrel_raw(fewrel_path: Path) -> dict[str, list[dict[str, Any]]]:
    raw: dict[str, list[dict[str, Any]]] = json.loads(fewrel_path.read_text(encoding="utf-8"))
    return raw


@pytest.fixture(scope="module")
def fewrel(fewrel_path: Path) -> DatasetResult:
    return load_fewrel(fewrel_path)


@pytest.mark.parametrize("keep_object_first", [False, True])
def test_fewrel_counts_add_up_per_relation(
    fewrel_path: Path, fewrel_raw: dict[str, list[Any]], keep_object_first: bool
) -> None:
    result = load_fewrel(fewrel_path, keep_object_first=keep_object_first)
    assert list(result.kept) == list(fewrel_raw)
    for pid, instances in fewrel_raw.items():
        assert total(result, pid) == len(instances)
        outcomes = Counter(fewrel_outcome(x, keep_object_first) for x in instances)
        assert result.kept[pid] == outcomes.pop("kept", 0)
        assert result.skipped[pid] == dict(outcomes)
    assert result.n_kept + result.n_skipped == sum(len(xs) for xs in fewrel_raw.values())
    if keep_object_first:
        flipped = [r for r in result.records if r.meta["object_first"]]
        assert flipped and all(r.subject_span is None for r in flipped)
        assert_valid(result.records)


def test_fewrel_fixture_figures() -> None:
    """tests/data/fewrel as its README describes it: 8 relations x 15, 12 kept per relation; one
    object-first and one overlapping instance each; the four other reasons twice each."""
    result = load_fewrel(FEWREL)
    assert len(result.kept) == 8 and set(result.kept.values()) == {12}
    assert all(total(result, pid) == 15 for pid in result.kept)
    reasons = Counter(reason for d in result.skipped.values() for reason, n in d.items() for _ in range(n))
    assert reasons == {
        "object_first": 8,
        "overlap": 8,
        "malformed": 2,
        "invalid_span": 2,
        "empty_prompt": 2,
        "subject_not_in_prompt": 2,
    }
    assert load_fewrel(FEWREL, keep_object_first=True).n_kept == 8 * 13


@pytest.mark.real_data
def test_fewrel_real_figures() -> None:
    """FewRel 1.0 validation: 16 x 700, only object-first instances skipped (golden totals)."""
    path = real_data(RELATIVE["fewrel"])
    raw = json.loads(path.read_text(encoding="utf-8"))
    result = load_fewrel(path)
    assert len(result.kept) == 16 and all(len(xs) == 700 for xs in raw.values())
    assert {reason for d in result.skipped.values() for reason in d} == {"object_first"}
    assert (result.n_kept, result.n_skipped) == (6128, 5072)
    at_start = sum(1 for xs in raw.values() for x in xs if x["t"][2][0][0] == 0)
    flipped = load_fewrel(path, keep_object_first=True)
    assert (flipped.n_kept, flipped.n_skipped) == (16 * 700 - at_start, at_start)
    assert {reason for d in flipped.skipped.values() for reason in d} == {"empty_prompt"}


def test_fewrel_prompt_ends_right_before_object(
    fewrel: DatasetResult, fewrel_raw: dict[str, list[Any]]
) -> None:
    assert_valid(fewrel.records)
    for r in fewrel.records:
        inst = fewrel_raw[r.relation_id][r.meta["fewrel_index"]]
        tokens = inst["tokens"]
        head, tail = inst["h"][2][0], inst["t"][2][0]
        sentence = " ".join(nonblank(tokens))
        assert sentence.startswith(r.text)
        before_object = " ".join(nonblank(tokens[: tail[0]]))
        assert r.text == before_object
        assert sentence[len(r.text) :].startswith(" " + " ".join(nonblank(tokens[tail[0] : tail[-1] + 1])))
        assert r.subject_span is not None
        assert r.text[r.subject_span[0] : r.subject_span[1]] == " ".join(
            nonblank(tokens[head[0] : head[-1] + 1])
        )
        assert (r.subject, r.object) == (inst["h"][0], inst["t"][0])
        assert (r.meta["subject_qid"], r.meta["object_qid"]) == (inst["h"][1], inst["t"][1])
        assert (r.source, r.split, r.target, r.object_span) == ("fewrel", "val", "last", None)
        assert "  " not in r.text and "\n" not in r.text


def test_fewrel_relation_names_from_pid2name(fewrel: DatasetResult, fewrel_path: Path) -> None:
    pid2name = json.loads((fewrel_path.parent / "pid2name.json").read_text(encoding="utf-8"))
    names = {r.relation_id: r.relation_name for r in fewrel.records}
    assert names == {pid: pid2name[pid][0] for pid in names}
    assert names["P177"] == "crosses"
    assert names["P26"] == "spouse"


def test_fewrel_limit_and_relations_are_deterministic(fewrel: DatasetResult, fewrel_path: Path) -> None:
    pids = list(fewrel.kept)
    first, second = pids[1], pids[3]
    result = load_fewrel(fewrel_path, relations=[second, first], limit_per_relation=5)
    assert list(result.kept) == [first, second]  # file order, not request order
    assert result.kept == {first: 5, second: 5}
    assert total(result, first) == total(fewrel, first)
    expected = [r for r in fewrel.records if r.relation_id == first][:5]
    assert [r for r in result.records if r.relation_id == first] == expected
    assert load_fewrel(fewrel_path, relations=[second], limit_per_relation=5).records == [
        r for r in result.records if r.relation_id == second
    ]
    with pytest.raises(DatasetError, match="P999"):
        load_fewrel(fewrel_path, relations=["P999"])


def _fewrel_instance(tokens: str, head: list[int], tail: list[int]) -> dict[str, Any]:
    toks = tokens.split("|")
    return {"tokens": toks, "h": ["head", "Q1", [head]], "t": ["tail", "Q2", [tail]]}


def test_fewrel_synthetic_skip_reasons(tmp_path: Path) -> None:
    data = {
        "P1": [
            _fewrel_instance("Alice|\xa0|met|\n|Bob|.", [0], [4]),  # kept, blanks dropped
            _fewrel_instance("Bob|met|Alice", [2], [0]),  # object first
            _fewrel_instance("Alice|Bob", [0, 1], [1]),  # overlap
            _fewrel_instance("Alice|met|Bob", [0], [7]),  # index out of range
            {"tokens": "not a list"},
        ]
    }
    path = tmp_path / "fewrel.json"
    path.write_text(json.dumps(data))
    result = load_fewrel(path)
    assert result.kept == {"P1": 1}
    assert result.skipped == {"P1": {"object_first": 1, "overlap": 1, "invalid_span": 1, "malformed": 1}}
    (record,) = result.records
    assert record.text == "Alice met"
    assert record.subject_span == (0, 5)
    assert record.relation_name == "P1"  # no pid2name.json next to the file
    kept = load_fewrel(path, keep_object_first=True)
    assert kept.kept == {"P1": 1} and kept.skipped["P1"]["empty_prompt"] == 1


# --------------------------------------------------------------------------- LRE


@pytest.fixture(scope="module", params=SOURCES)
def lre_path(request: pytest.FixtureRequest) -> Path:
    return data_path("lre", request.param)


def _lre_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.json"))


def test_lre_counts_are_templates_times_samples(lre_path: Path) -> None:
    raw = {f.stem: json.loads(f.read_text(encoding="utf-8")) for f in _lre_files(lre_path)}
    blank = {rel: sum(1 for s in d["samples"] if not s["subject"].strip()) for rel, d in raw.items()}
    result = load_lre(lre_path)
    assert list(result.kept) == list(raw)  # sorted path order
    assert result.kept == {
        rel: len(d["prompt_templates"]) * (len(d["samples"]) - blank[rel]) for rel, d in raw.items()
    }
    assert result.skipped == {rel: {"empty_subject": n} if n else {} for rel, n in blank.items()}
    first = load_lre(lre_path, templates="first")
    assert first.kept == {rel: len(d["samples"]) - blank[rel] for rel, d in raw.items()}


def test_lre_records_fill_templates(lre_path: Path) -> None:
    result = load_lre(lre_path)
    assert_valid(result.records)
    categories = {f.stem: f.parent.name for f in _lre_files(lre_path)}
    assert len(set(categories.values())) == 4  # factual, commonsense, linguistic, bias
    for r in result.records:
        assert r.text == r.meta["template"].format(r.subject)
        assert r.subject_span is not None
        assert r.text[r.subject_span[0] : r.subject_span[1]] == r.subject
        assert r.meta["category"] == categories[r.relation_id]
        assert "\\u" not in r.subject + r.object and r.subject == r.subject.strip() and r.subject
    assert {r.relation_name for r in result.records if r.relation_id == "country_capital_city"} == {
        "country capital city"
    }


def test_lre_fixture_figures() -> None:
    """The quirks the fixture reproduces are cleaned: a double-escaped name, a trailing space."""
    raw = json.loads((LRE / "factual" / "country_capital_city.json").read_text(encoding="utf-8"))
    assert {"subject": "Velmaria ", "object": "Port Sella"} in raw["samples"]
    assert {"subject": "Ostravia", "object": "Brn\\u00edk"} in raw["samples"]
    result = load_lre(LRE)
    capitals = {r.subject: r.object for r in result.records if r.relation_id == "country_capital_city"}
    assert capitals["Ostravia"] == "Brník" and capitals["Velmaria"] == "Port Sella"
    assert (result.n_kept, result.n_skipped, len(result.kept)) == (30, 1, 5)
    assert load_lre(LRE, templates="first").n_kept == 21
    path = LRE / "factual" / "country_capital_city.json"
    limited = load_lre(path, limit_per_relation=3)
    assert [r.text for r in limited.records] == [
        "The seat of government of Ostravia is in",
        "Officials of Ostravia meet in the city of",
        "The seat of government of Velmaria is in",
    ]
    assert total(limited, "country_capital_city") == 12 and limited.skipped == {
        "country_capital_city": {"over_limit": 9}
    }
    with pytest.raises(DatasetError, match="templates"):
        load_lre(path, templates="some")  # type: ignore[arg-type]


@pytest.mark.real_data
def test_lre_real_figures() -> None:
    """evandez/relations: 47 relations, 11,089 samples, nothing skipped; Brasília decoded."""
    root = real_data(RELATIVE["lre"])
    result = load_lre(root)
    assert (len(result.kept), result.n_skipped) == (47, 0)
    assert load_lre(root, templates="first").n_kept == 11089
    capitals = {r.subject: r.object for r in result.records if r.relation_id == "country_capital_city"}
    assert capitals["Brazil"] == "Brasília"
    path = root / "factual" / "country_capital_city.json"
    limited = load_lre(path, limit_per_relation=3)
    assert [r.text for r in limited.records] == [
        "The capital city of United States is",
        "The capital of United States is",
        "The capital city of Canada is",
    ]
    assert total(limited, "country_capital_city") == 48


def test_lre_bad_files(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    good = {"name": "r", "prompt_templates": ["{} is"], "samples": [{"subject": "x", "object": "y"}]}
    (tmp_path / "a" / "rel.json").write_text(json.dumps(good))
    (tmp_path / "b" / "rel.json").write_text(json.dumps(good))
    with pytest.raises(DatasetError, match="relation id 'rel' is used by both"):
        load_lre(tmp_path)
    bad = tmp_path / "bad.json"
    for data, problem in [
        ({"samples": "no"}, "expected an LRE relation object"),
        ({**good, "prompt_templates": []}, "'prompt_templates' must be a non-empty list"),
        ({**good, "samples": [{"subject": 3, "object": "y"}]}, "string 'subject' and 'object'"),
        ({**good, "prompt_templates": ["{} and {}"]}, "exactly one"),
    ]:
        bad.write_text(json.dumps(data))
        with pytest.raises(DatasetError, match=problem):
            load_lre(bad)


# --------------------------------------------------------------------------- known_1000


@pytest.mark.parametrize("source", SOURCES)
def test_known1000(source: str) -> None:
    path = data_path("known1000", source)
    raw = json.loads(path.read_text(encoding="utf-8"))
    located = [x for x in raw if x["subject"] in x["prompt"]]
    result = load_known1000(path)
    assert result.n_kept == len(located)
    assert result.n_skipped == len(raw) - len(located)
    assert_valid(result.records)
    for r, x in zip(result.records, located, strict=True):
        assert r.text == x["prompt"] and r.object == x["attribute"]
        assert r.subject_span is not None
        assert r.text[r.subject_span[0] : r.subject_span[1]] == x["subject"]
        assert r.relation_id == r.relation_name == x["relation_id"]
        assert r.meta == {"known_id": x["known_id"], "template": x["template"]}
    assert load_known1000(path, limit=10).records == result.records[:10]
    p30 = load_known1000(path, relations=["P30"])
    assert p30.records == [r for r in result.records if r.relation_id == "P30"]


def test_known1000_fixture_figures() -> None:
    result = load_known1000(KNOWN)
    assert (result.n_kept, result.skipped["P127"]) == (17, {"subject_not_in_prompt": 1})
    limited = load_known1000(KNOWN, relations=["P30", "P103"], limit_per_relation=5)
    assert [r.relation_id for r in limited.records] == ["P30"] * 5 + ["P103"] * 5
    assert limited.skipped == {"P30": {"over_limit": 2}, "P103": {"over_limit": 1}}
    assert (
        limited.records[0].text == "Mount Elvaran is located in the continent of"
    )  # prompt extends the template


@pytest.mark.real_data
def test_known1000_real_figures() -> None:
    path = real_data(RELATIVE["known1000"])
    assert load_known1000(path).n_kept == len(json.loads(path.read_text(encoding="utf-8"))) == 1209


# --------------------------------------------------------------------------- MAPS


@pytest.mark.parametrize("source", SOURCES)
def test_maps_directory(source: str) -> None:
    root = data_path("maps", source)
    files = sorted(root.rglob("*.json"))
    result = load_maps(root, template="Q: {} A:")
    assert set(result.kept) == {f.parent.name for f in files} == {f.stem for f in files}
    assert result.n_kept == sum(len(json.loads(f.read_text(encoding="utf-8"))) for f in files)
    assert_valid(result.records)
    for r in result.records:
        assert r.subject_span is not None
        assert r.text == f"Q: {r.subject} A:" and r.text[r.subject_span[0] : r.subject_span[1]] == r.subject
    pairs = json.loads((root / "english_to_french" / "english_to_french.json").read_text(encoding="utf-8"))
    french = load_maps(root, relations=["english_to_french"])
    assert [(r.text, r.object) for r in french.records] == [tuple(p) for p in pairs]
    with pytest.raises(DatasetError, match="exactly one"):
        load_maps(root, template="no field")


def test_maps_fixture_figures() -> None:
    result = load_maps(MAPS)
    assert result.kept["year_to_following"] == 3 and len(result.kept) == 7
    french = load_maps(MAPS / "english_to_french" / "english_to_french.json", limit_per_relation=2)
    assert [(r.text, r.object) for r in french.records] == [("bread", "pain"), ("house", "maison")]
    with pytest.raises(DatasetError, match=r"list of \[subject, object\] string pairs"):
        load_maps(KNOWN)


@pytest.mark.real_data
def test_maps_real_figures() -> None:
    root = real_data(RELATIVE["maps"])
    assert len(load_maps(root).kept) == 20
    french = load_maps(root, relations=["english_to_french"])
    assert (french.records[0].text, french.records[0].object) == ("cat", "chat")


# --------------------------------------------------------------------------- fixtures are generated


def test_fixtures_are_what_make_fixtures_writes(tmp_path: Path) -> None:
    """The committed LRE, known_1000 and MAPS fixtures equal a fresh run of their writers."""
    spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, folder in (("lre", "lre_relations"), ("known_1000", "known_1000"), ("maps", "maps")):
        module.WRITERS[name](tmp_path)
        fresh = sorted(p.relative_to(tmp_path) for p in (tmp_path / folder).rglob("*") if p.is_file())
        committed = sorted(p.relative_to(FIXTURES) for p in (FIXTURES / folder).rglob("*") if p.is_file())
        assert fresh == committed, name
        for rel in fresh:
            assert (tmp_path / rel).read_bytes() == (FIXTURES / rel).read_bytes(), rel


# --------------------------------------------------------------------------- demo


def test_demo_corpus() -> None:
    result = load_demo()
    assert len(result.kept) == 6
    assert_valid(result.records)
    for relation, n in result.kept.items():
        facts = {r.subject for r in result.records if r.relation_id == relation}
        templates = {r.meta["template"] for r in result.records if r.relation_id == relation}
        assert 30 <= len(facts) <= 40 and len(templates) == 2
        assert n == len(facts) * 2
    for r in result.records:
        assert r.subject_span is not None and r.text[r.subject_span[0] : r.subject_span[1]] == r.subject
        assert r.object and r.text == r.text.strip()
    assert load_demo() == result
    small = load_demo(relations=["country_capital"], limit_per_relation=2)
    assert [r.text for r in small.records] == ["The capital of France is", "France has its capital in"]


# --------------------------------------------------------------------------- JSONL / Parquet

GOOD_ROWS: list[dict[str, Any]] = [
    {
        "text": "The capital of France is",
        "subject": "France",
        "object": "Paris",
        "relation_id": "capital",
        "tag": 7,
    },
    {
        "text": "Paris is the capital of France.",
        "target": 5,
        "subject_span": [0, 5],
        "object_span": [24, 30],
        "relation_id": "capital",
        "relation_name": "country capital",
        "split": "test",
    },
    {"text": "Just text"},
]


def test_jsonl_fields(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in GOOD_ROWS) + "\n\n")
    result = load_jsonl(path)
    assert_valid(result.records)
    a, b, c = result.records
    assert a.subject_span == (15, 21) and a.meta == {"tag": 7} and a.target == "last"
    assert b.target == 5 and b.object_span == (24, 30) and b.split == "test"
    assert (b.relation_name, a.relation_name) == ("country capital", "capital")
    assert c.subject_span is None and c.relation_id == "" and c.source == "jsonl"
    assert result.kept == {"capital": 2, "": 1}
    assert load_jsonl(path, relations=["capital"], limit_per_relation=1).records == [a]


def test_parquet_and_json_array_match_jsonl(tmp_path: Path) -> None:
    lines = tmp_path / "p.jsonl"
    lines.write_text("\n".join(json.dumps(r) for r in GOOD_ROWS))
    array = tmp_path / "p.json"
    array.write_text(json.dumps(GOOD_ROWS))
    parquet = tmp_path / "p.parquet"
    columns = sorted(set().union(*GOOD_ROWS))
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in columns} for r in GOOD_ROWS]), parquet)
    expected = load_jsonl(lines).records
    assert load_jsonl(array).records == expected
    # Parquet fills absent columns with nulls; null means "not given"
    assert load_jsonl(parquet).records == expected


BAD_LINES = [
    ('{"text": "ok", ', "malformed JSON"),
    ('["a list"]', "expected a JSON object"),
    ('{"subject": "x"}', "missing 'text'"),
    ('{"text": "   "}', "'text' is empty"),
    ('{"text": 5}', "'text' must be a string"),
    ('{"text": "abc", "subject": 3}', "'subject' must be a string"),
    ('{"text": "abc", "subject_span": [0, 9]}', "out of range"),
    ('{"text": "abc", "subject_span": [2, 1]}', "start >= end"),
    ('{"text": "abc", "object_span": [0]}', r"\[start, end\]"),
    ('{"text": "abc", "object_span": [0, true]}', r"\[start, end\]"),
    ('{"text": "abc", "target": 0}', r"out of range 1\.\.3"),
    ('{"text": "abc", "target": 4}', r"out of range 1\.\.3"),
    ('{"text": "abc", "target": "first"}', "'target' must be"),
    ('{"text": "abc", "subject": "zzz"}', "subject 'zzz' not found"),
]


@pytest.mark.parametrize(("line", "problem"), BAD_LINES)
def test_jsonl_errors_name_file_and_line(tmp_path: Path, line: str, problem: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n\n' + line + "\n")
    with pytest.raises(DatasetError, match=problem) as info:
        load_jsonl(path)
    message = str(info.value)
    assert message.startswith(f"{path}, line 3: ") and "\n" not in message


# --------------------------------------------------------------------------- dispatch


def test_load_dataset_dispatch(tmp_path: Path) -> None:
    assert (
        load_dataset(f"fewrel:{FEWREL}", relations=["P26"]).records
        == load_fewrel(FEWREL, relations=["P26"]).records
    )
    assert load_dataset(f"lre:{LRE}", templates="first").records == load_lre(LRE, templates="first").records
    assert load_dataset(f"known1000:{KNOWN}", limit=3).records == load_known1000(KNOWN).records[:3]
    assert (
        load_dataset(f"maps:{MAPS}", template="{} ->", relations=["adj_antonym"]).records[0].text == "hot ->"
    )
    lines = tmp_path / "p.jsonl"
    lines.write_text("\n".join(json.dumps(r) for r in GOOD_ROWS))
    assert load_dataset(f"jsonl:{lines}", relations=["capital"]).records == load_jsonl(lines).records[:2]
    # options that do not apply are fine when unset
    assert (
        load_dataset(f"lre:{LRE}", keep_object_first=False, template=None, limit_per_relation=1).n_kept == 5
    )


@pytest.mark.real_data
def test_load_dataset_dispatch_real() -> None:
    lre = real_data(RELATIVE["lre"])
    assert load_dataset(f"lre:{lre}", templates="first").n_kept == 11089
    assert (
        load_dataset(f"lre:{lre}", keep_object_first=False, template=None, limit_per_relation=1).n_kept == 47
    )
    maps = real_data(RELATIVE["maps"])
    assert (
        load_dataset(f"maps:{maps}", template="{} ->", relations=["adj_antonym"]).records[0].text == "love ->"
    )


def test_load_dataset_errors(tmp_path: Path) -> None:
    assert load_dataset("demo").records == load_dataset("demo:").records == load_demo().records
    with pytest.raises(DatasetError, match="expected one of fewrel, lre, known1000, maps, jsonl, demo"):
        load_dataset("csv:/x.csv")
    with pytest.raises(DatasetError, match="not found"):
        load_dataset(f"jsonl:{tmp_path / 'missing.jsonl'}")
    with pytest.raises(DatasetError, match="no path"):
        load_dataset("lre:")
    with pytest.raises(DatasetError, match="keep_object_first do not apply to demo"):
        load_dataset("demo", keep_object_first=True)
    with pytest.raises(DatasetError, match="unknown dataset option"):
        load_dataset("demo", colour="red")
    with pytest.raises(DatasetError, match="limit_per_relation must be a positive integer"):
        load_dataset("demo", limit_per_relation=0)


def test_fill_template() -> None:
    assert fill_template("{{x}} of {} is", "Rome") == ("{x} of Rome is", (7, 11))
    for bad in ("{} and {}", "{name}", "none", "{:>5}"):
        with pytest.raises(ValueError):
            fill_template(bad, "Rome")


def test_cli_keep_object_first_ingests_the_flipped_instances(tmp_path: Path) -> None:
    """``ingest --keep-object-first`` stores exactly the loader's flipped instances, without a subject span."""
    from click.testing import CliRunner

    import actstore
    from actstore.cli import main

    raw = json.loads(FEWREL.read_text(encoding="utf-8"))
    pid = next(iter(raw))
    limit = str(len(raw[pid]))  # every instance of the relation
    args = [
        "ingest",
        "--model",
        "tiny-llama",
        "--dataset",
        f"fewrel:{FEWREL}",
        "--relations",
        pid,
        "--limit-per-relation",
        limit,
        "--batch-size",
        "8",
        "--quiet",
    ]
    r = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "skip")])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, [*args, "--keep-object-first", "--out", str(tmp_path / "keep")])
    assert r.exit_code == 0, r.output
    want = load_fewrel(FEWREL, relations=[pid], limit_per_relation=int(limit), keep_object_first=True)
    flipped = sorted(x.text for x in want.records if x.meta["object_first"])
    assert flipped
    keep, skip = actstore.open(tmp_path / "keep"), actstore.open(tmp_path / "skip")
    got = (
        keep.sql("SELECT text FROM examples WHERE subject_start < 0 ORDER BY text").column("text").to_pylist()
    )
    assert got == flipped
    assert skip.sql("SELECT count(*) AS n FROM examples WHERE subject_start < 0").column("n")[0].as_py() == 0
    assert keep.manifest.ingest["keep_object_first"] is True
