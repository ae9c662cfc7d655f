"""HTML from the Jinja2 templates in ``templates/`` (autoescaping on: every value is text)."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import jinja2
from markupsafe import Markup

from actstore.core.store import StoreReader
from actstore.query.report.context import Block, Section, fmt


@functools.cache
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("actstore.query.report", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )
    env.filters["cell"] = fmt
    return env


def render_blocks(blocks: Sequence[Block]) -> Markup:
    """The blocks of a section as HTML."""
    module = environment().get_template("blocks.html.j2").module
    return Markup(module.render_blocks(list(blocks)))  # type: ignore[attr-defined]


def render_page(store: StoreReader, sections: Sequence[Section], *, title: str | None = None) -> str:
    """The whole report page: header, navigation and ``sections`` in order."""
    g = store.geometry
    name = str(store.manifest.model.get("name"))
    return (
        environment()
        .get_template("page.html.j2")
        .render(
            title=title or f"actstore report: {name}",
            store_url=store.url,
            n_rows=store.n_rows,
            n_layers=g.n_layers,
            n_heads=g.n_heads,
            generated=time.strftime("%Y-%m-%d %H:%M:%S"),
            sections=list(sections),
        )
    )
