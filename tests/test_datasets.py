"""Dataset loaders against the real reference data in ../shared/data and synthetic edge cases."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ingest.datasets import (
    DatasetError,
    DatasetResult,
    fill_template,
    load_dataset,
    load_demo,
    load_fewrel,
    load_jsonl,
    load_known1000,
    load_lre,
    load_maps,
)
from ingest.records import PromptRecord

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
FEWREL = SHARED_DATA / "fewrel" / "val_wiki.json"
LRE = SHARED_DATA / "lre_relations" / "data"
KNOWN = SHARED_DATA / "known_1000" / "known_1000.json"
MAPS = SHARED_DATA / "maps" / "datasets"

needs_data = pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="../shared/data not present")


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


@pytest.fixture(scope="module")
def fewrel_raw() -> dict[str, list[dict[str, Any]]]:
    raw: dict[str, list[dict[str, Any]]] = json.loads(FEWREL.read_text(encoding="utf-8"))
    return raw


@pytest.fixture(scope="module")
def fewrel() -> DatasetResult:
    return load_fewrel(FEWREL)


@needs_data
def test_fewrel_counts_add_up_per_relation(fewrel: DatasetResult, fewrel_raw: dict[str, list[Any]]) -> None:
    assert len(fewrel.kept) == 16
    for pid, instances in fewrel_raw.items():
        assert len(instances) == 700
        assert total(fewrel, pid) == 700
        subject_first = sum(1 for x in instances if x["t"][2][0][0] > x["h"][2][0][0])
        assert fewrel.kept[pid] == subject_first
        assert fewrel.skipped[pid] == {"object_first": 700 - subject_first}
    # golden totals for FewRel 1.0 validation (16 x 700)
    assert (fewrel.n_kept, fewrel.n_skipped) == (6128, 5072)


@needs_data
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


@needs_data
def test_fewrel_relation_names_from_pid2name(fewrel: DatasetResult) -> None:
    names = {r.relation_id: r.relation_name for r in fewrel.records}
    assert names["P177"] == "crosses"
    assert names["P26"] == "spouse"


@needs_data
def test_fewrel_keep_object_first(fewrel_raw: dict[str, list[Any]]) -> None:
    result = load_fewrel(FEWREL, keep_object_first=True)
    at_start = sum(1 for xs in fewrel_raw.values() for x in xs if x["t"][2][0][0] == 0)
    assert result.n_kept == 16 * 700 - at_start
    assert result.n_skipped == at_start
    assert {reason for d in result.skipped.values() for reason in d} == {"empty_prompt"}
    flipped = [r for r in result.records if r.meta["object_first"]]
    assert flipped and all(r.subject_span is None for r in flipped)
    assert_valid(result.records)


@needs_data
def test_fewrel_limit_and_relations_are_deterministic(fewrel: DatasetResult) -> None:
    result = load_fewrel(FEWREL, relations=["P40", "P26"], limit_per_relation=5)
    assert list(result.kept) == ["P26", "P40"]  # file order, not request order
    assert result.kept == {"P26": 5, "P40": 5}
    assert total(result, "P26") == 700
    expected = [r for r in fewrel.records if r.relation_id == "P26"][:5]
    assert [r for r in result.records if r.relation_id == "P26"] == expected
    assert load_fewrel(FEWREL, relations=["P40"], limit_per_relation=5).records == [
        r for r in result.records if r.relation_id == "P40"
    ]
    with pytest.raises(DatasetError, match="P999"):
        load_fewrel(FEWREL, relations=["P999"])


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


def _lre_files() -> list[Path]:
    return sorted(LRE.rglob("*.json"))


@needs_data
def test_lre_counts_are_templates_times_samples() -> None:
    raw = [json.loads(f.read_text(encoding="utf-8")) for f in _lre_files()]
    result = load_lre(LRE)
    assert len(result.kept) == len(raw) == 47
    assert result.n_kept == sum(len(d["prompt_templates"]) * len(d["samples"]) for d in raw)
    assert result.n_skipped == 0
    first = load_lre(LRE, templates="first")
    assert first.n_kept == sum(len(d["samples"]) for d in raw) == 11089


@needs_data
def test_lre_records_fill_templates() -> None:
    result = load_lre(LRE)
    assert_valid(result.records)
    categories = {f.stem: f.parent.name for f in _lre_files()}
    for r in result.records:
        assert r.text == r.meta["template"].format(r.subject)
        assert r.subject_span is not None
        assert r.text[r.subject_span[0] : r.subject_span[1]] == r.subject
        assert r.meta["category"] == categories[r.relation_id]
        assert "\\u" not in r.subject + r.object and r.subject == r.subject.strip()
    capitals = {r.subject: r.object for r in result.records if r.relation_id == "country_capital_city"}
    assert capitals["Brazil"] == "Brasília"
    assert {r.relation_name for r in result.records if r.relation_id == "country_capital_city"} == {
        "country capital city"
    }


@needs_data
def test_lre_single_file_and_limit() -> None:
    path = LRE / "factual" / "country_capital_city.json"
    result = load_lre(path, limit_per_relation=3)
    assert [r.text for r in result.records] == [
        "The capital city of United States is",
        "The capital of United States is",
        "The capital city of Canada is",
    ]
    assert total(result, "country_capital_city") == 48
    with pytest.raises(DatasetError, match="templates"):
        load_lre(path, templates="some")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- known_1000


@needs_data
def test_known1000() -> None:
    raw = json.loads(KNOWN.read_text(encoding="utf-8"))
    result = load_known1000(KNOWN)
    assert result.n_kept == len(raw) == 1209
    assert_valid(result.records)
    for r, x in zip(result.records, raw):
        assert r.text == x["prompt"] and r.object == x["attribute"]
        assert r.subject_span is not None
        assert r.text[r.subject_span[0] : r.subject_span[1]] == x["subject"]
        assert r.relation_id == r.relation_name == x["relation_id"]
        assert r.meta == {"known_id": x["known_id"], "template": x["template"]}
    assert load_known1000(KNOWN, limit=10).records == result.records[:10]
    p30 = load_known1000(KNOWN, relations=["P30"])
    assert p30.records and {r.relation_id for r in p30.records} == {"P30"}


# --------------------------------------------------------------------------- MAPS


@needs_data
def test_maps_directory() -> None:
    files = sorted(MAPS.rglob("*.json"))
    result = load_maps(MAPS, template="Q: {} A:")
    assert set(result.kept) == {f.parent.name for f in files} == {f.stem for f in files}
    assert result.n_kept == sum(len(json.loads(f.read_text(encoding="utf-8"))) for f in files)
    assert_valid(result.records)
    for r in result.records:
        assert r.subject_span is not None
        assert r.text == f"Q: {r.subject} A:" and r.text[r.subject_span[0] : r.subject_span[1]] == r.subject
    french = load_maps(MAPS, relations=["english_to_french"])
    assert (french.records[0].text, french.records[0].object) == ("cat", "chat")
    with pytest.raises(DatasetError, match="exactly one"):
        load_maps(MAPS, template="no field")


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


@needs_data
def test_load_dataset_dispatch() -> None:
    assert (
        load_dataset(f"fewrel:{FEWREL}", relations=["P26"]).records
        == load_fewrel(FEWREL, relations=["P26"]).records
    )
    assert load_dataset(f"lre:{LRE}", templates="first").n_kept == 11089
    assert load_dataset(f"known1000:{KNOWN}", limit=3).n_kept == 3
    assert (
        load_dataset(f"maps:{MAPS}", template="{} ->", relations=["adj_antonym"]).records[0].text == "love ->"
    )
    # options that do not apply are fine when unset
    assert (
        load_dataset(f"lre:{LRE}", keep_object_first=False, template=None, limit_per_relation=1).n_kept == 47
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


@needs_data
def test_cli_keep_object_first_ingests_the_flipped_instances(tmp_path: Path) -> None:
    """``ingest --keep-object-first`` stores exactly the loader's flipped instances, without a subject span."""
    from click.testing import CliRunner

    import actstore
    from actstore.cli import main

    args = ["ingest", "--model", "tiny-llama", "--dataset", f"fewrel:{FEWREL}", "--relations", "P155",
            "--limit-per-relation", "12", "--batch-size", "8", "--quiet"]
    r = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "skip")])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, [*args, "--keep-object-first", "--out", str(tmp_path / "keep")])
    assert r.exit_code == 0, r.output
    want = load_fewrel(FEWREL, relations=["P155"], limit_per_relation=12, keep_object_first=True)
    flipped = sorted(x.text for x in want.records if x.meta["object_first"])
    assert flipped
    keep, skip = actstore.open(tmp_path / "keep"), actstore.open(tmp_path / "skip")
    got = keep.sql("SELECT text FROM examples WHERE subject_start < 0 ORDER BY text").column("text").to_pylist()
    assert got == flipped
    assert skip.sql("SELECT count(*) AS n FROM examples WHERE subject_start < 0").column("n")[0].as_py() == 0
    assert keep.manifest.ingest["keep_object_first"] is True
