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
from conftest import FIXTURES, require_chromium

import actstore
from actstore.cli import main
from actstore.writer import write_result_table
from query.report import SECTION_IDS, build_report, expected_sections, write_report

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
    (ingest/tracing.py, ingest/patching.py, query/lens.py, ingest/maps_ablation.py, query/methods.py)."""
    g = store.geometry
    L, H = g.n_layers, g.n_heads
    rng = np.random.default_rng(0)
    facts = store.sql("SELECT e.example_id, e.relation_id, e.subject, e.object, e.subject_start, e.subject_end, "
                      "e.n_tokens FROM examples e WHERE e.subject_start >= 0 ORDER BY 1 LIMIT 3").to_pylist()
    toks = {r["example_id"]: r["toks"] for r in store.sql(
        "SELECT example_id, list(token ORDER BY position) AS toks FROM tokens GROUP BY 1").to_pylist()}
    eff: dict[str, list[Any]] = {k: [] for k in ("run_id", "example_id", "component", "layer", "position", "token",
                                                "role", "prob", "indirect_effect")}
    for f in facts:
        s0, s1, n = f["subject_start"], f["subject_end"], f["n_tokens"]
        for c in ("resid", "mlp", "attn"):
            for layer in range(L):
                for p in range(n):
                    role = ("subject_first" if p == s0 else "subject_last" if p == s1 - 1 else "subject_middle") \
                        if s0 <= p < s1 else ("before_subject" if p < s0 else "after_subject")
                    ie = float(rng.random()) * (1.0 if p >= s0 else 0.0)
                    for k, v in (("run_id", "trace-test"), ("example_id", f["example_id"]), ("component", c),
                                 ("layer", layer), ("position", p), ("token", toks[f["example_id"]][p]),
                                 ("role", role), ("prob", 0.1 + ie), ("indirect_effect", ie)):
                        eff[k].append(v)
    write_result_table(store, "trace_effects", "trace-test", pa.table(eff))
    write_result_table(store, "trace_facts", "trace-test", pa.Table.from_pylist([
        {"run_id": "trace-test", **f, "p_clean": 0.6, "p_corrupt": 0.1, "total_effect": 0.5, "noise_std": 0.3,
         "samples": 3, "window": 2} for f in facts]))
    patch = [{"run_id": "patch-test", "example_id": 0, "counterfactual_id": 1, "component": c, "layer": layer,
              "head": -1, "position": "last", "recovery": float(rng.random())}
             for c in ("resid", "mlp", "attn") for layer in range(L)]
    patch += [{"run_id": "patch-test", "example_id": 0, "counterfactual_id": 1, "component": "head", "layer": layer,
               "head": h, "position": "last", "recovery": float(rng.random())} for layer in range(L) for h in range(H)]
    write_result_table(store, "patch_effects", "patch-test", pa.Table.from_pylist(patch))
    lens = [{"run_id": "lens-test", "example_id": e, "lens": name, "split": "heldout", "index": i, "layer": i - 1,
             "object_prob": float(rng.random()) * i / (L + 1), "object_rank": int(rng.integers(0, 50)),
             "top_token_id": 0} for e in range(4) for name in ("logit", "tuned") for i in range(L + 1)]
    write_result_table(store, "lens", "lens-test", pa.Table.from_pylist(lens))
    write_result_table(store, "maps_ablation", "ablate-test", pa.Table.from_pylist([
        {"run_id": "ablate-test", "relation": "P17", "evaluated": ev, "condition": cond, "draw": 0, "n_heads": 2,
         "heads": "0.1,1.2", "accuracy": acc, "n_prompts": 10, "mode": "zero", "positions": "last"}
        for ev, cond, acc in (("P17", "base", 0.8), ("P17", "relation_heads", 0.3), ("P17", "random_heads", 0.7),
                              ("P31", "base", 0.6), ("P31", "relation_heads", 0.55))]))
    write_result_table(store, "method_agreement", "agree-test", pa.Table.from_pylist([
        {"run_id": "agree-test", "method_a": "trace", "method_b": "patch", "n_facts": 3, "key_layer_agreement": 0.67,
         "key_layer_exact": 0.33, "n_verdict": 3, "verdict_agreement": 1.0, "profile_correlation": 0.5}]))
    write_result_table(store, "my_custom_result", "custom-test", pa.table({"x": [1, 2, 3], "y": ["a", "b", "c"]}))


@pytest.fixture(scope="module")
def report_store(store_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the tiny-Llama FewRel store (shared with tests/test_probe.py) holding every kind of result."""
    from query.demo_steps import run_demo_analyses

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
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
           f"--user-data-dir={tmp / 'chromium-profile'}", "--virtual-time-budget=10000", *extra,
           html_path.resolve().as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "HOME": str(tmp)})


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


ALL_SECTIONS = [SECTION_IDS[k] for k in ("summary", "probes", "headscore", "tokenscore", "predictors", "shortcuts",
                                         "maps", "maps_dynamic", "maps_ablation", "tracing", "patching", "lens",
                                         "agreement", "tables")]


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
    write_result_table(store, "trace_effects", "old-run", pa.table({"run_id": ["old-run"], "component": ["mlp"]}))
    text = build_report(store)
    p = _Collect()
    p.feed(text)
    assert p.ids == [SECTION_IDS["summary"], SECTION_IDS["headscore"], SECTION_IDS["tracing"]]
    assert "head_scores lacks columns" in text and "trace_effects lacks columns" in text


def test_report_command(report_store: Path, tmp_path: Path) -> None:
    out = tmp_path / "sub" / "r.html"
    res = CliRunner().invoke(main, ["report", str(report_store), "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["sections"] == ALL_SECTIONS and d["images"] >= 20 and out.stat().st_size == d["bytes"]
    bad = CliRunner().invoke(main, ["report", str(tmp_path / "nope"), "--out", str(out)])
    assert bad.exit_code == 1 and bad.output.count("\n") == 1 and bad.output.startswith("error: no actstore store")


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
    probe.write_text(path.read_text(encoding="utf-8").replace("</body>", PROBE_SCRIPT + "</body>"), encoding="utf-8")
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


def test_demo_steps_skip_missing_modules_and_failures() -> None:
    from query.demo_steps import DemoLog

    seen: list[str] = []
    log = DemoLog(seen.append)
    assert log.run("a", "step a", ("query.not_built_yet",), lambda: 1) is None
    assert log.run("b", "step b", ("query.report",), lambda: 1 / 0) is None
    assert log.run("c", "step c", ("query.report",), lambda: {"x": 1}) == {"x": 1}
    assert log.notes[0] == "a: skipped (query.not_built_yet not built)"
    assert log.notes[1].startswith("b: failed (ZeroDivisionError")
    assert log.results == {"c": {"x": 1}} and set(log.timings) == {"b", "c"}
    assert seen == ["step a: skipped (query.not_built_yet not built)", "step b", "step c"]
