"""The method study's checkpoints (``actstore study checkpoint`` and ``restore``): a
study's runs leave a store as numbers and run records only, and come back into a store ingested
from the same data byte for byte equal as tables, text columns included; a resumed study goes on
from them as the original would; a wrong store is refused with one line and left as it was."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner, Result
from helpers import FIXTURES, build_store

from actstore.cli import main
from actstore.ingest.datasets.methods2k import build_methods2k
from actstore.jobs.study_checkpoint import CHECKPOINT_TABLES
from actstore.jobs.study_state import read_summary, study_runs, write_summary

pytestmark = pytest.mark.usefixtures("one_thread")
M2K = FIXTURES / "methods2k"

ROOT = Path(__file__).resolve().parents[3]


def study(*args: object) -> Result:
    """``actstore study ARGS`` in this process."""
    return CliRunner().invoke(main, ["study", *map(str, args)])


def ok(*args: object) -> Result:
    r = study(*args)
    assert r.exit_code == 0, r.output
    return r


COMMON = [
    "--all-facts",
    "--chunk",
    "2",
    "--samples",
    "2",
    "--window",
    "2",
    "--methods",
    "trace,patch",
    "--modes",
    "knockout",
    "--random-draws",
    "1",
    "--resamples",
    "20",
]


def _store(root: Path, name: str, *, size: int = 18, arch: str = "llama") -> Path:
    data = root / f"m2k-{size}"
    if not data.exists():
        build_methods2k(
            M2K / "lre" / "factual",
            M2K / "known_1000.json",
            data,
            size=size,
            frequency=json.loads((M2K / "zipf.json").read_text()),
        )
    return build_store(root / name, arch, dataset=f"methods2k:{data}", limit=100)


def _files(store: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(store)): p.read_bytes()
        for p in sorted((store / "tables").rglob("*"))
        if p.is_file()
    }


def _run_tables(s: Any, state: dict[str, Any]) -> dict[tuple[str, str], Any]:
    out = {}
    for kind, rid in study_runs(state):
        for name in (*CHECKPOINT_TABLES[kind], "runs"):
            out[(name, rid)] = s.table(name, files=[f"tables/{name}/{rid}.parquet"])
    return out


@pytest.fixture(scope="module")
def studied(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A store with a 4-fact study (2 trace runs, 1 patch run, knock-out effects) and its checkpoint."""
    root = tmp_path_factory.mktemp("ck")
    a = _store(root, "a")
    state = root / "a.json"
    ok("run", a, "--state", state, "--max-facts", "4", *COMMON)
    ok("checkpoint", a, "--state", state, "--out", root / "ck")
    return root, a, state


def test_checkpoint_in_a_fresh_process_writes_the_same_files(studied: tuple[Path, Path, Path]) -> None:
    """The ``checkpoint`` command run as a user runs it, in a process of its own (its imports are its
    own: it once used ``pyarrow.compute`` that only another module had imported), writes the files
    the in-process call wrote, byte for byte."""
    import subprocess
    import sys

    root, a, state = studied
    out = root / "ck-fresh"
    r = subprocess.run(
        [sys.executable, "-m", "actstore.cli", "study", "checkpoint", str(a), "--state", str(state)]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]

    def tree(d: Path) -> dict[str, bytes]:
        return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}

    assert tree(out) == tree(root / "ck") and len(tree(out)) > 3


def test_checkpoint_holds_no_text_of_the_data_set(studied: tuple[Path, Path, Path]) -> None:
    import actstore

    root, a, _ = studied
    s = actstore.open(str(a))
    text = set(
        s.sql(
            "SELECT subject AS x FROM examples UNION SELECT object FROM examples UNION "
            "SELECT relation_id FROM examples UNION SELECT token FROM tokens"
        )
        .column("x")
        .to_pylist()
    )
    text = {t for t in text if t and len(t.strip()) >= 3}
    assert len(text) > 30
    seen = 0
    files = sorted((root / "ck").rglob("*.parquet"))
    assert {f.parent.name for f in files} == {
        "ck",
        "runs",
        "trace_effects",
        "trace_facts",
        "patch_effects",
        "patch_pairs",
        "site_effects",
    }
    for f in files:
        t = pq.read_table(f)
        for col in t.column_names:
            if t.schema.field(col).type == "string":
                values = set(t.column(col).to_pylist())
                seen += len(values)
                assert not values & text, (f.name, col, sorted(values & text)[:3])
    assert seen > 0
    ids = pq.read_table(root / "ck" / "facts.parquet").column("example_id").to_pylist()
    assert ids == sorted(ids) and len(ids) >= 4  # in example order: a rewrite gives the same bytes
    assert not any(x in (root / "ck" / "checkpoint.json").read_text() for x in text if len(x) >= 6)
    # and the text columns are really gone from the result tables
    for f in files:
        names = set(pq.read_schema(f).names)
        assert not names & {"token", "subject", "object", "relation_id", "counterfactual_object"}, f
        assert f.parent.name in ("ck", "runs") or "run_id" in names


def test_restore_gives_back_equal_tables_and_a_study_that_resumes(
    studied: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    import actstore

    root, a, state_a = studied
    b = _store(tmp_path, "b")
    state_b = tmp_path / "b.json"
    ok("restore", b, "--from", root / "ck", "--state", state_b)
    st_a, st_b = json.loads(state_a.read_text()), json.loads(state_b.read_text())
    assert st_b == {k: v for k, v in st_a.items() if not k.startswith("metrics_")}
    assert len(st_b["trace_runs"]) == 2 and len(st_b["patch_runs"]) == 1 and st_b["effects_knockout_run"]
    sa, sb = actstore.open(str(a)), actstore.open(str(b))
    ta, tb = _run_tables(sa, st_a), _run_tables(sb, st_b)
    assert ta.keys() == tb.keys() and len(ta) == 2 * 3 + 3 + 2
    for key, t in ta.items():
        assert tb[key].equals(t), key  # schema, column order, row order and every value, text included
    assert tb[("trace_effects", st_a["trace_runs"][0])].column("token").null_count == 0
    # the restored store answers SQL over the runs as the original does
    q = "SELECT example_id, component, layer, position, token, prob FROM trace_effects ORDER BY ALL"
    assert sb.sql(q).equals(sa.sql(q))
    # a resumed study goes on from the restored state as it goes on from the original one
    for store, state in ((a, state_a), (b, state_b)):
        ok("run", store, "--state", state, "--max-facts", "6", *COMMON)
    st_a, st_b = json.loads(state_a.read_text()), json.loads(state_b.read_text())
    assert st_a["traced"] == st_b["traced"] and len(st_b["traced"]) == 6 and len(st_b["trace_runs"]) == 3
    new_a, new_b = st_a["trace_runs"][-1], st_b["trace_runs"][-1]
    assert new_a != new_b
    for name in ("trace_effects", "trace_facts"):
        ea = sa.table(name, files=[f"tables/{name}/{new_a}.parquet"]).drop_columns(["run_id"])
        eb = sb.table(name, files=[f"tables/{name}/{new_b}.parquet"]).drop_columns(["run_id"])
        assert ea.equals(eb), name
    # a checkpoint of the grown study keeps the earlier runs' files byte for byte (a commit adds only new files)
    ck2 = tmp_path / "ck2"
    ok("checkpoint", a, "--state", state_a, "--out", ck2)

    def run_files(ck: Path) -> dict[Path, bytes]:
        return {
            f.relative_to(ck): f.read_bytes()
            for f in ck.rglob("*.parquet")
            if f.parent.name not in ("ck", "ck2", "site_effects") and not f.name.startswith("effects-")
        }

    before, after = run_files(root / "ck"), run_files(ck2)
    assert [k for k in before if before[k] != after.get(k)] == []
    assert len(before) == 2 * 3 + 3 and before.items() <= after.items() and len(after) == len(before) + 6
    # checkpointing the grown study over the earlier checkpoint removes the effect runs it no longer
    # lists (the effects were redone on six facts) and leaves exactly the files it lists
    ck3 = tmp_path / "ck3"
    shutil.copytree(root / "ck", ck3)
    old_files = set(json.loads((ck3 / "checkpoint.json").read_text())["files"])
    ok("checkpoint", a, "--state", state_a, "--out", ck3)
    new_files = set(json.loads((ck3 / "checkpoint.json").read_text())["files"])
    gone = old_files - new_files
    assert gone and all(f.startswith(("site_effects/effects-", "runs/effects-")) for f in gone)
    on_disk = {str(f.relative_to(ck3)) for f in ck3.rglob("*.parquet")}
    assert on_disk == new_files | {"facts.parquet"}


def test_restore_refuses_a_wrong_store_and_leaves_it_as_it_was(
    studied: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """Each refusal is one ``error:`` line and exit status 1 (the command could not do what was
    asked), the store left as it was."""
    root, _, _ = studied
    ck = str(root / "ck")

    def one_line(r: Result, words: str) -> None:
        err = r.stderr.strip()
        assert r.exit_code == 1 and err.startswith("error: ") and "\n" not in err and words in err, r.output

    def refused(store: Path, state: Path, words: str) -> None:
        before = _files(store)
        one_line(study("restore", store, "--from", ck, "--state", state), words)
        assert _files(store) == before

    other_facts = _store(
        tmp_path, "small", size=12
    )  # a smaller sample of the pool: other facts under the same ids
    refused(other_facts, tmp_path / "s1.json", "is not the checkpoint's fact")
    other_model = _store(tmp_path, "gpt2", arch="gpt2")
    refused(other_model, tmp_path / "g.json", "other weights")
    b = _store(tmp_path, "b")
    ok("restore", b, "--from", ck, "--state", tmp_path / "b.json")
    refused(b, tmp_path / "b2.json", "already holds run")  # twice into one store
    existing = tmp_path / "exists.json"
    existing.write_text("{}")
    refused(_store(tmp_path, "c"), existing, "exists")
    assert existing.read_text() == "{}"
    refused(b, tmp_path / "b3.json", "already holds run")
    (tmp_path / "notck").mkdir()
    one_line(
        study("restore", b, "--from", tmp_path / "notck", "--state", tmp_path / "b4.json"),
        "not a study checkpoint",
    )
    # a checkpoint whose file list points outside its tables
    bad = tmp_path / "bad"

    shutil.copytree(ck, bad)
    doc = json.loads((bad / "checkpoint.json").read_text())
    doc["files"][0] = "../../escape.parquet"
    (bad / "checkpoint.json").write_text(json.dumps(doc))
    fresh = _store(tmp_path, "d")
    before = _files(fresh)
    one_line(
        study("restore", fresh, "--from", bad, "--state", tmp_path / "d.json"), "is not TABLE/RUN_ID.parquet"
    )
    assert _files(fresh) == before
    # a store that is not there, a state with nothing to keep: one line each
    r = study("restore", tmp_path / "nowhere", "--from", ck, "--state", tmp_path / "b5.json")
    one_line(r, "")
    assert r.stderr.startswith("error: no actstore store at")
    r = study("checkpoint", b, "--state", tmp_path / "none.json", "--out", tmp_path / "ck3")
    one_line(r, "no runs to checkpoint")
    assert not (tmp_path / "ck3").exists()
    # usage errors: a missing option, exit status 2
    r = study("restore", b, "--state", tmp_path / "b6.json")
    assert r.exit_code == 2 and "--from" in r.stderr and "\n" not in r.stderr.strip(), r.output


GEMMA_SUMMARY = ROOT / "benchmarks" / "results" / "methods-gemma3-270m-s10" / "study.out.json.gz"


def test_committed_summary_prints_the_tables_the_results_page_cites(tmp_path: Path) -> None:
    """The Gemma-3-270M study's summary is kept gzip-compressed; ``tables`` reads it as it reads the
    plain JSON the study writes, and prints the figures docs/results-methods.md quotes."""
    summary = read_summary(GEMMA_SUMMARY)
    plain = tmp_path / "out.json"
    write_summary(plain, summary)
    assert read_summary(plain) == summary
    again = tmp_path / "out.json.gz"
    write_summary(again, summary)
    assert read_summary(again) == summary
    printed = [ok("tables", path).stdout for path in (GEMMA_SUMMARY, plain)]
    assert printed[0] == printed[1]
    assert "| trace vs patch | 520 | 43.7% [39.2%, 47.9%] | 82.5% |" in printed[0]
    assert "| all methods (consensus) | 400 | 3.2% [1.8%, 5.0%] | 47.6% |" in printed[0]
    docs = (ROOT / "docs" / "results-methods.md").read_text()
    assert "43.7% [39.2, 47.9]" in docs and "3.2% [1.8, 5.0]" in docs


# The results page's "Issue 36 in one table": the committed re-reads, each a column
SUMMARY_COLUMNS = [
    ("Gemma-3-270M, window 10 (530)", "methods-gemma3-270m-s10/chance-corpus.json.gz"),
    ("Gemma-3-270M, window 1 (first 96)", "methods-gemma3-270m-s10-w1/chance-w1.json.gz"),
    ("SmolLM2-135M, window 10 (535)", "methods-smollm2-135m-s10/chance.json.gz"),
    ("SmolLM2-135M, window 1 (first 96)", "methods-smollm2-135m-s10-w1/chance-w1.json.gz"),
]


def test_the_results_page_cites_the_summary_of_the_committed_rereads() -> None:
    """Every row of ``actstore study summary`` over the committed re-reads stands in
    docs/results-methods.md as printed, so the page's one-table summary is the committed data's."""
    results = ROOT / "benchmarks" / "results"
    args = [f"{label}={results / rel}" for label, rel in SUMMARY_COLUMNS]
    rows = [ln for ln in ok("summary", *args).stdout.splitlines() if ln.startswith("| ")]
    docs = (ROOT / "docs" / "results-methods.md").read_text()
    assert len(rows) > 20 and rows[0].startswith("| figure | Gemma-3-270M, window 10 (530) |")
    missing = [r for r in rows if r not in docs]
    assert missing == [], missing[:3]
