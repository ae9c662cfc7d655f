"""The HTML report: built from a FewRel store with real probe, HeadScore/TokenScore, predictor,
shortcut and MAPS results (run by the demo's own steps), plus tracing, patching, lens and
agreement tables in their stored schema; checked as HTML and in a real headless Chromium.

The store is the FewRel fixture's (tests/data/fewrel, invented sentences).  The browser test uses
Debian's ``chromium`` (``apt-get install chromium``); it is skipped when that is absent, and fails
then under ``ACTSTORE_REQUIRE_REAL=1`` (CI).  Set ``ACTSTORE_REPORT_SCREENSHOT=/path.png`` to keep
its screenshot.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from click.testing import CliRunner
from helpers import FIXTURES, agreement_row, require_chromium

import actstore
from actstore.cli import main
from actstore.core.errors import CorruptStoreError
from actstore.core.writer import write_result_table
from actstore.query.report.builder import build_report, collect_sections, expected_sections, write_report
from actstore.query.report.context import SECTION_IDS

FEWREL_FIXTURE = FIXTURES / "fewrel" / "val_wiki.json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _synthetic_tables(store: actstore.Store) -> None:
    """Tracing, patching, lens, ablation and agreement results in the schema their writers use
    (actstore/interventions/tracing.py, actstore/interventions/patching.py, query/analyses/lens.py,
    actstore/interventions/ablation.py, query/methods/readings.py)."""
    g = store.geometry
    L, H = g.n_layers, g.n_heads
    rng = np.random.default_rng(0)
    facts = store.sql(
        "SELECT e.example_id, e.relation_id, e.subject, e.object, e.subject_start, e.subject_end, "
        "e.n_tokens FROM examples e WHERE e.subject_start >= 0 ORDER BY 1 LIMIT 3"
    ).to_pylist()
    toks = {
        r["example_id"]: r["toks"]
        for r in store.sql(
            "SELECT example_id, list(token ORDER BY position) AS toks FROM tokens GROUP BY 1"
        ).to_pylist()
    }
    eff: dict[str, list[Any]] = {
        k: []
        for k in (
            "run_id",
            "example_id",
            "component",
            "layer",
            "position",
            "token",
            "role",
            "prob",
            "indirect_effect",
        )
    }
    for f in facts:
        s0, s1, n = f["subject_start"], f["subject_end"], f["n_tokens"]
        for c in ("resid", "mlp", "attn"):
            for layer in range(L):
                for p in range(n):
                    role = (
                        ("subject_first" if p == s0 else "subject_last" if p == s1 - 1 else "subject_middle")
                        if s0 <= p < s1
                        else ("before_subject" if p < s0 else "after_subject")
                    )
                    ie = float(rng.random()) * (1.0 if p >= s0 else 0.0)
                    for k, v in (
                        ("run_id", "trace-test"),
                        ("example_id", f["example_id"]),
                        ("component", c),
                        ("layer", layer),
                        ("position", p),
                        ("token", toks[f["example_id"]][p]),
                        ("role", role),
                        ("prob", 0.1 + ie),
                        ("indirect_effect", ie),
                    ):
                        eff[k].append(v)
    write_result_table(store, "trace_effects", "trace-test", pa.table(eff))
    write_result_table(
        store,
        "trace_facts",
        "trace-test",
        pa.Table.from_pylist(
            [
                {
                    "run_id": "trace-test",
                    **f,
                    "p_clean": 0.6,
                    "p_corrupt": 0.1,
                    "total_effect": 0.5,
                    "noise_std": 0.3,
                    "samples": 3,
                    "window": 2,
                }
                for f in facts
            ]
        ),
    )
    patch = [
        {
            "run_id": "patch-test",
            "example_id": 0,
            "counterfactual_id": 1,
            "component": c,
            "layer": layer,
            "head": -1,
            "position": "last",
            "recovery": float(rng.random()),
        }
        for c in ("resid", "mlp", "attn")
        for layer in range(L)
    ]
    patch += [
        {
            "run_id": "patch-test",
            "example_id": 0,
            "counterfactual_id": 1,
            "component": "head",
            "layer": layer,
            "head": h,
            "position": "last",
            "recovery": float(rng.random()),
        }
        for layer in range(L)
        for h in range(H)
    ]
    write_result_table(store, "patch_effects", "patch-test", pa.Table.from_pylist(patch))
    lens = [
        {
            "run_id": "lens-test",
            "example_id": e,
            "lens": name,
            "split": "heldout",
            "index": i,
            "layer": i - 1,
            "object_prob": float(rng.random()) * i / (L + 1),
            "object_rank": int(rng.integers(0, 50)),
            "top_token_id": 0,
        }
        for e in range(4)
        for name in ("logit", "tuned")
        for i in range(L + 1)
    ]
    write_result_table(store, "lens", "lens-test", pa.Table.from_pylist(lens))
    write_result_table(
        store,
        "maps_ablation",
        "ablate-test",
        pa.Table.from_pylist(
            [
                {
                    "run_id": "ablate-test",
                    "relation": "P17",
                    "evaluated": ev,
                    "condition": cond,
                    "draw": 0,
                    "n_heads": 2,
                    "heads": "0.1,1.2",
                    "accuracy": acc,
                    "n_prompts": 10,
                    "mode": "zero",
                    "positions": "last",
                }
                for ev, cond, acc in (
                    ("P17", "base", 0.8),
                    ("P17", "relation_heads", 0.3),
                    ("P17", "random_heads", 0.7),
                    ("P31", "base", 0.6),
                    ("P31", "relation_heads", 0.55),
                )
            ]
        ),
    )
    write_result_table(
        store,
        "method_agreement",
        "agree-test",
        pa.Table.from_pylist([agreement_row()]),
    )
    write_result_table(
        store, "my_custom_result", "custom-test", pa.table({"x": [1, 2, 3], "y": ["a", "b", "c"]})
    )


@pytest.fixture(scope="module")
def report_store(store_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the tiny-Llama FewRel store (shared with tests/integration/analyses/test_probe.py) holding every kind of result."""
    from actstore.jobs.demo import run_demo_analyses

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = store_factory("llama", dataset=f"fewrel:{FEWREL_FIXTURE}", limit=10, segment_size=64)
        dst = tmp_path_factory.mktemp("report") / "store"
        shutil.copytree(src, dst)
        store = actstore.open(dst)
        summary = run_demo_analyses(store, out=str(dst.parent), episodes=4, step=lambda m: None)
        failed = [n for n in summary["notes"] if "failed" in n]
        assert not failed, failed
        _synthetic_tables(store)
    finally:
        torch.set_num_threads(old)
    return dst


def _browser(chromium: str, html_path: Path, tmp: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--hide-scrollbars",
        f"--user-data-dir={tmp / 'chromium-profile'}",
        "--virtual-time-budget=10000",
        *extra,
        html_path.resolve().as_uri(),
    ]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "HOME": str(tmp)}
    )


class _Collect(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: list[str] = []
        self.imgs: list[str] = []
        self.external: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "section" and a.get("id"):
            self.ids.append(str(a["id"]))
        if tag == "img":
            self.imgs.append(str(a.get("src") or ""))
        for key in ("src", "href"):
            v = a.get(key)
            if v and not (v.startswith("data:") or v.startswith("#")):
                self.external.append(v)


ALL_SECTIONS = [
    SECTION_IDS[k]
    for k in (
        "summary",
        "probes",
        "headscore",
        "tokenscore",
        "predictors",
        "shortcuts",
        "maps",
        "maps_dynamic",
        "maps_ablation",
        "tracing",
        "patching",
        "lens",
        "agreement",
        "tables",
    )
]


def test_report_html_is_self_contained_with_every_section(report_store: Path, tmp_path: Path) -> None:
    store = actstore.open(report_store)
    text = build_report(store)
    p = _Collect()
    p.feed(text)
    assert p.ids == ALL_SECTIONS
    assert expected_sections(store) == ALL_SECTIONS[:-1]  # "other tables" depends on what the others consumed
    assert not p.external, p.external  # no external assets
    assert len(p.imgs) >= 20
    for src in p.imgs:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == PNG_MAGIC
    assert "could not render" not in text
    assert "my_custom_result" in text  # tables without a section are listed
    # TokenScore: tokens as coloured spans, errors and correct predictions both shown
    assert text.count('class="tok"') > 20
    assert 'class="badge error"' in text and 'class="badge correct"' in text


def test_report_sections_only_for_present_tables(store_factory: Callable[..., Path], tmp_path: Path) -> None:
    src = store_factory("llama", dataset=f"fewrel:{FEWREL_FIXTURE}", limit=10, segment_size=64)
    dst = tmp_path / "store"
    shutil.copytree(src, dst)
    store = actstore.open(dst)
    p = _Collect()
    p.feed(build_report(store))
    assert p.ids == [SECTION_IDS["summary"]]
    # a result table missing the columns a figure needs: a note, never a crash
    write_result_table(store, "head_scores", "old-run", pa.table({"run_id": ["old-run"], "layer": [0]}))
    write_result_table(
        store, "trace_effects", "old-run", pa.table({"run_id": ["old-run"], "component": ["mlp"]})
    )
    text = build_report(store)
    p = _Collect()
    p.feed(text)
    assert p.ids == [SECTION_IDS["summary"], SECTION_IDS["headscore"], SECTION_IDS["tracing"]]
    assert "head_scores lacks columns" in text and "trace_effects lacks columns" in text


def test_report_command(report_store: Path, tmp_path: Path) -> None:
    out = tmp_path / "sub" / "r.html"
    res = CliRunner().invoke(main, ["report", str(report_store), "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)  # stdout: the JSON object; stderr: the log lines ("actstore: report: ...")
    assert d["sections"] == ALL_SECTIONS and d["images"] >= 20 and out.stat().st_size == d["bytes"]
    bad = CliRunner().invoke(main, ["report", str(tmp_path / "nope"), "--out", str(out)])
    assert (
        bad.exit_code == 1
        and bad.output.count("\n") == 1
        and bad.output.startswith("error: no actstore store")
    )


PROBE_SCRIPT = """<script>
window.addEventListener('load', () => {
  const imgs = [...document.images];
  const out = {
    images: imgs.length,
    decoded: imgs.filter(i => i.complete && i.naturalWidth > 0 && i.src.startsWith('data:image/png;base64,')).length,
    visible: [...document.querySelectorAll('section')].filter(s => s.offsetHeight > 0).map(s => s.id),
    tokens: document.querySelectorAll('#section-tokenscore span.tok').length,
  };
  const pre = document.createElement('pre');
  pre.id = 'browser-check';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


def test_report_in_headless_chromium(report_store: Path, tmp_path: Path) -> None:
    chromium = require_chromium()
    store = actstore.open(report_store)
    path = Path(write_report(store, tmp_path / "report.html"))
    # 1. The DOM as Chromium parsed it: every section and every image, with image data.
    dom = _browser(chromium, path, tmp_path, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    p = _Collect()
    p.feed(dom.stdout)
    assert p.ids == ALL_SECTIONS
    n_img = path.read_text(encoding="utf-8").count("<img ")
    assert len(p.imgs) == n_img >= 20
    assert all(s.startswith("data:image/png;base64,") and len(s) > 1000 for s in p.imgs)
    # 2. After layout: every section has height and every image decoded (naturalWidth > 0).
    probe = tmp_path / "probe.html"
    probe.write_text(
        path.read_text(encoding="utf-8").replace("</body>", PROBE_SCRIPT + "</body>"), encoding="utf-8"
    )
    dom = _browser(chromium, probe, tmp_path, "--dump-dom")
    m = re.search(r'<pre id="browser-check">(.*?)</pre>', dom.stdout)
    assert m, dom.stdout[-500:]
    check = json.loads(m.group(1).replace("&quot;", '"'))
    assert check["visible"] == ALL_SECTIONS
    assert check["images"] == check["decoded"] == n_img
    assert check["tokens"] > 20
    # 3. A screenshot of the top of the page renders.
    shot = Path(os.environ.get("ACTSTORE_REPORT_SCREENSHOT") or tmp_path / "report.png")
    res = _browser(chromium, path, tmp_path, "--window-size=1280,6000", f"--screenshot={shot}")
    assert res.returncode == 0, res.stderr[-2000:]
    assert shot.read_bytes()[:8] == PNG_MAGIC and shot.stat().st_size > 50_000


def test_demo_steps_note_failures_and_raise_on_a_missing_module() -> None:
    from actstore.jobs.demo import DemoLog

    seen: list[str] = []
    details: list[str] = []
    log = DemoLog(seen.append, details.append)
    assert log.run("b", "step b", lambda: 1 / 0) is None
    assert log.run("c", "step c", lambda: {"x": 1}) == {"x": 1}

    def missing() -> None:
        import actstore.query.not_built_yet  # noqa: F401  (a packaging mistake fails loudly, not as a skipped step)

    with pytest.raises(ModuleNotFoundError, match="actstore.query.not_built_yet"):
        log.run("a", "step a", missing)
    assert log.notes == [log.notes[0]] and log.notes[0].startswith("b: failed (ZeroDivisionError")
    assert log.results == {"c": {"x": 1}} and set(log.timings) == {"a", "b", "c"}
    assert seen == ["step b", "step c", "step a"] and details[0].startswith("    skipped: ZeroDivisionError")


# ----------------------------------------------------------------------------------- escaping, sections, failures
HOSTILE_RELATION = "<script>document.title='pwned'</script>"
HOSTILE_SUBJECT = '<img src=x onerror="document.title=1">'


class _Tree(HTMLParser):
    """Element names, text, and the sections (their element counts and CSS classes) of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.text: list[str] = []
        self.section: str | None = None
        self.per_section: dict[str, dict[str, int]] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.tags.append(tag)
        if tag == "section":
            self.section = str(a.get("id"))
            self.per_section[self.section] = {}
        if self.section is not None:
            counts = self.per_section[self.section]
            for key in [tag] + [f".{c}" for c in str(a.get("class") or "").split()]:
                counts[key] = counts.get(key, 0) + 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "section":
            self.section = None

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _tree(text: str) -> _Tree:
    t = _Tree()
    t.feed(text)
    t.close()
    return t


def test_report_escapes_names_from_the_store(store_factory: Callable[..., Path], tmp_path: Path) -> None:
    data = tmp_path / "hostile.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "text": f"{s} is located in",
                    "subject": s,
                    "object": o,
                    "relation_id": "P1",
                    "relation_name": HOSTILE_RELATION,
                }
            )
            + "\n"
            for s, o in ((HOSTILE_SUBJECT, "Paris"), ("Lyon", "France"), ("Rome", "Italy"))
        ),
        encoding="utf-8",
    )
    store = actstore.open(store_factory("llama", dataset=f"jsonl:{data}", limit=None))
    assert store.sql("SELECT DISTINCT relation_name FROM examples").column(0).to_pylist() == [
        HOSTILE_RELATION
    ]
    text = build_report(store, title="<b>title</b>")
    tree = _tree(text)
    # The parser sees no script or img element and no bold title: every name arrived as text.
    assert "script" not in tree.tags and "img" not in tree.tags and "b" not in tree.tags
    page_text = "".join(tree.text)
    assert HOSTILE_RELATION in page_text and "<b>title</b>" in page_text
    assert "&lt;script&gt;" in text and "<script>" not in text
    # The same in Chromium's DOM (the browser would have run the script and changed the title).
    chromium = require_chromium()
    path = Path(write_report(store, tmp_path / "hostile.html", title="<b>title</b>"))
    dom = _browser(chromium, path, tmp_path, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "<script" not in dom.stdout and "<img" not in dom.stdout and "pwned" in dom.stdout
    assert "<title>&lt;b&gt;title&lt;/b&gt;</title>" in dom.stdout


def test_every_section_renders_content_on_the_fixture_store(report_store: Path) -> None:
    from actstore.query.report.context import Omitted

    store = actstore.open(report_store)
    sections = collect_sections(store)
    assert [s.id for s in sections] == ALL_SECTIONS
    for s in sections:
        assert s.blocks and not any(isinstance(b, Omitted) for b in s.blocks), s.key
    tree = _tree(build_report(store))
    # each section holds its own data: a figure, a table or TokenScore examples; no section is a bare note
    for sid in ALL_SECTIONS:
        counts = tree.per_section[sid]
        assert counts.get("img", 0) + counts.get("table", 0) + counts.get(".tokex", 0) > 0, (sid, counts)
        assert ".omitted" not in counts, sid
    assert tree.per_section[SECTION_IDS["headscore"]]["img"] >= 2  # all relations + one per relation
    assert tree.per_section[SECTION_IDS["tracing"]]["img"] == 3  # the class average + two facts
    assert tree.per_section[SECTION_IDS["tokenscore"]][".tokex"] >= 2


def test_a_table_deleted_while_the_report_runs_omits_only_its_section(
    report_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dst = tmp_path / "store"
    shutil.copytree(report_store, dst)
    before = _tree(build_report(actstore.open(dst))).per_section
    store = actstore.open(dst)
    rel = store.table_files()["head_scores"][0]  # one run's file of the table
    connect = store.connect

    def connect_then_delete(
        **kw: Any,
    ) -> Any:  # another process removes the run's results after the report began
        con = connect(**kw)
        os.remove(dst / rel)
        return con

    monkeypatch.setattr(store, "connect", connect_then_delete)
    text = build_report(store)
    tree = _tree(text)
    assert list(tree.per_section) == ALL_SECTIONS  # the section stays, saying why it is empty
    hs = SECTION_IDS["headscore"]
    assert tree.per_section[hs].get(".omitted") == 1 and "img" not in tree.per_section[hs]
    body = text.split(f'id="{hs}"')[1].split("</section>")[0]
    assert "This section is omitted: a table it reads could not be read (CorruptStoreError" in body
    assert f"{rel}: missing" in body
    for sid in ALL_SECTIONS:
        if sid != hs:
            assert tree.per_section[sid] == before[sid], sid  # every other section as before
    assert ".omitted" not in "".join(k for sid in ALL_SECTIONS if sid != hs for k in tree.per_section[sid])


def test_a_damaged_table_file_is_one_clear_error_and_no_report(report_store: Path, tmp_path: Path) -> None:
    dst = tmp_path / "store"
    shutil.copytree(report_store, dst)
    store = actstore.open(dst)
    rel = store.table_files()["head_scores"][0]
    (dst / rel).write_bytes(b"PAR1 this is not parquet PAR1")
    out = tmp_path / "report.html"
    out.write_text("previous report", encoding="utf-8")
    with pytest.raises(CorruptStoreError, match=re.escape(rel)):
        write_report(actstore.open(dst), out)
    assert out.read_text(encoding="utf-8") == "previous report"  # the old file is left whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html", "store"]  # no temporary file left


def test_errors_other_than_reading_a_table_propagate(
    report_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from actstore.query.report import builder

    def broken(ctx: Any) -> Any:
        raise KeyError("a bug in a section")

    monkeypatch.setattr(builder, "SECTIONS", (builder.SectionSpec("lens", "Lens", ("lens",), broken),))
    with pytest.raises(KeyError, match="a bug in a section"):
        collect_sections(actstore.open(report_store))


def test_blocks_render_through_autoescaping_templates() -> None:
    from actstore.query.report.context import Figure, Heading, Note, Table
    from actstore.query.report.render import render_blocks

    html = str(
        render_blocks(
            [
                Heading("<h1>x</h1>"),
                Note("a & b"),
                Table([{"a": "<td>", "b": 1.23456}], ["a", "b"], {"a": "<th>"}),
                Figure("data:image/png;base64,AAAA", 'say "hi"'),
            ]
        )
    )
    assert "<h3>&lt;h1&gt;x&lt;/h1&gt;</h3>" in html and "a &amp; b" in html
    assert "<th>&lt;th&gt;</th>" in html and "<td>&lt;td&gt;</td><td>1.235</td>" in html
    assert 'alt="say &#34;hi&#34;"' in html
