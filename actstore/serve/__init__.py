"""``actstore serve``: a read-only web explorer over stores (docs/explorer.md).

:func:`actstore.serve.app.create_app` makes the Starlette app over a
:class:`actstore.serve.catalog.Catalog` of stores; the command (``actstore/cli/serve.py``) runs it
with uvicorn.  Modules: ``catalog`` (the stores by name, locks, caches), ``common`` (validated
parameters, JSON values, SQL), ``views`` (store, relation, HeadScore, head, methods, tables),
``prompt`` (the prompt view and per-source-token contributions), ``console`` (SQL console and
features projection), ``pages`` (the HTML shells), ``app`` (routes and errors) and ``static/``
(the page script and style, served by the app: no CDN).
"""
