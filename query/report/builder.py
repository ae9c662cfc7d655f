"""Collect the report's sections in page order, render them into one page, and write it atomically."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from actstore.core.store import StoreReader
from actstore.query.report.context import (
    READ_ERRORS,
    SECTION_IDS,
    Omitted,
    ReportContext,
    ReportOptions,
    Section,
)
from actstore.query.report.context import log as logger
from actstore.query.report.interventions import patching_section, tracing_section
from actstore.query.report.lens import agreement_section, lens_section
from actstore.query.report.maps import maps_ablation_section, maps_dynamic_section, maps_section
from actstore.query.report.method_metrics import method_metrics_section
from actstore.query.report.predictors import predictors_section, shortcuts_section
from actstore.query.report.probes import headscore_section, probes_section
from actstore.query.report.render import render_page
from actstore.query.report.summary import summary_section
from actstore.query.report.tables import other_tables_section
from actstore.query.report.tokens import tokenscore_section


@dataclass(frozen=True)
class SectionSpec:
    """A section of the page: its key, its title, the result tables it reads (it appears when one of them
    exists), and the function that builds it."""

    key: str
    title: str
    tables: tuple[str, ...]
    build: Callable[[ReportContext], Section | None]


SECTIONS: tuple[SectionSpec, ...] = (
    SectionSpec(
        "probes",
        "Probes: episodic relation classification",
        ("probe_runs", "relation_metrics", "probe_episodes", "probe_predictions"),
        probes_section,
    ),
    SectionSpec("headscore", "HeadScore per relation (layer × head)", ("head_scores",), headscore_section),
    SectionSpec("tokenscore", "TokenScore over the prompt", ("token_scores",), tokenscore_section),
    SectionSpec(
        "predictors",
        "Predictors of per-relation probe accuracy",
        ("relation_predictors", "correlations"),
        predictors_section,
    ),
    SectionSpec(
        "shortcuts",
        "Lexical shortcuts in probe errors",
        ("shortcut_summary", "shortcut_errors"),
        shortcuts_section,
    ),
    SectionSpec(
        "maps",
        "MAPS: head functions from the weights",
        ("maps_scores", "maps_relations", "maps_salient"),
        maps_section,
    ),
    SectionSpec(
        "maps_dynamic",
        "MAPS: static vs dynamic scores",
        ("maps_dynamic", "maps_correlation"),
        maps_dynamic_section,
    ),
    SectionSpec("maps_ablation", "MAPS: head ablation", ("maps_ablation",), maps_ablation_section),
    SectionSpec("tracing", "Causal tracing", ("trace_effects", "trace_facts"), tracing_section),
    SectionSpec("patching", "Activation patching", ("patch_effects", "patch_pairs"), patching_section),
    SectionSpec("lens", "Logit and tuned lens", ("lens",), lens_section),
    SectionSpec(
        "agreement",
        "Agreement between interpretability methods",
        ("method_agreement", "method_readings"),
        agreement_section,
    ),
    SectionSpec(
        "method_metrics",
        "Method comparison (the ACL 2025 comparison of methods for factual recall)",
        ("method_metrics", "method_pair_metrics", "method_cross_size"),
        method_metrics_section,
    ),
)

#: Result tables each section reads (one of them must exist for the section to appear).
SECTION_TABLES: dict[str, tuple[str, ...]] = {s.key: s.tables for s in SECTIONS}


def expected_sections(store: StoreReader) -> list[str]:
    """Ids of the sections a report of ``store`` holds (tables present), in page order."""
    files = store.table_files()
    return [SECTION_IDS["summary"]] + [
        SECTION_IDS[s.key] for s in SECTIONS if any(files.get(t) for t in s.tables)
    ]


def _run_started(ctx: ReportContext) -> dict[str, float]:
    """``run_id -> started`` from the runs table (the order of runs; empty when there is none to read)."""
    if not {"run_id", "started"} <= set(ctx.columns("runs")):
        return {}
    try:
        rows = ctx.sql('SELECT run_id, started FROM "runs"').to_pylist()
    except READ_ERRORS as e:  # runs are then ordered by id; the summary says the table is unreadable
        logger.warning("report: the runs table cannot be read (%s)", e)
        return {}
    return {str(r["run_id"]): float(r["started"]) for r in rows if r["started"] is not None}


def collect_sections(
    store: StoreReader, options: ReportOptions | None = None, log: Callable[[str], None] | None = None
) -> list[Section]:
    """Every section for ``store``, in page order.  A section whose tables cannot be read (a file missing or
    damaged, columns a statement needs) is kept with a note saying so; every other section is unaffected.
    ``log``: called with a line as each section starts (progress)."""
    opts = options or ReportOptions()
    ctx = ReportContext(store, opts, store.table_files(), store.connect())
    ctx.run_started = _run_started(ctx)
    sections = [summary_section(ctx)]
    for spec in SECTIONS:
        if not any(ctx.has(t) for t in spec.tables):
            continue
        _progress(f"report: {spec.key}", log)
        try:
            sec = spec.build(ctx)
        except READ_ERRORS as e:
            logger.warning("report: section %s omitted (%s)", spec.key, e)
            sec = Section(
                spec.key,
                spec.title,
                [
                    Omitted(
                        f"This section is omitted: a table it reads could not be "
                        f"read ({type(e).__name__}: {e})."
                    )
                ],
            )
            ctx.used.update(spec.tables)
        if sec is not None:
            sections.append(sec)
    other = other_tables_section(ctx)
    if other is not None:
        sections.append(other)
    return sections


def _progress(line: str, callback: Callable[[str], None] | None) -> None:
    """``line`` once: to ``callback`` when given, else to the log."""
    if callback is not None:
        callback(line)
    else:
        logger.info(line)


def render_html(store: StoreReader, sections: Sequence[Section], *, title: str | None = None) -> str:
    """The page holding ``sections`` (one self-contained HTML string)."""
    return render_page(store, sections, title=title)


def build_report(
    store: StoreReader,
    *,
    options: ReportOptions | None = None,
    title: str | None = None,
    log: Callable[[str], None] | None = None,
) -> str:
    """The report of ``store`` as one HTML string."""
    return render_html(store, collect_sections(store, options, log), title=title)


def write_text_atomically(path: str | os.PathLike[str], text: str) -> str:
    """Write ``text`` to ``path`` (a local file; parent folders made) so that readers see the old file or the
    whole new one, never a part; returns the path."""
    out = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return out


def write_report(
    store: StoreReader,
    out: str | os.PathLike[str],
    *,
    options: ReportOptions | None = None,
    title: str | None = None,
    log: Callable[[str], None] | None = None,
) -> str:
    """Write the report atomically to ``out`` (a local file) and return its path."""
    return write_text_atomically(out, build_report(store, options=options, title=title, log=log))
