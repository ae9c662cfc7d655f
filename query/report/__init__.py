"""A self-contained HTML report of a store and every analysis result it holds.

    from actstore.query.report.builder import build_report, write_report
    html = build_report(actstore.open("/tmp/s"))          # one string, no external assets
    write_report(store, "report.html")                   # written atomically

The report discovers result tables by name (``tables/<name>/<run_id>.parquet``) and renders a
section only when its tables exist; a table that lacks a column a figure needs gets a note
instead of the figure, so results written by older or newer code never break the report, and a
table whose files cannot be read (missing, damaged) costs only its own section, which says so.
Figures are matplotlib PNGs (:mod:`actstore.query.analyses.plotting`) embedded as base64 ``data:`` URIs; the page
is rendered from the Jinja2 templates in ``templates/`` with autoescaping.  Every section has a
stable element id (:data:`~actstore.query.report.context.SECTION_IDS`) so tests and links can find it.

Modules: :mod:`~actstore.query.report.builder` (section order, page, atomic write),
:mod:`~actstore.query.report.context` (blocks, options, table access), :mod:`~actstore.query.report.render`
(templates), and one module per section or group of related sections:

* ``section-summary``     model, geometry, corpus per relation, sizes, runs (always)           summary
* ``section-probes``      probe accuracy per run and per relation                                probes
* ``section-headscore``   mean HeadScore heatmap (layer x head) per relation                     probes
* ``section-tokenscore``  TokenScore over the prompt's tokens, errors and correct predictions    tokens
* ``section-predictors``  F1 against each predictor, with correlations                           predictors
* ``section-shortcuts``   lexical shortcut figures of probe errors                               predictors
* ``section-maps``        static MAPS score heatmaps per relation                                maps
* ``section-maps-dynamic`` static vs dynamic MAPS scores                                         maps
* ``section-maps-ablation`` accuracy with a relation's heads removed                             maps
* ``section-tracing``     causal tracing heatmaps (ROME position classes x layer)                interventions
* ``section-patching``    activation patching recovery per layer and per head                    interventions
* ``section-lens``        logit / tuned lens curves per layer                                    lens
* ``section-agreement``   method agreement table                                                 lens
* ``section-tables``      any other result table: name, rows, columns and a preview              tables

The tables each section reads are :data:`~actstore.query.report.builder.SECTION_TABLES`.
"""
